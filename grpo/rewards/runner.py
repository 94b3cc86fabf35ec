"""Calling reward functions: sync or async, here, in threads or in worker processes, with timeouts, retries and
the error policy. Outcome and process functions are called the same way; reward models are not called here
(`grpo.rewards.scoring.score_with_model`).

A function receives, as keyword arguments and only if its signature accepts them (or it takes `**kwargs`),
`prompts`, `completions`, `completion_ids`, `trainer_state` and every other dataset column, as a list with one
entry per row. What it returns is checked by the function's `check` (`check_rewards` for outcome functions,
`grpo.rewards.process.check_step_rewards` for process functions): a malformed result is a bug and always raises.

How the functions run (`run_reward_functions`):
  - async functions run concurrently, in one event loop;
  - with `num_workers > 0`, each synchronous function is called on `num_workers` slices of the rows at once, in
    threads (for slow row-wise functions: remote judges, sandboxes) or, with `worker_type="process"`, in a pool of
    worker processes (for CPU-bound pure-Python functions); with a `timeout` alone, each runs in a thread;
    otherwise synchronous functions run one after the other in the caller's thread;
  - every call may have a timeout; a timed-out thread cannot be killed and is abandoned (it is a daemon thread),
    a process pool with a timed-out call is killed once the round's other calls have finished; each call runs in a
    `CallScope` (grpo/generation/call_scope.py), abandoned at its timeout: the sandboxes of `code_execution` that
    the call started are killed then, and it can start no more;
  - on an exception the rows are retried one by one to name the failing row; `errors="skip"` gives failed rows
    None for that function (for a process function: no step rewards, all NaN) and counts them, one per failed
    row (a timed-out or wholly failed call counts all its rows), instead of raising. Any `BaseException` counts:
    a function that calls `sys.exit()` or raises `KeyboardInterrupt` fails like one that raises `ValueError`, and
    cannot end the run; only a `KeyboardInterrupt` in the main thread passes through (that is the user's Ctrl-C);
  - every call gets its own deep copy of the per-row arguments (`completions`, `prompts`, the columns), so a
    function that edits them in place changes nothing another function, a retry or the trainer sees; the
    episodes' `environments` are the exception, passed live (as in TRL).
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import math
import multiprocessing
import numbers
import pickle
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel

from grpo.data import InputError
from grpo.generation.call_scope import CallScope, run_in_context
from grpo.rewards.names import reward_name
from grpo.rewards.process import is_process_reward


def is_async(func: Callable) -> bool:
    """An `async def` function, or an object whose `__call__` is one."""
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__)


def _accepted_kwargs(func: Callable, available: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return available
    missing = [
        name
        for name, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and name not in available
    ]
    if missing:
        raise TypeError(
            f"Reward function '{reward_name(func)}' requires argument(s) {missing}, which are neither standard "
            f"reward arguments nor dataset columns. Available: {sorted(available)}."
        )
    return {k: v for k, v in available.items() if k in params}


class RewardFunctionError(InputError, RuntimeError, TypeError):
    """A reward function raised, or returned something other than one number (or None) per row: a bug in the
    function, which the message names with its fix. An `InputError`, so that `grpo train` prints it as one line; also
    the RuntimeError, ValueError and TypeError these failures were raised as before."""


def _rows(kwargs: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Every per-row argument cut to rows [start, stop); others (trainer_state) unchanged."""
    return {k: (v[start:stop] if isinstance(v, (list, tuple, torch.Tensor)) else v) for k, v in kwargs.items()}


def _own_copy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of one call, deep-copied, so that in-place edits stay with the call. `trainer_state` is shared
    (read-only by contract, and large). The `environments` are the live objects, in a list of the call's own (as
    in TRL: a reward asks an environment for its state, and a copy of a client or a container handle is not the
    environment). A column whose values cannot be deep-copied gets a new list of them."""
    copied = {}
    for key, value in kwargs.items():
        if key == "environments":
            copied[key] = list(value)
            continue
        try:
            copied[key] = value if key == "trainer_state" else copy.deepcopy(value)
        except Exception:
            copied[key] = list(value) if isinstance(value, (list, tuple)) else value
    return copied


def _reraise_interrupt(error: BaseException) -> None:
    """Re-raise a `KeyboardInterrupt` in the main thread: that is where Ctrl-C lands, and the user's stop must stop
    the run. Any other exception, and a `KeyboardInterrupt` from a worker thread or process (no signal lands
    there: the function raised it), is the function's failure."""
    if isinstance(error, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
        raise error


def _to_float(value: Any, name: str, row: int) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real):
        return float(value)
    raise RewardFunctionError(
        f"Reward function '{name}' returned {value!r} ({type(value).__name__}) for row {row}; "
        "each entry must be a number, or None when the function does not apply to that row."
    )


