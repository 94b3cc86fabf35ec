"""Scoring completions with reward functions and reward models.

A reward function is a plain callable `f(prompts, completions, **kwargs) -> list[float | None]`, or an `async def`
one. It receives, as keyword arguments and only if its signature accepts them (or it takes `**kwargs`): `prompts`,
`completions`, `completion_ids`, `trainer_state`, and every other dataset column as a list with one entry per row
(a positional-only parameter, or `*args` alone, is refused by `check_reward_signature`). `None` means "does not
apply to this row" and becomes NaN, which the advantage computation ignores.

A reward model is a `PreTrainedModel` with one output label (`AutoModelForSequenceClassification`); it scores the
prompt and completion text, rendered with the chat template for conversational data, using its own tokenizer.

A reward given as a string means the same in Python as in a recipe (`resolve_reward_name`): a built-in name
(`BUILTIN_REWARDS`), `module:function`, a local reward-model folder, or else a hub reward-model id. A name close to a
built-in one is refused with a suggestion, and a local-looking path that does not exist is refused, before any
import or download.

A process reward function (`@process_reward`, grpo/rewards/process.py) is called the same way and returns a
`StepRewards` (or None) per row instead of a number; `RewardSet` keeps the two kinds apart for the trainer and
scores both in one pass (`RewardSet.score`, or `score_rewards` for the functions given as lists).

How the functions run (`score_rewards`; the same for outcome and process functions):
  - async functions run concurrently, in one event loop;
  - with `num_workers > 0`, each synchronous function is called on `num_workers` slices of the rows at once, in
    threads (for slow row-wise functions: remote judges, sandboxes) or, with `worker_type="process"`, in a pool of
    worker processes (for CPU-bound pure-Python functions); with a `timeout` alone, each runs in a thread;
    otherwise synchronous functions run one after the other in the caller's thread;
  - every call may have a timeout; a timed-out thread cannot be killed and is abandoned (it is a daemon thread),
    a process pool with a timed-out call is killed once the round's other calls have finished;
  - on an exception the rows are retried one by one to name the failing row; `errors="skip"` gives failed rows
    None for that function (for a process function: no step rewards, all NaN) and counts them, one per failed
    row (a timed-out or wholly failed call counts all its rows), instead of raising.
"""

from __future__ import annotations

import asyncio
import difflib
import importlib
import inspect
import math
import multiprocessing
import numbers
import pickle
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple

import torch
from transformers import AutoTokenizer, PreTrainedModel

from grpo.data import RESERVED_COLUMNS, InputError, is_conversational
from grpo.models import check_reward_model, load_reward_model, looks_local
from grpo.objective.loss import combine_rewards, step_reward_sums
from grpo.rewards.process import check_step_rewards, is_process_reward, lay_out_steps

REWARD_ERRORS = ("raise", "skip")
REWARD_WORKER_TYPES = ("thread", "process")

# Built-in rewards by name (in grpo/rewards/__init__.py): (attribute, whether it is a factory called with the settings).
BUILTIN_REWARDS = {
    "accuracy": ("accuracy", False),
    "reasoning_gym": ("reasoning_gym", False),
    "format_reward": ("format_reward", True),
    "soft_overlong_punishment": ("soft_overlong_punishment", True),
    "code_execution": ("code_execution", True),
}


class RewardScores(NamedTuple):
    # (B, K_outcome) float32, NaN where an outcome function returned None (or failed, under errors="skip")
    rewards: torch.Tensor
    # per function, outcome functions first, then process functions: rows whose call failed or timed out (always 0
    # under errors="raise")
    errors: list[int]
    seconds: float  # wall-clock time of the whole scoring
    # (B, K_process, width) float32: each step's reward at its last token, NaN elsewhere (and on rows a process
    # function returned None for or failed on); (B, 0, width) without process functions
    step_rewards: torch.Tensor | None = None


