"""Metrics accumulated between two log calls, reduced the right way.

Token-level metrics (kl, entropy, clip ratios) are weighted by the number of loss tokens they were measured on, so
the logged value is the mean over every token of the logging window, on every process, and not a mean of per-step
means. Lengths keep a true minimum and maximum. The trainer adds values that are already summed or gathered over
processes; this class only accumulates them over micro-steps and generation rounds.
"""

from __future__ import annotations

import json
import math
import os


class MetricsWindow:
    def __init__(self):
        self._sums: dict[str, list[float]] = {}  # name -> [weighted total, total weight]
        self._mins: dict[str, float] = {}
        self._maxs: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._totals: dict[str, float] = {}

    def add_mean(self, name: str, total: float, weight: float = 1.0) -> None:
        """Add `total` (a value already multiplied by its weight) and its `weight`."""
        entry = self._sums.setdefault(name, [0.0, 0.0])
        entry[0] += float(total)
        entry[1] += float(weight)

    def add_sum(self, name: str, value: float) -> None:
        """A count: the logged value is the total over the window."""
        self._totals[name] = self._totals.get(name, 0.0) + float(value)

    def add_min(self, name: str, value: float) -> None:
        self._mins[name] = min(self._mins.get(name, math.inf), float(value))

    def add_max(self, name: str, value: float) -> None:
        self._maxs[name] = max(self._maxs.get(name, -math.inf), float(value))

    def set_last(self, name: str, value: float) -> None:
        self._last[name] = float(value)

    def state_dict(self) -> dict[str, dict]:
        """What the window holds, as plain dicts (saved in checkpoints: a resumed run logs what it would have)."""
        return {key: dict(value) for key, value in vars(self).items()}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        for key, value in state.items():
            setattr(self, key, dict(value))

    def pop(self) -> dict[str, float]:
        """The reduced metrics of the window, then an empty window. A mean with zero weight is NaN (nothing was
        measured: e.g. no row had a reward from that function)."""
        out = {name: (total / weight if weight > 0 else math.nan) for name, (total, weight) in self._sums.items()}
        out.update(self._mins)
        out.update(self._maxs)
        out.update(self._last)
        out.update(self._totals)
        self.__init__()
        return out


def format_completions(samples: list[dict], reward_names: list[str], max_rows: int | None = None) -> str:
    """A plain-text table of sampled completions: prompt, completion, each reward and the advantage."""
    from grpo.rewards import completion_text

    rows = samples if max_rows is None else samples[:max_rows]

    def clip(value, width):
        text = str(completion_text(value))
        text = text.replace("\n", "\\n")
        return text if len(text) <= width else text[: width - 3] + "..."

    header = ["prompt", "completion", *reward_names, "advantage"]
    lines = [" | ".join(header)]
    for s in rows:
        rewards = [f"{r:.3f}" for r in s["rewards"]]
        lines.append(
            " | ".join([clip(s["prompt"], 40), clip(s["completion"], 60), *rewards, f"{s['advantage']:+.3f}"])
        )
    return "\n".join(lines)


def write_completions(path: str, step: int, samples: list[dict], reward_names: list[str]) -> None:
    """Append every sample of a logged round to a JSON-lines file: one object per completion with the step, the
    prompt, the completion, each reward by name (None where a function gave none) and the advantage."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        for s in samples:
            rewards = {name: (None if math.isnan(r) else r) for name, r in zip(reward_names, s["rewards"])}
            record = {"step": step, "prompt": s["prompt"], "completion": s["completion"], "rewards": rewards}
            record["advantage"] = None if math.isnan(s["advantage"]) else s["advantage"]
            f.write(json.dumps(record) + "\n")
