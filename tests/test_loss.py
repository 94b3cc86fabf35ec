"""The GRPO math (grpo/objective/loss.py): hand-worked numbers, equality with the naive loops in
tests/helpers/naive.py, and the properties docs/method.md requires."""

import math

import pytest
import torch

from grpo.objective.advantages import (
    decoupled_advantages,
    group_advantages,
    group_reward_stats,
    mixed_advantages,
    process_advantages,
)
from grpo.objective.loss import (
    accumulation,
    aggregate,
    kl_k3,
    masked_mean,
    process_weight,
    spans_the_step,
    window_token_totals,
)
from grpo.objective.loss_types import LOSS_TYPES as ALL_LOSS_TYPES
from grpo.objective.loss_types import TERM_DEFAULTS, vespo_weights
from grpo.objective.token_weights import entropy_threshold, off_policy_sequence_mask, sampling_correction
from tests.helpers.losses import loss_with
from tests.helpers.naive import (
    naive_decoupled_advantages,
    naive_group_advantages,
    naive_mixed_advantages,
    naive_policy_loss,
    naive_process_advantages,
)

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]
NEW_LOSS_TYPES = ["cispo", "sapo", "luspo", "vespo"]  # beyond PPO's clip with its four aggregations


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


# ---- Several reward functions: GDPO ----


def test_decoupled_advantages_hand_worked():
    # One group of 4, two functions of weight 1: f1 = [1, 0, 0, 0] (a rare success), f2 = [0, 1, 1, 0].
    # Summed first: [1, 1, 1, 0], mean 0.75, std 0.5 -> A = [0.4999, 0.4999, 0.4999, -1.4997]: rows 0-2 tie.
    # GDPO: f1 mean 0.25, unbiased std sqrt((0.5625 + 3 x 0.0625) / 3) = 0.5 -> r~ = 0.75 / 0.5001 = 1.4997, else
    #       -0.25 / 0.5001 = -0.4999; f2 mean 0.5, std sqrt(1 / 3) = 0.577350 -> r~ = +-0.5 / 0.577450 = +-0.865875
    #       sums s = [0.633825, 0.365975, 0.365975, -1.365775]; batch mean 0, unbiased std 0.919230
    #       A = s / 0.919330 = [0.689442, 0.398089, 0.398089, -1.485620]: the rare success ranks first.
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    weights = torch.ones(2)
    gdpo = decoupled_advantages(rewards, weights, 4)
    assert gdpo.tolist() == pytest.approx([0.689442, 0.398089, 0.398089, -1.485620], abs=1e-5)
    summed = mixed_advantages(rewards.sum(1), torch.zeros(4, 0, 1), torch.zeros(0), 4)
    assert summed.tolist() == pytest.approx([0.4999, 0.4999, 0.4999, -1.4997], abs=1e-4)
    per_func = (rewards, weights)
    settings = dict(aggregation="normalize_then_sum", per_func=per_func)
    torch.testing.assert_close(
        mixed_advantages(rewards.sum(1), torch.zeros(4, 0, 1), torch.zeros(0), 4, **settings), gdpo
    )
    with pytest.raises(ValueError, match="multi_objective_aggregation='sum' is not one of"):
        mixed_advantages(rewards.sum(1), torch.zeros(4, 0, 1), torch.zeros(0), 4, aggregation="sum")