def reward_name(func: Callable | PreTrainedModel | str) -> str:
    """The name used in metrics (`rewards/<name>/mean`) and error messages; for a reward model named by path or hub
    id and not loaded yet, the name it will have."""
    if isinstance(func, str):
        return func.rstrip("/").split("/")[-1]
    if isinstance(func, PreTrainedModel):
        return func.config._name_or_path.rstrip("/").split("/")[-1] or type(func).__name__
    return getattr(func, "__name__", None) or type(func).__name__


def reward_kind(name: str) -> str:
    """What a reward string names, decided without importing or downloading anything: 'builtin', 'function'
    (`module:function`), 'path' (an existing local reward-model folder) or 'hub' (a reward-model id). Raises
    `InputError` for a local-looking path that does not exist and for a name close to a built-in one."""
    if name in BUILTIN_REWARDS:
        return "builtin"
    if looks_local(name):
        if not Path(name).expanduser().exists():
            raise InputError(
                f"Reward {name!r} looks like a local reward-model path, but it does not exist (relative paths start "
                f"from the working directory {Path.cwd()}). Fix the path, or name a built-in reward "
                f"({', '.join(BUILTIN_REWARDS)}) or your own as 'module:function'."
            )
        return "path"
    if ":" in name:
        return "function"
    if Path(name).is_dir():
        return "path"
    close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1, cutoff=0.6) if "/" not in name else []
    if close:
        raise InputError(
            f"Unknown reward {name!r}: it is not a built-in reward. Did you mean {close[0]!r}? (Built-ins: "
            f"{', '.join(BUILTIN_REWARDS)}; your own function: 'module:function'; a reward model: a local folder or "
            "a hub id such as 'org/name'.)"
        )
    return "hub"


def resolve_reward_name(
    name: str, kwargs: dict | None = None, search_dirs: Sequence = ()
) -> Callable | PreTrainedModel:
    """The reward a string names (see `reward_kind`), the one resolver behind both `GRPOTrainer(reward_funcs="...")`
    and recipes. `module:function` is imported with the working directory and `search_dirs` on the import path; a
    factory (built-in or imported) is called with `kwargs` when they are given."""
    kind = reward_kind(name)
    kwargs = kwargs or {}
    if kind in ("path", "hub"):
        if kwargs:
            raise InputError(f"Reward model {name!r} takes no settings; remove its `kwargs`.")
        if kind == "path":
            return load_reward_model(str(Path(name).expanduser()))
        try:
            return load_reward_model(name)
        except InputError:
            raise
        except Exception as e:
            raise InputError(
                f"Reward {name!r} is not a built-in reward ({', '.join(BUILTIN_REWARDS)}), a 'module:function' or a "
                f"local folder, so it was loaded as a reward model from the hub, which failed: {type(e).__name__}: "
                f"{e}. Fix the name, or pass the reward model's local folder."
            ) from e
    if kind == "function":
        module_name, _, attr = name.partition(":")
        for folder in [Path.cwd(), *search_dirs]:
            if str(folder) not in sys.path:
                sys.path.insert(0, str(folder))
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise InputError(
                f"Reward '{name}': cannot import module '{module_name}' ({e}). Put {module_name}.py in the "
                "working directory or the recipe's folder, or install the package that provides it."
            ) from e
        if not hasattr(module, attr):
            raise InputError(
                f"Reward '{name}': module '{module_name}' has no attribute '{attr}'. Check the function's name: "
                "'module:function'."
            )
        func = getattr(module, attr)
        return func(**kwargs) if kwargs else func
    from grpo import rewards

    attr, is_factory = BUILTIN_REWARDS[name]
    func = getattr(rewards, attr)
    if not is_factory:
        if kwargs:
            raise InputError(f"The built-in reward '{name}' takes no settings; remove its `kwargs`.")
        return func
    try:
        return func(**kwargs)
    except TypeError as e:
        raise InputError(
            f"The built-in reward '{name}' needs settings ({e}): in a recipe give them under `kwargs:`; in Python "
            f"call grpo.rewards.{attr}(...) and pass the function it returns."
        ) from e


