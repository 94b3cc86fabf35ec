"""Peak memory of one GRPO training step against completion length: this trainer against TRL's `GRPOTrainer`, side
by side, in one invocation, each cell a fresh process.

    .venv-trl/bin/python benchmarks/long_sequences.py                      # the CPU table of docs/performance.md
    .venv-trl/bin/python benchmarks/long_sequences.py --lengths 1024 2048 --kinds ours-plain ours   # ours only
    python benchmarks/long_sequences.py --device cuda --model random-qwen2.5-1.5b --budget-gib 80 \
        --lengths 4096 8192 16384 32768 65536                                # on one GPU (docs/long-sequences.md)

It installs nothing: TRL's cells need `.venv-trl` (`make install-trl`); without TRL they are reported as missing and
ours still run. Every cell trains `--steps` optimizer steps (default 1: forward, backward and the AdamW step, whose
state is created there) on G = 2 completions of exactly L tokens of one short prompt, both trainers given the same
model, tokenizer, completions and reward. The completions come from a `rollout_func` (public in both trainers:
fixed random token ids, no EOS), so no time goes to decoding and both train on the same tokens. Both run at their
best documented memory settings: `gradient_checkpointing=True`, beta 0 (no reference model), one micro-batch; TRL's
Liger loss (`use_liger_kernel`) where its package is installed (GPU only: it needs Triton). Kinds:

- `trl`: TRL 1.16's GRPOTrainer with the settings above;
- `ours-plain`: this trainer with the settings above and its defaults;
- `ours`: the same with the long-sequence options of docs/long-sequences.md (`LONG`, GRPOConfig fields a user sets).

Reported per cell: the peak (the child's peak resident set size from `os.wait4` on CPU, `torch.cuda.max_memory_allocated`
on CUDA) and the median step time. A cell is `over` when it passes the budget (`--budget-gib`, default 20 GiB):
on CPU the parent stops a child whose resident set passes it, on CUDA the child's allocator is capped to it; a cell
the kernel's out-of-memory killer ends is `killed`. Once a kind is over budget, its longer lengths are not run. Then,
per kind: bytes per completion token (the slope of the peak between its two longest lengths that fit) and the
longest length that fits the budget, measured, and projected from that slope (a straight line: attention that grows
faster than the sequence would make the projection optimistic; the measured figure is the one to trust).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
G, PROMPT = 2, "Write a long story about a river."
# The long-sequence options measured as `ours`: GRPOConfig fields, as a recipe or a script would set them.
LONG: dict = {"tiled_mlp_tokens": 1024}
KINDS = ["trl", "ours-plain", "ours"]


def build_model(name: str, dtype):
    """(model or folder, tokenizer, [low, high) of the forced completion ids). `smollm2` is SmolLM2-135M-Instruct,
    offline (`grpo.models.smollm2_path`); the `random-*` models have that shape or Qwen2.5-1.5B's, with random weights
    built in code (no download) and grpo's byte-level test tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from grpo.testing import tiny_tokenizer

    if name == "smollm2":
        from grpo.models import smollm2_path

        folder = str(smollm2_path())
        return folder, AutoTokenizer.from_pretrained(folder), (1000, 49152)
    tokenizer = tiny_tokenizer()
    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    if name == "random-smollm2":
        config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=131072,
                             rope_theta=100000.0, tie_word_embeddings=True, **special)  # fmt: skip
        model = LlamaForCausalLM(config)
    else:  # random-qwen2.5-1.5b: Qwen2.5-1.5B's config.json
        config = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                             num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=131072,
                             rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, **special)  # fmt: skip
        model = Qwen2ForCausalLM(config)
    return model.to(dtype), tokenizer, (32, 250)  # the byte tokenizer's ordinary bytes, below its special tokens


