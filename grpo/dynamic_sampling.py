"""Moving rows between generation rounds and processes, for DAPO dynamic sampling (`GRPOConfig.dynamic_sampling`).

The trainer decides which groups to keep (`GRPOTrainer._dynamic_sampling`, docs/method.md); these helpers do the
bookkeeping. A *round* is the dict `GRPOTrainer._generate_round` returns: token tensors and text for this process's
rows, rewards (`rewards_per_func`, `step_rewards`) for all processes' rows. `gather_round` makes every entry global;
`select_rows` builds a round of chosen rows from several gathered rounds and keeps one process's share.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from accelerate.utils import gather, gather_object

from grpo.sampler import RepeatSampler

# Row-aligned token tensors: (key, side padded).
_TOKEN_KEYS = (
    ("prompt_ids", "left"),
    ("prompt_mask", "left"),
    ("completion_ids", "right"),
    ("completion_mask", "right"),
    ("loss_mask", "right"),
    ("sampling_logps", "right"),  # None unless the sampler reports log-probs (vLLM)
)


def refill_indices(sampler: RepeatSampler) -> Iterator[int]:
    """Dataset indices from `sampler`, epoch after epoch, without end: where extra rounds take their prompts. Every
    process builds the same sampler, so all see the same order and each takes its own block of every round."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from sampler
        epoch += 1


def zero_advantage_groups(advantages: torch.Tensor, num_generations: int) -> list[bool]:
    """For each group of G consecutive rows, whether every advantage of its rows is exactly 0 (equal rewards: the
    group gives no policy gradient). `advantages` is (B,) or (B, T)."""
    groups = advantages.reshape(-1, num_generations * (advantages[0].numel()))  # (B/G, G) or (B/G, G*T)
    return (groups == 0).all(dim=1).tolist()


def gather_round(accelerator, pad_token_id: int, round_: dict[str, Any]) -> dict[str, Any]:
    """All processes' rows of a round, in process order: token tensors padded to a common width across processes
    (prompts on the left, completions on the right), texts by `gather_object`. Rewards are already global."""
    out = dict(round_)
    out["prompts"], out["completions"] = gather_object(round_["prompts"]), gather_object(round_["completions"])
    for key, side in _TOKEN_KEYS:
        if round_.get(key) is None:
            continue
        fill = pad_token_id if key.endswith("_ids") else 0
        padded = accelerator.pad_across_processes(round_[key], dim=1, pad_index=fill, pad_first=side == "left")
        out[key] = gather(padded)
    out["is_truncated"] = gather(round_["is_truncated"])
    return out


def _stack(rounds, key, selection, fill, side):
    """Rows `selection` ((round, row) pairs) of `key` from several rounds, padded on `side` to a common width."""
    width = max(rounds[r][key].shape[-1] for r, _ in selection)
    values = []
    for r, i in selection:
        value = rounds[r][key][i]
        padding = value.new_full((*value.shape[:-1], width - value.shape[-1]), fill)
        values.append(torch.cat([padding, value], -1) if side == "left" else torch.cat([value, padding], -1))
    return torch.stack(values)


def select_rows(
    rounds: list[dict[str, Any]], rows: list[tuple[int, int]], local: slice, pad_token_id: int
) -> dict[str, Any]:
    """The round made of `rows` ((index into `rounds`, row) pairs, in batch order) of gathered rounds: this
    process's rows `rows[local]` for the token tensors and texts (trimmed to their longest prompt and completion),
    and every row for the rewards, which stay global as `_generate_round` returns them."""
    picked = rows[local]
    out: dict[str, Any] = {
        "prompts": [rounds[r]["prompts"][i] for r, i in picked],
        "completions": [rounds[r]["completions"][i] for r, i in picked],
    }
    keys = [(key, side) for key, side in _TOKEN_KEYS if rounds[0].get(key) is not None]
    for key, side in keys:
        out[key] = _stack(rounds, key, picked, pad_token_id if key.endswith("_ids") else 0, side)
    prompt_width = max(int(out["prompt_mask"].sum(dim=1).max()), 1)
    completion_width = max(int(out["completion_mask"].sum(dim=1).max()), 1)
    for key, side in keys:
        out[key] = out[key][:, -prompt_width:] if side == "left" else out[key][:, :completion_width]
    out["is_truncated"] = torch.stack([rounds[r]["is_truncated"][i] for r, i in picked])
    out["rewards_per_func"] = torch.stack([rounds[r]["rewards_per_func"][i] for r, i in rows])  # (B_global, K)
    out["step_rewards"] = _stack(rounds, "step_rewards", rows, torch.nan, "right")  # (B_global, K_p, T)
    return out