@pytest.mark.parametrize("groups", [4, [4, 2, 1, 3, 2]])
def test_decoupled_advantages_match_naive(groups):
    generator = torch.Generator().manual_seed(11)
    B, K = 12, 3
    rewards = torch.randn(B, K, generator=generator, dtype=torch.float64)
    rewards[0, 1] = math.nan  # one function did not score a row
    rewards[5] = math.nan  # a row no function scored
    rewards[8:12, 2] = 0.5  # a flat group for one function (the last one with G = 4)
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    sizes = [groups] * (B // groups) if isinstance(groups, int) else groups
    expected = naive_decoupled_advantages(rewards.tolist(), weights.tolist(), sizes)
    got = decoupled_advantages(rewards, weights, groups)
    assert got.tolist() == pytest.approx(expected, abs=1e-12)
    assert got[5] == 0 and got.abs().sum() > 1


# ---- Process (step) rewards ----


def _dense_steps(rows, width):
    """Step rewards as process_advantages takes them: (B, T), the reward at each step's last token, NaN elsewhere."""
    dense = torch.full((len(rows), width), math.nan)
    for i, row in enumerate(rows):
        for reward, end in row:
            dense[i, end] = reward
    return dense


def test_process_advantages_hand_worked_two_and_three_steps():
    # One group of two completions: o_1 has 2 steps ending at tokens 1 and 3; o_2 has 3 steps ending at 0, 2 and 4.
    # R = [1, 0, 1, 1, 0]: mean 0.6; deviations 0.4, -0.6, 0.4, 0.4, -0.6; squares sum 3 x 0.16 + 2 x 0.36 = 1.2;
    #   unbiased std = sqrt(1.2 / 4) = 0.547723
    #   r~ = 0.4 / (0.547723 + 1e-4) = 0.730166 for reward 1, -0.6 / 0.547823 = -1.095248 for reward 0
    # o_1: steps (1 at t=1), (0 at t=3): A_t = sum of r~ of steps ending at or after t
    #   t=0,1: 0.730166 - 1.095248 = -0.365082; t=2,3: -1.095248; t=4: 0 (no step ends there or later)
    # o_2: steps (1 at t=0), (1 at t=2), (0 at t=4)
    #   t=0: 0.730166 + 0.730166 - 1.095248 = 0.365083; t=1,2: 0.730166 - 1.095248 = -0.365082; t=3,4: -1.095248
    rows = [[(1.0, 1), (0.0, 3)], [(1.0, 0), (1.0, 2), (0.0, 4)]]
    adv = process_advantages(_dense_steps(rows, 5), num_generations=2)
    expected = [
        [-0.365082, -0.365082, -1.095248, -1.095248, 0.0],
        [0.365083, -0.365082, -0.365082, -1.095248, -1.095248],
    ]
    assert adv.tolist()[0] == pytest.approx(expected[0], abs=1e-5)
    assert adv.tolist()[1] == pytest.approx(expected[1], abs=1e-5)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_process_advantages_match_naive(scale):
    g = torch.Generator().manual_seed(0)
    width, rows = 9, []
    for _ in range(12):
        num_steps = int(torch.randint(0, 4, (1,), generator=g))  # some rows have no step at all
        ends = sorted(torch.randperm(width, generator=g)[:num_steps].tolist())
        rows.append([(float(torch.randn(1, generator=g)), end) for end in ends])
    rows[8:12] = [[(0.5, 2)], [(0.5, 0), (0.5, 6)], [], [(0.5, 8)]]  # a flat group
    expected = naive_process_advantages(rows, width, 4, scale)
    got = process_advantages(_dense_steps(rows, width), 4, scale)
    for g_row, e_row in zip(got.tolist(), expected):
        assert g_row == pytest.approx(e_row, abs=1e-5)
    assert (got[8:12] == 0).all()


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_outcome_reward_as_one_final_step_equals_the_outcome_path(scale):
    torch.manual_seed(1)
    rewards = torch.randn(8)
    rewards[5] = math.nan  # an unscored row has no step
    lengths = torch.tensor([3, 5, 1, 4, 5, 2, 5, 3])
    width = 5
    mask = torch.arange(width)[None, :] < lengths[:, None]
    steps = [[] if math.isnan(r) else [(float(r), int(n) - 1)] for r, n in zip(rewards, lengths)]
    token_adv = process_advantages(_dense_steps(steps, width), 4, scale)
    outcome = group_advantages(rewards, 4, scale)
    expected = outcome[:, None].expand(-1, width)
    torch.testing.assert_close(token_adv[mask], expected[mask], rtol=1e-5, atol=1e-6)


def test_entropy_threshold_keeps_the_top_fraction():
    entropies = torch.arange(10, dtype=torch.float)  # 0..9
    assert entropy_threshold(entropies, 1.0).item() == 0.0  # everything
    threshold = entropy_threshold(torch.cat([entropies, torch.full((5,), math.nan)]), 0.2)
    # The 0.8 quantile of 0..9 (linear interpolation): position 0.8 x 9 = 7.2 -> 7.2; tokens 8 and 9 are kept.
    assert threshold.item() == pytest.approx(7.2)
    assert (entropies >= threshold).sum() == 2
    assert entropy_threshold(torch.full((3,), math.nan), 0.5).item() == math.inf


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
    loss, stats = loss_with(logps, old, None, advantages, mask, loss_type=loss_type, epsilon_low=0.2, **kwargs)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # One of three loss tokens was clipped from below, none from above.
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(1 / 3)
    assert stats["clip_ratio/high_mean"].item() == 0
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(1 / 3)


# The random cases are float64, where the loss and its vectorised and naive forms agree to rounding far below any
# error in the math whatever order a CPU sums in: a sum of n <= 56 terms of size <= 10 (A ~ N(0, 1) times a ratio
# clipped near 1, plus the KL) is within (n - 1) eps sum|terms| = 55 x 2.2e-16 x 560 = 7e-12 of exact (Higham's
# bound for any order), and the gradients' terms are smaller. A wrong normaliser or clip is off by far more.
F64 = dict(rtol=0, atol=1e-11)


def _random_case(seed, B=6, T=7, token_advantages=False):
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    logps = (-torch.rand(B, T, **f64) * 3).requires_grad_(True)
    old = logps.detach() + torch.randn(B, T, **f64) * 0.3  # ratios on both sides of the clip range
    ref = logps.detach() + torch.randn(B, T, **f64) * 0.5
    shape = (B, T) if token_advantages else (B,)
    advantages = torch.randn(shape, **f64)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[2] = 0  # a row with no loss tokens (e.g. a masked truncated completion)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    return logps, old, ref, advantages, mask


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta, bias_correction_kl", [(0.0, False), (0.04, False), (0.04, True)])
@pytest.mark.parametrize("eps_high, delta", [(0.2, None), (0.28, None), (0.28, 1.4)])
@pytest.mark.parametrize("on_policy", [False, True])
def test_policy_loss_matches_naive_loop(loss_type, level, beta, bias_correction_kl, eps_high, delta, on_policy):
    for seed in range(3):
        logps, old, ref, advantages, mask = _random_case(seed)
        old = None if on_policy else old
        kwargs = dict(max_len=9, normalizer=17.0, level=level, delta=delta, bias_correction_kl=bias_correction_kl)
        expected = naive_policy_loss(logps, old, ref, advantages, mask, loss_type, beta, 0.2, eps_high, **kwargs)
        (expected_grad,) = torch.autograd.grad(expected, logps)
        loss, _ = loss_with(
            logps,
            old,
            ref,
            advantages,
            mask,
            loss_type=loss_type,
            beta=beta,
            epsilon_low=0.2,
            epsilon_high=eps_high,
            delta=delta,
            importance_sampling_level=level,
            max_completion_length=9,
            normalizer=17.0,
            bias_correction_kl=bias_correction_kl,
        )
        (grad,) = torch.autograd.grad(loss, logps)
        torch.testing.assert_close(loss, expected, **F64)
        torch.testing.assert_close(grad, expected_grad, **F64)


def test_bias_corrected_kl_hand_worked():
    # One token, A = 0 (only the KL term), beta = 1, on-policy: logp = -1, ref = -1.5, so ref - logp = -0.5 and
    #   k3 = exp(-0.5) + 0.5 - 1 = 0.106531 either way (the ratio is 1 in value);
    #   d k3 / d logp         = 1 - exp(-0.5)             = 0.393469   (k3's own gradient)
    #   d (ratio k3) / d logp = k3 + 1 - exp(-0.5)        = 0.5 = logp - ref, the reverse KL's gradient sample.
    for correction, want_grad in [(False, 0.393469), (True, 0.5)]:
        logps = torch.tensor([[-1.0]], dtype=torch.float64, requires_grad=True)
        ref = torch.tensor([[-1.5]], dtype=torch.float64)
        loss, stats = loss_with(
            logps,
            None,
            ref,
            torch.zeros(1),
            torch.ones(1, 1),
            loss_type="bnpo",
            beta=1.0,
            bias_correction_kl=correction,
        )
        (grad,) = torch.autograd.grad(loss, logps)
        assert loss.item() == pytest.approx(0.106531, abs=1e-6)
        assert stats["kl"].item() == pytest.approx(0.106531, abs=1e-6)
        assert grad.item() == pytest.approx(want_grad, abs=1e-6)


def test_off_policy_sequence_mask_hand_worked():
    # Four rows of two tokens; sampling - logp per token, and the mean over the row's loss tokens:
    #   row 0: A = -1, drifts 0.5, 0.7 -> 0.6 > 0.5: dropped
    #   row 1: A = +1, the same drifts -> kept (a positive advantage is always kept)
    #   row 2: A = -1, drifts 0.4, 0.4 -> 0.4 <= 0.5: kept
    #   row 3: A = -1, drifts 1.2, NaN (unscored, counts 0) -> 0.6: dropped; second token masked out -> 1.2: dropped
    logps = torch.zeros(4, 2, dtype=torch.float64)
    sampling = torch.tensor([[0.5, 0.7], [0.5, 0.7], [0.4, 0.4], [1.2, float("nan")]], dtype=torch.float64)
    advantages = torch.tensor([-1.0, 1.0, -1.0, -1.0], dtype=torch.float64)
    keep = off_policy_sequence_mask(advantages, logps, sampling, torch.ones(4, 2), 0.5)
    assert keep.squeeze(1).tolist() == [0.0, 1.0, 1.0, 0.0]
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    keep = off_policy_sequence_mask(advantages, logps, sampling, mask, 0.5)
    assert keep.squeeze(1).tolist() == [0.0, 1.0, 1.0, 0.0]
    # A row without loss tokens has no drift: kept.
    assert off_policy_sequence_mask(advantages[:1], logps[:1], sampling[:1], torch.zeros(1, 2), 0.5).item() == 1.0


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("threshold", [0.0, 0.1])
def test_off_policy_masking_matches_naive_loop(level, threshold):
    for seed in range(3):
        logps, old, ref, advantages, mask = _random_case(seed)
        g = torch.Generator().manual_seed(100 + seed)
        sampling = logps.detach() + 0.1 + torch.randn(logps.shape, generator=g, dtype=torch.float64) * 0.3
        sampling[0, 0] = float("nan")  # a token the sampler could not score
        keep = off_policy_sequence_mask(advantages, logps, sampling, mask, threshold)
        assert 0 < keep.sum() < len(keep)  # some rows dropped, some kept: the case tests the mask
        expected = naive_policy_loss(
            logps, old, ref, advantages, mask, "grpo", 0.04, 0.2, 0.2, level=level, bias_correction_kl=True,
            sampling_logps=sampling, off_policy_threshold=threshold,
        )  # fmt: skip
        (expected_grad,) = torch.autograd.grad(expected, logps)
        loss, _ = loss_with(
            logps,
            old,
            ref,
            advantages,
            mask,
            loss_type="grpo",
            beta=0.04,
            importance_sampling_level=level,
            policy_mask=keep.bool().expand_as(mask),
            bias_correction_kl=True,
        )
        (grad,) = torch.autograd.grad(loss, logps)
        torch.testing.assert_close(loss, expected, **F64)
        torch.testing.assert_close(grad, expected_grad, **F64)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_policy_loss_accepts_token_level_advantages_and_a_policy_mask(level):
    logps, old, ref, advantages, mask = _random_case(0, token_advantages=True)
    policy_mask = torch.rand(mask.shape, generator=torch.Generator().manual_seed(5)) < 0.5
    for loss_type in LOSS_TYPES:
        expected = naive_policy_loss(
            logps, old, ref, advantages, mask, loss_type, 0.1, 0.2, 0.2, 9, 17.0, level, policy_mask=policy_mask
        )
        loss, _ = loss_with(
            logps,
            old,
            ref,
            advantages,
            mask,
            loss_type=loss_type,
            beta=0.1,
            importance_sampling_level=level,
            policy_mask=policy_mask,
            max_completion_length=9,
            normalizer=17.0,
        )
        torch.testing.assert_close(loss, expected, **F64)
    # With beta = 0, the tokens outside the policy mask get no gradient at all.
    loss, _ = loss_with(logps, old, None, advantages, mask, policy_mask=policy_mask)
    (grad,) = torch.autograd.grad(loss, logps)
    assert (grad[~policy_mask] == 0).all() and (grad[policy_mask & mask.bool()] != 0).any()


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        # Sequence level (GSPO): one ratio per row from the mean log-ratio of its loss tokens.
        # Row 0 (A = +1): mean log-ratio (0.1 + 0) / 2 = 0.05, ratio exp(0.05) = 1.051271, inside [0.8, 1.2]
        #                 -> l = -1.051271 on both tokens
        # Row 1 (A = -1): one loss token, mean log-ratio -0.3, ratio 0.740818 < 0.8 -> clipped -> l = 0.8
        # grpo:    mean(-1.051271, 0.8) = -0.125636
        ("grpo", {}, -0.125636),
        # bnpo:    (-2 x 1.051271 + 0.8) / 3 = -0.434181
        ("bnpo", {}, -0.434181),
        # dr_grpo: -1.302542 / (2 x 4) = -0.162818
        ("dr_grpo", {"max_completion_length": 4}, -0.162818),
        # dapo:    -1.302542 / 10 = -0.130254
        ("dapo", {"normalizer": 10}, -0.130254),
    ],
)
def test_sequence_level_policy_loss_hand_worked(loss_type, kwargs, expected):
    logps, old, advantages, mask = _hand_case()
    loss, stats = loss_with(
        logps, old, None, advantages, mask, loss_type=loss_type, importance_sampling_level="sequence", **kwargs
    )
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # Row 1's one loss token is clipped from below: 1 of 3 tokens.
    assert stats["clip_ratio/low_mean"].item() == pytest.approx(1 / 3)
    assert stats["clip_ratio/high_mean"].item() == 0


