"""Group-relative advantages as pure functions: each completion's reward against its group's (outcome rewards),
each step's reward against its group's step rewards (process rewards), and the two mixed; with several reward
functions, optionally each normalised on its own before they are summed (GDPO); and each turn of a multi-turn
episode against the same turn of its group (turn-level credit, MT-GRPO).

    A_i = (r_i - mean(r_group)) / (std(r_group) + 1e-4)          scale_rewards="group" (DeepSeekMath)

Notation as in loss.py (docs/method.md): G completions per prompt, B rows, T completion tokens. Every function takes
tensors and scalar knobs and returns tensors; tests compare each with a naive loop (tests/helpers/naive.py) and with numbers
worked out by hand.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from grpo.objective.settings import MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS, TURN_ADVANTAGES


def _group_view(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if rewards.dim() != 1 or rewards.numel() % num_generations != 0:
        raise ValueError(
            f"rewards must be a 1-D tensor whose length is a multiple of num_generations={num_generations}, "
            f"got shape {tuple(rewards.shape)}"
        )
    return rewards.view(-1, num_generations)  # (B/G, G)


def _group_moments(rewards: torch.Tensor, num_generations: int):
    """Mean, unbiased std and a zero-spread flag per group, ignoring NaN rewards. Each is (B/G, 1)."""
    r = _group_view(rewards, num_generations)  # (N, G)
    valid = ~torch.isnan(r)
    count = valid.sum(dim=1, keepdim=True)  # (N, 1)
    mean = torch.where(valid, r, 0.0).sum(dim=1, keepdim=True) / count.clamp(min=1)
    sq_dev = torch.where(valid, (r - mean) ** 2, 0.0)
    std = (sq_dev.sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()  # 0 for a group of <= 1 valid row
    spread = torch.where(valid, r, -torch.inf).amax(dim=1, keepdim=True) - torch.where(valid, r, torch.inf).amin(
        dim=1, keepdim=True
    )
    # Exact equality, not std < tol: equal rewards must give A = 0 exactly, whatever the rounding of the mean.
    flat = (count <= 1) | (spread == 0)
    return r, valid, mean, std, flat


def group_advantages(
    rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Group-relative advantages (DeepSeekMath, arXiv:2402.03300, eq. 3 with outcome supervision).

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

    `rewards` is (B,), each group's G rows consecutive. `scale_rewards` picks the divisor: "group" the group's
    std (GRPO), "batch" the std of all rewards in `rewards`, "none" no division (Dr. GRPO, arXiv:2503.20783).
    std is the unbiased (Bessel) estimate, as TRL computes it.

    Rules that keep the result finite: a NaN reward (no reward function applied to that row) is left out of its
    group's mean and std and gets A = 0; a group whose valid rewards are all equal (or which has at most one) gets
    A = 0 for every row, exactly. Returns (B,).
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {SCALE_REWARDS}")
    r, valid, mean, std, flat = _group_moments(rewards, num_generations)
    advantages = r - mean  # (N, G)
    if scale_rewards == "group":
        advantages = advantages / (std + eps)
    elif scale_rewards == "batch":
        all_valid = rewards[~torch.isnan(rewards)]
        batch_std = all_valid.std() if all_valid.numel() > 1 else rewards.new_zeros(())
        advantages = advantages / (batch_std + eps)
    advantages = torch.where(valid & ~flat, advantages, 0.0)
    return advantages.reshape(-1)


def pad_groups(values: torch.Tensor, group_sizes: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Consecutive groups of different sizes laid out as equal ones: `values` (B, ...) whose groups are
    `group_sizes` consecutive rows, padded with NaN rows to the largest group. Returns the padded (N * G_max, ...)
    tensor and the (N * G_max,) bool mask of the real rows. The group statistics ignore NaN rows, so a function of
    equal groups applied to the padded tensor and read back at the mask is the same function of the ragged groups."""
    sizes = [int(s) for s in group_sizes]
    if sum(sizes) != values.shape[0] or any(s < 1 for s in sizes):
        raise ValueError(f"group_sizes {sizes} (each >= 1) must add up to the {values.shape[0]} rows of the values")
    width = max(sizes, default=1)
    padded = values.new_full((len(sizes) * width, *values.shape[1:]), torch.nan)
    mask = torch.zeros(len(sizes) * width, dtype=torch.bool, device=values.device)
    for g, size in enumerate(sizes):
        mask[g * width : g * width + size] = True
    padded[mask] = values
    return padded, mask


