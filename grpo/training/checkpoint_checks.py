"""What a checkpoint is checked for before a run resumes from it.

`Trainer` reads a checkpoint's files one by one as it resumes, and a truncated or garbage file then fails deep inside
safetensors, torch or json with a traceback that names no file. Here every file is read once first: `check_checkpoint`
names the first bad file, what is wrong with it, and the newest intact checkpoint beside it, in one line. The weights
are read tensor by tensor and must be finite (a NaN weight would otherwise fail only in sampling). Files written with
`torch.save` are zip archives whose directory sits at the end: opening the archive finds a truncated or garbage file
without reading the tensors, and its small records (the pickle, the version) are read and checked against their CRC.

The settings a restored state overrides are saved beside it (`RUN_SETTINGS_FILE`, JSON) and compared on resume:
`changed_settings` lists what differs, with what the resumed run will do about each.
"""

from __future__ import annotations

import json
import os
import warnings
import zipfile

from grpo.data import InputError

RUN_SETTINGS_FILE = "run_settings.json"
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# Settings a resumed run takes from the checkpoint's state instead of its arguments, and what that means for the run.
OVERRIDDEN = {
    "learning_rate": "the restored optimizer and scheduler keep the checkpoint's learning rate",
    "lr_scheduler_type": "the new schedule continues from the restored step and learning rate",
    "weight_decay": "the restored optimizer keeps the checkpoint's weight decay",
    "seed": "the data order of the epoch in progress changes, and the restored random state is the old run's",
    "data_seed": "the data order of the epoch in progress changes",
}


class CheckpointFileError(InputError):
    """A file of a checkpoint to resume from is missing, cut short, unreadable or holds non-finite weights."""


def _check_safetensors(path: str) -> str | None:
    """What is wrong with a safetensors file: unreadable, or a tensor with NaN or inf (None when whole)."""
    import torch
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                    bad = int((~torch.isfinite(tensor)).sum())
                    return f"holds non-finite weights ({bad} NaN or inf values in {name})"
    except (SafetensorError, OSError) as e:
        return f"is cut short or not a safetensors file ({e})"
    return None


def _check_torch_file(path: str) -> str | None:
    """What is wrong with a file written by `torch.save` (a zip archive), without loading its tensors."""
    try:
        with zipfile.ZipFile(path) as archive:
            size = os.path.getsize(path)
            for info in archive.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"is cut short ({info.filename} ends past the end of the file)"
                if not info.filename.split("/")[-2:-1] == ["data"]:  # the records, not the tensors: CRC-checked
                    archive.read(info)
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        return f"is cut short or not a file written by torch.save ({e})"
    return None


def _check_json(path: str) -> str | None:
    try:
        with open(path) as f:
            json.load(f)
    except (ValueError, OSError) as e:
        return f"is not valid JSON ({e})"
    return None


def checkpoint_problem(checkpoint: str) -> str | None:
    """The first problem of `checkpoint`'s files as "<file> <what is wrong>", or None when every file is whole."""
    names = set(os.listdir(checkpoint))
    weights = [name for name in WEIGHT_FILES if name in names]
    # FSDP and DeepSpeed keep the weights their own way (pytorch_model_fsdp*, global_stepN/): not read here.
    sharded = any(name.startswith(("pytorch_model_fsdp", "global_step")) for name in names)
    if not weights and not sharded:
        return f"has no weights file ({' or '.join(WEIGHT_FILES[:2])})"
    if "model.safetensors.index.json" in weights:
        problem = _check_json(os.path.join(checkpoint, "model.safetensors.index.json"))
        if problem:
            return f"model.safetensors.index.json {problem}"
        with open(os.path.join(checkpoint, "model.safetensors.index.json")) as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        missing = [shard for shard in shards if shard not in names]
        if missing:
            return f"{missing[0]} is missing (listed in model.safetensors.index.json)"
        names.update(shards)
    for name in sorted(names):
        path = os.path.join(checkpoint, name)
        if not os.path.isfile(path):
            continue
        if name.endswith(".safetensors"):
            problem = _check_safetensors(path)
        elif name.endswith((".pt", ".pth", ".bin")):
            problem = _check_torch_file(path)
        elif name.endswith(".json"):
            problem = _check_json(path)
        else:
            continue
        if problem:
            return f"{name} {problem}"
    return None


def newest_intact(checkpoints: list[tuple[int, str]], skip: str) -> str | None:
    """The newest of `checkpoints` ((step, path), oldest first) other than `skip` whose files are whole."""
    for _, path in reversed(checkpoints):
        if os.path.abspath(path) != os.path.abspath(skip) and checkpoint_problem(path) is None:
            return path
    return None


def check_checkpoint(checkpoint: str, others: list[tuple[int, str]]) -> None:
    """Raise `CheckpointFileError` naming the first bad file of `checkpoint` and the newest intact one of `others`
    (the checkpoints beside it) to resume from instead."""
    problem = checkpoint_problem(checkpoint)
    if problem is not None:
        intact = newest_intact(others, skip=checkpoint)
        fix = (
            f"The newest intact checkpoint is {intact}: resume from it (resume_from_checkpoint={intact!r}), or "
            f"delete {checkpoint} and resume with resume_from_checkpoint=True."
            if intact
            else "No other checkpoint beside it is intact: start a new run in a new output_dir."
        )
        raise CheckpointFileError(f"Cannot resume from {checkpoint}: {problem}. {fix}")


def warn_without_rng_state(checkpoint: str) -> None:
    """Warn when `checkpoint` has no RNG state: the resume will not be exact."""
    if not any(name.startswith("rng_state") for name in os.listdir(checkpoint)):
        warnings.warn(
            f"{checkpoint} has no rng_state.pth (the random state of sampling and dropout): the resumed run draws "
            "other random numbers and will not match a run that was never stopped.",
            stacklevel=3,
        )


def run_settings(args) -> dict:
    """The values of the settings in `OVERRIDDEN` (saved in each checkpoint as `RUN_SETTINGS_FILE`)."""
    return {name: getattr(args, name, None) for name in OVERRIDDEN}


def changed_settings(checkpoint: str, args) -> str | None:
    """A warning listing the settings in `OVERRIDDEN` that `args` changes from `checkpoint`'s, old and new values and
    what the resumed run does about each; None when none changed (or the checkpoint did not record them)."""
    path = os.path.join(checkpoint, RUN_SETTINGS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        saved = json.load(f)
    now = json.loads(json.dumps(run_settings(args), default=str))  # as saved: enums as their strings
    changed = [name for name in OVERRIDDEN if name in saved and saved[name] != now[name]]
    if not changed:
        return None
    listed = "; ".join(f"{name}={saved[name]!r} (now {now[name]!r}): {OVERRIDDEN[name]}" for name in changed)
    return f"Resuming from {checkpoint} with changed settings: {listed}. Start a new run to apply them from step 0."
