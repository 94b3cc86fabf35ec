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
(`OfflineGroups`): the sampler draws groups and each process gets whole groups. This module is the data stage's
part of offline training; the later stages each take theirs, so that data never imports what comes after it:

  - generation: `StoredCompletions` (grpo/generation/stored.py) turns the drawn groups into the same `Rollout`
    generation makes; from there on the trainer's path is the online one (scoring, advantages by group size,
    old and reference log-probs, micro-batches, the loss, metrics and checkpoints);
  - rewards: the stored reward is scored like a reward function (`StoredReward` and `offline_rewards`,
    grpo/rewards/stored.py), first in the reward set, weight 1 unless `reward_weights` has one more entry than
    there are reward functions; reward functions, when given, score the stored completions too;
  - training: `save_round` (grpo/training/rollouts_file.py) writes an online run's rounds in the
    one-row-per-completion form (`GRPOConfig.save_rollouts`), and `load_scored_rollouts`, here, reads such files
    back.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
from pathlib import Path
from typing import Any

import torch

from grpo.data import InputError, check_prompt_dataset
from grpo.data.sampler import train_batch_size

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


def reward_problem(value: Any) -> str | None:
    """What is wrong with one stored reward, or None: a finite number, or None (unscored: advantage 0)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        return f"{value!r}, which is not a finite number (or None for unscored)"
    return None


class OfflineGroups(torch.utils.data.Dataset):
    """A training set of scored completions as a data set of groups: item g is {"prompt": ..., "rows": [one dict
    per completion of that prompt]}, each row holding the completion (under `offline_completion_column`), the stored
    reward, the behaviour log-probs when given, and the training set's other columns (for reward functions). The
    column names and `args` it keeps are what `StoredCompletions` (grpo/generation/stored.py) tokenizes a round by."""

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
        if getattr(args, "sequence_parallel_size", 1) > 1:
            raise InputError(
                "offline training is not supported with sequence parallelism (sp_size > 1) yet: train without "
                "sp_size, or generate the completions online."
            )
        groups = OfflineGroups(train_dataset, args, bool(reward_funcs))
        train_batch_size(args, args.world_size, groups=True)  # whole groups per process: fails now, not at training
    except ValueError as e:  # InputError, and the sampler's ValueError
        raise InputError(
            f"{switched}; if it holds prompts to generate from, rename that column, e.g. "
            f"train_dataset.rename_column({column!r}, 'reference_{column}'). {e}"
        ) from e
    return groups


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
