"""Deliberately naive loop implementations of the GRPO math, one scalar at a time, written straight from
docs/method.md. grpo/objective/loss.py must agree with them on random inputs (tests/test_loss.py)."""

import math

import torch


def naive_group_advantages(rewards, num_generations, scale_rewards="group", eps=1e-4):
    """Consecutive groups of `num_generations` rows: `naive_grouped_advantages` with every size equal."""
    sizes = [min(num_generations, len(rewards) - start) for start in range(0, len(rewards), num_generations)]
    return naive_grouped_advantages(rewards, sizes, scale_rewards, eps)


def naive_process_advantages(rows, width, num_generations, scale_rewards="group", eps=1e-4):
    """rows: one list per row of (reward, index of the step's last token) pairs. Returns B lists of `width` token
    advantages (docs/method.md, "Process supervision"), one step at a time."""
    all_rewards = [r for row in rows for r, _ in row]
    if len(all_rewards) > 1:
        m = sum(all_rewards) / len(all_rewards)
        batch_std = math.sqrt(sum((r - m) ** 2 for r in all_rewards) / (len(all_rewards) - 1))
    else:
        batch_std = 0.0
    out = []
    for start in range(0, len(rows), num_generations):
        group = rows[start : start + num_generations]
        R = [r for row in group for r, _ in row]
        flat = len(R) <= 1 or max(R) == min(R)
        mean = sum(R) / len(R) if R else 0.0
        std = math.sqrt(sum((r - mean) ** 2 for r in R) / (len(R) - 1)) if len(R) > 1 else 0.0
        for row in group:
            token_adv = [0.0] * width
            for t in range(width):
                for r, end in row:
                    if end >= t and not flat:
                        if scale_rewards == "group":
                            token_adv[t] += (r - mean) / (std + eps)
                        elif scale_rewards == "batch":
                            token_adv[t] += (r - mean) / (batch_std + eps)
                        else:
                            token_adv[t] += r - mean
            out.append(token_adv)
    return out