def check_rewards(values: Any, name: str, num_rows: int, offset: int = 0) -> list[float | None]:
    """What an outcome function `name` returned for `num_rows` rows (the first being row `offset` of the batch),
    checked: a float or None per row. A wrong length or type raises (a bug in the function, never skipped)."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != num_rows:
        got = f"length {len(values)}" if isinstance(values, Sequence) else type(values).__name__
        raise RewardFunctionError(
            f"Reward function '{name}' must return a list of {num_rows} values (one per row), got {got}."
        )
    return [_to_float(v, name, offset + i) for i, v in enumerate(values)]


class _Call(NamedTuple):
    """One call of one function on rows [start, start + num_rows) of the batch."""

    index: int  # the function's position among the functions scored (outcome functions first)
    func: Callable
    kwargs: dict[str, Any]
    start: int
    num_rows: int
    # checks what the function returned: (values, name, num_rows, offset) -> one value or None per row;
    # `check_rewards` (numbers) for outcome functions, `check_step_rewards` (StepRewards) for process functions,
    # `check_turn_rewards` (a list per row) for turn functions
    check: Callable[[Any, str, int, int], list] = check_rewards


# The outcome of a call: the checked values (None where a row failed) and the failures as (row in the batch or None
# for the whole call, exception). Rows are retried one by one only after the call on all of them raised.
_Outcome = tuple[list[Any], list[tuple[int | None, BaseException]]]


def _retry_rows(
    call: _Call, batch_error: BaseException, one_row: Callable, stop_at_first: bool, own: Callable = _own_copy
) -> _Outcome:
    name = reward_name(call.func)
    values, failures = [], []
    for i in range(call.num_rows):
        try:
            value = one_row(own(_rows(call.kwargs, i, i + 1)))
        except BaseException as error:
            _reraise_interrupt(error)
            failures.append((call.start + i, error))
            values.append(None)
            if stop_at_first:
                break
            continue
        values += call.check(value, name, 1, call.start + i)  # a malformed result is a bug: raise, never skip
    if not failures:  # every row alone works, the batch does not
        return [None] * call.num_rows, [(None, batch_error)]
    return values + [None] * (call.num_rows - len(values)), failures


def _run_sync(call: _Call, stop_at_first: bool, invoke: Callable | None = None) -> _Outcome:
    """Call a synchronous function, here or through `invoke(kwargs)` (a call in a worker process)."""
    # Arguments sent to a worker process are pickled there and back: that is the call's own copy already.
    own = _own_copy if invoke is None else (lambda kwargs: kwargs)
    invoke = invoke or (lambda kwargs: call.func(**kwargs))
    try:
        values = invoke(own(call.kwargs))
    except BaseException as error:
        _reraise_interrupt(error)
        return _retry_rows(call, error, invoke, stop_at_first, own)
    return call.check(values, reward_name(call.func), call.num_rows, call.start), []


# Worker-process pools, one per size and import path, kept between rounds (starting a process costs far more than
# a call).
_PROCESS_POOLS: dict[tuple[int, tuple[str, ...]], ProcessPoolExecutor] = {}


def _process_pool(num_workers: int, folders: tuple[str, ...] = ()) -> ProcessPoolExecutor:
    """The pool of `num_workers` processes whose import path starts with `folders` (`_module_folders`)."""
    if (num_workers, folders) not in _PROCESS_POOLS:
        # spawn, not fork: the trainer has threads (and maybe CUDA), which a forked child would inherit broken.
        context = multiprocessing.get_context("spawn")
        # A standard-library initializer, so that a worker imports no grpo (which loads transformers: seconds).
        start = f"import sys; sys.path[:0] = {list(folders)!r}"
        _PROCESS_POOLS[num_workers, folders] = ProcessPoolExecutor(
            num_workers, mp_context=context, initializer=exec, initargs=(start,)
        )
    return _PROCESS_POOLS[num_workers, folders]


def _module_folders(funcs: Iterable[Callable]) -> tuple[str, ...]:
    """The folders a spawned worker, which starts with this process's `sys.path`, lacks to import the functions'
    modules by name: those of modules imported from a folder that is no longer on the path (a recipe's folder,
    there only while `grpo.rewards.names.import_from_folders` imported the module)."""
    folders = []
    for func in funcs:
        name = getattr(func, "__module__", None) or ""
        file = getattr(sys.modules.get(name), "__file__", None)
        if not file or name == "__main__":  # a spawned worker runs the main script itself
            continue
        folder = Path(file).absolute().parent
        for _ in range(name.count(".") + (Path(file).name == "__init__.py")):  # up to the top-level package's parent
            folder = folder.parent
        if str(folder) not in sys.path and str(folder) not in folders:
            folders.append(str(folder))
    return tuple(folders)


def _discard_process_pool(num_workers: int, folders: tuple[str, ...] = ()) -> None:
    """Kill a pool's workers (one may be stuck in a timed-out call) and forget it; the next round starts anew."""
    pool = _PROCESS_POOLS.pop((num_workers, folders), None)
    if pool is not None:
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)


