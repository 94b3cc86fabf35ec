"""What a checkpoint is checked for before a run resumes from it.

`Trainer` reads a checkpoint's files one by one as it resumes, and a truncated or garbage file then fails deep inside
safetensors, torch or json with a traceback that names no file. Here every file is read once first: `check_checkpoint`
names the first bad file, what is wrong with it, and the newest intact checkpoint beside it, in one line. The weights
are read tensor by tensor and must be finite (a NaN weight would otherwise fail only in sampling). Files written with
`torch.save` are zip archives whose directory sits at the end: opening the archive finds a truncated or garbage file
without reading the tensors, and its small records (the pickle, the version) are read and checked against their CRC.

The settings a restored state overrides are saved beside it (`RUN_SETTINGS_FILE`, JSON) and compared on resume:
`changed_settings` lists what differs, with what the resumed run will do about each. The tools a run offers are
recorded in the trainer's state (grpo/training/rounds.py); `changed_tools` is the warning of a resume with others.

Where a resume cannot be exact or cannot train, it says so: a checkpoint without optimizer state (`save_only_model`)
or random state warns (`inexact_resume_message`); a checkpoint already at the run's last step is a finished run,
which resuming leaves as it is, and one past it an error (`finished_run_message`); and a learning-rate schedule that
the new settings change (a longer `max_steps`, another scheduler type) is put at the restored step of the new
schedule, with a warning (`continue_schedule`).
"""

from __future__ import annotations

import json
import os
import zipfile

from grpo.data import InputError

RUN_SETTINGS_FILE = "run_settings.json"
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
# Settings a resumed run takes from the checkpoint's state instead of its arguments, and what that means for the run.
OVERRIDDEN = {
    "learning_rate": "the restored optimizer and scheduler keep the checkpoint's learning rate",
    "lr_scheduler_type": "the new schedule applies from the restored step (the next step trains at its rate there)",
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


def inexact_resume_message(checkpoint: str) -> str | None:
    """Why a resume from `checkpoint` cannot match a run never stopped: no optimizer state (`save_only_model=True`
    saves the weights alone), or no RNG state; None when both are there."""
    names = os.listdir(checkpoint)
    # DeepSpeed keeps the optimizer in global_stepN/, FSDP in optimizer_0/ or optimizer*.bin.
    optimizer = any(name.startswith(("optimizer", "global_step")) for name in names)
    if not optimizer:
        return (
            f"{checkpoint} holds no optimizer state (it was written with save_only_model=True, which saves the "
            "weights alone): the resumed run starts Adam's moments from zero and draws other random numbers, so it "
            "will not match a run that was never stopped (the learning rate does continue its schedule). Keep "
            "save_only_model=False for checkpoints that resume exactly."
        )
    if not any(name.startswith("rng_state") for name in names):
        return (
            f"{checkpoint} has no rng_state.pth (the random state of sampling and dropout): the resumed run draws "
            "other random numbers and will not match a run that was never stopped."
        )
    return None


def checkpoint_step(checkpoint: str) -> int:
    """The optimizer steps `checkpoint` was written after (its trainer_state.json's `global_step`)."""
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        return int(json.load(f).get("global_step", 0))


def finished_run_message(checkpoint: str, total_steps: int, args) -> str | None:
    """None when `checkpoint` is before the run's last step, `total_steps`. At it, the run is finished: the line
    that says resuming trains nothing. Past it (a smaller max_steps than the checkpoint's step), an `InputError`:
    Trainer would train one step anyway before it looks at max_steps."""
    step = checkpoint_step(checkpoint)
    if step < total_steps:
        return None
    end = f"max_steps={args.max_steps}" if args.max_steps > 0 else f"{total_steps} steps of num_train_epochs"
    if step > total_steps:
        raise InputError(
            f"Cannot resume from {checkpoint}: it is at step {step}, past this run's last step ({end}). Set "
            f"max_steps above {step} to train further, or resume from the checkpoint of an earlier step "
            "(resume_from_checkpoint='.../checkpoint-N')."
        )
    return (
        f"Nothing to train: {checkpoint} is at step {step}, the last step of this run ({end}), so the run is "
        "finished; its model and checkpoints are left as they are. Raise max_steps to train further."
    )


def continue_schedule(optimizer, scheduler, step: int) -> tuple[float, float] | None:
    """Put a `LambdaLR` `scheduler` (every schedule of transformers' `get_scheduler` but reduce_lr_on_plateau) at
    optimizer step `step` of the current run's schedule, and the optimizer's learning rates at that schedule's value
    there: lr = base_lr x lambda(step), where lambda is this run's (its max_steps, warmup and type) and base_lr the
    restored one. Without it, the first step after a resume trains at the learning rate the checkpoint's optimizer
    holds, which is the old schedule's (0 at the end of a linear decay), and a checkpoint without a scheduler state
    starts the schedule again from step 0. Returns (the restored rate, the rate now) of the first parameter group
    when they differ; None when they agree (a resume with unchanged settings: nothing is touched, so it stays exact)."""
    from torch.optim.lr_scheduler import LambdaLR

    scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper, if any
    if not isinstance(scheduler, LambdaLR):
        return None
    rates = [base * fn(step) for base, fn in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    restored = [group["lr"] for group in optimizer.param_groups]
    scheduler.last_epoch = step
    if restored == rates:
        return None
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    scheduler._last_lr = list(rates)  # what get_last_lr() (and Trainer's logged learning_rate) reads
    return float(restored[0]), float(rates[0])


def schedule_message(checkpoint: str, args, step: int, total_steps: int, rates: tuple[float, float]) -> str:
    """The warning of a schedule that `continue_schedule` moved: what the next step trains at, and why."""
    restored, now = rates
    path = os.path.join(checkpoint, "trainer_state.json")
    with open(path) as f:
        old_total = json.load(f).get("max_steps")
    before = f" (its run was {old_total} steps long)" if old_total and old_total != total_steps else ""
    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)  # an enum once TrainingArguments parsed it
    return (
        f"Resuming {checkpoint} at step {step}{before}: the learning rate follows this run's schedule "
        f"({kind}, {total_steps} steps) from step {step} on, as a run started with these settings "
        f"would, so step {step + 1} trains at {now:.4g} instead of the checkpoint's {restored:.4g}."
    )


def changed_tools(saved: dict[str, str] | None, now: dict[str, str]) -> str | None:
    """A warning naming the tools added, removed and described otherwise (another signature or docstring: another
    schema digest) since the checkpoint's run, whose tool set (`grpo.generation.tools.tool_set`) is `saved`; None
    when they are the same, or when the checkpoint did not record them."""
    if saved is None or saved == now:
        return None
    added, removed = sorted(set(now) - set(saved)), sorted(set(saved) - set(now))
    described = sorted(name for name in set(saved) & set(now) if saved[name] != now[name])
    listed = "; ".join(
        f"{what} {names}"
        for what, names in (("added", added), ("removed", removed), ("described otherwise", described))
        if names
    )
    return (
        f"Resuming with other tools than the checkpoint's run ({listed}): the policy was trained to call that run's "
        "tools, and a generation round in progress was sampled with them. Pass the same tools (and environment "
        "classes) to continue that run, or start a new run in a new output_dir to train with these from step 0."
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