def test_on_policy_sequence_ratio_has_the_gradient_of_token_level_grpo():
    # On-policy, ratio_i = 1 with gradient mean_t d logp_it, so GSPO under grpo aggregation, -mean_i(A_i ratio_i),
    # has exactly the gradient of token-level GRPO, -mean_i(A_i mean_t ratio_it).
    logps, _, _, advantages, mask = _random_case(4)
    token, _ = loss_with(logps, None, None, advantages, mask, loss_type="grpo")
    sequence, _ = loss_with(
        logps, None, None, advantages, mask, loss_type="grpo", importance_sampling_level="sequence"
    )
    torch.testing.assert_close(sequence, token, **F64)
    torch.testing.assert_close(torch.autograd.grad(sequence, logps)[0], torch.autograd.grad(token, logps)[0], **F64)


def test_clip_higher_and_two_sided_clipping_hand_worked():
    logps = torch.zeros(3, 1, requires_grad=True)
    # Ratios exp(0.25) = 1.284025 (A = +1), exp(0.5) = 1.648721 (A = -1), exp(0.25) (A = -1).
    old = torch.tensor([[-0.25], [-0.5], [-0.25]])
    advantages = torch.tensor([1.0, -1.0, -1.0])
    mask = torch.ones(3, 1)

    def run(**kwargs):
        loss, stats = loss_with(logps, old, None, advantages, mask, loss_type="bnpo", **kwargs)
        (grad,) = torch.autograd.grad(loss, logps)
        return loss.item(), grad.view(-1).tolist(), stats

    # eps_high = 0.2: row 0 clipped at 1.2 (l = -1.2, no gradient); rows 1, 2 unclipped (A < 0 and ratio > 1):
    # loss = (-1.2 + 1.648721 + 1.284025) / 3 = 0.577582
    loss, grad, stats = run(epsilon_high=0.2)
    assert loss == pytest.approx(0.577582, abs=1e-6)
    assert grad[0] == 0 and grad[1] == pytest.approx(1.648721 / 3, abs=1e-6)
    assert stats["clip_ratio/high_mean"].item() == pytest.approx(1 / 3)
    # Clip-higher, eps_high = 0.28: 1.284025 < 1.28 is false, still clipped at 1.28 -> l = -1.28
    loss, grad, _ = run(epsilon_high=0.28)
    assert loss == pytest.approx((-1.28 + 1.648721 + 1.284025) / 3, abs=1e-6)
    # eps_high = 0.3: row 0 inside the range, l = -1.284025 and its gradient is -ratio / 3.
    loss, grad, stats = run(epsilon_high=0.3)
    assert loss == pytest.approx((-1.284025 + 1.648721 + 1.284025) / 3, abs=1e-6)
    assert grad[0] == pytest.approx(-1.284025 / 3, abs=1e-6)
    assert stats["clip_ratio/region_mean"].item() == 0
    # Two-sided clipping, delta = 1.5: row 1's ratio 1.648721 > 1.5 is capped, l = 1.5 and no gradient.
    loss, grad, stats = run(epsilon_high=0.3, delta=1.5)
    assert loss == pytest.approx((-1.284025 + 1.5 + 1.284025) / 3, abs=1e-6)
    assert grad[1] == 0 and grad[2] != 0
    assert stats["clip_ratio/region_mean"].item() == pytest.approx(1 / 3)
    assert stats["clip_ratio/low_mean"].item() == 0 and stats["clip_ratio/high_mean"].item() == 0
    with pytest.raises(ValueError, match=r"delta=1.2 must be > 1 \+ epsilon_high"):
        run(epsilon_high=0.3, delta=1.2)


