"""Whether this run's compute threads share the CPU with other work, said once (`grpo train` only).

torch computes on `torch.get_num_threads()` threads (one per core by default). When other processes keep some of the
same cores busy, those threads wait on one another at every parallel operation, and a run can take several times
longer (a demo measured 43 minutes under load against about 3 idle, with 6x its CPU time). Nothing here changes the
thread count: the library never changes process-wide settings (docs/STYLE.md), so the line names the setting
(`OMP_NUM_THREADS`, read when torch starts) for the user to choose.

The machine's load is the 1-minute load average (`os.getloadavg`, Unix), against the cores this process may run on
(`os.sched_getaffinity`, Linux; else `os.cpu_count()`); where neither is known, nothing is said.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from transformers import TrainerCallback


def machine_load() -> float | None:
    """The 1-minute load average (runnable and running threads, averaged), or None where the system has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # Windows has no getloadavg; a system may refuse it
        return None


def usable_cores() -> int | None:
    """The cores this process may run on (its affinity mask on Linux), else the machine's, else None."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count()


def oversubscription(load: float | None, cores: int | None, threads: int, own: float) -> str | None:
    """The line to print when `threads` compute threads of this run would share `cores` with other work, else None.

    `load`: the machine's load average; `own`: how much of it is this run (subtracted: the rest is other work).
    Oversubscribed when the other work and this run's threads need at least one core more than there are:
    others + threads >= cores + 1 (so a stray process using half a core is not worth a line).

    >>> oversubscription(load=4.0, cores=2, threads=2, own=1.0) is not None   # 3 other threads on 2 cores
    True
    >>> oversubscription(load=1.3, cores=2, threads=2, own=1.0) is None       # the machine is this run's
    True
    """
    if load is None or not cores:
        return None
    others = max(0.0, load - own)
    if others + threads < cores + 1:
        return None
    fits = max(1, cores - round(others))
    fix = (
        f"run with OMP_NUM_THREADS={fits} (set before grpo train starts), or stop the other jobs"
        if fits < threads
        else "stop the other jobs or wait for them (this run already computes on one thread)"
    )
    waiting = "which then wait on each other" if threads > 1 else "which then waits for a free core"
    return (
        f"the CPU is oversubscribed: other processes keep about {others:.1f} of its {cores} cores busy (load "
        f"{load:.1f}) and this run computes on {threads} thread(s), {waiting} and can make every step several times "
        f"slower. To fix: {fix}."
    )


def check_threads(threads: int, own: float, say: Callable[[str], None], load=None, cores=None) -> bool:
    """Say the `oversubscription` line, if there is one, through `say`; whether it was said. `load` and `cores`: the
    sources (`machine_load` and `usable_cores` when None; injected in tests)."""
    line = oversubscription((load or machine_load)(), (cores or usable_cores)(), threads, own)
    if line is not None:
        say(f"grpo train: {line}")
    return line is not None


class ThreadWatch(TrainerCallback):
    """Checks again at each logged step, while training, when nothing was said at the start: other work may begin
    later. Says it at most once. This run's own share of the load is taken as its compute threads (they run
    through most of a step)."""

    def __init__(self, threads: int, say: Callable[[str], None], said: bool = False, load=None, cores=None):
        self.threads, self.say, self.said, self.load, self.cores = threads, say, said, load, cores

    def on_log(self, args, state, control, **kwargs):
        if not self.said and state.is_local_process_zero:
            self.said = check_threads(self.threads, self.threads, self.say, self.load, self.cores)
