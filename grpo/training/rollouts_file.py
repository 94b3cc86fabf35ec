"""`save_rollouts`: an online run's scored rounds written to `output_dir/rollouts.jsonl` (docs/offline.md).

The file is training's output and offline training's input: one line per completion, in the form
`grpo.data.offline` reads back (`load_scored_rollouts`, then `offline_groups`), so an online run's samples can be
trained on again without generating.
"""

from __future__ import annotations

import json
import math
import os

from accelerate.utils import gather_object

from grpo.data.offline import TRUNCATED
from grpo.rollout import Rollout, gather_rows

ROLLOUTS_FILE = "rollouts.jsonl"  # what `save_rollouts` writes in output_dir


def save_round(output_dir: str, accelerator, rollout: Rollout, rewards, step: int) -> None:
    """Append a scored round (all processes' rows) to `output_dir/rollouts.jsonl`, one line per completion, in the
    form offline training reads back: prompt, completion, reward (the combined reward), rewards (per function),
    truncated (cut off without EOS) and step (the optimizer step it was sampled at). Every process calls it; the
    main process writes. `rewards`: the run's `RewardSet`, which names the functions and combines their columns."""
    columns, combined = rewards.columns(rollout.rewards_per_func, rollout.step_rewards, rollout.turn_rewards)
    prompts, completions = gather_object(rollout.prompts), gather_object(rollout.completions)
    truncated = gather_rows(accelerator, rollout.is_truncated).tolist()
    if not accelerator.is_main_process:
        return
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, ROLLOUTS_FILE)

    def number(x: float) -> float | None:  # JSON has no NaN: unscored is null
        return None if math.isnan(x) else x

    with open(path, "a") as f:
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            per_function = {n: number(v) for n, v in zip(rewards.names, columns[i].tolist())}
            record = {"prompt": prompt, "completion": completion, "reward": number(combined[i].item())}
            record |= {"rewards": per_function, TRUNCATED: truncated[i], "step": step}
            f.write(json.dumps(record) + "\n")
