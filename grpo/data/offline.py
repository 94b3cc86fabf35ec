"""Training from scored rollouts: (prompt, completion, reward) data instead of generation (docs/offline.md).

The training set selects the mode: a `completion` column (one row per completion) or a `completions` column (one row
per prompt, with lists) makes `GRPOTrainer` train on the stored completions; the names follow
`GRPOConfig.offline_completion_column` (the per-prompt column is that name plus "s"). The switch is logged, and
errors about the stored data say that the column caused it (`offline_groups`).

    prompt                  completion          reward                      one row per completion
    "What is 2 + 2?"        "4"                 1.0
    "What is 2 + 2?"        "5"                 0.0

    prompt                  completions         reward                      one row per prompt
    "What is 2 + 2?"        ["4", "5"]          [1.0, 0.0]

Rows are grouped by prompt (`prompt_key`); a group is what a generation round's G completions of one prompt are
online, but its size may differ from group to group. The training set becomes a data set of groups
(`OfflineGroups`): the sampler draws groups, each process gets whole groups, and `OfflineGroups.rollout` turns the
drawn groups into the same `Rollout` generation makes. From there on the trainer's path is the online one: scoring,
advantages (`grouped_advantages`), old and reference log-probs, micro-batches, the loss, metrics and checkpoints.

The stored reward is scored like a reward function (`StoredReward`, first in the reward set, weight 1 unless
`reward_weights` has one more entry than there are reward functions); reward functions, when given, score the
stored completions too and are added with their weights.

`save_round` writes an online run's rounds in the one-row-per-completion form (`GRPOConfig.save_rollouts`), and
`load_scored_rollouts` reads such files back.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object

from grpo.data import InputError, check_prompt_dataset, completion_text, encode_prompts
from grpo.data.sampler import train_batch_size
from grpo.rollout import Rollout, gather_rows

ROLLOUTS_FILE = "rollouts.jsonl"  # what `save_rollouts` writes in output_dir
TRUNCATED = "truncated"  # optional bool column: the stored completion was cut off, so no EOS is appended
FILE_LOADERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}

logger = logging.getLogger(__name__)


def offline_form(dataset: Any, args) -> str | None:
    """How `dataset` holds scored completions: "rows" (one row per completion), "lists" (one row per prompt) or
    None (a prompt data set: online training)."""
    columns = getattr(dataset, "column_names", None) or []
    if args.offline_completion_column in columns:
        return "rows"
    listed = args.offline_completion_column + "s"
    if listed not in columns or not hasattr(dataset, "__len__") or len(dataset) == 0:
        return None
    # Only lists: a column of single completions named like that is the reserved-name mistake check_prompt_dataset
    # reports (reward functions receive `completions` themselves).
    return "lists" if isinstance(dataset[0][listed], list) else None


def prompt_key(prompt: Any) -> str:
    """The key rows are grouped by: the prompt string itself, or the JSON of its chat messages (keys sorted)."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def completion_problem(completion: Any) -> str | None:
    """What is wrong with one stored completion, or None: a string, an assistant message
    `{"role": "assistant", "content": ...}` or a list holding one."""
    if isinstance(completion, str):
        return None
    message = completion[-1] if isinstance(completion, list) and len(completion) == 1 else completion
    if isinstance(message, dict) and isinstance(message.get("content"), str):
        return None
    return f"{str(completion)[:80]!r}, which is neither a string nor an assistant message"


def prefill(prompt: Any) -> str:
    """The text a conversational prompt's final assistant message starts the completion with ("" without one)."""
    return prompt[-1]["content"] if not isinstance(prompt, str) and prompt[-1]["role"] == "assistant" else ""


def continuation(prompt: Any, text: str) -> str:
    """The part of a stored completion the model produced: after the prompt's prefill, which online completions
    (and so exported ones) repeat at their start."""
    start = prefill(prompt)
    return text[len(start) :] if start and text.startswith(start) else text


