"""Process (step) rewards mixed with an outcome reward, under a DAPO-style configuration, on a tiny model.

    .venv/bin/python examples/process_rewards.py

A process reward function scores every step of a completion (here: every line) and says where each step ends; the
trainer turns the step rewards into per-token advantages (docs/method.md, docs/rewards.md). The model is a
randomly initialised 2-layer Llama built in code (`grpo.testing`), so nothing is downloaded and the run takes
seconds on a CPU; it shows the API, not learning.
"""

import re
import tempfile

from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer, StepRewards, process_reward
from grpo.testing import save_tiny_model


@process_reward
def digit_lines(completions, **kwargs):
    """Each non-empty line is a step, ending at its last character; a line with a digit earns 1, any other 0."""
    out = []
    for text in completions:
        lines = list(re.finditer(r"[^\n]+", text))
        rewards = [float(any(c.isdigit() for c in line.group())) for line in lines]
        out.append(StepRewards(rewards, char_ends=[line.end() for line in lines]) if lines else None)
    return out


def final_answer(completions, answer, **kwargs):
    """Outcome reward: 1 when the completion contains the expected answer."""
    return [1.0 if str(a) in c else 0.0 for c, a in zip(completions, answer)]


def main():
    model_path = save_tiny_model(tempfile.mkdtemp())
    dataset = Dataset.from_dict(
        {
            "prompt": [f"What is {i} + {i}? Show each step on its own line." for i in range(32)],
            "answer": [2 * i for i in range(32)],
        }
    )
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        report_to="none",
        max_steps=4,
        logging_steps=1,
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_completion_length=24,
        # DAPO: token-level loss over the whole step, clip-higher, overlong filtering, dynamic sampling.
        loss_type="dapo",
        epsilon_high=0.28,
        mask_truncated_completions=True,
        dynamic_sampling=True,
        # The outcome reward counts fully; the step rewards' advantages are added with weight 0.5.
        reward_weights=[1.0, 0.5],
    )
    trainer = GRPOTrainer(model_path, [final_answer, digit_lines], args=args, train_dataset=dataset)
    trainer.train()


if __name__ == "__main__":
    main()
