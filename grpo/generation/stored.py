"""`StoredCompletions`: the generation backend of offline training (docs/offline.md). A round's completions are
the stored ones of the groups the sampler drew (`OfflineGroups`, grpo/data/offline.py), tokenized as generation
would have produced them; their stored rewards are scored by the first reward function (`StoredReward`,
grpo/rewards/stored.py). From the `Rollout` on, the trainer's path is the online one, with no branch of its own."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from accelerate.utils import gather_object
from torch import nn

from grpo.data import InputError, completion_text, encode_prompts
from grpo.data.offline import TRUNCATED, OfflineGroups
from grpo.generation.base import Completions
from grpo.rollout import Rollout


def prefill(prompt: Any) -> str:
    """The text a conversational prompt's final assistant message starts the completion with ("" without one)."""
    return prompt[-1]["content"] if not isinstance(prompt, str) and prompt[-1]["role"] == "assistant" else ""


def continuation(prompt: Any, text: str) -> str:
    """The part of a stored completion the model produced: after the prompt's prefill, which online completions
    (and so exported ones) repeat at their start."""
    start = prefill(prompt)
    return text[len(start) :] if start and text.startswith(start) else text


class StoredCompletions:
    """Replays stored, scored completions instead of sampling. `sample_rollout` asks it for whole rollouts
    (`rollout`), since each row brings its own completion; `generate`, which takes prompt ids alone, refuses."""

    def __init__(self, groups: OfflineGroups, accelerator):
        self.groups, self.accelerator = groups, accelerator

    def sync_weights(self, model: nn.Module, version: int) -> None:
        """Nothing samples, so no weights are needed."""

    def generate(self, model: nn.Module, prompt_ids: list[list[int]]) -> Completions:
        raise TypeError(
            "StoredCompletions replays stored completions of drawn groups; it cannot sample completions for bare "
            "prompt ids. Use sample_rollout (GRPOTrainer.sample_round) with the drawn groups."
        )

    def rollout(self, groups: list[dict[str, Any]], tokenizer, eos_token_ids) -> tuple[Rollout, dict[str, list]]:
        """The `Rollout` of the drawn `groups` (this process's), on the accelerator's device, not yet scored, and
        the rows' other columns for the reward functions (the stored reward among them). Completions are tokenized
        without special tokens and end with the tokenizer's EOS token (unless the `truncated` column says they were
        cut off); at most `max_completion_length` tokens are kept (a longer one is truncated). With
        `offline_logprobs_column`, those log-probs become the old log-probs, so that the ratio is taken against the
        policy that produced the data."""
        args, column, logprobs = self.groups.args, self.groups.completion, self.groups.logprobs
        rows = [row for group in groups for row in group["rows"]]
        prompts = [group["prompt"] for group in groups for _ in group["rows"]]
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos_token_ids[0]
        prompt_ids, prompt_cut = encode_prompts(
            prompts,
            tokenizer,
            args.max_prompt_length,
            args.truncation_side,
            chat_template_kwargs=args.chat_template_kwargs,
        )
        texts = [continuation(p, completion_text(row[column])) for p, row in zip(prompts, rows)]
        completion_ids, truncated = [], []
        for ids, row in zip(tokenizer(texts, add_special_tokens=False)["input_ids"], rows):
            ids = ids if row.get(TRUNCATED) else ids + [eos]
            completion_ids.append(ids[: args.max_completion_length])
            truncated.append(bool(row.get(TRUNCATED)) or len(ids) > args.max_completion_length)
        completions = [
            t if isinstance(p, str) else [{"role": "assistant", "content": prefill(p) + t}]
            for p, t in zip(prompts, texts)
        ]
        rollout = Rollout.from_tokens(
            prompts,
            completions,
            prompt_ids,
            completion_ids,
            truncated,
            tokenizer.pad_token_id,
            mask_truncated=args.mask_truncated_completions,
        )
        old_logps = behaviour_logps(rows, logprobs, completion_ids, texts, tokenizer) if logprobs else None
        everyone = gather_object([[len(group["rows"]) for group in groups]])  # every process's group sizes
        first_row = sum(sum(sizes) for sizes in everyone[: self.accelerator.process_index])
        rollout = replace(
            rollout,
            old_logps=old_logps,
            group_sizes=[s for sizes in everyone for s in sizes],
            first_row=first_row,
            prompt_truncated=torch.tensor(prompt_cut, dtype=torch.long),
        )
        columns = {k: [row[k] for row in rows] for k in rows[0] if k != column}
        return rollout.to(self.accelerator.device), columns


def behaviour_logps(rows: list[dict], column: str, completion_ids: list[list[int]], texts, tokenizer) -> torch.Tensor:
    """(B, T) the stored behaviour log-probs of the completion tokens, right-padded with 0. A row needs one per
    token of its completion, the appended EOS included, before the `max_completion_length` cut."""
    width = max(len(ids) for ids in completion_ids)
    out = torch.zeros(len(rows), width)
    for i, (row, ids) in enumerate(zip(rows, completion_ids)):
        values = row.get(column)
        expected = len(tokenizer(texts[i], add_special_tokens=False)["input_ids"]) + (0 if row.get(TRUNCATED) else 1)
        if not isinstance(values, (list, tuple)) or len(values) != expected:
            count = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise InputError(
                f"The behaviour log-probs ({column!r}) of completion {texts[i][:60]!r} have {count} entries, but it "
                f"has {expected} tokens with the appended EOS. Give one log-prob per completion token, the EOS "
                f"included, with this model's tokenizer; or set offline_logprobs_column=None (old = current policy)."
            )
        out[i, : len(ids)] = torch.tensor([float(v) for v in values[: len(ids)]])
    return out