def check_reward_funcs(reward_funcs, reward_processing_classes=None, reward_weights=None) -> tuple[list, list]:
    """Every check of the rewards given to the trainer that needs no weights, so that a misspelt name, a bad
    signature or a miscounted `reward_weights` fails before any model loads: every string is checked
    (`reward_kind`) before any is resolved, built-ins and `module:function` are resolved (an import, no weights),
    each function's signature is checked (`check_reward_signature`), and `reward_processing_classes` and
    `reward_weights` must have one entry per reward. Returns (the rewards, reward models named by path or hub id
    still as strings; the tokenizers given, aligned with them)."""
    reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    if not reward_funcs:
        raise ValueError("reward_funcs is empty; pass at least one reward function or reward model.")
    kinds = [reward_kind(f) if isinstance(f, str) else None for f in reward_funcs]
    reward_funcs = [resolve_reward_name(f) if k in ("builtin", "function") else f for f, k in zip(reward_funcs, kinds)]
    for f in reward_funcs:
        if isinstance(f, PreTrainedModel):
            check_reward_model(f, reward_name(f))
            if is_process_reward(f):
                raise TypeError(
                    f"Reward model '{reward_name(f)}' is marked @process_reward, but a reward model scores whole "
                    "completions. Wrap it in a @process_reward function that splits the completion into steps, "
                    "scores them and returns StepRewards."
                )
        elif callable(f):
            check_reward_signature(f)
        elif not isinstance(f, str):
            raise TypeError(f"A reward function must be callable or a reward model, got {type(f).__name__}.")
    given = reward_processing_classes
    if given is None:
        given = [None] * len(reward_funcs)
    elif not isinstance(given, list):
        given = [given]
    if len(given) != len(reward_funcs):
        raise ValueError(
            f"reward_processing_classes has {len(given)} entries for {len(reward_funcs)} reward "
            "functions; align them (None for plain functions)."
        )
    if reward_weights is not None and len(reward_weights) != len(reward_funcs):
        raise ValueError(
            f"reward_weights has {len(reward_weights)} entries but there are {len(reward_funcs)} reward functions "
            f"({[reward_name(f) for f in reward_funcs]}); give one weight per function."
        )
    return reward_funcs, given


def load_reward_funcs(reward_funcs, reward_processing_classes=None, reward_weights=None) -> tuple[list, list]:
    """Check the rewards given to the trainer (`check_reward_funcs`), then load the reward models named by path or
    hub id (`resolve_reward_name`) and the tokenizers of reward models given without one. Returns (reward functions
    and models, tokenizers aligned with them)."""
    reward_funcs, given = check_reward_funcs(reward_funcs, reward_processing_classes, reward_weights)
    reward_funcs = [resolve_reward_name(f) if isinstance(f, str) else f for f in reward_funcs]
    tokenizers = []
    for func, tokenizer in zip(reward_funcs, given):
        if isinstance(func, PreTrainedModel) and tokenizer is None:
            path = func.config._name_or_path
            if not path:
                raise ValueError(
                    f"Reward model '{reward_name(func)}' was built in code and has no path to load a tokenizer "
                    "from; pass its tokenizer in `reward_processing_classes`."
                )
            tokenizer = AutoTokenizer.from_pretrained(path)
        if tokenizer is not None and tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if isinstance(func, PreTrainedModel) and func.config.pad_token_id is None:
            func.config.pad_token_id = tokenizer.pad_token_id
        tokenizers.append(tokenizer)
    return reward_funcs, tokenizers