def test_clip_ratios_count_exactly_the_tokens_whose_gradient_is_cut():
    # A clipped token (per the stats) is one whose policy-term gradient is 0; every other loss token with A != 0
    # has a non-zero gradient. Checked token by token with the gradient of the summed (bnpo x tokens) loss.
    logps, old, _, advantages, mask = _random_case(7, B=8, T=6, token_advantages=True)
    # (Token level only: at sequence level a token's gradient also flows through its row's shared ratio.)
    for delta in (None, 1.3):
        loss, stats = loss_with(logps, old, None, advantages, mask, loss_type="bnpo", epsilon_high=0.28, delta=delta)
        (grad,) = torch.autograd.grad(loss, logps)
        cut = (grad == 0) & mask.bool()
        assert stats["clip_ratio/region_mean"].item() == pytest.approx(cut.sum().item() / mask.sum().item())
        assert 0 < cut.sum() < mask.sum()


def test_masked_tokens_get_zero_gradient_even_with_extreme_values():
    logps, old, ref, advantages, mask = _random_case(1)
    old = old.clone()
    ref = ref.clone()
    old[mask == 0] = -1e4  # exp(logp - old) would overflow if masked positions reached exp
    ref[mask == 0] = 1e4
    for loss_type in LOSS_TYPES + NEW_LOSS_TYPES:
        loss, _ = loss_with(logps, old, ref, advantages, mask, loss_type=loss_type, beta=0.04, max_completion_length=7)
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
    loss, _ = loss_with(logps, None, None, advantages, mask, loss_type="grpo", beta=0.0)
    assert loss.item() == pytest.approx(-advantages.mean().item(), abs=1e-7)
    assert abs(loss.item()) < 1e-6
    (grad,) = torch.autograd.grad(loss, logps)
    assert grad.abs().sum() > 0.1
    # bnpo weights rows by length, so its value is not 0 in general.
    bnpo, _ = loss_with(logps, None, None, advantages, mask, loss_type="bnpo")
    assert abs(bnpo.item()) > 1e-3


