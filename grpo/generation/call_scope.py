"""What a tool call or a reward call started outside the process, stopped when the call is abandoned at its timeout.

A sync call that times out cannot be stopped: its thread runs on. What it started outside the process can be, and
must be: a sandboxed run of model-written code (grpo/rewards/sandbox) would otherwise go on for its whole wall-clock
limit after the call was answered "took longer than N s", and past the end of `train()`.

The caller that may abandon a call (grpo/generation/tool_executor.py, grpo/rewards/runner.py) runs it inside a
`CallScope`, which is a context variable, so threads that copy the context (`run_in_context`) and asyncio tasks see
it too. Code that starts such work registers a way to stop it with the current scope (`current_scope().enter(stop)`)
and leaves when it ends; `abandon()` calls every registered stop and refuses later ones, so the abandoned call
starts nothing more.

    scope = CallScope()
    thread = threading.Thread(target=run_in_context(scope.run, tool, code))
    ...                                  # the timeout passes
    scope.abandon()                      # every sandbox the call started is killed; a new one is refused
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

_current: contextvars.ContextVar[CallScope | None] = contextvars.ContextVar("grpo_call_scope", default=None)


class CallScope:
    """The stops of what one call started (each a callable taking no argument), called by `abandon()`."""

    def __init__(self):
        self._lock = threading.Lock()
        self._stops: list[Callable[[], Any]] = []
        self._abandoned = False

    @property
    def abandoned(self) -> bool:
        """Whether the call was abandoned: it must start nothing more."""
        return self._abandoned

    def run(self, function: Callable, /, *args, **kwargs):
        """`function(*args, **kwargs)` with this scope current (in this thread, and what copies its context)."""
        token = _current.set(self)
        try:
            return function(*args, **kwargs)
        finally:
            _current.reset(token)

    def enter(self, stop: Callable[[], Any]) -> bool:
        """Register `stop`; False, registering nothing, once the call is abandoned (then stop the work at once)."""
        with self._lock:
            if self._abandoned:
                return False
            self._stops.append(stop)
            return True

    def leave(self, stop: Callable[[], Any]) -> None:
        """The work of `stop` ended by itself: forget it."""
        with self._lock:
            if stop in self._stops:
                self._stops.remove(stop)

    def abandon(self) -> None:
        """Call every registered stop (one that raises does not keep the others from running) and refuse more."""
        with self._lock:
            self._abandoned, stops, self._stops = True, self._stops, []
        for stop in stops:
            try:
                stop()
            except Exception:  # a stop is best effort: the work may be gone already
                pass


def current_scope() -> CallScope | None:
    """The scope of the call this code runs in, or None outside any (work started then is the caller's to stop)."""
    return _current.get()


def run_in_context(function: Callable, *args) -> Callable[[], Any]:
    """A callable for a new thread that runs `function(*args)` in a copy of this thread's context (a thread starts
    with an empty one), so that the current scope reaches it."""
    context = contextvars.copy_context()
    return lambda: context.run(function, *args)