def child(settings: dict) -> dict:
    """Train one cell in this process; returns its step times and (on CUDA) peak allocated bytes."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    cuda = settings["device"] == "cuda"
    if cuda:  # the budget as a cap on this process's allocator: past it, an out-of-memory error, not a slow spill
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, settings["budget"] / total))
    model, tokenizer, (low, high) = build_model(settings["model"], torch.bfloat16 if cuda else torch.float32)
    length, times = settings["length"], []
    forced = torch.randint(low, high, (G, length), generator=torch.Generator().manual_seed(0)).tolist()
    prompt_ids = tokenizer(PROMPT)["input_ids"]

    def rollout(prompts, trainer):
        rows = [forced[i % G] for i in range(len(prompts))]
        logprobs = [[0.0] * length for _ in prompts] if settings["kind"] == "trl" else None
        return {"prompt_ids": [list(prompt_ids) for _ in prompts], "completion_ids": rows, "logprobs": logprobs}

    def alternating(completions, **kwargs):
        return [float(i % 2) for i in range(len(completions))]  # a spread in every group: a non-zero gradient

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.start)
            print(f"step {len(times)}: {times[-1]:.1f} s", file=sys.stderr, flush=True)

    common = dict(
        report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=not cuda, bf16=cuda, logging_steps=1,
        max_steps=settings["steps"], per_device_train_batch_size=G, num_generations=G, learning_rate=1e-6,
        beta=0.0, max_completion_length=length, gradient_checkpointing=True,
    )  # fmt: skip
    dataset = Dataset.from_dict({"prompt": [PROMPT] * 16})
    with tempfile.TemporaryDirectory() as output_dir:
        if settings["kind"] == "trl":
            import importlib.util

            from trl import GRPOConfig, GRPOTrainer

            liger = cuda and importlib.util.find_spec("liger_kernel") is not None
            args = GRPOConfig(output_dir=output_dir, use_liger_kernel=liger, **common)
        else:
            from grpo import GRPOConfig, GRPOTrainer

            args = GRPOConfig(output_dir=output_dir, **common, **(LONG if settings["kind"] == "ours" else {}))
        trainer = GRPOTrainer(
            model, alternating, args=args, train_dataset=dataset, processing_class=tokenizer, rollout_func=rollout
        )
        trainer.add_callback(Timer())
        try:
            trainer.train()
        except torch.OutOfMemoryError:
            return {"over": True}
    result = {"step_seconds": statistics.median(times[1:] or times)}
    if cuda:
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
    return result


def run_child(settings: dict, log: Path) -> dict:
    """One cell in a fresh process. On CPU the parent watches the child's resident set and stops it past the budget
    (`over`); its peak is the child's own (`os.wait4`)."""
    if settings["kind"] == "trl" and not settings["trl"]:
        return {"missing": "trl is not installed here (make install-trl; run in .venv-trl)"}
    command = [sys.executable, __file__, "--child", json.dumps(settings)]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env["TRL_EXPERIMENTAL_SILENCE"] = "1"  # TRL's warning that rollout_func is experimental
    # glibc's malloc raises its mmap threshold each time a large block is freed, after which freed tensors stay in
    # its heaps and the resident set keeps memory no tensor holds. A fixed threshold returns every block of 256 KiB
    # or more at once, so the peak resident set follows the live tensors. Both trainers' cells run so.
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(256 * 1024))
    over = False
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        # wait4 (not Popen.poll, which would reap the child first): the child's own peak resident set size.
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if settings["device"] == "cpu" and not over and _resident_bytes(process.pid) > settings["budget"]:
                over = True
                process.kill()
            time.sleep(0.2)
    if over:
        return {"over": True}
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
        return {"killed": True}  # the kernel's out-of-memory killer
    if status != 0:
        raise RuntimeError(f"{settings} failed:\n{log.read_text()[-3000:]}")
    result = json.loads(process.stdout.read().strip().splitlines()[-1])  # one short line: the pipe cannot fill
    if settings["device"] == "cpu":
        result["peak_bytes"] = usage.ru_maxrss * 1024  # kilobytes on Linux
    return result