def _in_process(call: _Call, pool: ProcessPoolExecutor) -> Callable:
    try:
        pickle.dumps((call.func, call.kwargs))
    except Exception as e:
        raise TypeError(
            f"Reward function '{reward_name(call.func)}' cannot be sent to a worker process "
            f"(reward_worker_type='process'): {type(e).__name__}: {e}. Define it at the top level of a module "
            "(not a lambda or a nested function), keep its arguments picklable, or use reward_worker_type='thread'."
        ) from e
    return lambda kwargs: pool.submit(call.func, **kwargs).result()


async def _run_async(call: _Call, stop_at_first: bool) -> _Outcome:
    try:
        values = await call.func(**_own_copy(call.kwargs))
    except asyncio.CancelledError:
        raise  # the call's timeout, not the function's failure
    except BaseException as error:  # asyncio would let SystemExit and KeyboardInterrupt stop the event loop
        batch_error = error
        # Retried rows run in a private event loop in a thread of their own: this loop is busy awaiting us.
        return await _in_daemon_thread(
            lambda: _retry_rows(call, batch_error, lambda kwargs: asyncio.run(call.func(**kwargs)), stop_at_first)
        )
    return call.check(values, reward_name(call.func), call.num_rows, call.start), []


def _in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run `fn` in a daemon thread, in this thread's context (its `CallScope`): unlike an executor's threads, one
    that hangs past its timeout does not block the interpreter's exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result, error):
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    def target():
        try:
            result, error = fn(), None
        except BaseException as e:
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop has closed: the call timed out and was abandoned
            pass

    threading.Thread(target=run_in_context(target), daemon=True, name="grpo-reward").start()
    return future


async def _run_concurrently(
    calls: list[_Call], timeout: float | None, num_workers: int, worker_type: str, stop_at_first: bool
):
    workers = asyncio.Semaphore(num_workers or max(len(calls), 1))  # sync calls running at once
    pool, folders = None, ()
    if worker_type == "process" and num_workers > 0:  # a worker needs the folders of the functions' modules
        folders = _module_folders(call.func for call in calls)
        pool = _process_pool(num_workers, folders)
    invokers = {id(call): _in_process(call, pool) for call in calls if pool is not None and not is_async(call.func)}
    timed_out = False

    async def run(call: _Call) -> _Outcome:
        nonlocal timed_out
        scope = CallScope()  # current where the call's task or thread is made: they copy it
        try:
            if is_async(call.func):
                task = scope.run(asyncio.ensure_future, _run_async(call, stop_at_first))  # made in the scope
                return await asyncio.wait_for(task, timeout)
            async with workers:
                work = scope.run(_in_daemon_thread, lambda: _run_sync(call, stop_at_first, invokers.get(id(call))))
                return await asyncio.wait_for(work, timeout)
        except (asyncio.TimeoutError, TimeoutError):
            scope.abandon()
            timed_out = True
            return [None] * call.num_rows, [(None, TimeoutError(f"timed out after {timeout} s (reward_timeout)"))]

    outcomes = await asyncio.gather(*(run(call) for call in calls))
    if pool is not None and (timed_out or getattr(pool, "_broken", False)):
        _discard_process_pool(num_workers, folders)  # after every call has finished: none of theirs is killed
    return outcomes