# ---- cispo, sapo, luspo, vespo ----

VESPO_DEFAULTS = {name[len("vespo_") :]: value for name, value in TERM_DEFAULTS.items() if name.startswith("vespo_")}


def test_every_loss_type_is_tested_here():
    assert sorted(ALL_LOSS_TYPES) == sorted(LOSS_TYPES + NEW_LOSS_TYPES)


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        # _hand_case: row 0 (A = +1) ratios exp(0.1) = 1.105171 and 1, logps -1, -2; row 1 (A = -1) ratio
        # exp(-0.3) = 0.740818, logp -0.5; 3 loss tokens.
        # cispo, cap 1.05: weights min(r, 1.05) = 1.05, 1, 0.740818 (detached); l = -w A logp
        #   = -1.05, -2 ... negated: 1.05 x 1 x 1 = 1.05, 1 x 1 x 2 = 2, -(0.740818 x -1 x -0.5) = -0.370409
        #   dapo's mean: (1.05 + 2 - 0.370409) / 3 = 0.893197
        ("cispo", {"epsilon_high": 1.05}, 0.893197),
        # sapo, tau 1 (A > 0) and 1.05 (A <= 0): gate (4 / tau) sigmoid(tau (r - 1))
        #   row 0: 4 sigmoid(0.105171) = 2.105074, 4 sigmoid(0) = 2 -> l = -2.105074, -2, row mean -2.052537
        #   row 1: (4 / 1.05) sigmoid(1.05 x -0.259182) = 1.647168, A = -1 -> l = 1.647168
        #   grpo's mean over rows: (-2.052537 + 1.647168) / 2 = -0.202685
        ("sapo", {}, -0.202685),
        # luspo, sequence ratios exp(0.05) = 1.051271 (row 0, inside the clip range) and 0.740818 (row 1, clipped
        #   at 0.8): row sums -2 x 1.051271 = -2.102542 and 0.8; mean over rows (-2.102542 + 0.8) / 2 = -0.651271
        ("luspo", {"importance_sampling_level": "sequence"}, -0.651271),
        # vespo, phi = exp(lambda + k log w - lambda w), w the product of a row's token ratios:
        #   row 0: w = exp(0.1), A >= 0 so k = 2, lambda = 3: exp(3 + 0.2 - 3 x 1.105171) = 0.890909
        #   row 1: w = exp(-0.3), A < 0 so k = 3, lambda = 2: exp(2 - 0.9 - 2 x 0.740818) = 0.682743
        #   l = -phi A logp: 0.890909 x 1, 0.890909 x 2, -(0.682743 x 0.5); dapo's mean 2.331356 / 3 = 0.777119
        ("vespo", {}, 0.777119),
    ],
)
def test_new_loss_types_hand_worked(loss_type, kwargs, expected):
    logps, old, advantages, mask = _hand_case()
    loss, stats = loss_with(logps, old, None, advantages, mask, loss_type=loss_type, **kwargs)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert ("clip_ratio/low_mean" in stats) == (loss_type == "luspo")  # PPO's clip counts only for its own term
    if loss_type == "cispo":
        # Only row 0's first token has A > 0 and a weight above the cap; each token's gradient is -w A / 3.
        assert stats["cispo_clip_ratio"].item() == pytest.approx(1 / 3)
        (grad,) = torch.autograd.grad(loss, logps)
        assert grad.tolist() == [pytest.approx([-0.35, -1 / 3]), pytest.approx([0.740818 / 3, 0.0], abs=1e-6)]
    if loss_type == "vespo":  # the mean of phi over the loss tokens: (2 x 0.890909 + 0.682743) / 3
        assert stats["vespo/phi_seq_mean"].item() == pytest.approx(0.821521, abs=1e-6)


