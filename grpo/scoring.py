"""Scoring completions with reward functions and reward models.

A reward function is a plain callable `f(prompts, completions, **kwargs) -> list[float | None]`. It receives, as
keyword arguments and only if its signature accepts them (or it takes `**kwargs`): `prompts`, `completions`,
`completion_ids`, `trainer_state`, and every other dataset column as a list with one entry per row. `None` means
"does not apply to this row" and becomes NaN, which the advantage computation ignores.

A reward model is a `PreTrainedModel` with one output label (`AutoModelForSequenceClassification`); it scores the
prompt and completion text, rendered with the chat template for conversational data, using its own tokenizer.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from grpo.data import is_conversational


def reward_name(func: Callable | PreTrainedModel) -> str:
    """The name used in metrics (`rewards/<name>/mean`) and error messages."""
    if isinstance(func, PreTrainedModel):
        return func.config._name_or_path.rstrip("/").split("/")[-1] or type(func).__name__
    return getattr(func, "__name__", None) or type(func).__name__


def _accepted_kwargs(func: Callable, available: dict[str, Any]) -> dict[str, Any]:
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return available
    missing = [
        name
        for name, p in params.items()
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        and name not in available
    ]
    if missing:
        raise TypeError(
            f"Reward function '{reward_name(func)}' requires argument(s) {missing}, which are neither standard "
            f"reward arguments nor dataset columns. Available: {sorted(available)}."
        )
    return {k: v for k, v in available.items() if k in params}


def _row_slice(kwargs: dict[str, Any], i: int) -> dict[str, Any]:
    return {k: (v[i : i + 1] if isinstance(v, (list, tuple, torch.Tensor)) else v) for k, v in kwargs.items()}


def _to_float(value: Any, name: str, row: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(
        f"Reward function '{name}' returned {value!r} ({type(value).__name__}) for row {row}; "
        "each entry must be a number, or None when the function does not apply to that row."
    )


def call_reward_function(func: Callable, available: dict[str, Any], num_rows: int) -> list[float]:
    """Call `func` with the arguments it accepts and check what it returns. On an exception, the rows are tried one
    by one to name the first that fails, and the error says which function, which row and what it raised."""
    name = reward_name(func)
    kwargs = _accepted_kwargs(func, available)
    try:
        values = func(**kwargs)
    except Exception as batch_error:
        failing_row, error = None, batch_error
        if num_rows > 1:
            for i in range(num_rows):
                try:
                    func(**_row_slice(kwargs, i))
                except Exception as row_error:
                    failing_row, error = i, row_error
                    break
        where = f"row {failing_row}" if failing_row is not None else f"a batch of {num_rows} rows"
        prompt = available["prompts"][failing_row] if failing_row is not None else None
        detail = f" (prompt: {str(prompt)[:200]!r})" if prompt is not None else ""
        raise RuntimeError(
            f"Reward function '{name}' failed on {where}{detail}: {type(error).__name__}: {error}"
        ) from batch_error
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    if not isinstance(values, Sequence) or isinstance(values, str) or len(values) != num_rows:
        got = f"length {len(values)}" if isinstance(values, Sequence) else type(values).__name__
        raise ValueError(f"Reward function '{name}' must return a list of {num_rows} values (one per row), got {got}.")
    return [_to_float(v, name, i) for i, v in enumerate(values)]


@torch.no_grad()
def score_with_model(model: PreTrainedModel, tokenizer, prompts: Sequence, completions: Sequence) -> list[float]:
    """Scalar score of each (prompt, completion) pair from a one-label sequence-classification model."""
    if is_conversational(prompts[0]):
        # A prompt ending in an assistant message (prefill) is continued: that text already starts the completion.
        texts = [
            tokenizer.apply_chat_template((p[:-1] if p[-1]["role"] == "assistant" else p) + c, tokenize=False)
            for p, c in zip(prompts, completions)
        ]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    inputs = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
    device = next(model.parameters()).device
    logits = model(**{k: v.to(device) for k, v in inputs.items()}).logits  # (B, num_labels)
    return logits[:, 0].float().tolist()


def score_completions(
    reward_funcs: Sequence[Callable | PreTrainedModel],
    reward_tokenizers: Sequence[Any],
    *,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    trainer_state: Any = None,
) -> torch.Tensor:
    """Rewards of every row under every function: (B, K) float32, NaN where a function returned None."""
    num_rows = len(prompts)
    available = {
        **columns,
        "prompts": prompts,
        "completions": completions,
        "completion_ids": completion_ids,
        "trainer_state": trainer_state,
    }
    per_func = []
    for func, tokenizer in zip(reward_funcs, reward_tokenizers):
        if isinstance(func, PreTrainedModel):
            per_func.append(score_with_model(func, tokenizer, prompts, completions))
        else:
            per_func.append(call_reward_function(func, available, num_rows))
    return torch.tensor(per_func, dtype=torch.float32).T.reshape(num_rows, len(reward_funcs))  # (B, K)