def naive_policy_loss(
    logps,
    old_logps,
    ref_logps,
    advantages,
    mask,
    loss_type,
    beta,
    eps_low,
    eps_high,
    max_len=None,
    normalizer=None,
    level="token",
    delta=None,
    policy_mask=None,
    bias_correction_kl=False,
    sampling_logps=None,
    off_policy_threshold=None,
    sampling_weights=None,
    sapo=(1.0, 1.05),
    vespo=(2.0, 3.0, 3.0, 2.0),
    entropy=None,
    entropy_coef=0.0,
):
    """Returns the loss as a 0-d tensor built token by token (so autograd gives the naive gradient too).
    `bias_correction_kl`: each token's k3 times its (token or sequence) ratio. `off_policy_threshold`: a row whose
    advantage is negative and whose mean of sampling - logp over its tokens (NaN as 0) exceeds it trains no policy
    term (the sampler's log-probs `sampling_logps`, else old, else logp itself). `sampling_weights` c (B, T): each
    token's whole loss times c, except vespo's policy term, whose sequence ratio takes the product of c instead.
    `sapo`: (tau_pos, tau_neg); `vespo`: (k_pos, lambda_pos, k_neg, lambda_neg). `entropy` H (B, T) with
    `entropy_coef` c: each token the policy term trains (inside `policy_mask`, row not dropped) also loses c H, times
    its c weight, aggregated with the rest. The loss types beyond PPO's clip:
    cispo  -sg(min(ratio, eps_high)) * A * logp, dapo's token mean;
    sapo   -(4 / tau) * sigmoid(tau * (ratio - 1)) * A, grpo's per-sequence mean;
    luspo  the clipped term, summed over each row's tokens, then the mean over rows;
    vespo  -sg(phi(w)) * A * logp with w the product of the row's token ratios, dapo's token mean."""
    B, T = logps.shape
    token_loss = [[None] * T for _ in range(B)]
    for i in range(B):
        phi = None
        if loss_type == "vespo":
            log_w = 0.0
            for t in range(T):
                if mask[i][t]:
                    old = float(logps[i][t]) if old_logps is None else float(old_logps[i][t])
                    log_w += min(max(float(logps[i][t]) - old, -20.0), 20.0)
                    if sampling_weights is not None:
                        c = float(sampling_weights[i][t])
                        log_w += min(max(math.log(c) if c > 0 else -math.inf, math.log(1e-8)), 20.0)
            log_w = min(max(log_w, math.log(1e-8)), 20.0)
            phi = []
            for t in range(T):
                a = float(advantages[i]) if advantages.dim() == 1 else float(advantages[i][t])
                k, lam = (vespo[0], vespo[1]) if a >= 0 else (vespo[2], vespo[3])
                value = math.exp(lam + k * log_w - lam * math.exp(log_w))  # phi(w) = e^lam w^k e^(-lam w)
                phi.append(value if math.isfinite(value) else 0.0)
        dropped = False
        if off_policy_threshold is not None:
            drift, n = 0.0, 0
            for t in range(T):
                if mask[i][t]:
                    if sampling_logps is not None:
                        behaviour = float(sampling_logps[i][t])
                    elif old_logps is not None:
                        behaviour = float(old_logps[i][t])
                    else:
                        behaviour = float(logps[i][t])
                    d = behaviour - float(logps[i][t])
                    drift += 0.0 if math.isnan(d) else d
                    n += 1
            a0 = float(advantages[i]) if advantages.dim() == 1 else float(advantages[i][0])
            dropped = n > 0 and a0 < 0 and drift / n > off_policy_threshold
        seq_log_ratio = None
        if level == "sequence":
            n = sum(int(mask[i][t]) for t in range(T))
            seq_log_ratio = logps.sum() * 0
            for t in range(T):
                if mask[i][t]:
                    old = logps[i][t].detach() if old_logps is None else old_logps[i][t]
                    seq_log_ratio = seq_log_ratio + (logps[i][t] - old) / n
        for t in range(T):
            if not mask[i][t]:
                continue
            a = advantages[i] if advantages.dim() == 1 else advantages[i][t]
            old = logps[i][t].detach() if old_logps is None else old_logps[i][t]
            ratio = torch.exp(logps[i][t] - old) if level == "token" else torch.exp(seq_log_ratio)
            c = 1.0 if sampling_weights is None else float(sampling_weights[i][t])
            if loss_type == "cispo":
                surrogate = min(float(ratio), eps_high) * a * logps[i][t] * c
            elif loss_type == "sapo":
                tau = sapo[0] if a > 0 else sapo[1]
                surrogate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau * a * c
            elif loss_type == "vespo":
                surrogate = phi[t] * a * logps[i][t]  # c is inside phi
            else:
                clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
                capped = ratio if delta is None else torch.clamp(ratio, max=delta)
                surrogate = torch.min(capped * a, clipped * a) * c
            if (policy_mask is not None and not policy_mask[i][t]) or dropped:
                surrogate = surrogate * 0
            loss = -surrogate
            if beta != 0:
                d = ref_logps[i][t] - logps[i][t]
                k3 = torch.exp(d) - d - 1
                loss = loss + beta * (k3 * ratio if bias_correction_kl else k3) * c
            if entropy_coef and not ((policy_mask is not None and not policy_mask[i][t]) or dropped):
                loss = loss - entropy_coef * entropy[i][t] * c
            token_loss[i][t] = loss
    zero = logps.sum() * 0
    if loss_type == "luspo":
        rows = [sum((token_loss[i][t] for t in range(T) if mask[i][t]), zero) for i in range(B)]
        return sum(rows, zero) / B
    if loss_type in ("grpo", "sapo"):
        total = zero
        for i in range(B):
            n = sum(int(mask[i][t]) for t in range(T))
            row = sum((token_loss[i][t] for t in range(T) if mask[i][t]), zero)
            total = total + (row / n if n > 0 else zero)
        return total / B
    all_tokens = [token_loss[i][t] for i in range(B) for t in range(T) if mask[i][t]]
    total = sum(all_tokens, zero)
    if loss_type == "bnpo":
        return total / max(len(all_tokens), 1)
    if loss_type == "dr_grpo":
        return total / (B * max_len)
    if loss_type in ("dapo", "cispo", "vespo"):
        return total / (normalizer if normalizer is not None else max(len(all_tokens), 1))
    raise ValueError(loss_type)


