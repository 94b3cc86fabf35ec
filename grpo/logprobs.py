"""Per-token log-probs of completions under a model: the one place where the trainer turns logits into numbers.

Policy, old and reference log-probs all come from `completion_logprobs`, so they agree on temperature, positions and
masking. Spec section 8: only the selected token's logit and the log-sum-exp over the vocabulary are needed.
"""

from __future__ import annotations

import torch
from torch import nn


def selective_log_softmax(logits: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[..., index], without materialising the full log-softmax.

        logp_t = logits_t[index_t] - logsumexp(logits_t)

    logits (B, T, V), index (B, T) -> (B, T) in float32. Rows are processed one at a time so the float32 temporary
    is (T, V), not (B, T, V).
    """
    rows = []
    for row_logits, row_index in zip(logits, index):  # (T, V), (T,)
        row_logits = row_logits.float()
        picked = row_logits.gather(-1, row_index.unsqueeze(-1)).squeeze(-1)  # (T,)
        rows.append(picked - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)


@torch.no_grad()
def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position, H = logsumexp(z) - sum_v p_v z_v. (B, T, V) -> (B, T), float32,
    one row at a time. Used for metrics only, hence no gradient."""
    rows = []
    for row_logits in logits:
        row_logits = row_logits.float()
        probs = torch.softmax(row_logits, dim=-1)
        rows.append(torch.logsumexp(row_logits, dim=-1) - (probs * row_logits).sum(-1))
    return torch.stack(rows)


def completion_logprobs(
    model: nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    batch_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log pi(o_t | q, o_<t) for every completion token, from logits divided by the sampling temperature.

    prompt_ids/prompt_mask (B, P) left-padded; completion_ids/completion_mask (B, T) right-padded, the mask 1 for
    tokens up to and including EOS. Returns logps (B, T) float32 and, if `with_entropy`, the per-token entropy (B, T)
    of the same tempered distribution. Values at masked positions are meaningless; callers mask them.

    Position ids count only real tokens (cumsum of the attention mask), as `generate` does for left-padded prompts,
    so scoring sees the positions that sampling saw. `batch_size` splits the rows into chunks (for no-grad passes).
    """
    if batch_size is not None and batch_size < prompt_ids.shape[0]:
        chunks = [
            completion_logprobs(
                model,
                prompt_ids[i : i + batch_size],
                prompt_mask[i : i + batch_size],
                completion_ids[i : i + batch_size],
                completion_mask[i : i + batch_size],
                temperature=temperature,
                with_entropy=with_entropy,
            )
            for i in range(0, prompt_ids.shape[0], batch_size)
        ]
        logps = torch.cat([c[0] for c in chunks])
        entropy = torch.cat([c[1] for c in chunks]) if with_entropy else None
        return logps, entropy

    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P+T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    num_completion = completion_ids.shape[1]
    # The logit at position j predicts token j+1: the last prompt position predicts the first completion token,
    # and the last completion position predicts nothing. Keeping T+1 logits and dropping the last gives (B, T, V).
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        logits_to_keep=num_completion + 1,
        use_cache=False,
    ).logits[:, :-1, :]
    logits = logits / temperature
    logps = selective_log_softmax(logits, completion_ids)
    entropy = entropy_from_logits(logits.detach()) if with_entropy else None
    return logps, entropy