def reward_problem(value: Any) -> str | None:
    """What is wrong with one stored reward, or None: a finite number, or None (unscored: advantage 0)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return f"{value!r}, which is not a finite number (or None for unscored)"
    return None


class StoredReward:
    """The stored reward column as a reward function, first in the trainer's reward set: it returns the column's
    values, so the stored reward's metrics (`rewards/<column>/mean`), weight and advantages work like any function's.
    A module-level class, so that it pickles for `reward_worker_type="process"`."""

    def __init__(self, column: str):
        self.column = column
        self.__name__ = column

    def __call__(self, prompts, completions, **columns) -> list:
        return list(columns[self.column])


class OfflineGroups(torch.utils.data.Dataset):
    """A training set of scored completions as a data set of groups: item g is {"prompt": ..., "rows": [one dict
    per completion of that prompt]}, each row holding the completion (under `offline_completion_column`), the stored
    reward, the behaviour log-probs when given, and the training set's other columns (for reward functions)."""

    def __init__(self, dataset, args, reward_funcs_given: bool, name: str = "train_dataset"):
        self.dataset, self.args, self.form = dataset, args, offline_form(dataset, args)
        self.completion, self.reward = args.offline_completion_column, args.offline_reward_column
        self.logprobs = args.offline_logprobs_column
        check_offline_dataset(dataset, args, self.form, reward_funcs_given, name)
        self.has_reward = self.reward in dataset.column_names
        self.groups = group_rows(dataset, self.form, self.completion + "s", args.offline_baseline)

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, index: int) -> dict[str, Any]:
        indices = self.groups[index]
        if self.form == "rows":
            batch = self.dataset[indices]
            rows = [{k: v[i] for k, v in batch.items() if k != "prompt"} for i in range(len(indices))]
            return {"prompt": batch["prompt"][0], "rows": rows}
        listed = {self.completion + "s": self.completion, self.reward: self.reward, self.logprobs: self.logprobs}
        rows = []
        for record in (self.dataset[i] for i in indices):
            for j in range(len(record[self.completion + "s"])):
                row = {k: v for k, v in record.items() if k not in listed and k != "prompt"}
                rows.append(row | {target: record[k][j] for k, target in listed.items() if k in record})
        return {"prompt": self.dataset[indices[0]]["prompt"], "rows": rows}

    def rollout(self, groups: list[dict], tokenizer, eos_token_ids, accelerator) -> tuple[Rollout, dict[str, list]]:
        """The `Rollout` of the drawn `groups` (this process's), on the accelerator's device, not yet scored, and
        the rows' other columns for the reward functions. Completions are tokenized without special tokens and end
        with the tokenizer's EOS token (unless the `truncated` column says they were cut off); at most
        `max_completion_length` tokens are kept (a longer one is truncated). With `offline_logprobs_column`, those
        log-probs become the old log-probs, so that the ratio is taken against the policy that produced the data."""
        args = self.args
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
        texts = [continuation(p, completion_text(row[self.completion])) for p, row in zip(prompts, rows)]
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
        old_logps = behaviour_logps(rows, self.logprobs, completion_ids, texts, tokenizer) if self.logprobs else None
        everyone = gather_object([[len(group["rows"]) for group in groups]])  # every process's group sizes
        first_row = sum(sum(sizes) for sizes in everyone[: accelerator.process_index])
        rollout = replace(
            rollout,
            old_logps=old_logps,
            group_sizes=[s for sizes in everyone for s in sizes],
            first_row=first_row,
            prompt_truncated=torch.tensor(prompt_cut, dtype=torch.bool),
        )
        columns = {k: [row[k] for row in rows] for k in rows[0] if k != self.completion}
        return rollout.to(accelerator.device), columns


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


