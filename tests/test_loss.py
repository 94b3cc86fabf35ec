"""The GRPO math (grpo/loss.py): hand-worked numbers, equality with the naive loops in tests/naive.py, and the
properties GRPO_SPEC.md requires."""

import math

import pytest
import torch

from grpo.loss import aggregate, group_advantages, group_reward_stats, kl_k3, masked_mean, policy_loss
from tests.naive import naive_group_advantages, naive_policy_loss

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


# ---- Advantages ----


def test_group_advantages_hand_worked():
    # Group 1: rewards 1, 3 -> mean 2, unbiased std sqrt(((1-2)^2 + (3-2)^2) / 1) = sqrt(2) = 1.414214
    #          A = -+1 / (1.414214 + 1e-4) = -+0.707057
    # Group 2: rewards 2, 2 -> all equal -> A = 0 exactly.
    adv = group_advantages(torch.tensor([1.0, 3.0, 2.0, 2.0]), num_generations=2)
    assert adv.tolist() == pytest.approx([-0.707057, 0.707057, 0.0, 0.0], abs=1e-6)
    assert adv[2] == 0 and adv[3] == 0


def test_group_advantages_scale_options_hand_worked():
    rewards = torch.tensor([1.0, 3.0, 5.0, 9.0])
    # none: r - group mean -> [-1, 1, -2, 2]
    assert group_advantages(rewards, 2, "none").tolist() == [-1.0, 1.0, -2.0, 2.0]
    # batch: std of [1, 3, 5, 9] = sqrt(((-3.5)^2 + (-1.5)^2 + 0.5^2 + 4.5^2) / 3) = sqrt(35 / 3) = 3.415650
    expected = [-1 / 3.41575, 1 / 3.41575, -2 / 3.41575, 2 / 3.41575]
    assert group_advantages(rewards, 2, "batch").tolist() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_naive(scale):
    torch.manual_seed(0)
    rewards = torch.randn(24)
    rewards[3] = math.nan  # one unscored row
    rewards[8:12] = 0.5  # one flat group
    rewards[16:20] = math.nan  # one group nobody scored
    expected = naive_group_advantages(rewards.tolist(), 4, scale)
    assert group_advantages(rewards, 4, scale).tolist() == pytest.approx(expected, abs=1e-6)


def test_equal_rewards_give_exactly_zero_advantage_and_no_nan():
    # 0.1 is not representable: the mean of equal values can differ from them by rounding.
    for value in [0.1, 1 / 3, 7.0, 0.0, -2.5]:
        adv = group_advantages(torch.full((6,), value), num_generations=3)
        assert torch.equal(adv, torch.zeros(6))


def test_nan_rewards_are_ignored_and_get_zero_advantage():
    adv = group_advantages(torch.tensor([1.0, math.nan, 3.0, math.nan, math.nan, 4.0]), num_generations=3)
    assert not torch.isnan(adv).any()
    assert adv[1] == 0  # unscored row
    assert adv[0] == pytest.approx(-0.707057, abs=1e-6) and adv[2] == pytest.approx(0.707057, abs=1e-6)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]  # a group with one valid reward has no baseline


def test_group_reward_stats():
    stats = group_reward_stats(torch.tensor([1.0, 3.0, 2.0, 2.0]), 2)
    assert stats["frac_reward_zero_std"] == 0.5
    assert stats["reward_std"] == pytest.approx(math.sqrt(2) / 2)


def test_group_advantages_rejects_partial_groups():
    with pytest.raises(ValueError, match="multiple of num_generations"):
        group_advantages(torch.ones(5), 2)


# ---- KL ----


def test_kl_k3_hand_worked():
    # ref - logp = ln 2: exp(ln 2) - ln 2 - 1 = 2 - 0.693147 - 1 = 0.306853
    assert kl_k3(torch.tensor(-1.0), torch.tensor(-1.0 + math.log(2))).item() == pytest.approx(0.306853, abs=1e-6)


def test_kl_k3_nonnegative_and_zero_at_equality():
    torch.manual_seed(0)
    a, b = torch.randn(1000) * 3, torch.randn(1000) * 3
    assert (kl_k3(a, b) >= 0).all()
    assert torch.equal(kl_k3(a, a), torch.zeros(1000))