def check_reward_signature(func: Callable) -> None:
    """Refuse a reward function that cannot receive its arguments: they are all passed by keyword
    (`_accepted_kwargs`), so a positional-only parameter without a default is never filled, and a function with no
    keyword parameter and no `**kwargs` (e.g. only `*args`) receives nothing. A signature that cannot be read (some
    built-in callables) is not checked."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return
    params = signature.parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        problem = f"so its positional-only parameter(s) {positional} would never be given"
    elif not any(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params):
        problem = "and it takes none (no named parameter, no **kwargs)"
    else:
        return
    name = reward_name(func)
    raise InputError(
        f"Reward function '{name}{signature}' cannot receive its arguments: reward functions are called with keyword "
        f"arguments only, {problem}. Supported signatures: def {name}(prompts, completions, **kwargs) -> "
        f"list[float | None], or async def the same; the keywords are {', '.join(RESERVED_COLUMNS)} and every other "
        "dataset column (name those you use, **kwargs takes the rest)."
    )


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


def _rows(kwargs: dict[str, Any], start: int, stop: int) -> dict[str, Any]:
    """Every per-row argument cut to rows [start, stop); others (trainer_state) unchanged."""
    return {k: (v[start:stop] if isinstance(v, (list, tuple, torch.Tensor)) else v) for k, v in kwargs.items()}


def _to_float(value: Any, name: str, row: int) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"Reward function '{name}' returned {value!r} ({type(value).__name__}) for row {row}; "
        "each entry must be a number, or None when the function does not apply to that row."
    )


def _checked(values: Any, name: str, num_rows: int, offset: int = 0) -> list[float | None]:
    """What an outcome function `name` returned for `num_rows` rows (the first being row `offset` of the batch),
    checked: a float or None per row. A wrong length or type raises (a bug in the function, never skipped)."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != num_rows:
        got = f"length {len(values)}" if isinstance(values, Sequence) else type(values).__name__
        raise ValueError(f"Reward function '{name}' must return a list of {num_rows} values (one per row), got {got}.")
    return [_to_float(v, name, offset + i) for i, v in enumerate(values)]


class _Call(NamedTuple):
    """One call of one function on rows [start, start + num_rows) of the batch."""

    index: int  # the function's position among the functions scored (outcome functions first)
    func: Callable
    kwargs: dict[str, Any]
    start: int
    num_rows: int
    # checks what the function returned: (values, name, num_rows, offset) -> one value or None per row;
    # `_checked` (numbers) for outcome functions, `check_step_rewards` (StepRewards) for process functions
    check: Callable[[Any, str, int, int], list] = _checked


# The outcome of a call: the checked values (None where a row failed) and the failures as (row in the batch or None
# for the whole call, exception). Rows are retried one by one only after the call on all of them raised.
_Outcome = tuple[list[Any], list[tuple[int | None, BaseException]]]


def _retry_rows(call: _Call, batch_error: Exception, one_row: Callable, stop_at_first: bool) -> _Outcome:
    name = reward_name(call.func)
    values, failures = [], []
    for i in range(call.num_rows):
        try:
            value = one_row(_rows(call.kwargs, i, i + 1))
        except Exception as error:
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
    invoke = invoke or (lambda kwargs: call.func(**kwargs))
    try:
        values = invoke(call.kwargs)
    except Exception as error:
        return _retry_rows(call, error, invoke, stop_at_first)
    return call.check(values, reward_name(call.func), call.num_rows, call.start), []


# Worker-process pools, one per size, kept between rounds (starting a process costs far more than a call).
_PROCESS_POOLS: dict[int, ProcessPoolExecutor] = {}


def _process_pool(num_workers: int) -> ProcessPoolExecutor:
    if num_workers not in _PROCESS_POOLS:
        # spawn, not fork: the trainer has threads (and maybe CUDA), which a forked child would inherit broken.
        context = multiprocessing.get_context("spawn")
        _PROCESS_POOLS[num_workers] = ProcessPoolExecutor(num_workers, mp_context=context)
    return _PROCESS_POOLS[num_workers]