def _resident_bytes(pid: int) -> int:
    """The process's resident set now (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def summary(cells: list[dict], budget: float) -> dict:
    """Per kind: bytes per completion token between its two longest lengths that fit, and the longest length that
    fits, measured and projected on that slope."""
    fits = sorted((c["length"], c["peak_bytes"]) for c in cells if "peak_bytes" in c)
    if not fits:
        return {"slope": None, "longest": None, "projected": None}
    longest = fits[-1][0]
    if len(fits) < 2:
        return {"slope": None, "longest": longest, "projected": None}
    (l1, p1), (l2, p2) = fits[-2:]
    slope = (p2 - p1) / (l2 - l1)
    projected = int(l2 + (budget - p2) / slope) if slope > 0 else None
    return {"slope": slope, "longest": longest, "projected": projected}


def report(settings: dict, cells: dict[str, list[dict]]) -> str:
    lengths = sorted({c["length"] for kind_cells in cells.values() for c in kind_cells})
    gib = 2**30
    lines = [
        f"{settings['model']}, {settings['device']}, G = {G} completions of L tokens, one prompt of a few tokens, "
        f"gradient checkpointing, beta 0, AdamW, {settings['steps']} step(s); budget {settings['budget'] / gib:.0f} GiB",
        f"{'kind':11} " + " ".join(f"{f'L={n}':>17}" for n in lengths) + f" | {'KiB/token':>9} {'longest':>8} {'projected':>9}",
    ]  # fmt: skip
    for kind, kind_cells in cells.items():
        by_length = {c["length"]: c for c in kind_cells}
        row = [f"{kind:11}"]
        for n in lengths:
            c = by_length.get(n, {"skipped": True})
            if "peak_bytes" in c:
                row.append(f"{c['peak_bytes'] / gib:7.2f} GiB {c['step_seconds']:5.0f} s")
            else:
                row.append(f"{next(k for k in ('over', 'killed', 'missing', 'skipped') if k in c):>17}")
        s = summary(kind_cells, settings["budget"])
        slope = f"{s['slope'] / 1024:9.1f}" if s["slope"] else f"{'-':>9}"
        row.append(f"| {slope} {s['longest'] or '-':>8} {s['projected'] or '-':>9}")
        lines.append(" ".join(row))
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=KINDS)
    parser.add_argument("--model", choices=["smollm2", "random-smollm2", "random-qwen2.5-1.5b"], default="smollm2")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--budget-gib", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps per cell (time: median after the first)")
    parser.add_argument("--json", metavar="FILE", help="also write the cells to FILE")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    cli = parser.parse_args()
    if cli.child:
        print(json.dumps(child(json.loads(cli.child))), flush=True)
        return
    import importlib.util

    settings = dict(model=cli.model, device=cli.device, steps=cli.steps, budget=cli.budget_gib * 2**30)
    settings["trl"] = importlib.util.find_spec("trl") is not None
    cells: dict[str, list[dict]] = {kind: [] for kind in cli.kinds}
    logs = Path(tempfile.mkdtemp(prefix="long_sequences_"))
    print(f"children's logs (a line per step): {logs}", flush=True)
    for length in sorted(cli.lengths):
        for kind in cli.kinds:
            if any(k in c for c in cells[kind] for k in ("over", "killed")):
                cells[kind].append({"length": length, "skipped": True})  # a shorter length was over budget
                continue
            cell = {**settings, "kind": kind, "length": length}
            result = run_child(cell, logs / f"{kind}-{length}.log")
            cells[kind].append({"length": length, **result})
            print(f"{kind} L={length}: {result}", flush=True)
    print(report(settings, cells))
    if cli.json:
        Path(cli.json).write_text(
            json.dumps({"date": time.strftime("%Y-%m-%d"), **settings, "cells": cells}, indent=1)
        )


if __name__ == "__main__":
    main()
