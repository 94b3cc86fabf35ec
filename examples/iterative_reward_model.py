"""The iterative RL scheme: the reference resets to the policy every K steps, and a reward model is retrained
between iterations on the newest scored samples plus a replay of older ones (DeepSeekMath, arXiv:2402.03300,
Algorithm 1; docs/method.md, "A reference that moves").

    .venv/bin/python examples/iterative_reward_model.py [--steps 12] [--reset-every 4]

The reward model here is a tiny linear model over a completion's byte histogram; its training labels come from an
"oracle" (the fraction of digit characters, standing in for the verifier or human labels that are too costly to ask
for every sample). The policy is a randomly initialised 2-layer Llama built in code (`grpo.testing`), so nothing is
downloaded and the run takes seconds on a CPU: it shows the mechanism (the `on_reference_reset` hook, what data the
reward model sees), not learning. For each iteration it prints the reward model's error on that iteration's samples
before and after the refresh.
"""

import argparse
import random
import tempfile

import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer, ReferenceResetCallback
from grpo.testing import save_tiny_model


def features(texts: list[str]) -> torch.Tensor:
    """(N, 256): each text's byte histogram, normalised to sum 1."""
    counts = torch.zeros(len(texts), 256)
    for i, text in enumerate(texts):
        for byte in text.encode():
            counts[i, byte] += 1
    return counts / counts.sum(dim=1, keepdim=True).clamp(min=1)


def oracle(texts: list[str]) -> torch.Tensor:
    """The expensive label the reward model learns to predict: the fraction of digits in the text."""
    return torch.tensor([sum(c.isdigit() for c in t) / max(len(t), 1) for t in texts])


class RewardModel:
    """A linear reward model, used as a reward function; it keeps the completions it scores for the next refresh."""

    __name__ = "learned_reward"

    def __init__(self):
        self.linear = torch.nn.Linear(256, 1)
        self.new_samples: list[str] = []  # scored since the last refresh
        self.replay: list[str] = []  # older samples

    def __call__(self, completions, **kwargs):
        self.new_samples.extend(completions)
        with torch.no_grad():
            return self.linear(features(completions)).squeeze(1).tolist()

    def error(self, texts: list[str]) -> float:
        with torch.no_grad():
            return torch.nn.functional.mse_loss(self.linear(features(texts)).squeeze(1), oracle(texts)).item()

    def refresh(self, replay_size: int = 64, epochs: int = 200) -> tuple[float, float]:
        """Fit to the newest samples plus up to `replay_size` older ones; returns the error on the newest before and
        after. Then the newest join the replay pool."""
        new = self.new_samples
        data = new + random.sample(self.replay, min(replay_size, len(self.replay)))
        before = self.error(new)
        x, y = features(data), oracle(data)
        optimizer = torch.optim.Adam(self.linear.parameters(), lr=0.05)
        for _ in range(epochs):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(self.linear(x).squeeze(1), y).backward()
            optimizer.step()
        after = self.error(new)
        self.replay.extend(new)
        self.new_samples = []
        return before, after


class RefreshRewardModel(ReferenceResetCallback):
    """Between iterations: the reference has just become the policy; retrain the reward model."""

    def __init__(self, reward_model: RewardModel):
        self.reward_model = reward_model

    def on_reference_reset(self, args, state, control, trainer=None, **kwargs):
        count = len(self.reward_model.new_samples)
        before, after = self.reward_model.refresh()
        print(
            f"iteration ending at step {state.global_step}: reward model refreshed on {count} new samples "
            f"(error on them {before:.5f} -> {after:.5f}), replay pool {len(self.reward_model.replay)}"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--reset-every", type=int, default=4)
    parser.add_argument("--output-dir", default=None)
    cli = parser.parse_args()
    random.seed(0)
    torch.manual_seed(0)

    reward_model = RewardModel()
    dataset = Dataset.from_dict({"prompt": [f"Write the number {i} in words and digits." for i in range(64)]})
    args = GRPOConfig(
        output_dir=cli.output_dir or tempfile.mkdtemp(),
        beta=0.04,  # a moving reference needs the KL term
        ref_model_reset_steps=cli.reset_every,
        max_steps=cli.steps,
        num_generations=4,
        per_device_train_batch_size=8,
        max_completion_length=24,  # short completions keep the run to seconds
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        str(save_tiny_model(tempfile.mkdtemp())),
        reward_model,
        args=args,
        train_dataset=dataset,
        callbacks=[RefreshRewardModel(reward_model)],
    )
    trainer.train()


if __name__ == "__main__":
    main()