def _discard_process_pool(num_workers: int) -> None:
    """Kill a pool's workers (one may be stuck in a timed-out call) and forget it; the next round starts anew."""
    pool = _PROCESS_POOLS.pop(num_workers, None)
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
        values = await call.func(**call.kwargs)
    except Exception as error:
        batch_error = error
        # Retried rows run in a private event loop in a thread of their own: this loop is busy awaiting us.
        return await _in_daemon_thread(
            lambda: _retry_rows(call, batch_error, lambda kwargs: asyncio.run(call.func(**kwargs)), stop_at_first)
        )
    return call.check(values, reward_name(call.func), call.num_rows, call.start), []


def _in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run `fn` in a daemon thread: unlike an executor's threads, one that hangs past its timeout does not block
    the interpreter's exit."""
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

    threading.Thread(target=target, daemon=True, name="grpo-reward").start()
    return future


async def _run_concurrently(
    calls: list[_Call], timeout: float | None, num_workers: int, worker_type: str, stop_at_first: bool
):
    workers = asyncio.Semaphore(num_workers or max(len(calls), 1))  # sync calls running at once
    pool = _process_pool(num_workers) if worker_type == "process" and num_workers > 0 else None
    invokers = {id(call): _in_process(call, pool) for call in calls if pool is not None and not is_async(call.func)}
    timed_out = False

    async def run(call: _Call) -> _Outcome:
        nonlocal timed_out
        try:
            if is_async(call.func):
                return await asyncio.wait_for(_run_async(call, stop_at_first), timeout)
            async with workers:
                work = _in_daemon_thread(lambda: _run_sync(call, stop_at_first, invokers.get(id(call))))
                return await asyncio.wait_for(work, timeout)
        except (asyncio.TimeoutError, TimeoutError):
            timed_out = True
            return [None] * call.num_rows, [(None, TimeoutError(f"timed out after {timeout} s (reward_timeout)"))]

    outcomes = await asyncio.gather(*(run(call) for call in calls))
    if pool is not None and (timed_out or getattr(pool, "_broken", False)):
        _discard_process_pool(num_workers)  # after every call has finished: none of theirs is killed
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
    raise RuntimeError(
        f"{what} '{name}' failed on {where}{detail}: {type(error).__name__}: {error}. Fix the function, or "
        "set reward_errors='skip' to give such rows None for this function and continue."
    ) from error


def call_reward_function(func: Callable, available: dict[str, Any], num_rows: int) -> list[float]:
    """Call one function (sync or async) on all rows and check what it returns; an exception is re-raised naming
    the function, the first row that fails alone, and what it raised."""
    call = _Call(0, func, _accepted_kwargs(func, available), 0, num_rows)
    if is_async(func):
        values, failures = _run_event_loop(_run_concurrently([call], None, 0, "thread", True))[0]
    else:
        values, failures = _run_sync(call, stop_at_first=True)
    _report(call, failures, available.get("prompts", [None] * num_rows), "raise")
    return [math.nan if v is None else v for v in values]


@torch.no_grad()
def score_with_model(
    model: PreTrainedModel, tokenizer, prompts: Sequence, completions: Sequence, batch_size: int | None = None
) -> list[float]:
    """Scalar score of each (prompt, completion) pair from a one-label sequence-classification model, computed in
    chunks of `batch_size` rows (all at once when None)."""
    if is_conversational(prompts[0]):
        # A prompt ending in an assistant message (prefill) is continued: that text already starts the completion.
        texts = [
            tokenizer.apply_chat_template((p[:-1] if p[-1]["role"] == "assistant" else p) + c, tokenize=False)
            for p, c in zip(prompts, completions)
        ]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    device = next(model.parameters()).device
    batch_size = batch_size or len(texts)
    scores = []
    for start in range(0, len(texts), batch_size):
        inputs = tokenizer(
            texts[start : start + batch_size],
            return_tensors="pt",
            padding=True,
            padding_side="right",
            add_special_tokens=False,
        )
        logits = model(**{k: v.to(device) for k, v in inputs.items()}).logits  # (b, 1)
        scores += logits[:, 0].float().tolist()
    return scores


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


