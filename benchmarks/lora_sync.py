"""A LoRA policy's weight sync to `grpo vllm-serve --enable-lora`: the adapter alone against merged weights.

    .venv-vllm/bin/python benchmarks/lora_sync.py --repeats 5
    .venv-vllm/bin/python benchmarks/lora_sync.py --generation --plot lora-sync.png   # also a bar chart
    .venv-vllm/bin/python benchmarks/lora_sync.py --replot run.json --plot lora-sync.png   # a saved run (--json)

SmolLM2-135M-Instruct (float32, CPU) with a LoRA of rank 16 on the attention projections (q, k, v, o), its B
matrices random so that the adapter changes the outputs. One server, started with --enable-lora, takes both kinds of
sync in this one run: first `--repeats` adapter syncs (the tensors PEFT saves, plus the adapter's config; the
server writes them as an adapter directory and loads it under a new LoRA id), then `--repeats` merged syncs (every
weight, W + (alpha / r) B A, which the engine reloads in place). A sync's time is the trainer's wall time from the
start of sending to the server's answer that the engine holds the new weights. Check: after the adapter syncs and
after the merged ones the server's greedy completion of one prompt is the same. With `--generation`, also the time
of one generation (4 prompts x n=4 x 32 tokens, forced) with the adapter applied, then with the merged weights and
no adapter, on the same server. The server's log goes to `--log`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import torch
from transformers import AutoModelForCausalLM

from grpo.generation.policy_weights import adapter_tensors, checkpoint_tensors
from grpo.generation.vllm import lora_sync
from grpo.generation.vllm.client import VLLMClient
from grpo.models import smollm2_path

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lora_policy(path):
    import peft

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = peft.LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_dropout=0.0
    )
    model = peft.get_peft_model(model, config)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return model


def _greedy(client) -> list[int]:
    return client.generate([PROMPT], n=1, max_tokens=24, temperature=0.0, logprobs=False)["completion_ids"][0]


def _generation_seconds(client, repeats: int) -> float:
    def once():
        start = time.perf_counter()
        client.generate([PROMPT] * 4, n=4, max_tokens=32, min_tokens=32, temperature=1.0, seed=0, logprobs=True)
        return time.perf_counter() - start

    once()  # warm-up
    return statistics.median(once() for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--generation", action="store_true", help="also time generation with and without adapter")
    parser.add_argument("--log", default="lora_sync_server.log", help="the server's log")
    parser.add_argument("--plot", metavar="PNG", help="also draw the measured sizes and times as a chart")
    parser.add_argument("--json", metavar="FILE", help="also write the charted numbers to FILE")
    parser.add_argument("--replot", metavar="FILE", help="measure nothing: --plot the numbers in FILE")
    cli = parser.parse_args()
    if cli.replot:
        with open(cli.replot) as f:
            run = json.load(f)
        plot(run["sizes"], run["generation"], f"medians of {run['repeats']}, {run['date']}", cli.plot)
        return
    bucket = int(cli.bucket_mb * 2**20)

    path = smollm2_path()
    policy = _lora_policy(path)
    config = lora_sync.adapter_config(policy.peft_config["default"])
    port = _free_port()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    command = [sys.executable, "-m", "grpo", "vllm-serve", "--model", str(path), "--port", str(port)]
    command += ["--dtype", "float32", "--enforce-eager", "--max-model-len", "512", "--enable-lora"]
    log = open(cli.log, "w")
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    generation = {}
    try:
        client = VLLMClient(port=port, timeout=300, group_port=_free_port())
        client.wait_until_ready()
        syncs = {"adapter": [], "merged": []}
        for version in range(cli.repeats + 1):  # the first of each kind opens the group or warms up: not counted
            syncs["adapter"].append(client.update_weights(adapter_tensors(policy), version, bucket, config))
        adapter_greedy = _greedy(client)
        if cli.generation:
            generation["adapter"] = _generation_seconds(client, cli.repeats)
        for version in range(100, 100 + cli.repeats + 1):
            syncs["merged"].append(client.update_weights(checkpoint_tensors(policy), version, bucket))
        merged_greedy = _greedy(client)
        if cli.generation:
            generation["merged"] = _generation_seconds(client, cli.repeats)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)

    def median(kind, key):
        return statistics.median(sync[key] for sync in syncs[kind][1:])

    print(f"SmolLM2-135M-Instruct, float32, LoRA r=16 on q/k/v/o_proj; medians of {cli.repeats} syncs each")
    print(f"{'':>24} {'adapter':>12} {'merged':>12} {'adapter/merged':>15}")
    for key, unit, scale in (("tensors", "", 1), ("bytes", " MB", 1e6), ("seconds", " s", 1)):
        a, m = median("adapter", key) / scale, median("merged", key) / scale
        print(f"{'sync ' + key + unit:>24} {a:>12.3f} {m:>12.3f} {a / m:>15.4f}")
    if generation:
        a, m = generation["adapter"], generation["merged"]
        print(f"{'generate 4x4x32 tok, s':>24} {a:>12.3f} {m:>12.3f} {a / m:>15.4f}")
    print(f"greedy completion equal after both syncs: {adapter_greedy == merged_greedy}")
    sizes = {kind: (median(kind, "bytes") / 1e6, median(kind, "seconds")) for kind in syncs}
    run = {"sizes": sizes, "generation": generation, "repeats": cli.repeats, "date": time.strftime("%Y-%m-%d")}
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(run, f, indent=1)
    if cli.plot:
        plot(sizes, generation, f"medians of {cli.repeats}, {run['date']}", cli.plot)
        print(f"chart written to {cli.plot}")


def plot(sizes: dict[str, tuple[float, float]], generation: dict[str, float], when: str, path: str) -> None:
    """Bar charts side by side, adapter against merged: MB per sync, seconds per sync and, when measured, seconds
    per generation (the other side of the trade), each adapter bar labelled with its share of the merged one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--plot needs matplotlib in this environment (make install-vllm installs it).") from e
    panels = [
        ("MB per sync", {kind: mb for kind, (mb, _) in sizes.items()}, "{:.2f} MB"),
        ("seconds per sync", {kind: s for kind, (_, s) in sizes.items()}, "{:.3f} s"),
    ]
    if generation:
        panels.append(("seconds per generation\n(4 prompts x n=4 x 32 tokens)", generation, "{:.2f} s"))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.4 * len(panels), 3.8))
    colors = {"adapter": "#3b6ea8", "merged": "#b0b0b0"}
    for ax, (label, values, fmt) in zip(axes, panels):
        kinds = ["merged", "adapter"]
        ax.bar(range(2), [values[k] for k in kinds], 0.6, color=[colors[k] for k in kinds])
        for i, kind in enumerate(kinds):
            text = fmt.format(values[kind])
            if kind == "adapter":
                text += f"\n(x{values['adapter'] / values['merged']:.3g})"
            ax.annotate(text, (i, values[kind]), ha="center", va="bottom", fontsize=9)
        ax.set_xticks(range(2), ["merged sync", "adapter sync"])
        ax.set_ylim(0, max(values.values()) * 1.3)
        ax.set_ylabel(label)
    fig.suptitle(f"SmolLM2-135M-Instruct, float32, CPU, LoRA r=16 on q/k/v/o; {when}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