def _sampling_weights(mask, seed):
    """Correction weights as `sampling_correction` gives them: positive, one 0 (a masked ratio), 1 where masked."""
    g = torch.Generator().manual_seed(seed)
    weights = (0.5 + 1.5 * torch.rand(mask.shape, generator=g, dtype=torch.float64)).masked_fill(mask == 0, 1.0)
    weights[0, 0] = 0.0
    return weights


@pytest.mark.parametrize("loss_type", NEW_LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta, bias_correction_kl", [(0.0, False), (0.04, True)])
@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("corrected", [False, True])
def test_new_loss_types_match_naive_loop(loss_type, level, beta, bias_correction_kl, on_policy, corrected):
    # Knobs away from their defaults, so a swapped pair (pos for neg) or a default read in place of the knob fails;
    # none is a float32 number, so a knob rounded to float32 on the way fails too.
    knobs = dict(sapo_temperature_pos=2.1, sapo_temperature_neg=4.3, vespo_k_pos=1.3, vespo_lambda_pos=2.7)
    knobs.update(vespo_k_neg=3.3, vespo_lambda_neg=1.7)
    for seed in range(3):
        logps, old, ref, advantages, mask = _random_case(seed, token_advantages=seed == 2)
        old = None if on_policy else old
        weights = _sampling_weights(mask, seed) if corrected else None
        expected = naive_policy_loss(
            logps, old, ref, advantages, mask, loss_type, beta, 0.2, 1.2, normalizer=17.0, level=level,
            bias_correction_kl=bias_correction_kl, sampling_weights=weights, sapo=(2.1, 4.3),
            vespo=(1.3, 2.7, 3.3, 1.7),
        )  # fmt: skip
        (expected_grad,) = torch.autograd.grad(expected, logps)
        loss, _ = loss_with(
            logps,
            old,
            ref,
            advantages,
            mask,
            loss_type=loss_type,
            beta=beta,
            epsilon_high=1.2,  # cispo's cap: some of the random ratios exceed it
            importance_sampling_level=level,
            normalizer=17.0,
            sampling_weights=weights,
            bias_correction_kl=bias_correction_kl,
            **knobs,
        )
        (grad,) = torch.autograd.grad(loss, logps)
        torch.testing.assert_close(loss, expected, **F64)
        torch.testing.assert_close(grad, expected_grad, **F64)


def test_new_loss_types_with_a_policy_mask_match_naive_loop():
    logps, old, ref, advantages, mask = _random_case(1)
    keep = torch.rand(mask.shape, generator=torch.Generator().manual_seed(9)) < 0.6
    for loss_type in NEW_LOSS_TYPES:
        level = "sequence" if loss_type == "luspo" else "token"
        expected = naive_policy_loss(
            logps, old, ref, advantages, mask, loss_type, 0.04, 0.2, 1.2, level=level, policy_mask=keep
        )
        loss, _ = loss_with(
            logps, old, ref, advantages, mask, loss_type=loss_type, beta=0.04, epsilon_high=1.2,
            importance_sampling_level=level, policy_mask=keep,
        )  # fmt: skip
        torch.testing.assert_close(loss, expected, **F64)
        torch.testing.assert_close(torch.autograd.grad(loss, logps)[0], torch.autograd.grad(expected, logps)[0], **F64)


@pytest.mark.parametrize("loss_type, same_as", [("cispo", "dapo"), ("sapo", "grpo"), ("vespo", "dapo")])
def test_on_policy_each_term_has_the_plain_policy_gradient(loss_type, same_as):
    # On-policy the ratio is 1: cispo's weight min(1, cap) = 1 (cap >= 1), sapo's gate has slope 4 sigmoid'(0) = 1,
    # vespo's phi(1) = exp(lambda + 0 - lambda) = 1. Each then has the gradient -A d logp of its aggregation's
    # clipped loss (whose ratio is 1 too), though cispo's and vespo's values (A logp) differ from it.
    logps, _, _, advantages, mask = _random_case(5)
    loss, _ = loss_with(logps, None, None, advantages, mask, loss_type=loss_type, epsilon_high=5.0, normalizer=17.0)
    plain, _ = loss_with(logps, None, None, advantages, mask, loss_type=same_as, normalizer=17.0)
    (expected,) = torch.autograd.grad(plain, logps)
    torch.testing.assert_close(torch.autograd.grad(loss, logps)[0], expected, **F64)
    assert expected.abs().sum() > 0.1


def test_off_policy_each_term_departs_from_the_clipped_gradient():
    # Off-policy the terms differ from PPO's clip: cispo keeps a gradient on clipped tokens, sapo's gate is smooth.
    logps, old, _, advantages, mask = _random_case(6)
    grads = {}
    for loss_type in ("dapo", "cispo", "grpo", "sapo"):
        loss, _ = loss_with(logps, old, None, advantages, mask, loss_type=loss_type, epsilon_high=0.2)
        grads[loss_type] = torch.autograd.grad(loss, logps)[0]
    cut = (grads["dapo"] == 0) & mask.bool()  # tokens PPO's clip gives no gradient
    assert cut.any() and (grads["cispo"][cut] != 0).all()
    assert (grads["sapo"] - grads["grpo"]).abs().max() > 1e-3


def test_luspo_is_dr_grpo_times_the_length_budget():
    # luspo: mean_i sum_t l m; dr_grpo: sum l m / (B L). Same clipped term, so luspo = L x dr_grpo, value and gradient.
    logps, old, ref, advantages, mask = _random_case(8)
    settings = dict(beta=0.04, importance_sampling_level="sequence", max_completion_length=7)
    luspo, _ = loss_with(logps, old, ref, advantages, mask, loss_type="luspo", **settings)
    dr_grpo, _ = loss_with(logps, old, ref, advantages, mask, loss_type="dr_grpo", **settings)
    torch.testing.assert_close(luspo, 7 * dr_grpo, **F64)
    torch.testing.assert_close(torch.autograd.grad(luspo, logps)[0], 7 * torch.autograd.grad(dr_grpo, logps)[0], **F64)


def test_vespo_weight_peaks_at_ratio_one_and_folds_in_the_sampler_weights():
    # phi(w) = e^lambda w^k e^(-lambda w) has its maximum at w = k / lambda (2/3 for the positive defaults) and
    # phi(1) = 1; a sampler weight c on a token multiplies w by c, exactly as a ratio exp(log c) of its own would.
    mask = torch.ones(1, 2)
    advantages = torch.ones(1, 1)
    zeros = torch.zeros(1, 2, dtype=torch.float64)

    def phi(log_ratio, weights=None):
        return vespo_weights(zeros + log_ratio, zeros, mask, advantages, weights, **VESPO_DEFAULTS).item()

    assert phi(torch.tensor([[0.0, 0.0]])) == pytest.approx(1.0)
    peak = math.log(2 / 3) / 2  # two tokens
    assert phi(torch.tensor([[peak, peak]])) > phi(torch.tensor([[peak + 0.05, peak]]))
    assert phi(torch.tensor([[peak, peak]])) > phi(torch.tensor([[peak - 0.05, peak]]))
    c = torch.tensor([[0.8, 1.3]], dtype=torch.float64)
    assert phi(zeros, c) == pytest.approx(phi(torch.log(c)), rel=1e-12)
    assert phi(torch.tensor([[60.0, 0.0]])) == 0.0  # w = e^20 after the clamp: phi underflows to 0, not NaN


def _accumulated(loss_type, logps, old, ref, advantages, mask, num_micro):
    """Loss and gradient as the trainer accumulates them over `num_micro` micro-batches of one optimizer step."""
    rows = logps.shape[0] // num_micro
    total_tokens = mask.sum()
    total = 0
    for k in range(num_micro):
        s = slice(k * rows, (k + 1) * rows)
        loss, _ = loss_with(
            logps[s],
            old[s],
            ref[s],
            advantages[s],
            mask[s],
            loss_type=loss_type,
            beta=0.04,
            epsilon_high=1.2 if loss_type == "cispo" else None,
            importance_sampling_level="sequence" if loss_type == "luspo" else "token",
            max_completion_length=7,
            normalizer=total_tokens,
        )
        total = total + (loss if spans_the_step(loss_type) else loss / num_micro)
    (grad,) = torch.autograd.grad(total, logps)
    return total.detach(), grad


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", *NEW_LOSS_TYPES])
def test_accumulation_invariance(loss_type):
    logps, old, ref, advantages, mask = _random_case(3, B=8)
    one_loss, one_grad = _accumulated(loss_type, logps, old, ref, advantages, mask, 1)
    for num_micro in (2, 4, 8):
        loss, grad = _accumulated(loss_type, logps, old, ref, advantages, mask, num_micro)
        torch.testing.assert_close(loss, one_loss, **F64)
        torch.testing.assert_close(grad, one_grad, **F64)


def test_bnpo_is_not_accumulation_invariant_by_design():
    logps, old, ref, advantages, mask = _random_case(3, B=8)
    one_loss, _ = _accumulated("bnpo", logps, old, ref, advantages, mask, 1)
    loss, _ = _accumulated("bnpo", logps, old, ref, advantages, mask, 4)
    assert abs(loss.item() - one_loss.item()) > 1e-4


@pytest.mark.parametrize("loss_type", ALL_LOSS_TYPES)
def test_process_weights_make_uneven_processes_losses_the_loss_of_all_their_rows(loss_type):
    # A last, shorter evaluation batch of 5 rows split 2 / 3 between two processes: each process aggregates its own
    # rows (a loss normalised over the step by the batch's tokens over P = 2, as in evaluation), and the mean of the
    # two weighted by process_weight is the loss of all 5 rows aggregated on one process.
    torch.manual_seed(0)
    per_token = torch.randn(5, 6, dtype=torch.float64)
    mask = (torch.rand(5, 6) < 0.7).long()
    mask[:, 0] = 1  # every row has a loss token
    whole = aggregate(per_token, mask, loss_type, max_completion_length=6, normalizer=mask.sum())
    losses, weights = [], []
    for rows in (slice(0, 2), slice(2, 5)):
        normalizer, _ = accumulation(loss_type, 1, mask.sum().double(), 2)
        losses.append(
            aggregate(per_token[rows], mask[rows], loss_type, max_completion_length=6, normalizer=normalizer)
        )
        weights.append(process_weight(loss_type, rows.stop - rows.start, mask[rows].sum()).double())
    mean = sum(w * loss for w, loss in zip(weights, losses)) / sum(weights)
    torch.testing.assert_close(mean, whole, **F64)
    plain = sum(losses) / 2  # what an unweighted mean over the processes gives: another number but for the step
    assert spans_the_step(loss_type) or abs(plain.item() - whole.item()) > 1e-3


def test_aggregate_and_masked_mean_edge_cases():
    assert masked_mean(torch.tensor([1.0, math.nan]), torch.tensor([1, 0])).item() == 1.0
    assert masked_mean(torch.ones(3), torch.zeros(3)).item() == 0.0
    with pytest.raises(ValueError, match="not one of"):
        aggregate(torch.ones(2, 2), torch.ones(2, 2), "mean")
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate(torch.ones(2, 2), torch.ones(2, 2), "dr_grpo")
    with pytest.raises(ValueError, match="ref_logps"):
        loss_with(torch.zeros(1, 1), None, None, torch.ones(1), torch.ones(1, 1), beta=0.1)


# ---- dapo's window, the sampler's correction ----


def test_window_token_totals():
    assert window_token_totals(torch.tensor([3.0, 1.0, 2.0, 2.0]), 2).tolist() == [4.0, 4.0, 4.0, 4.0]
    assert window_token_totals(torch.tensor([3.0, 1.0, 2.0, 5.0]), 1).tolist() == [3.0, 1.0, 2.0, 5.0]
    assert window_token_totals(torch.tensor([3.0, 1.0, 2.0, 5.0]), 4).tolist() == [11.0] * 4


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_mixed_advantages_match_naive(scale):
    generator = torch.Generator().manual_seed(3)
    B, K, T, G = 8, 2, 5, 4
    rewards = torch.randn(B, generator=generator)
    rows_per_func = []
    steps = torch.full((B, K, T), math.nan)
    for k in range(K):
        rows = []
        for i in range(B):
            ends = sorted(torch.randperm(T, generator=generator)[: 1 + i % 3].tolist())
            row = [(float(torch.randn(1, generator=generator)), end) for end in ends]
            for r, end in row:
                steps[i, k, end] = r
            rows.append(row)
        rows_per_func.append(rows)
    weights = torch.tensor([0.5, 2.0])
    got = mixed_advantages(rewards, steps, weights, G, scale)
    expected = naive_mixed_advantages(rewards.tolist(), rows_per_func, weights.tolist(), T, G, scale)
    assert got.shape == (B, T)
    assert got.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]
    # Without process functions the advantages are per row.
    assert mixed_advantages(rewards, steps[:, :0], weights[:0], G, scale).shape == (B,)