def _warn_unscored(rewards: torch.Tensor, step_rewards: torch.Tensor, any_failed: bool) -> None:
    """Warn about rows that no function scored: no outcome value and no step reward. They get advantage 0."""
    if rewards.shape[1] + step_rewards.shape[1] == 0:  # nothing was asked to score: nothing to warn about
        return
    no_steps = torch.isnan(step_rewards).flatten(1).all(dim=1)  # (B,), True when K_process = 0
    unscored = (torch.isnan(rewards).all(dim=1) & no_steps).nonzero().flatten().tolist()
    if unscored:
        warnings.warn(
            f"No reward function scored row(s) {unscored[:20]}{' ...' if len(unscored) > 20 else ''} of this batch "
            f"({len(unscored)} of {rewards.shape[0]}): each returned None{' or failed' if any_failed else ''}. "
            "These rows get advantage 0. Make sure at least one reward function applies to every row.",
            stacklevel=4,
        )


def score_rewards(
    outcome_funcs: Sequence[Callable | PreTrainedModel],
    outcome_tokenizers: Sequence[Any],
    process_funcs: Sequence[Callable],
    *,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    trainer_state: Any = None,
    tokenizer: Any = None,
    width: int | None = None,
    errors: str = "raise",
    timeout: float | None = None,
    num_workers: int = 0,
    worker_type: str = "thread",
    model_batch_size: int | None = None,
) -> RewardScores:
    """Score every row under every outcome function or reward model (`outcome_tokenizers`: the reward models'
    tokenizers, aligned) and every process function, all called the same way (see the module docstring for
    `errors`, `timeout`, `num_workers` and `worker_type`). Returns the (B, K_outcome) rewards, the
    (B, K_process, width) step rewards (`tokenizer`: the policy's, which maps `char_ends` to tokens; `width`: the
    longest completion when None), the failed rows per function (outcome functions first) and the time taken."""
    if errors not in REWARD_ERRORS:
        raise ValueError(f"errors={errors!r} must be one of {REWARD_ERRORS}.")
    if worker_type not in REWARD_WORKER_TYPES:
        raise ValueError(f"worker_type={worker_type!r} must be one of {REWARD_WORKER_TYPES}.")
    began = time.perf_counter()
    num_rows = len(prompts)
    width = max((len(ids) for ids in completion_ids), default=0) if width is None else width
    available = {
        **columns,
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        "trainer_state": trainer_state,
    }
    funcs = [*outcome_funcs, *process_funcs]
    checks = [_checked] * len(outcome_funcs) + [check_step_rewards] * len(process_funcs)
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
        failed[call.index] += _report(call, failures, prompts, errors)
        values[call.index][call.start : call.start + call.num_rows] = call_values

    rewards = torch.full((num_rows, len(outcome_funcs)), math.nan)  # (B, K_outcome)
    for k, (func, reward_tokenizer) in enumerate(zip(outcome_funcs, outcome_tokenizers)):
        if isinstance(func, PreTrainedModel):
            scores = score_with_model(func, reward_tokenizer, prompts, completions, model_batch_size)
            rewards[:, k] = torch.tensor(scores)
        else:
            rewards[:, k] = torch.tensor([math.nan if v is None else v for v in values[k]], dtype=torch.float32)
    laid_out = [
        lay_out_steps(values[len(outcome_funcs) + j], completion_ids, completions, tokenizer, width, reward_name(f))
        for j, f in enumerate(process_funcs)
    ]
    step_rewards = torch.stack(laid_out, dim=1) if laid_out else torch.empty(num_rows, 0, width)

    _warn_unscored(rewards, step_rewards, any(failed))
    return RewardScores(rewards, failed, time.perf_counter() - began, step_rewards)