def naive_mixed_advantages(rewards, rows_per_func, weights, width, num_generations, scale_rewards="group", eps=1e-4):
    """A_{i,t} = A_i + sum_k w_k * A^(k)_{i,t}: the outcome advantage of each row on every token plus each process
    function's token advantages, weighted (docs/method.md, "Process supervision")."""
    outcome = naive_group_advantages(rewards, num_generations, scale_rewards, eps)
    out = [[a] * width for a in outcome]
    for rows, weight in zip(rows_per_func, weights):
        per_token = naive_process_advantages(rows, width, num_generations, scale_rewards, eps)
        out = [[a + weight * p for a, p in zip(row, prow)] for row, prow in zip(out, per_token)]
    return out


def naive_grouped_advantages(rewards, group_sizes, scale_rewards="group", eps=1e-4, baseline=None):
    """Advantages of consecutive groups of different sizes, one group at a time (docs/offline.md): the GRPO formula
    in each group; a group of one row gets r - baseline (unscaled) when a baseline is given, else 0."""
    rewards = [float(r) for r in rewards]
    valid_all = [r for r in rewards if not math.isnan(r)]
    if len(valid_all) > 1:
        m = sum(valid_all) / len(valid_all)
        batch_std = math.sqrt(sum((r - m) ** 2 for r in valid_all) / (len(valid_all) - 1))
    else:
        batch_std = 0.0
    out, start = [], 0
    for size in group_sizes:
        group = rewards[start : start + size]
        start += size
        if size == 1 and baseline is not None:
            out.append(0.0 if math.isnan(group[0]) else group[0] - baseline)
            continue
        valid = [r for r in group if not math.isnan(r)]
        if len(valid) <= 1 or max(valid) == min(valid):
            out += [0.0] * size
            continue
        mean = sum(valid) / len(valid)
        std = math.sqrt(sum((r - mean) ** 2 for r in valid) / (len(valid) - 1))
        divisor = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale_rewards]
        out += [0.0 if math.isnan(r) else (r - mean) / divisor for r in group]
    return out


def naive_decoupled_advantages(rewards_per_func, weights, group_sizes, eps=1e-4):
    """GDPO (docs/method.md, "Several reward functions"), one function and one group at a time: each function's
    rewards normalised within their group (a group whose valid rewards are all equal, or which has at most one, gives
    0; a NaN entry 0), weighted and summed over the functions that scored the row, then the sums normalised over the
    batch (mean and unbiased std of the rows some function scored; the others get 0). `rewards_per_func`: B lists of
    K numbers (NaN: not scored); `group_sizes`: consecutive groups."""
    B, K = len(rewards_per_func), len(weights)
    normalised = [[0.0] * K for _ in range(B)]
    for k in range(K):
        start = 0
        for size in group_sizes:
            rows = range(start, start + size)
            start += size
            valid = [rewards_per_func[i][k] for i in rows if not math.isnan(rewards_per_func[i][k])]
            if len(valid) <= 1 or max(valid) == min(valid):
                continue
            mean = sum(valid) / len(valid)
            std = math.sqrt(sum((r - mean) ** 2 for r in valid) / (len(valid) - 1))
            for i in rows:
                if not math.isnan(rewards_per_func[i][k]):
                    normalised[i][k] = (rewards_per_func[i][k] - mean) / (std + eps)
    scored = [any(not math.isnan(r) for r in row) for row in rewards_per_func]
    sums = [sum(w * n for w, n in zip(weights, normalised[i])) for i in range(B)]
    valid = [s for s, ok in zip(sums, scored) if ok]
    mean = sum(valid) / len(valid) if valid else 0.0
    std = math.sqrt(sum((s - mean) ** 2 for s in valid) / (len(valid) - 1)) if len(valid) > 1 else 0.0
    return [(s - mean) / (std + eps) if ok else 0.0 for s, ok in zip(sums, scored)]
