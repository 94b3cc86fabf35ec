"""The learning-signal watch: one warning line, with the likely fix, when the logged training metrics show that a run
cannot be learning, however long it goes on (`GRPOConfig.learning_signal_warnings`, on by default; docs/metrics.md,
"When nothing is learned").

Each sign is a metric of the log line (docs/metrics.md) that stays past its threshold on `WINDOW` logged steps in a
row; each warns once per run:
  - `completions/clipped_ratio` >= 0.99: every completion is cut at `max_completion_length`, so no answer is finished;
  - `frac_reward_zero_std` >= 0.95: nearly every group's completions tie, so every advantage is 0;
  - `clip_ratio/region_mean` >= 0.9: nearly every token's ratio is clipped, so nearly no gradient passes;
  - `entropy` below 5% of its first logged value: the policy samples the same tokens, so groups stop differing.
Mostly missing rewards are warned of per round already (`metrics.warn_mostly_unscored`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable
from typing import NamedTuple

from transformers import TrainerCallback

# Logged steps in a row a sign must hold: one bad log line (a hard batch) is not yet a run that cannot learn.
WINDOW = 3

logger = logging.getLogger(__name__)


class Sign(NamedTuple):
    metric: str
    holds: Callable[[float, float], bool]  # (value, the first value logged) -> whether it signals no learning
    message: str  # what it means and the likely fix


SIGNS = (
    Sign(
        "completions/clipped_ratio",
        lambda value, first: value >= 0.99,
        "every completion is cut at max_completion_length, so none finishes its answer: raise "
        "max_completion_length, or ask for shorter answers in the prompt",
    ),
    Sign(
        "frac_reward_zero_std",
        lambda value, first: value >= 0.95,
        "nearly every group's completions get the same reward, so every advantage is 0 and nothing is learned: "
        "the task is too easy or too hard for this model, or the reward too coarse (make it finer-grained, or "
        "raise num_generations or temperature)",
    ),
    Sign(
        "clip_ratio/region_mean",
        lambda value, first: value >= 0.9,
        "nearly every token's probability ratio is clipped, so almost no gradient passes: the policy moves too far "
        "between generation and update; lower learning_rate or num_iterations",
    ),
    Sign(
        "entropy",
        lambda value, first: first > 0 and value < 0.05 * first,
        "the entropy collapsed below 5% of its first value: the policy samples the same tokens every time, so the "
        "completions of a group stop differing; lower learning_rate, add a KL term (beta > 0), or an entropy bonus "
        "(use_adaptive_entropy=True, entropy_target near the first entropy)",
    ),
)


class SignalWatch(TrainerCallback):
    """Watches the training log lines for `SIGNS` (on the main process) and warns once per sign."""

    def __init__(self, window: int = WINDOW):
        self.window = window
        self.recent = {sign.metric: deque(maxlen=window) for sign in SIGNS}
        self.first: dict[str, float] = {}
        self.warned: set[str] = set()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        for sign in SIGNS:
            value = logs.get(sign.metric)  # evaluation lines carry eval_* names, never these
            if not isinstance(value, int | float) or isinstance(value, bool) or math.isnan(value):
                continue
            first = self.first.setdefault(sign.metric, value)
            recent = self.recent[sign.metric]
            recent.append(sign.holds(value, first))
            if len(recent) == self.window and all(recent) and sign.metric not in self.warned:
                self.warned.add(sign.metric)
                logger.warning(
                    "Learning signal, step %d: for %d logged steps %s=%.3g: %s. (learning_signal_warnings=False "
                    "turns this warning off.)",
                    state.global_step,
                    self.window,
                    sign.metric,
                    value,
                    sign.message,
                )
