"""`log_completions_hub_repo`: the completions log (output_dir/completions.jsonl) pushed to a Hugging Face Hub data
set repository at every logged step, as TRL 1.16 pushes its completion tables; with `log_multimodal`, the prompt
images the log refers to go with it, each file once.

`CompletionsHub` checks, when the trainer is built, that a token is set and that the Hub answers, by creating the
repository (or finding it): a run that would log nowhere fails before any weight loads, in one line. Each push
uploads the whole file in the background (`huggingface_hub`'s `run_as_future`), so training does not wait on the
network; a push that failed is reported by one warning at the next push or at the end of training, and the run goes
on. `create_repository` and `upload` are the two calls to the Hub, module functions so that tests replace them.
"""

from __future__ import annotations

import os
import warnings
from concurrent.futures import Future

from grpo.data import InputError
from grpo.training.logged_images import IMAGE_DIR

FILE_IN_REPO = "completions.jsonl"


def create_repository(repo_id: str, token: str, private: bool | None) -> str:
    """Create the data set repository `repo_id` (or find it); returns its URL. Raises what `huggingface_hub` raises
    when the Hub cannot be reached or refuses."""
    from huggingface_hub import create_repo

    return str(create_repo(repo_id, token=token, private=private, repo_type="dataset", exist_ok=True))


def upload(repo_id: str, token: str, files: dict[str, str], step: int) -> Future:
    """Upload `files` (path in the repository -> local path) to `repo_id` in one commit, in the background."""
    from huggingface_hub import CommitOperationAdd, HfApi

    return HfApi(token=token).create_commit(
        repo_id=repo_id,
        operations=[CommitOperationAdd(path_in_repo=name, path_or_fileobj=local) for name, local in files.items()],
        repo_type="dataset",
        commit_message=f"completions up to step {step}",
        run_as_future=True,
    )


def hub_token(explicit: str | None) -> str | None:
    """The token to push with: `hub_token` when given, else the one `huggingface_hub` finds (HF_TOKEN, then the
    token file `hf auth login` writes)."""
    if explicit:
        return explicit
    from huggingface_hub import get_token

    return get_token()


def for_run(args) -> CompletionsHub | None:
    """The run's `CompletionsHub` (None without `log_completions_hub_repo`): the token is checked on every process
    (one that lacks it fails), the repository created on the main process, which alone pushes."""
    if args.log_completions_hub_repo is None:
        return None
    token = hub_token(args.hub_token)
    if args.process_index != 0 and token:
        return None
    return CompletionsHub(args.log_completions_hub_repo, token, args.hub_private_repo)


class CompletionsHub:
    """Pushes the completions log to `repo_id`; built once per run, on the main process."""

    def __init__(self, repo_id: str, token: str | None, private: bool | None):
        if not token:
            raise InputError(
                f"log_completions_hub_repo={repo_id!r}, but no Hugging Face token is set: log in with `hf auth login`, "
                "set HF_TOKEN (or hub_token), or remove log_completions_hub_repo."
            )
        try:
            self.url = create_repository(repo_id, token, private)
        except Exception as e:  # no network, offline mode, a bad token, no right to the namespace: all one line
            reason = (str(e).strip().splitlines() or [""])[0]
            raise InputError(
                f"log_completions_hub_repo={repo_id!r}: the Hub could not create or find the repository "
                f"({type(e).__name__}: {reason}). Check the network and the token's write access, or remove "
                "log_completions_hub_repo."
            ) from None
        self.repo_id, self.token = repo_id, token
        self.pending: Future | None = None
        self.images_sent: set[str] = set()  # logged image files already in the repository
        self.sending: list[str] = []  # those of the pending push

    def push(self, path: str, step: int) -> None:
        """Push the log as it is after `step` (the previous push is checked first), with the logged images
        (`log_multimodal`, in `IMAGE_DIR` beside the log) that no earlier push sent."""
        self.wait()
        files = {FILE_IN_REPO: path}
        folder = os.path.join(os.path.dirname(path), IMAGE_DIR)
        if os.path.isdir(folder):
            new = sorted(name for name in os.listdir(folder) if name.endswith(".png") and name not in self.images_sent)
            files.update({f"{IMAGE_DIR}/{name}": os.path.join(folder, name) for name in new})
            self.sending = new
        self.pending = upload(self.repo_id, self.token, files, step)

    def wait(self) -> None:
        """Wait for the last push; warn in one line if it failed."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        sending, self.sending = self.sending, []
        try:
            pending.result()
            self.images_sent.update(sending)
        except Exception as e:
            reason = (str(e).strip().splitlines() or [""])[0]
            warnings.warn(
                f"Pushing the completions log to {self.repo_id!r} failed ({type(e).__name__}: {reason}); training "
                "goes on, and the next logged step pushes the whole file again.",
                stacklevel=2,
            )
