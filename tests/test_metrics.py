"""The metric reductions of grpo/training/metrics.py on hand-made numbers."""

import math

import pytest
import torch

from grpo.objective.step_loss import token_metric_totals
from grpo.objective.token_weights import sampling_summary
from grpo.training.metrics import (
    MetricsWindow,
    add_episode_metrics,
    add_round_metrics,
    add_sampling_metrics,
    add_token_metrics,
)


def test_round_metrics_by_hand():
    window = MetricsWindow()
    lengths = torch.tensor([2, 4, 6, 8])
    truncated = torch.tensor([0, 0, 1, 0])
    columns = torch.tensor([[1.0, math.nan], [0.0, 2.0], [1.0, 2.0], [math.nan, math.nan]])
    rewards = torch.tensor([1.0, 2.0, 3.0, math.nan])
    add_round_metrics(window, lengths, truncated, columns, rewards, ["acc", "fmt"], num_generations=2)
    logged = window.pop()
    assert logged["completions/mean_length"] == 5.0
    assert logged["completions/min_length"] == 2.0 and logged["completions/max_length"] == 8.0
    assert logged["completions/clipped_ratio"] == 0.25
    assert logged["completions/mean_terminated_length"] == pytest.approx(14 / 3)
    assert logged["rewards/acc/mean"] == pytest.approx(2 / 3)
    assert logged["rewards/fmt/mean"] == 2.0 and logged["rewards/fmt/std"] == 0.0
    assert logged["reward"] == 2.0  # the unscored row is left out
    # Groups [1, 2] (std 0.707) and [3, NaN] (one value: std 0, flat).
    assert logged["frac_reward_zero_std"] == 0.5


def test_token_metrics_are_read_from_the_device_only_when_the_window_is():
    """Per micro-step the trainer adds tensors; reading them (on a GPU, a wait for the device) happens once, at the
    log or the checkpoint, and what is read is the same as adding the values one by one."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Reads.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    window, by_hand = MetricsWindow(), MetricsWindow()
    micro_steps = [torch.tensor([4.0, 2.0, 0.5]), torch.tensor([6.0, 9.0, 1.5])]  # [tokens, entropy sum, kl sum]
    with Reads():
        for totals in micro_steps:
            add_token_metrics(window, totals, ["entropy", "kl"])
    assert Reads.count == 0
    for totals in micro_steps:
        add_token_metrics(by_hand, totals.tolist(), ["entropy", "kl"])
    state = window.state_dict()
    assert state["_sums"] == {"entropy": [11.0, 10.0], "kl": [2.0, 10.0]}
    assert all(isinstance(x, float) for pair in state["_sums"].values() for x in pair)  # a checkpoint holds floats
    restored = MetricsWindow()
    restored.load_state_dict(state)
    assert window.pop() == by_hand.pop() == restored.pop() == {"entropy": 1.1, "kl": 0.2}


def test_sampling_summary_and_its_reduction_over_processes():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    stats = {
        "ratio": torch.tensor([[1.0, 2.0, 9.0], [0.5, 9.0, 9.0]]),
        "logp_difference": torch.tensor([[0.1, 0.3, 9.0], [0.2, 9.0, 9.0]]),
    }
    local = sampling_summary(stats, mask)
    assert local[:4].tolist() == pytest.approx([0.6, 3.0, 3.5, 3.0])
    empty = sampling_summary(stats, torch.zeros_like(mask))  # a process with no loss tokens
    window = MetricsWindow()
    add_sampling_metrics(window, torch.stack([local, empty]))
    logged = window.pop()
    assert logged["sampling/sampling_logp_difference/mean"] == pytest.approx(0.2)
    assert logged["sampling/importance_sampling_ratio/mean"] == pytest.approx(3.5 / 3)
    assert logged["sampling/sampling_logp_difference/max"] == pytest.approx(0.3)
    assert logged["sampling/importance_sampling_ratio/max"] == 2.0
    assert logged["sampling/importance_sampling_ratio/min"] == 0.5


def test_token_metrics_weight_by_loss_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    entropy = torch.tensor([[1.0, 2.0, 7.0], [3.0, 7.0, 7.0]])
    totals, names = token_metric_totals({"kl": torch.tensor(0.5)}, entropy, mask)
    assert names == ["entropy", "kl"]
    assert totals.tolist() == [3.0, 6.0, 1.5]
    other, _ = token_metric_totals({"kl": torch.tensor(1.0)}, torch.zeros(1, 1), torch.ones(1, 1))
    window = MetricsWindow()
    add_token_metrics(window, totals + other, names)  # as summed over two processes
    logged = window.pop()
    assert logged["kl"] == pytest.approx((1.5 + 1.0) / 4) and logged["entropy"] == pytest.approx(6 / 4)


class OneProcess:
    """The accelerator of a single process: a sum over processes is the tensor itself."""

    device = torch.device("cpu")

    def reduce(self, tensor, reduction):
        return tensor


def test_tool_failure_frequency_counts_unknown_tools_as_trl_does():
    """TRL's tools/failure_frequency is (errors + timeouts + unknown tools) / (calls + unknown tools): a call of a tool
    that does not exist is a call, and a failed one. Malformed calls are not seen by TRL, so not counted here."""
    from grpo.generation.episodes import EpisodeState, episode_stats
    from grpo.generation.tool_executor import ToolCounts
    from grpo.generation.tools import Episode

    states = [EpisodeState(Episode(None, {}), [1]) for _ in range(2)]
    for state, statuses in zip(states, (["ok", "error", "unknown_tool"], ["timeout", "malformed", "ok", "ok"])):
        for status in statuses:
            state.counts.add(status)
    assert states[0].counts + states[1].counts == ToolCounts(
        calls=5, errors=1, timeouts=1, malformed=1, unknown_tools=1
    )
    window = MetricsWindow()
    add_episode_metrics(window, episode_stats(states), OneProcess())
    logged = window.pop()
    # (1 error + 1 timeout + 1 unknown tool) / (5 calls that reached a tool + 1 unknown tool)
    assert logged["tools/failure_frequency"] == pytest.approx(3 / 6)
    assert logged["tools/call_frequency"] == pytest.approx(5 / 2)
    assert logged["tools/parse_failures"] == pytest.approx(2 / 2)
    assert "tools/unknown_tools" not in logged
