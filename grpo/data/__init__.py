"""Prompts in, token ids out; token ids in, completions out.

A prompt is either a string (standard) or a list of `{"role", "content"}` messages (conversational), rendered with
the tokenizer's chat template. Completions come back in the same form: strings, or a one-message list
`[{"role": "assistant", "content": ...}]`. A conversational prompt that ends with an assistant message is continued
(prefill), and that message's text starts the completion.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from grpo.errors import InputError  # defined apart so that the command line loads it without torch

# Names the trainer passes to reward functions itself (grpo/rewards/scoring.py, grpo/rewards/process.py); a data set column with one
# of them would be silently replaced by the generated values.
RESERVED_COLUMNS = ("prompts", "completions", "completion_ids", "trainer_state")

# The chat roles a prompt may use: what chat templates know. Others ("bot", "User") would be rendered as given, or
# dropped by a template that only matches these, without a word.
ROLES = ("system", "user", "assistant", "tool")
# Which end of a prompt longer than max_prompt_length is cut (GRPOConfig.truncation_side).
TRUNCATION_SIDES = ("left", "right")

GOOD_PROMPT = (
    "A prompt is a non-empty string, or a non-empty list of messages such as "
    "[{'role': 'user', 'content': 'What is 2 + 2?'}]."
)


def is_conversational(prompt: Any) -> bool:
    return (
        isinstance(prompt, list)
        and len(prompt) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt)
    )


def completion_text(completion: str | dict | list) -> str:
    """The text of a completion (or prompt): the string itself, or the content of the last chat message (a
    message given alone counts as one)."""
    if isinstance(completion, list):
        completion = completion[-1]
    return completion["content"] if isinstance(completion, dict) else completion


def render_prompt(
    prompt: str | list[dict], tokenizer, tools: list[dict] | None = None, chat_template_kwargs: dict | None = None
) -> str:
    """The text the model is conditioned on: the prompt itself, or its messages through the chat template (with the
    JSON schemas of `tools`, for multi-turn episodes, and the template variables `chat_template_kwargs`)."""
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
        prompt,
        tools=tools,
        tokenize=False,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        **(chat_template_kwargs or {}),
    )


def tokenize_prompts(
    texts: Sequence[str], tokenizer, max_prompt_length: int | None, side: str = "left"
) -> list[list[int]]:
    """Token ids of each rendered prompt, cut to `max_prompt_length` tokens on `side` (`cut_prompt`; "left", the
    default, keeps the end of a prompt, where the question and the generation prompt are). No special
    tokens are added: chat templates already carry theirs, and this matches TRL."""
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"]
    if max_prompt_length is not None:
        ids = [cut_prompt(seq, max_prompt_length, side) for seq in ids]
    if any(len(seq) == 0 for seq in ids):
        raise ValueError("A prompt tokenized to zero tokens; every prompt needs at least one token.")
    return ids


def cut_prompt(ids: list[int], max_length: int, side: str) -> list[int]:
    """`ids` cut to `max_length` tokens: "right" keeps the first ones, "left" the last ones."""
    if len(ids) <= max_length:
        return list(ids)
    return list(ids[:max_length]) if side == "right" else list(ids[len(ids) - max_length :])


def conversation_turns(prompt: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """A conversation as its leading system message (a list of zero or one) and its turns: a turn opens with a user
    message and runs up to the next one (the answer, tool messages); messages before the first user message make
    a turn of their own.

        [system, user, assistant, user, assistant, user] -> [system], [[user, assistant], [user, assistant], [user]]
    """
    head = prompt[:1] if prompt[0]["role"] == "system" else []
    turns: list[list[dict]] = []
    for message in prompt[len(head) :]:
        if not turns or message["role"] == "user":
            turns.append([])
        turns[-1].append(message)
    return head, turns


def cut_turns(
    prompt: list[dict],
    tokenizer,
    max_length: int,
    tools: list[dict] | None = None,
    chat_template_kwargs: dict | None = None,
    name: str | None = None,
) -> tuple[list[int], int]:
    """The token ids of the conversation `prompt`, longer than `max_length` tokens, with its oldest turns dropped
    (`conversation_turns`) until it fits, and how many were dropped. Its leading system message (with the tools'
    schemas the template renders there) and its last turn are always kept and no turn is cut inside, so a
    conversation whose system message and last turn alone are too long is refused with an `InputError` naming it
    (`name`, e.g. "train_dataset row 7", else the start of its last message) and the fixes."""
    head, turns = conversation_turns(prompt)
    length = None
    for dropped in range(1, len(turns)):
        kept = head + [message for turn in turns[dropped:] for message in turn]
        text = render_prompt(kept, tokenizer, tools, chat_template_kwargs)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) <= max_length:
            return ids, dropped
        length = len(ids)
    if length is None:  # a single turn: the whole prompt is that turn (and the system message)
        text = render_prompt(prompt, tokenizer, tools, chat_template_kwargs)
        length = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    what = name or f"The prompt whose last message begins {completion_text(prompt)[:60]!r}"
    kept = "its system message and last turn" if head else "its last turn"
    schemas = " (with the tools' schemas)" if tools else ""
    raise InputError(
        f"{what}: the conversation is longer than max_prompt_length={max_length} tokens, and {kept} alone are "
        f"{length} tokens{schemas}. A conversation is cut only by whole turns (the oldest first, the system "
        f"message kept), never inside one. Raise max_prompt_length to at least {length}, set "
        "max_prompt_length=None to keep whole prompts (as TRL does), or shorten that prompt."
    )


def encode_prompts(
    prompts: Sequence[str | list[dict]],
    tokenizer,
    max_prompt_length: int | None,
    side: str = "left",
    tools: Sequence[list[dict] | None] | None = None,
    chat_template_kwargs: dict | None = None,
    names: Sequence[str] | None = None,
) -> tuple[list[list[int]], list[int]]:
    """Render and tokenize `prompts` (`render_prompt`, `tokenize_prompts`; `tools`: each row's tool schemas, for
    episodes; `chat_template_kwargs`: the template's variables), and how each was cut: 0 when whole. A prompt
    longer than `max_prompt_length` is cut: a conversation by whole turns (`cut_turns`, which refuses one that
    cannot be; `names` name the prompts in that error), and its entry is how many turns it lost; a string on
    `side` (`cut_prompt`), entry 1."""
    tools = [None] * len(prompts) if tools is None else list(tools)
    texts = [render_prompt(p, tokenizer, t, chat_template_kwargs) for p, t in zip(prompts, tools)]
    ids = tokenize_prompts(texts, tokenizer, None)
    cut = [0] * len(ids)
    for i, seq in enumerate(ids):
        if max_prompt_length is None or len(seq) <= max_prompt_length:
            continue
        if is_conversational(prompts[i]):
            name = names[i] if names is not None else None
            ids[i], cut[i] = cut_turns(prompts[i], tokenizer, max_prompt_length, tools[i], chat_template_kwargs, name)
        else:
            ids[i], cut[i] = cut_prompt(seq, max_prompt_length, side), 1
    return ids, cut


def pad(
    sequences: Sequence[Sequence[int]], pad_value: int, side: str, width: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ragged sequences into (ids, mask) of shape (B, max(max_len, width)), padding on the `side` ("left" or
    "right")."""
    width = max(max((len(s) for s in sequences), default=0), width)
    ids = torch.full((len(sequences), width), pad_value, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, seq in enumerate(sequences):
        if len(seq) == 0:
            continue
        cols = slice(width - len(seq), width) if side == "left" else slice(0, len(seq))
        ids[i, cols] = torch.as_tensor(list(seq), dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def round_up(width: int, multiple_of: int | None) -> int:
    """`width` rounded up to a multiple of `multiple_of` (`GRPOConfig.pad_to_multiple_of`); None leaves it."""
    return width if not multiple_of else -(-width // multiple_of) * multiple_of


def content_widths(prompt_mask: torch.Tensor, completion_mask: torch.Tensor) -> tuple[int, int]:
    """The widths that hold every row's tokens: the longest prompt (left-padded) and the longest completion
    (right-padded), at least 1. Columns beyond them are padding in every row and can be dropped."""
    return max(int(prompt_mask.sum(dim=1).max()), 1), max(int(completion_mask.sum(dim=1).max()), 1)


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


def prompt_problem(prompt: Any) -> str | None:
    """What is wrong with one prompt, or None when it can be rendered. An empty string is wrong: it tokenizes to
    zero tokens, which `tokenize_prompts` refuses."""
    if isinstance(prompt, str):
        return "an empty string, which has no tokens to condition on" if prompt == "" else None
    if prompt is None:
        return "missing (None)"
    if not isinstance(prompt, list):
        return f"of type {type(prompt).__name__}: {str(prompt)[:60]!r}"
    if not prompt:
        return "an empty list of messages"
    for j, message in enumerate(prompt):
        if not isinstance(message, dict):
            return f"a list whose message {j} is a {type(message).__name__}, not a {{'role', 'content'}} dict"
        for key in ("role", "content"):
            # Arrow fills a key missing from one message with None, so a missing key and None look the same.
            if message.get(key) is None:
                return f"a list whose message {j} has no {key!r}: {str(message)[:80]}"
        if message["role"] not in ROLES:
            return f"a list whose message {j} has role {message['role']!r}, not one of {', '.join(ROLES)}"
    return None


def check_prompt_dataset(dataset: Any, name: str = "train_dataset", batch_size: int = 10_000) -> None:
    """Check a prompt data set once, before training: no column named like a reward-function argument the trainer
    passes itself (RESERVED_COLUMNS), a `prompt` column, and every prompt a string or a list of messages. `name`
    is the trainer's argument, "train_dataset" or "eval_dataset" (which may be a dict of data sets).

    Reads the prompt column once, `batch_size` rows at a time, without tokenizing (per million rows, about 0.1 s for
    strings and 3 s for chat messages). Of a stream (`is_stream`) only the columns are checked, when it lists them;
    its rows are checked as the trainer reads them (grpo/data/stream.py). Raises `InputError` naming the first bad
    row (and how many there are) or the column, and the fix."""
    if dataset is None:
        return
    if isinstance(dataset, dict):
        if dataset and not any(hasattr(value, "column_names") for value in dataset.values()):  # columns, not splits
            raise InputError(
                f"{name} is a plain dict (keys {sorted(dataset)[:5]}), not a data set. Wrap it: "
                f"{name}=datasets.Dataset.from_dict({{'prompt': [...], ...}})."
            )
        if name == "train_dataset":  # a DatasetDict where one split was meant
            raise InputError(
                f"{name} is a dict of data sets with keys {sorted(dataset)}; pass one split, e.g. "
                f"{name}=dataset[{next(iter(dataset), 'train')!r}]."
            )
        for key, value in dataset.items():  # several evaluation sets, as `Trainer` accepts
            check_prompt_dataset(value, f"{name}[{key!r}]", batch_size)
        return
    columns = getattr(dataset, "column_names", None)
    if columns is None:
        return  # columns unknown (a torch Dataset): rows are checked when drawn
    reserved = [c for c in columns if c in RESERVED_COLUMNS]
    if reserved:
        raise InputError(
            f"{name} has column(s) {reserved}, a name the trainer passes to reward functions itself (the generated "
            f"values would silently replace the column). Rename it, e.g. "
            f"{name}.rename_column({reserved[0]!r}, 'reference_{reserved[0]}')."
        )
    if "prompt" not in columns:
        raise InputError(
            f"{name} needs a 'prompt' column; it has {columns}. Rename your prompt column, e.g. "
            f"{name}.rename_column('question', 'prompt')."
        )
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "select_columns"):
        return
    first, count = None, 0
    rows = dataset.select_columns(["prompt"]).with_format(None)
    for start in range(0, len(rows), batch_size):
        for i, prompt in enumerate(rows[start : start + batch_size]["prompt"], start):
            problem = prompt_problem(prompt)
            if problem is not None:
                first = first or (i, problem)
                count += 1
    if first is not None:
        i, problem = first
        also = f" ({count} bad rows in all)" if count > 1 else ""
        raise InputError(
            f"{name} row {i}: the prompt is {problem}{also}. {GOOD_PROMPT} Fix those rows, or drop them with "
            f"{name}.filter(lambda row: grpo.data.prompt_problem(row['prompt']) is None)."
        )


def _each_dataset(datasets: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(name, data set) for each of `datasets` (the trainer's arguments by name), a dict of evaluation sets entry by
    entry, None and streams (which cannot be read whole before training) left out."""
    for name, dataset in datasets.items():
        if isinstance(dataset, dict):
            yield from ((f"{name}[{key!r}]", v) for key, v in dataset.items() if v is not None and not is_stream(v))
        elif dataset is not None and not is_stream(dataset):
            yield name, dataset


def is_stream(dataset: Any) -> bool:
    """Whether `dataset` is a stream: an `IterableDataset` (`load_dataset(..., streaming=True)`, or torch's), or any
    data set without a length. The trainer reads it in order (grpo/data/stream.py) instead of drawing by index."""
    if dataset is None or isinstance(dataset, dict):
        return False
    return isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__")


def _prompt_batches(dataset: Any, batch_size: int) -> Iterator[tuple[int, list]]:
    """(first row, prompts) of a sized data set, `batch_size` rows at a time: a `datasets.Dataset` by slices of its
    prompt column, another one row by row."""
    column = dataset.select_columns(["prompt"]).with_format(None) if hasattr(dataset, "select_columns") else None
    for start in range(0, len(dataset), batch_size):
        if column is not None:
            yield start, column[start : start + batch_size]["prompt"]
        else:
            yield start, [dataset[i]["prompt"] for i in range(start, min(start + batch_size, len(dataset)))]


def _holds_strings(dataset: Any) -> bool:
    """Whether a sized data set's prompts are strings (a column holds one kind), from its features, or else from its
    first prompt."""
    features = getattr(dataset, "features", None)
    if features is not None and "prompt" in features:
        return getattr(features["prompt"], "dtype", None) in ("string", "large_string")
    return len(dataset) == 0 or isinstance(dataset[0]["prompt"], str)


def check_prompt_turns(tokenizer, args, train_dataset: Any, eval_dataset: Any = None, batch_size: int = 1_000) -> None:
    """With `args.max_prompt_length` set, every conversational prompt of `train_dataset` and `eval_dataset` (which
    may be a dict of evaluation sets) rendered and tokenized once, as the trainer would (without tool schemas): one
    that cannot be cut by whole turns (its system message and last turn alone are too long, `cut_turns`) is an
    `InputError` now, naming its row, not at the round that draws it. Data sets of string prompts are not read."""
    if args.max_prompt_length is None:
        return
    for name, dataset in _each_dataset({"train_dataset": train_dataset, "eval_dataset": eval_dataset}):
        if _holds_strings(dataset):
            continue
        unit = "row" if hasattr(dataset, "select_columns") else "item"
        for start, prompts in _prompt_batches(dataset, batch_size):
            rows = [(i, p) for i, p in enumerate(prompts, start) if is_conversational(p)]
            if not rows:
                continue
            encode_prompts(
                [p for _, p in rows],
                tokenizer,
                args.max_prompt_length,
                chat_template_kwargs=args.chat_template_kwargs,
                names=[f"{name} {unit} {i}" for i, _ in rows],
            )


def check_prompt_lengths(
    tokenizer, model_config, args, train_dataset: Any, eval_dataset: Any = None, batch_size: int = 1_000
) -> None:
    """Prompts against the model's context (`max_position_embeddings` of `model_config`): a prompt that fills it
    (no position left for a completion) is an `InputError`, naming the first one, how many there are and the fixes;
    prompts that leave fewer than `args.max_completion_length` positions get one warning, since a completion that
    runs that long goes past the positions the model was trained on (or, with learned position embeddings, fails
    with 'index out of range'). Conversations no cut of whole turns fits are refused first (`check_prompt_turns`).
    Nothing is read when `args.max_prompt_length` (which cuts every prompt) leaves room for a whole completion; else
    every prompt of `train_dataset` and `eval_dataset` (a dict of evaluation sets too; offline groups are items with
    a prompt; streams, which may not end, are not read) is rendered once, as the trainer would (no tool schemas)."""
    check_prompt_turns(tokenizer, args, train_dataset, eval_dataset, batch_size)
    context = getattr(model_config.get_text_config(decoder=True), "max_position_embeddings", None)
    if not isinstance(context, int):  # a model without positions (or that does not say): nothing to check
        return
    max_prompt_length, max_completion_length = args.max_prompt_length, args.max_completion_length
    if max_prompt_length is not None and max_prompt_length + max_completion_length <= context:
        return
    room = context - max_completion_length  # the longest prompt a whole completion fits after
    fit = f"Set max_prompt_length={room} or less"  # room > 0: prompts cut there leave room for a whole completion
    # A prompt that fills the context: cut it so that a completion fits, or at least one token of one.
    cut = fit if room > 0 else f"Set max_prompt_length={context - 1} or less and lower max_completion_length"
    tight = []  # per data set: how many prompts a whole completion does not fit after, and the first one
    for name, dataset in _each_dataset({"train_dataset": train_dataset, "eval_dataset": eval_dataset}):
        first, full, count = None, None, 0
        for start, prompts in _prompt_batches(dataset, batch_size):
            texts = [render_prompt(p, tokenizer, chat_template_kwargs=args.chat_template_kwargs) for p in prompts]
            ids = tokenize_prompts(texts, tokenizer, max_prompt_length)
            for i, seq in enumerate(ids, start):
                if len(seq) >= context:
                    full = (full[0], full[1], full[2] + 1) if full else (i, len(seq), 1)
                elif len(seq) > room:
                    first, count = first or (i, len(seq)), count + 1
        unit = "row" if hasattr(dataset, "select_columns") else "item"
        if full is not None:
            i, length, many = full
            also = f" ({many} prompts in all)" if many > 1 else ""
            if max_prompt_length is None:
                setting = "max_prompt_length=None keeps every prompt whole"
            else:
                setting = f"max_prompt_length={max_prompt_length} cuts prompts only beyond that"
            raise InputError(
                f"{name} {unit} {i}: the prompt is {length} tokens{also}, which fills the model's context of {context} "
                f"tokens (max_position_embeddings) and leaves no position for a completion; {setting}. {cut} (longer "
                f"prompts are then cut on truncation_side, and counted), or drop those rows with {name}.filter(...)."
            )
        if first is not None:
            tight.append(f"{name}: {count}, the first {unit} {first[0]} with {first[1]} tokens")
    if tight:
        advice = (
            f"{fit} (longer prompts are then cut on truncation_side, and counted), or lower max_completion_length."
            if room > 0
            else f"Lower max_completion_length below {context}."
        )
        warnings.warn(
            f"Prompts leave fewer than max_completion_length={max_completion_length} positions in the model's "
            f"context of {context} tokens (max_position_embeddings) ({'; '.join(tight)}): a completion that runs that "
            f"long goes past the positions the model knows. {advice}",
            stacklevel=3,
        )