def check_offline_dataset(dataset, args, form: str, reward_funcs_given: bool, name: str) -> None:
    """Every check of a scored-completions data set that needs no tokenizer: the columns, every stored completion
    and reward, and the settings offline training does not take. Raises `InputError` naming the column or row and
    the fix."""
    if not hasattr(dataset, "__len__") or not hasattr(dataset, "select_columns"):
        raise InputError(f"{name} holds scored completions but is not a map-style datasets.Dataset; load it whole.")
    columns = dataset.column_names
    listed = args.offline_completion_column + "s"
    check_prompt_dataset(dataset.remove_columns([listed]) if form == "lists" else dataset, name)
    reward = args.offline_reward_column
    if reward not in columns and not reward_funcs_given:
        raise InputError(
            f"{name} has stored completions but no {reward!r} column, and no reward functions were given: nothing "
            f"scores them. Add a {reward!r} column, name yours with offline_reward_column, or pass reward_funcs."
        )
    if args.offline_logprobs_column is not None and args.offline_logprobs_column not in columns:
        raise InputError(
            f"offline_logprobs_column={args.offline_logprobs_column!r}, but {name} has no such column (columns: "
            f"{columns}). Name the behaviour log-probs column, or set offline_logprobs_column=None."
        )
    unsupported = {
        "use_vllm": "no completions are generated",
        "dynamic_sampling": "the stored groups are all there is to draw from",
        "save_rollouts": "it writes generated rollouts, and offline training generates none",
    }
    for setting, why in unsupported.items():
        if getattr(args, setting):
            raise InputError(f"{setting}=True does not apply to training on stored completions ({name}): {why}.")
    _check_values(dataset, form, args.offline_completion_column, reward if reward in columns else None, name)


def _check_values(dataset, form: str, completion: str, reward: str | None, name: str) -> None:
    """Every stored completion is a string or an assistant message, every reward a number or None, and in the
    per-prompt form the reward lists align with the completion lists."""
    column = completion + "s" if form == "lists" else completion
    selected = [column] + ([reward] if reward else [])
    rows = dataset.select_columns(selected).with_format(None)
    for start in range(0, len(rows), 10_000):
        batch = rows[start : start + 10_000]
        for i, completions in enumerate(batch[column], start):
            rewards = batch[reward][i - start] if reward else None
            if form == "lists":
                if not isinstance(completions, list) or not completions:
                    raise InputError(f"{name} row {i}: {column!r} must be a non-empty list of completions.")
                if reward and (not isinstance(rewards, list) or len(rewards) != len(completions)):
                    raise InputError(
                        f"{name} row {i}: {reward!r} must be a list with one reward per completion "
                        f"({len(completions)}), got {str(rewards)[:80]}."
                    )
            for value in completions if form == "lists" else [completions]:
                if completion_problem(value) is not None:
                    raise InputError(f"{name} row {i}: the completion in {column!r} is {completion_problem(value)}.")
            for value in (rewards if form == "lists" else [rewards]) if reward else []:
                if reward_problem(value) is not None:
                    raise InputError(f"{name} row {i}: the reward in {reward!r} is {reward_problem(value)}.")


def group_rows(dataset, form: str, list_column: str, baseline: float | None) -> list[list[int]]:
    """The groups, as lists of row indices, ordered by prompt key (so the order of the rows in the file does not
    matter); a group's completions in file order. In the per-prompt form ("lists"), rows with the same prompt are
    one group too. A group of one completion needs `offline_baseline`: its group mean is itself, so its advantage
    would always be 0."""
    prompts = dataset.select_columns(["prompt"]).with_format(None)["prompt"]
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt_key(prompt), []).append(i)
    ordered = [groups[key] for key in sorted(groups)]
    if form == "lists":
        counts = [len(c) for c in dataset.select_columns([list_column]).with_format(None)[list_column]]
        lone = [rows for rows in ordered if sum(counts[i] for i in rows) == 1]
    else:
        lone = [rows for rows in ordered if len(rows) == 1]
    if lone and baseline is None:
        raise InputError(
            f"{len(lone)} prompt(s) have a single scored completion (e.g. {str(prompts[lone[0][0]])[:80]!r}): a group "
            "of one has no other completion to compare with, so its advantage would always be 0. Give each prompt "
            "two or more completions, drop those rows, or set offline_baseline (A = reward - baseline for them)."
        )
    return ordered