def score_completions(
    reward_funcs: Sequence[Callable | PreTrainedModel],
    reward_tokenizers: Sequence[Any],
    *,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    trainer_state: Any = None,
    errors: str = "raise",
    timeout: float | None = None,
    num_workers: int = 0,
    worker_type: str = "thread",
    model_batch_size: int | None = None,
) -> RewardScores:
    """`score_rewards` with outcome functions and reward models only: rewards of every row under every function,
    (B, K) float32, NaN where a function returned None, with the failed rows per function and the time taken."""
    return score_rewards(
        reward_funcs,
        reward_tokenizers,
        [],
        prompts=prompts,
        completions=completions,
        completion_ids=completion_ids,
        columns=columns,
        trainer_state=trainer_state,
        errors=errors,
        timeout=timeout,
        num_workers=num_workers,
        worker_type=worker_type,
        model_batch_size=model_batch_size,
    )


class RewardSet:
    """The trainer's reward functions, built once: names, signatures and weights checked before any reward model
    loads, then rewards given as strings resolved and reward-model tokenizers loaded (`load_reward_funcs`), and the
    functions split by kind, since outcome and process functions give different advantages (grpo/objective/loss.py
    `mixed_advantages`) but are called the same way (`score`).

    Attributes: `names` (outcome functions first, then process functions: the order of the reward columns in
    metrics and of `RewardScores.errors`), `outcome_funcs` and `outcome_tokenizers` (reward functions and reward
    models, with the models' tokenizers; a caller may replace the models, e.g. with ones prepared for its devices),
    `outcome_weights` and `process_weights` (float32 tensors) and `process_funcs` (`@process_reward` functions)."""

    def __init__(self, reward_funcs, reward_processing_classes=None, reward_weights: Sequence[float] | None = None):
        funcs, tokenizers = load_reward_funcs(reward_funcs, reward_processing_classes, reward_weights)
        weights = list(reward_weights) if reward_weights is not None else [1.0] * len(funcs)
        is_process = [is_process_reward(f) for f in funcs]
        self.outcome_funcs = [f for f, p in zip(funcs, is_process) if not p]
        self.outcome_tokenizers = [t for t, p in zip(tokenizers, is_process) if not p]
        self.outcome_weights = torch.tensor([w for w, p in zip(weights, is_process) if not p], dtype=torch.float32)
        self.process_funcs = [f for f, p in zip(funcs, is_process) if p]
        self.process_weights = torch.tensor([w for w, p in zip(weights, is_process) if p], dtype=torch.float32)
        self.names = [reward_name(f) for f in self.outcome_funcs] + [reward_name(f) for f in self.process_funcs]

    def score(self, **keywords) -> RewardScores:
        """Every function of the set on one batch, in one pass: `score_rewards` with this set's functions and the
        same keywords (prompts, completions, completion_ids, columns, trainer_state, tokenizer, width, errors,
        timeout, num_workers, worker_type, model_batch_size). `rewards` is (B, K_outcome), `step_rewards`
        (B, K_process, width) and `errors` has one count per function in `names` order."""
        return score_rewards(self.outcome_funcs, self.outcome_tokenizers, self.process_funcs, **keywords)

    def columns(self, rewards_per_func: torch.Tensor, step_rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, K) one reward column per function in `names` order (a process function's: the sum of its step
        rewards, NaN without steps) and the combined reward of each row over every function that scored it."""
        columns = torch.cat([rewards_per_func, step_reward_sums(step_rewards)], dim=1)
        return columns, combine_rewards(columns, torch.cat([self.outcome_weights, self.process_weights]))


def call_settings(args, mode: str) -> dict[str, Any]:
    """How a `GRPOConfig` has reward functions called (`RewardSet.score` keywords) in `mode` ("train"/"eval")."""
    return {
        "errors": args.reward_errors,
        "timeout": args.reward_timeout,
        "num_workers": args.reward_num_workers,
        "worker_type": args.reward_worker_type,
        "model_batch_size": args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size,
    }