def _by_groups(group_sizes: Sequence[int], values: torch.Tensor, fn) -> torch.Tensor:
    """`fn(values, G)`, a function of equal groups of G consecutive rows, for ragged groups: applied to the
    NaN-padded layout of `pad_groups` and read back at the real rows."""
    padded, mask = pad_groups(values, group_sizes)
    return fn(padded, max(int(s) for s in group_sizes))[mask]


def grouped_advantages(
    rewards: torch.Tensor,
    group_sizes: Sequence[int],
    scale_rewards: str = "group",
    eps: float = 1e-4,
    baseline: float | None = None,
) -> torch.Tensor:
    """`group_advantages` for consecutive groups of different sizes (offline data: any number of stored completions
    per prompt). `rewards` (B,), `group_sizes` (N,) adding up to B; the same formula and rules in every group:

        A_i = (r_i - mean(r_group)) / (std(r_group) + eps)

    with "batch" the std of every reward in `rewards`. A group of one row gets A = 0 (its mean is its own reward),
    or with a fixed `baseline` b, A = r - b, unscaled (a row alone has no spread to divide by); groups of two or more
    rows never use b. Equal sizes give exactly `group_advantages(rewards, G)`. Returns (B,)."""
    advantages = _by_groups(group_sizes, rewards, lambda r, g: group_advantages(r, g, scale_rewards, eps))
    if baseline is None:
        return advantages
    sizes = torch.tensor([int(s) for s in group_sizes], device=rewards.device)
    alone = torch.repeat_interleave(sizes == 1, sizes) & ~torch.isnan(rewards)  # (B,)
    return torch.where(alone, rewards - baseline, advantages)


def group_reward_stats(rewards: torch.Tensor, num_generations: int | Sequence[int]) -> dict[str, torch.Tensor]:
    """Metrics of the reward spread: `reward_std` (mean over groups of the group std) and `frac_reward_zero_std`
    (fraction of groups whose rewards are all equal, so that they contribute no gradient). `num_generations`: G,
    or each group's size when they differ (NaN-padded groups give the same statistics)."""
    if not isinstance(num_generations, int):
        rewards, _ = pad_groups(rewards, num_generations)
        num_generations = max(int(s) for s in num_generations)
    _, _, _, std, flat = _group_moments(rewards, num_generations)
    return {"reward_std": std.mean(), "frac_reward_zero_std": flat.float().mean()}