def test_kl_k3_is_unbiased_estimate_of_kl():
    # Samples from p; k3 with r = q/p averages to KL(p || q). p = N(0, 1), q = N(0.5, 1): KL = 0.5^2 / 2 = 0.125.
    torch.manual_seed(0)
    x = torch.randn(400_000)
    logp, logq = -(x**2) / 2, -((x - 0.5) ** 2) / 2
    assert kl_k3(logp, logq).mean().item() == pytest.approx(0.125, abs=0.003)


# ---- Policy loss ----


def _hand_case():
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -2.0], [-0.2, 0.0]])
    advantages = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    return logps, old, advantages, mask


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        # Row 0 (A = +1): ratios exp(0.1) = 1.105171 (inside [0.8, 1.2]) and 1 -> l = -1.105171, -1
        # Row 1 (A = -1): ratio exp(-0.3) = 0.740818 < 0.8 -> min(-0.740818, -0.8) = -0.8 -> l = 0.8; token 2 masked
        # grpo:    mean(( -1.105171 - 1) / 2, 0.8 / 1) = (-1.052585 + 0.8) / 2 = -0.126293
        ("grpo", {}, -0.126293),
        # bnpo:    (-1.105171 - 1 + 0.8) / 3 tokens = -0.435057
        ("bnpo", {}, -0.435057),
        # dr_grpo: -1.305171 / (2 rows x 4 max tokens) = -0.163146
        ("dr_grpo", {"max_completion_length": 4}, -0.163146),
        # dapo:    -1.305171 / 10 tokens in the whole (hypothetical) optimizer step = -0.130517
        ("dapo", {"normalizer": 10}, -0.130517),
    ],
)
def test_policy_loss_hand_worked(loss_type, kwargs, expected):
    logps, old, advantages, mask = _hand_case()
    loss, stats = policy_loss(logps, old, None, advantages, mask, loss_type=loss_type, epsilon_low=0.2, **kwargs)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # One of three loss tokens was clipped from below, none from above.
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(1 / 3)
    assert stats["clip_ratio/high_mean"].item() == 0
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(1 / 3)


def _random_case(seed, B=6, T=7, token_advantages=False):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(B, T, generator=g) * 3).requires_grad_(True)
    old = logps.detach() + torch.randn(B, T, generator=g) * 0.3  # ratios on both sides of the clip range
    ref = logps.detach() + torch.randn(B, T, generator=g) * 0.5
    shape = (B, T) if token_advantages else (B,)
    advantages = torch.randn(shape, generator=g)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[2] = 0  # a row with no loss tokens (e.g. a masked truncated completion)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return logps, old, ref, advantages, mask


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("eps_high", [0.2, 0.28])
@pytest.mark.parametrize("on_policy", [False, True])
def test_policy_loss_matches_naive_loop(loss_type, beta, eps_high, on_policy):
    for seed in range(3):
        logps, old, ref, advantages, mask = _random_case(seed)
        old = None if on_policy else old
        kwargs = dict(max_len=9, normalizer=17.0)
        expected = naive_policy_loss(logps, old, ref, advantages, mask, loss_type, beta, 0.2, eps_high, **kwargs)
        (expected_grad,) = torch.autograd.grad(expected, logps)
        loss, _ = policy_loss(
            logps,
            old,
            ref,
            advantages,
            mask,
            loss_type=loss_type,
            beta=beta,
            epsilon_low=0.2,
            epsilon_high=eps_high,
            max_completion_length=9,
            normalizer=17.0,
        )
        (grad,) = torch.autograd.grad(loss, logps)
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-5, atol=1e-7)


def test_policy_loss_accepts_token_level_advantages():
    logps, old, ref, advantages, mask = _random_case(0, token_advantages=True)
    expected = naive_policy_loss(logps, old, ref, advantages, mask, "bnpo", 0.1, 0.2, 0.2)
    loss, _ = policy_loss(logps, old, ref, advantages, mask, loss_type="bnpo", beta=0.1)
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)


