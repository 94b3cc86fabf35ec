"""Where one training micro-step reads device values back to the host: the operations that, on a GPU, make the CPU
wait for the device inside `compute_loss` and its backward pass.

    python benchmarks/host_syncs.py                               # the default settings and a few variants
    python benchmarks/host_syncs.py --set beta=0.04 --set loss_type=grpo

It runs on the tiny test model (CPU is enough: it counts operations, it does not time them). A tensor's value is
needed on the host by `.item()`, `float(t)`, `int(t)`, `bool(t)` and `.tolist()` (all `aten._local_scalar_dense` at
dispatch), and by the operations whose output shape depends on the data (`nonzero`, `masked_select`, indexing with
a boolean mask). On a GPU each of them waits for every kernel queued before it, so the CPU cannot run ahead and
queue the backward pass while the forward still runs. A `TorchDispatchMode` sees every operation of one
`compute_loss` and its backward in a real `train()` of one step (scripted completions, so no generation), from a
subclass that overrides Trainer's `training_step` and `compute_loss`, and prints, per setting, the count of each
kind and the line of `grpo/` that asked for it.

What it measures is the number of such points, not their cost: that needs a GPU (scenario gpu-0.5b of
benchmarks/compare_trl.py, before and after a change).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import tempfile
import traceback

import torch
from datasets import Dataset
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PrinterCallback

from grpo import GRPOConfig, GRPOTrainer
from grpo.testing import tiny_model, tiny_tokenizer

SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"}
VARIANTS = {
    "default (dapo, beta 0)": {},
    "beta 0.04 (reference log-probs)": {"beta": 0.04},
    "grpo loss": {"loss_type": "grpo"},
    "2 iterations (old log-probs, clipping)": {"num_iterations": 2},
    "top_entropy_quantile 0.2": {"top_entropy_quantile": 0.2},
}
SETTINGS = dict(
    report_to="none",
    max_completion_length=8,
    num_generations=4,
    per_device_train_batch_size=4,
    max_steps=1,
    save_strategy="no",
    disable_tqdm=True,
)


def _boolean_index(args) -> bool:
    """Whether an `aten.index*` call indexes with a boolean mask (its result's shape depends on the data)."""
    for arg in args:
        if isinstance(arg, (list, tuple)):
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in arg):
                return True
    return False


class HostReads(TorchDispatchMode):
    """Counts the dispatched operations that need a device value on the host, by kind and by grpo/ source line."""

    def __init__(self):
        super().__init__()
        self.kinds = collections.Counter()
        self.lines = collections.Counter()
        self.backward = False  # set once compute_loss has returned: what follows is its backward

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in SYNCING or (name.startswith("aten.index") and _boolean_index(args)):
            kind = "boolean index" if name.startswith("aten.index") else name.split(".")[1]
            self.kinds[kind] += 1
            ours = [frame for frame in traceback.extract_stack() if "/grpo/" in frame.filename]
            where = (
                f"grpo/{ours[-1].filename.split('/grpo/')[-1]}:{ours[-1].lineno} ({ours[-1].name})"
                if ours and not self.backward
                else "autograd (backward)"
            )
            self.lines[where, kind] += 1
        return func(*args, **(kwargs or {}))


class _Scripted:
    """Completions that depend only on the prompt: ragged, some ending in EOS, one per group truncated."""

    def __init__(self, num_generations: int, length: int, eos: int):
        self.num_generations, self.length, self.eos = num_generations, length, eos

    def sync_weights(self, model, version):
        pass

    def generate(self, model, prompt_ids):
        from grpo.generation import Completions

        out = []
        for i, prompt in enumerate(prompt_ids):
            k = i % self.num_generations
            tokens = [(sum(prompt) + 31 * k + 7 * j) % 200 + 32 for j in range(self.length)]
            out.append(tokens if k == self.num_generations - 1 else tokens[: 1 + k] + [self.eos])
        return Completions(out)


class _Counted(GRPOTrainer):
    """GRPOTrainer counting host reads from the start of its first `compute_loss` to the end of that micro-step's
    `training_step`, which runs the backward: Trainer's public hooks, overridden as Trainer invites. The generation
    round that `training_step` runs first (with the scripted sampler: no generation) is not counted."""

    def training_step(self, *args, **kwargs):
        try:
            return super().training_step(*args, **kwargs)
        finally:
            self.counting.close()  # leaves the mode after the backward

    def compute_loss(self, model, inputs, *args, **kwargs):
        if self.reads is not None:
            return super().compute_loss(model, inputs, *args, **kwargs)
        self.reads = self.counting.enter_context(HostReads())
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        self.reads.backward = True
        return loss


def count(settings: dict) -> HostReads:
    """The host reads of the first micro-step's `compute_loss` and backward, in a real `train()` of one step."""
    tokenizer = tiny_tokenizer()
    data = Dataset.from_dict({"prompt": ["hello there", "count to three", "abc", "xyz"] * 4})
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), **{**SETTINGS, **settings})
    trainer = _Counted(
        tiny_model(tokenizer),
        lambda completions, **_: [float(len(c)) for c in completions],
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
    )
    trainer.generation = _Scripted(args.num_generations, args.max_completion_length, tokenizer.eos_token_id)
    trainer.reads, trainer.counting = None, contextlib.ExitStack()
    trainer.remove_callback(PrinterCallback)  # the step's metrics are not this benchmark's output
    trainer.train()
    return trainer.reads


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="a GRPOConfig field")
    cli = parser.parse_args()
    variants = VARIANTS
    if cli.set:
        settings = {key: _value(value) for key, value in (item.split("=", 1) for item in cli.set)}
        variants = {", ".join(cli.set): settings}
    for label, settings in variants.items():
        mode = count(settings)
        total = sum(mode.kinds.values())
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(mode.kinds.items()))
        print(f"{label}: {total} host reads in compute_loss + backward ({kinds})")
        for (where, kind), n in mode.lines.most_common():
            print(f"  {n:3d}  {where}  [{kind}]")


if __name__ == "__main__":
    main()