def process_advantages(
    step_rewards: torch.Tensor, num_generations: int | Sequence[int], scale_rewards: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """Token advantages from process (step) rewards (DeepSeekMath, arXiv:2402.03300, section 4.1.3;
    docs/method.md, "Process supervision").

        r~_i^(j) = (r_i^(j) - mean(R)) / (std(R) + eps)      R = every step reward of the group's G completions
        A_{i,t}  = sum over steps j of completion i with index(j) >= t of r~_i^(j)

    `step_rewards` is (B, T), each group's G rows consecutive: entry (i, t) holds the reward of the step of
    completion i that ends at token t (its last token), NaN where no step ends. `scale_rewards` as in
    `group_advantages` ("batch": the std of every step reward in `step_rewards`). A group whose step rewards are all
    equal, or which has at most one, gets 0 everywhere. Returns (B, T); tokens after a row's last step get 0.

    Naive form: for each row i and token t, add up r~ over the steps of row i that end at t or later. An outcome
    reward is the special case of one step ending at the last token, and then A_{i,t} = A_i of `group_advantages`.
    """
    if step_rewards.dim() != 2:
        raise ValueError(f"step_rewards must be (B, T), got shape {tuple(step_rewards.shape)}")
    if not isinstance(num_generations, int):  # ragged groups (offline data): NaN rows pad them and count nowhere
        return _by_groups(num_generations, step_rewards, lambda s, g: process_advantages(s, g, scale_rewards, eps))
    rows, width = step_rewards.shape
    # A group's G rows are G * width consecutive entries of the flattened tensor, so the outcome formula applies to
    # the group's step rewards as they are (NaN entries are ignored and come back as 0).
    normalised = group_advantages(step_rewards.reshape(-1), num_generations * width, scale_rewards, eps)
    normalised = normalised.view(rows, width)  # (B, T), r~ at each step end, 0 elsewhere
    return normalised.flip(-1).cumsum(-1).flip(-1)  # (B, T): sum over t' >= t


def decoupled_advantages(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, num_generations: int | Sequence[int], eps: float = 1e-4
) -> torch.Tensor:
    """GDPO's advantages (Group reward-Decoupled normalization Policy Optimization, arXiv:2601.05242), as TRL's
    `multi_objective_aggregation="normalize_then_sum"` computes them: each reward function normalised within its
    group on its own, the results weighted and summed, the sum normalised over the batch.

        r~_ik = (r_ik - mean(r_k over the group)) / (std(r_k over the group) + eps)     for each function k
        s_i   = sum_{k: r_ik not NaN} w_k * r~_ik                                       NaN if no function scored i
        A_i   = (s_i - mean(s)) / (std(s) + eps)                                        mean and std over the batch

    Summing raw rewards first lets the function with the widest spread dominate the ranking within a group, and
    gives every combination of rewards with the same total the same advantage; normalised first, each function
    counts by its own spread in the group (a success that is rare in the group counts more). `rewards_per_func` (B, K) with NaN where a function did not score a row, `weights` (K,);
    r~ is `group_advantages` per function (unbiased std; a group where the function's rewards are all equal, or
    scored at most once, gets r~ = 0 exactly; a NaN entry 0). `scale_rewards` does not apply, as in TRL. A row no
    function scored gets A = 0. Returns (B,).
    """
    per_func = torch.stack(
        [_outcome_advantages(rewards_per_func[:, k], num_generations, "group", eps) for k in range(weights.numel())],
        dim=1,
    )  # (B, K), 0 where NaN
    scored = ~torch.isnan(rewards_per_func).all(dim=1)  # (B,)
    summed = (per_func * weights.to(per_func)).sum(dim=1)
    valid = summed[scored]
    mean = valid.mean() if valid.numel() else summed.new_zeros(())
    std = valid.std() if valid.numel() > 1 else summed.new_zeros(())
    return torch.where(scored, (summed - mean) / (std + eps), 0.0)


def _outcome_advantages(rewards, num_generations, scale_rewards, eps, baseline=None):
    if isinstance(num_generations, int):
        return group_advantages(rewards, num_generations, scale_rewards, eps)  # (B,)
    return grouped_advantages(rewards, num_generations, scale_rewards, eps, baseline)


def mixed_advantages(
    rewards: torch.Tensor,
    step_rewards: torch.Tensor,
    step_weights: torch.Tensor,
    num_generations: int | Sequence[int],
    scale_rewards: str = "group",
    eps: float = 1e-4,
    baseline: float | None = None,
    aggregation: str = "sum_then_normalize",
    per_func: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Advantages of outcome and process rewards together.

        A_{i,t} = A_i + sum_k w_k * A^(k)_{i,t}

    A_i is `group_advantages` of the combined outcome reward `rewards` (B,) (NaN where no outcome function scored the
    row: A_i = 0), or with `aggregation="normalize_then_sum"` GDPO's `decoupled_advantages` of `per_func`, the
    outcome functions' own rewards and weights ((B, K_o), (K_o,)). A^(k) is `process_advantages` of process function
    k's step rewards, `step_rewards[:, k]` of (B, K, T), and w_k = `step_weights[k]` (K,). The weight multiplies the
    normalised advantage, not the raw step rewards, since group normalisation would cancel a positive scale. Returns
    (B,) when K = 0, else (B, T). `num_generations` is G, or each group's size when they differ
    (`grouped_advantages` and its `baseline` for groups of one row, offline data).
    """
    if aggregation not in MULTI_OBJECTIVE_AGGREGATIONS:
        raise ValueError(f"multi_objective_aggregation={aggregation!r} is not one of {MULTI_OBJECTIVE_AGGREGATIONS}")
    if aggregation == "normalize_then_sum":
        advantages = decoupled_advantages(*per_func, num_generations, eps)
    else:
        advantages = _outcome_advantages(rewards, num_generations, scale_rewards, eps, baseline)
    if step_rewards.shape[1] == 0:
        return advantages
    advantages = advantages.unsqueeze(1).expand(-1, step_rewards.shape[2])  # (B, T)
    for k in range(step_rewards.shape[1]):
        advantages = advantages + step_weights[k] * process_advantages(
            step_rewards[:, k], num_generations, scale_rewards, eps
        )
    return advantages


def turn_returns(turn_rewards: torch.Tensor) -> torch.Tensor:
    """Each turn's reward-to-go: the sum of the row's turn rewards from that turn on (undiscounted).

        R_{i,n} = sum_{n' >= n, r_{i,n'} not NaN} r_{i,n'}

    `turn_rewards` (B, N), NaN where a turn has no reward (or the row has fewer turns). Returns (B, N), NaN where
    no turn from n on has a reward."""
    scored = ~torch.isnan(turn_rewards)  # (B, N)
    summed = torch.where(scored, turn_rewards, 0.0).flip(-1).cumsum(-1).flip(-1)
    any_later = scored.flip(-1).cumsum(-1).flip(-1) > 0
    return torch.where(any_later, summed, torch.nan)


def turn_group_advantages(
    turn_rewards: torch.Tensor,
    num_generations: int | Sequence[int],
    scheme: str = "mt_grpo",
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Group-relative advantages of each policy turn (MT-GRPO, arXiv:2505.11821): turn n of row i against turn n
    of the other rows of its group.

        v_{i,n}   = r_{i,n}                    scheme="mt_grpo": the turn's own reward
                  = R_{i,n} (`turn_returns`)    scheme="reward_to_go": the rewards from turn n on
        Â_{i,n} = (v_{i,n} - mean_j v_{j,n}) / (std_j v_{j,n} + eps)     j over the group's rows with a v_{j,n}

    `turn_rewards` (B, N), each group's G rows consecutive, NaN where a turn has no reward. `scale_rewards` and the
    rules as in `group_advantages`, column by column: a NaN gets 0, and a turn whose rewards are equal across the
    group (or given for at most one row) gets 0 in every row, exactly. Returns (B, N)."""
    if scheme not in TURN_ADVANTAGES:
        raise ValueError(f"turn_advantage={scheme!r} is not one of {TURN_ADVANTAGES}")
    values = turn_rewards if scheme == "mt_grpo" else turn_returns(turn_rewards)  # (B, N)
    columns = [_outcome_advantages(values[:, n], num_generations, scale_rewards, eps) for n in range(values.shape[1])]
    return torch.stack(columns, dim=1) if columns else torch.zeros_like(values)


def turn_credit_advantages(
    advantages: torch.Tensor,
    turn_rewards: torch.Tensor,
    turn_weights: torch.Tensor,
    turn_index: torch.Tensor,
    num_generations: int | Sequence[int],
    scheme: str = "mt_grpo",
    coef: float = 1.0,
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> torch.Tensor:
    """Token advantages with turn-level credit: each policy token gets the episode's advantage plus its turn's.

        r_{i,n}  = sum_{k: r^(k)_{i,n} not NaN} w_k * r^(k)_{i,n}      NaN when no turn function scored turn n
        A_{i,t}  = A_i + coef * Â_{i,n(t)}                              n(t) = turn_index[i, t]; Â from
                                                                       `turn_group_advantages(r, scheme)`

    MT-GRPO's two-turn case: the first turn (a tool call) is scored, the second (the answer) is not; the tokens of
    turn 1 get A_i + coef * Â_{i,1} and those of turn 2 get A_i. This is the form of the authors' released trainer
    (outcome advantage plus `turn_advantage_coef`, default 1, times the turn advantage); the paper writes turn 1's
    as Â^T + lambda * Â^O, the same at coef = lambda = 1. Here every turn may be scored, and a turn without a score
    (or with equal scores across its group) gets A_i alone.

    `advantages`: the episodes' advantages A, (B,) or (B, T) (`mixed_advantages`, with process rewards);
    `turn_rewards` (B, K, N): turn function k's reward of policy turn n, NaN where none; `turn_weights` (K,);
    `turn_index` (B, T) long: the policy turn of each completion token, -1 on tool answers and padding (which get
    A_i: the loss masks them). Returns (B, T)."""
    weights = turn_weights.to(turn_rewards).view(1, -1, 1)
    scored = ~torch.isnan(turn_rewards).all(dim=1)  # (B, N)
    combined = torch.where(scored, (turn_rewards * weights).nansum(dim=1), torch.nan)  # (B, N)
    per_turn = turn_group_advantages(combined, num_generations, scheme, scale_rewards, eps)  # (B, N)
    rows, width = turn_index.shape
    if advantages.dim() == 2 and advantages.shape[1] != width:
        raise ValueError(f"advantages {tuple(advantages.shape)} and turn_index {tuple(turn_index.shape)} differ")
    inside = (turn_index >= 0) & (turn_index < per_turn.shape[1])  # (B, T)
    at = torch.where(inside, turn_index, 0)
    gathered = per_turn.gather(1, at) if per_turn.shape[1] else per_turn.new_zeros(rows, width)
    turn_term = torch.where(inside, gathered, 0.0)  # (B, T): Â of each token's turn, 0 off policy turns
    base = advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(-1, width)
    return base + coef * turn_term.to(base.dtype)