def test_masked_tokens_get_zero_gradient_even_with_extreme_values():
    logps, old, ref, advantages, mask = _random_case(1)
    old = old.clone()
    ref = ref.clone()
    old[mask == 0] = -1e4  # exp(logp - old) would overflow if masked positions reached exp
    ref[mask == 0] = 1e4
    for loss_type in LOSS_TYPES:
        loss, _ = policy_loss(
            logps, old, ref, advantages, mask, loss_type=loss_type, beta=0.04, max_completion_length=7
        )
        (grad,) = torch.autograd.grad(loss, logps)
        assert torch.isfinite(grad).all()
        assert (grad[mask == 0] == 0).all()
        assert (grad[mask == 1] != 0).any()


def test_beta_zero_on_policy_grpo_loss_is_minus_mean_advantage_with_nonzero_gradient():
    # Complete groups: advantages sum to zero per group, so the loss value is -mean(A) = 0, while each token
    # still pushes its log-prob along its advantage (ratio = 1 in value, gradient d logp).
    torch.manual_seed(0)
    advantages = group_advantages(torch.randn(8), num_generations=4)
    logps = (-torch.rand(8, 5) * 2).requires_grad_(True)
    mask = torch.ones(8, 5, dtype=torch.long)
    mask[1, 3:] = 0
    loss, _ = policy_loss(logps, None, None, advantages, mask, loss_type="grpo", beta=0.0)
    assert loss.item() == pytest.approx(-advantages.mean().item(), abs=1e-7)
    assert abs(loss.item()) < 1e-6
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad.abs().sum() > 0.1
    # bnpo weights rows by length, so its value is not 0 in general.
    bnpo, _ = policy_loss(logps, None, None, advantages, mask, loss_type="bnpo")
    assert abs(bnpo.item()) > 1e-3


def _accumulated(loss_type, logps, old, ref, advantages, mask, num_micro):
    """Loss and gradient as the trainer accumulates them over `num_micro` micro-batches of one optimizer step."""
    rows = logps.shape[0] // num_micro
    total_tokens = mask.sum()
    total = 0
    for k in range(num_micro):
        s = slice(k * rows, (k + 1) * rows)
        loss, _ = policy_loss(
            logps[s],
            old[s],
            ref[s],
            advantages[s],
            mask[s],
            loss_type=loss_type,
            beta=0.04,
            max_completion_length=7,
            normalizer=total_tokens,
        )
        total = total + (loss if loss_type == "dapo" else loss / num_micro)
    (grad,) = torch.autograd.grad(total, logps)
    return total.detach(), grad


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_accumulation_invariance(loss_type):
    logps, old, ref, advantages, mask = _random_case(3, B=8)
    one_loss, one_grad = _accumulated(loss_type, logps, old, ref, advantages, mask, 1)
    for num_micro in (2, 4, 8):
        loss, grad = _accumulated(loss_type, logps, old, ref, advantages, mask, num_micro)
        torch.testing.assert_close(loss, one_loss, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grad, one_grad, rtol=1e-5, atol=1e-7)


def test_bnpo_is_not_accumulation_invariant_by_design():
    logps, old, ref, advantages, mask = _random_case(3, B=8)
    one_loss, _ = _accumulated("bnpo", logps, old, ref, advantages, mask, 1)
    loss, _ = _accumulated("bnpo", logps, old, ref, advantages, mask, 4)
    assert abs(loss.item() - one_loss.item()) > 1e-4


def test_aggregate_and_masked_mean_edge_cases():
    assert masked_mean(torch.tensor([1.0, math.nan]), torch.tensor([1, 0])).item() == 1.0
    assert masked_mean(torch.ones(3), torch.zeros(3)).item() == 0.0
    with pytest.raises(ValueError, match="not one of"):
        aggregate(torch.ones(2, 2), torch.ones(2, 2), "mean")
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate(torch.ones(2, 2), torch.ones(2, 2), "dr_grpo")
    with pytest.raises(ValueError, match="ref_logps"):
        policy_loss(torch.zeros(1, 1), None, None, torch.ones(1), torch.ones(1, 1), beta=0.1)
