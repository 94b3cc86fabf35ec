"""One run per output directory, and a final model that is written whole or not at all.

Two runs started into one `output_dir` would interleave their checkpoints, and each would delete the other's staged
ones. `RunLock` makes the second one stop at once: the first holds `OUTPUT_DIR/.grpo-run.lock` (its host and pid)
while it trains. A lock whose process is gone (killed, or the machine rebooted) is taken over with a warning; the pid
is checked only on the same host, so a lock from another machine sharing the file system is never taken.

`save_final_model` writes the model the way checkpoints are written (grpo/training/checkpoints.py): into a staging
folder, every file fsynced, then each file renamed into place, the weights before `config.json`. A disk that fills
leaves `output_dir` as it was (never a `config.json` without weights), and the trained weights are still in memory to
save again.

`own_output_dir` makes `output_dir` absolute once, when the trainer is built (`resolve_run_paths`): checkpoints, the final model, the
run lock, the completions and rollout logs and TensorBoard's folder are all under it, so a reward function that
calls `os.chdir` cannot move them. `check_outside_model` refuses an `output_dir` that is the folder of the model to
train, or inside it, before any weight loads.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import warnings

from grpo.data import InputError

LOCK_FILE = ".grpo-run.lock"
FINAL_STAGING = "tmp-final-model"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    return True


def resolve_run_paths(args) -> None:
    """Make every path the run writes to absolute, once (in place on `args`): `output_dir`, under which Trainer puts
    the checkpoints, the final model, the run lock, `completions.jsonl`, `rollouts.jsonl` and TensorBoard's folder,
    and `logging_dir` where this version of TrainingArguments still has it. A relative path would otherwise be
    looked up afresh at each save, in whatever folder the process is in then."""
    for name in ("output_dir", "logging_dir"):
        value = getattr(args, name, None)
        if value:
            setattr(args, name, os.path.abspath(os.path.expanduser(os.fspath(value))))


def model_folder(model) -> str | None:
    """The local folder `model` (a path, hub id or loaded model) was loaded from; None for a hub id or an object
    made in memory."""
    path = (
        model
        if isinstance(model, (str, os.PathLike))
        else getattr(getattr(model, "config", None), "_name_or_path", "")
    )
    if not path or not os.path.isdir(os.path.expanduser(os.fspath(path))):
        return None
    return os.path.realpath(os.path.expanduser(os.fspath(path)))


def check_outside_model(output_dir: str, model) -> None:
    """Refuse an `output_dir` that is the local folder of the model to train, or a folder inside it: the final model
    would be written over the base weights (or checkpoints would fill the model's folder)."""
    folder = model_folder(model)
    if folder is None:
        return
    out = os.path.realpath(os.path.expanduser(os.fspath(output_dir)))
    if out != folder and not out.startswith(folder.rstrip(os.sep) + os.sep):
        return
    where = "is the folder" if out == folder else "is inside the folder"
    suggestion = os.path.join(os.path.dirname(folder), f"{os.path.basename(folder)}-GRPO")
    raise InputError(
        f"output_dir {output_dir!r} {where} of the model being trained ({folder}): the run would write its "
        f"checkpoints and final model over the base model's files. Use an output_dir outside it, e.g. "
        f"{suggestion!r}."
    )


def own_output_dir(args, model) -> None:
    """What `GRPOTrainer` does with `output_dir` first, before any weight loads: `resolve_run_paths`, then
    `check_outside_model`."""
    resolve_run_paths(args)
    check_outside_model(args.output_dir, model)


class RunLock:
    """Holds `output_dir/LOCK_FILE` while a run trains (`acquire`, `release`); refuses one held by a live run."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, LOCK_FILE)
        self.held = False

    def acquire(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        for _ in range(2):  # a second try after a stale lock was removed
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._take_over_if_stale(record["host"])
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            self.held = True
            return
        raise InputError(f"Could not take the lock {self.path}: another run took it first. Use another output_dir.")

    def _take_over_if_stale(self, host: str) -> None:
        """Remove the lock of a process that is gone; raise when its run may still be going."""
        try:
            with open(self.path) as f:
                owner = json.load(f)
        except (OSError, ValueError):
            owner = {}  # being written this instant, or garbage: treated as held
        pid, where = owner.get("pid"), owner.get("host")
        if isinstance(pid, int) and where == host and pid != os.getpid() and not _alive(pid):
            warnings.warn(
                f"Taking over {self.path}: the run that held it (pid {pid}) is no longer running.", stacklevel=3
            )
            stale = self.path + f".stale-{os.getpid()}"
            try:
                os.replace(self.path, stale)  # of two processes taking over at once, one renames; both retry
                os.remove(stale)
            except FileNotFoundError:
                pass
            return
        since = f", started {owner['started']}" if "started" in owner else ""
        raise InputError(
            f"output_dir {os.path.dirname(self.path)!r} is in use by another run (pid {pid} on {where}{since}). Wait "
            f"for it to finish or use another output_dir; if that run is gone, delete {self.path}."
        )

    def release(self) -> None:
        if self.held:
            self.held = False
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def fsync(path: str, directory: bool = False) -> None:
    """Flush a file's (or, with `directory`, a folder's entries') writes to disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rename_order(name: str) -> tuple[int, str]:
    """Weights first, `config.json` last: at no moment does a `config.json` stand beside missing weights."""
    if name == "config.json":
        return 2, name
    weights = ".safetensors" in name or (name.endswith(".bin") and name != "training_args.bin")
    return (0 if weights else 1), name


def publish_files(staged: str, output_dir: str) -> None:
    """fsync every file of `staged`, rename each into `output_dir` (weights first, `config.json` last, replacing
    older files of the same name), fsync `output_dir` and remove `staged`."""
    for root, _, files in os.walk(staged):
        for name in files:
            fsync(os.path.join(root, name))
        fsync(root, directory=True)
    for name in sorted(os.listdir(staged), key=_rename_order):
        target = os.path.join(output_dir, name)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        os.replace(os.path.join(staged, name), target)
    fsync(output_dir, directory=True)
    os.rmdir(staged)


def final_save_message(output_dir: str, cause: str, newest: str | None, remedy: str = "free space") -> str:
    """The message of a final save that failed: nothing written, the weights still in memory, how to retry (after
    `remedy`, what the cause calls for)."""
    later = (
        f"the newest checkpoint, {newest}, can be resumed (--resume_from_checkpoint true), which saves its model"
        if newest
        else "no checkpoint was kept (save_strategy), so the trained weights are lost when the process ends"
    )
    return (
        f"Saving the trained model to {output_dir} failed: {cause}. Nothing was written there (its earlier files are "
        f"unchanged). The trained weights are still in memory: {remedy}, then call trainer.save_model("
        f"{output_dir!r}) again, or save to another disk. If the process ends instead, {later}."
    )