def test_sampling_correction_by_hand():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    sampled = torch.tensor([[-1.5, -1.0, -3.0], [-1.0, -2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # rho = exp(old - sampled): row 0: e^0.5 = 1.649, e^-1 = 0.368, 1; row 1: 1, e^1 = 2.718, (masked)
    weights, stats = sampling_correction(old, sampled, mask, "token_truncate", cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.6487, 0.3679, 1.0], [1.0, 2.0, 1.0]]), atol=1e-4, rtol=0)
    torch.testing.assert_close(stats["logp_difference"], torch.tensor([[0.5, 1.0, 0.0], [0.0, 1.0, 0.0]]))
    weights, _ = sampling_correction(old, sampled, mask, "token_mask", cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.6487, 0.3679, 1.0], [1.0, 0.0, 1.0]]), atol=1e-4, rtol=0)
    # Sequence ratios: row 0 exp(0.5 - 1 + 0) = 0.607; row 1 exp(0 + 1) = 2.718 -> capped at 2, or masked to 0.
    weights, stats = sampling_correction(old, sampled, mask, "sequence_truncate", cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.6065] * 3, [2.0, 2.0, 1.0]]), atol=1e-4, rtol=0)
    assert stats["ratio"].shape == (2, 1)
    weights, _ = sampling_correction(old, sampled, mask, "sequence_mask", cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[0.6065] * 3, [0.0, 0.0, 1.0]]), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        sampling_correction(old, sampled, mask, "tokens", cap=2.0)
    # A lower bound c = 0.5 (TRL's clip_min): rho = 0.368 is raised to 0.5 when truncating, zeroed when masking; no
    # upper bound (cap None) keeps 2.718.
    weights, _ = sampling_correction(old, sampled, mask, "token_truncate", cap=None, floor=0.5)
    torch.testing.assert_close(weights, torch.tensor([[1.6487, 0.5, 1.0], [1.0, 2.7183, 1.0]]), atol=1e-4, rtol=0)
    weights, _ = sampling_correction(old, sampled, mask, "token_mask", cap=2.0, floor=0.5)
    torch.testing.assert_close(weights, torch.tensor([[1.6487, 0.0, 1.0], [1.0, 0.0, 1.0]]), atol=1e-4, rtol=0)
    weights, _ = sampling_correction(old, sampled, mask, "sequence_mask", cap=None, floor=0.7)  # row 0: 0.607 < 0.7
    torch.testing.assert_close(weights, torch.tensor([[0.0] * 3, [2.7183, 2.7183, 1.0]]), atol=1e-4, rtol=0)


def test_accumulation_by_where_the_normaliser_is_taken():
    # A micro-batch mean is divided by the micro-steps of its optimizer step (3 here, a short one would be fewer);
    # dapo's normaliser is the step's tokens on every process, 12, over P = 2 processes, since data parallelism
    # averages the processes' gradients: 12 / 2 = 6, and no division by the micro-steps.
    for loss_type in ("grpo", "bnpo", "dr_grpo"):
        normalizer, factor = accumulation(loss_type, 3, None, 2)
        assert normalizer is None and factor == pytest.approx(1 / 3)
    normalizer, factor = accumulation("dapo", 3, torch.tensor(12.0), 2)
    assert normalizer.item() == 6.0 and factor == 1.0
    assert [t for t in LOSS_TYPES + NEW_LOSS_TYPES if spans_the_step(t)] == ["dapo", "cispo", "vespo"]
