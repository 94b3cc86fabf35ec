"""Prompts in, token ids out; token ids in, completions out.

A prompt is either a string (standard) or a list of `{"role", "content"}` messages (conversational), rendered with
the tokenizer's chat template. Completions come back in the same form: strings, or a one-message list
`[{"role": "assistant", "content": ...}]`. A conversational prompt that ends with an assistant message is continued
(prefill), and that message's text starts the completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def is_conversational(prompt: Any) -> bool:
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    )


def render_prompt(prompt: str | list[dict], tokenizer) -> str:
    """The text the model is conditioned on: the prompt itself, or its messages through the chat template."""
    if isinstance(prompt, str):
        return prompt
    if not is_conversational(prompt):
        raise ValueError(
            "A prompt must be a string or a list of {'role': ..., 'content': ...} messages; got "
            f"{type(prompt).__name__}: {str(prompt)[:100]!r}"
        )
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "Conversational prompts need a tokenizer with a chat template; this tokenizer has none. Set "
            "`tokenizer.chat_template` or pass string prompts."
        )
    prefill = prompt[-1]["role"] == "assistant"
    return tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=not prefill, continue_final_message=prefill
    )


def tokenize_prompts(texts: Sequence[str], tokenizer, max_prompt_length: int | None) -> list[list[int]]:
    """Token ids of each rendered prompt, keeping the last `max_prompt_length` tokens (left truncation: the end of
    a prompt, where the question and the generation prompt are, matters most). No special tokens are added: chat
    templates already carry theirs, and this matches TRL."""
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    if max_prompt_length is not None:
        ids = [seq[-max_prompt_length:] for seq in ids]
    if any(len(seq) == 0 for seq in ids):
        raise ValueError("A prompt tokenized to zero tokens; every prompt needs at least one token.")
    return ids


def pad(sequences: Sequence[Sequence[int]], pad_value: int, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ragged sequences into (ids, mask) of shape (B, max_len), padding on the `side` ("left" or "right")."""
    width = max((len(s) for s in sequences), default=0)
    ids = torch.full((len(sequences), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            continue
        cols = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[i, cols] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def decode_completions(
    completion_ids: Sequence[Sequence[int]], prompts: Sequence[Any], tokenizer
) -> list[str | list[dict]]:
    """Completion texts without special tokens; messages when the prompt was conversational."""
    texts = tokenizer.batch_decode([list(ids) for ids in completion_ids], skip_special_tokens=True)
    completions = []
    for prompt, text in zip(prompts, texts):
        if is_conversational(prompt):
            prefill = prompt[-1]["content"] if prompt[-1]["role"] == "assistant" else ""
            completions.append([{"role": "assistant", "content": prefill + text}])
        else:
            completions.append(text)
    return completions