def _run_event_loop(coroutine):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    # Already inside an event loop (a notebook, an async caller): run ours in a thread of its own.
    with ThreadPoolExecutor(1) as thread:
        return thread.submit(asyncio.run, coroutine).result()


def _report(call: _Call, failures: list, prompts: Sequence, errors: str) -> int:
    """Raise for the first failure (errors="raise"), or return the number of rows that failed."""
    if not failures:
        return 0
    if errors == "skip":
        return sum(call.num_rows if row is None else 1 for row, _ in failures)
    row, error = failures[0]
    what = "Process reward function" if is_process_reward(call.func) else "Reward function"
    name = reward_name(call.func)
    if row is None:
        last = call.start + call.num_rows - 1
        where = f"a batch of {call.num_rows} rows ({call.start}-{last})" if call.num_rows > 1 else f"row {last}"
        detail = ""
    else:
        where, detail = f"row {row}", f" (prompt: {str(prompts[row])[:200]!r})"
    why = f"{type(error).__name__}: {error}"
    if not isinstance(error, Exception):  # SystemExit, KeyboardInterrupt, ...: say why the run did not end
        why += " (a reward function cannot end the run: return a reward, or None for a row it cannot score)"
    raise RewardFunctionError(
        f"{what} '{name}' failed on {where}{detail}: {why}. Fix the function, or "
        "set reward_errors='skip' to give such rows None for this function and continue."
    ) from error


def _plan_calls(
    funcs: Sequence[Callable], checks: Sequence[Callable], available: dict[str, Any], timeout, num_workers: int
) -> tuple[list[_Call], list[_Call]]:
    """The calls of the functions (reward models excluded): those for the event loop (async, threaded, timed) and
    those run one after the other in this thread. With `num_workers`, a synchronous function is cut into row
    slices."""
    num_rows = len(available["prompts"])
    in_loop, inline = [], []
    for k, (func, check) in enumerate(zip(funcs, checks)):
        if isinstance(func, PreTrainedModel):
            continue
        kwargs = _accepted_kwargs(func, available)
        if is_async(func) or (num_workers == 0 and timeout is not None):
            in_loop.append(_Call(k, func, kwargs, 0, num_rows, check))
        elif num_workers > 0:
            size = math.ceil(num_rows / num_workers)
            for start in range(0, num_rows, size):
                stop = min(start + size, num_rows)
                in_loop.append(_Call(k, func, _rows(kwargs, start, stop), start, stop - start, check))
        else:
            inline.append(_Call(k, func, kwargs, 0, num_rows, check))
    return in_loop, inline


def run_reward_functions(
    funcs: Sequence[Callable | PreTrainedModel],
    checks: Sequence[Callable],
    available: dict[str, Any],
    *,
    errors: str = "raise",
    timeout: float | None = None,
    num_workers: int = 0,
    worker_type: str = "thread",
) -> tuple[list[list[Any]], list[int]]:
    """Call every function (reward models are skipped: their entries stay None) on all rows, with the keywords of
    `available` each accepts, and check what it returns with its `checks` entry. Returns, per function, one checked
    value or None per row, and the number of rows that failed (see the module docstring for `errors`, `timeout`,
    `num_workers` and `worker_type`)."""
    num_rows = len(available["prompts"])
    in_loop, inline = _plan_calls(funcs, checks, available, timeout, num_workers)
    stop_at_first = errors == "raise"
    outcomes = (
        _run_event_loop(_run_concurrently(in_loop, timeout, num_workers, worker_type, stop_at_first))
        if in_loop
        else []
    )
    outcomes += [_run_sync(call, stop_at_first) for call in inline]

    values: list[list[Any]] = [[None] * num_rows for _ in funcs]  # per function, per row; None: no value
    failed = [0] * len(funcs)
    for call, (call_values, failures) in zip(in_loop + inline, outcomes):
        failed[call.index] += _report(call, failures, available["prompts"], errors)
        values[call.index][call.start : call.start + call.num_rows] = call_values
    return values, failed
