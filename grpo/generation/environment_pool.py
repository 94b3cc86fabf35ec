"""The environment objects of a run: made lazily, reused across episodes through `reset`, and always closed.

An environment may hold what outlives a Python object: a container, a browser, a server session, a child process,
an open file. So the objects of one factory live in an `EnvironmentPool`:
  - `take()` hands out an idle object, or calls the factory when none is idle: a pool grows to the number of
    episodes one round runs at once (a round's rows on this process), never more. A factory that raises, or that
    returns an object it gave before, ends the run with an `EnvironmentFactoryError` naming it
    (environment_checks.py);
  - `give_back(objects)` returns a round's objects once its rewards are scored (the reward functions receive the live
    objects, as in TRL), and the next episode resets one;
  - `close()` calls `close()` (sync or `async def`, when the class defines it) on every object the pool made, idle or
    handed out, and forgets them; a failing `close` is reported as a warning naming the class, and the others are
    still closed. A closed pool may be used again (evaluation after `train()`): it makes new objects.

The trainer closes its pools when training ends, whether it ended normally, with an error, or on SIGTERM (the
preemption stop), and when the trainer is garbage-collected (`weakref.finalize`, which also runs at interpreter exit).
A process killed outright (SIGKILL, a second SIGTERM) closes nothing: what an environment started must then die with
it by other means (a child process in its own process group that watches its parent, a server-side session timeout).

`group_seed(row, seed)`: the seed every episode of one group resets with under `environment_group_seed`, so that the
G episodes of a prompt start from the same state and the group baseline compares like with like.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping

from grpo.generation.environment_checks import check_new_object, factory_label, make_environment


class EnvironmentPool:
    """The objects of one environment factory (module docstring). `first`: an object already made (the trainer makes
    one when it is built, to check the class), which the first episode gets; `name`: the factory's key in a dict of
    them (for messages). Safe to use from several threads (an async generation producer and an evaluation in the main
    thread)."""

    def __init__(self, factory: Callable[[], object], first: object | None = None, name: str | None = None):
        self.factory, self.name = factory, name
        self.lock = threading.Lock()
        self.idle: list[object] = [] if first is None else [first]
        self.made: list[object] = list(self.idle)  # every object not yet closed, idle or handed out
        self.created = len(self.made)  # objects made over the pool's life (for tests and metrics)
        self.making = 0  # factory calls under way

    def take(self) -> object:
        """An idle object, or a new one from the factory."""
        with self.lock:
            if self.idle:
                return self.idle.pop()
            self.making += 1
            number = self.created + self.making  # this call's object, counting those under way in other threads
        try:  # outside the lock: a factory may take a while (a container starting)
            environment = make_environment(self.factory, self.name, number)
        finally:
            with self.lock:
                self.making -= 1
        with self.lock:
            check_new_object(environment, self.made, factory_label(self.factory, self.name))
            self.made.append(environment)
            self.created += 1
        return environment

    def give_back(self, environments: Iterable[object]) -> None:
        """Make `environments` (objects this pool made, handed out) idle again; others are ignored."""
        with self.lock:
            owned, idle = {id(e) for e in self.made}, {id(e) for e in self.idle}
            for environment in environments:
                if id(environment) in owned and id(environment) not in idle:
                    self.idle.append(environment)
                    idle.add(id(environment))

    def close(self) -> None:
        """`close()` every object the pool made (those that define it), then forget them all."""
        with self.lock:
            environments, self.made, self.idle = self.made, [], []
        for environment in environments:
            close_environment(environment)


def close_environment(environment: object) -> None:
    """Call `environment.close()` when its class defines one (awaited when `async def`); a failure is a warning."""
    close = getattr(environment, "close", None)
    if not callable(close):
        return
    try:
        result = close()
        if inspect.isawaitable(result):
            asyncio.run(_awaited(result))
    except Exception as error:  # closing the others matters more than this one's failure
        warnings.warn(
            f"{type(environment).__name__}.close() raised {type(error).__name__}: {error}. What that environment "
            "holds (a container, a session, a process) may still be open.",
            RuntimeWarning,
            stacklevel=2,
        )


async def _awaited(result):
    return await result


def close_pools(pools: Mapping[str | None, EnvironmentPool]) -> None:
    """Close every pool of `pools` (by factory name), as they are when called: what `weakref.finalize` runs when
    the toolbox that owns them is collected."""
    for pool in list(pools.values()):
        pool.close()


def group_seed(row: Mapping, seed: int) -> int:
    """A seed in [0, 2**31) made from the row's columns and the run's `seed`: equal for the G copies of one prompt,
    different (almost surely) between rows. Values that are not JSON (an image) count by their type only, so the seed
    is the same on every machine and in every run.

    >>> group_seed({"prompt": "Play.", "level": 3}, 0) == group_seed({"level": 3, "prompt": "Play."}, 0)
    True
    >>> group_seed({"prompt": "Play.", "level": 3}, 0) != group_seed({"prompt": "Play.", "level": 4}, 0)
    True
    """
    text = json.dumps([seed, dict(row)], sort_keys=True, default=lambda value: type(value).__name__)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") % 2**31


def accepts_seed(reset: Callable) -> bool:
    """Whether `reset` takes a `seed` keyword (named, or through `**kwargs`)."""
    parameters = inspect.signature(reset).parameters.values()
    return any(p.name == "seed" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