def offline_groups(train_dataset, eval_dataset, args, reward_funcs) -> OfflineGroups | None:
    """The training set as groups of scored completions when it holds them (`offline_form`), else None (online
    training on prompts). The switch is logged, and every error about the stored completions starts by saying why
    the data set was read that way: a prompt data set with a reference `completion` column is read so too."""
    form = offline_form(train_dataset, args)
    if form is None:
        return None
    column = args.offline_completion_column + ("s" if form == "lists" else "")
    switched = (
        f"train_dataset was read as stored, scored completions to train on without generation (offline training, "
        f"docs/offline.md) because it has a {column!r} column"
    )
    logger.info("%s.", switched)
    try:
        if eval_dataset is not None:
            raise InputError(
                "eval_dataset is not supported when train_dataset holds stored completions (offline training): "
                "evaluate the trained model separately, e.g. with a GRPOTrainer on prompts and trainer.evaluate()."
            )
        groups = OfflineGroups(train_dataset, args, bool(reward_funcs))
        train_batch_size(args, args.world_size, groups=True)  # whole groups per process: fails now, not at training
    except ValueError as e:  # InputError, and the sampler's ValueError
        raise InputError(
            f"{switched}; if it holds prompts to generate from, rename that column, e.g. "
            f"train_dataset.rename_column({column!r}, 'reference_{column}'). {e}"
        ) from e
    return groups


def offline_rewards(offline: OfflineGroups | None, reward_funcs, processing_classes, reward_weights):
    """(reward functions, their tokenizers, their weights) for `RewardSet`: online, as given (reward functions
    required); offline, the stored reward first (`StoredReward`, weight 1, or the first of `reward_weights` when it
    has one more entry than there are functions), then the functions given, which may be none."""
    weights = reward_weights
    funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, list) else [reward_funcs]
    if offline is None:
        if not funcs:
            raise InputError(
                "reward_funcs is empty: online training needs at least one reward function or reward model. (To "
                "train on stored, already scored completions, give train_dataset a 'completion' column; "
                "docs/offline.md.)"
            )
        return reward_funcs, processing_classes, weights
    if not offline.has_reward:
        return funcs, processing_classes, weights
    classes = processing_classes if isinstance(processing_classes, list) else [processing_classes] * len(funcs)
    if processing_classes is None:
        classes = [None] * len(funcs)
    if weights is not None and len(weights) == len(funcs):
        weights = [1.0, *weights]
    return [StoredReward(offline.reward), *funcs], [None, *classes], weights


def save_round(output_dir: str, accelerator, rollout: Rollout, rewards, step: int) -> None:
    """Append a scored round (all processes' rows) to `output_dir/rollouts.jsonl`, one line per completion, in the
    form offline training reads back: prompt, completion, reward (the combined reward), rewards (per function),
    truncated (cut off without EOS) and step (the optimizer step it was sampled at). Every process calls it; the
    main process writes."""
    columns, combined = rewards.columns(rollout.rewards_per_func, rollout.step_rewards)
    prompts, completions = gather_object(rollout.prompts), gather_object(rollout.completions)
    truncated = gather_rows(accelerator, rollout.is_truncated).tolist()
    if not accelerator.is_main_process:
        return
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, ROLLOUTS_FILE)

    def number(x: float) -> float | None:  # JSON has no NaN: unscored is null
        return None if math.isnan(x) else x

    with open(path, "a") as f:
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            per_function = {n: number(v) for n, v in zip(rewards.names, columns[i].tolist())}
            record = {"prompt": prompt, "completion": completion, "reward": number(combined[i].item())}
            record |= {"rewards": per_function, TRUNCATED: truncated[i], "step": step}
            f.write(json.dumps(record) + "\n")


def load_scored_rollouts(path: str | os.PathLike, split: str = "train"):
    """A file of scored completions (.jsonl/.json, .csv or .parquet; e.g. the `rollouts.jsonl` of `save_rollouts`)
    as a `datasets.Dataset`, read with the datasets library's own loaders. CSV holds only strings and numbers: chat
    prompts, message completions and per-prompt lists need JSON lines or Parquet."""
    import datasets

    path = Path(path)
    loader = FILE_LOADERS.get(path.suffix.lower())
    if loader is None:
        raise InputError(
            f"{path}: scored rollouts are read from {', '.join(FILE_LOADERS)} files, not {path.suffix!r}."
        )
    if not path.is_file():
        raise InputError(f"Scored rollouts file {str(path)!r} not found.")
    return datasets.load_dataset(loader, data_files={split: str(path)}, split=split)
