"""`grpo plot OUTPUT_DIR`: the training curves of a run as one PNG, from the log history `Trainer` saves in
`trainer_state.json` (at the end of `grpo train`, and in every checkpoint).

Panels: reward (total and per function), KL, mean completion length, clip ratio, each against the optimizer step.
A panel whose metric was never logged (KL with beta = 0, say) says so instead of staying blank.
"""

from __future__ import annotations

import json
import math
from pathlib import Path


def load_log_history(output_dir: str | Path) -> list[dict]:
    """The training log lines of a run: `output_dir/trainer_state.json`, else the newest checkpoint's."""
    output_dir = Path(output_dir)
    candidates = [output_dir / "trainer_state.json"]
    checkpoints = sorted(
        output_dir.glob("checkpoint-*"),
        key=lambda p: int(p.name.split("-")[-1]) if p.name.split("-")[-1].isdigit() else -1,
    )
    candidates += [c / "trainer_state.json" for c in reversed(checkpoints)]
    for path in candidates:
        if path.is_file():
            history = json.loads(path.read_text()).get("log_history", [])
            # Evaluation lines carry eval_* keys and the final summary carries train_runtime: keep training steps.
            return [
                h
                for h in history
                if "step" in h and not any(k.startswith("eval_") for k in h) and "train_runtime" not in h
            ]
    raise FileNotFoundError(
        f"No trainer_state.json in {output_dir} or its checkpoints. Point `grpo plot` at the output_dir of a run "
        "that finished (grpo train writes it) or saved a checkpoint."
    )


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(h["step"], h[key]) for h in history if key in h and h[key] is not None and not math.isnan(h[key])]
    return [p[0] for p in points], [p[1] for p in points]


def plot_run(output_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the PNG (default `output_dir/training.png`) and return its path."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("Plotting needs matplotlib: pip install 'grpo[plot]' (or pip install matplotlib).") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    history = load_log_history(output_dir)
    out = Path(out) if out is not None else Path(output_dir) / "training.png"
    reward_keys = sorted({k for h in history for k in h if k.startswith("rewards/") and k.endswith("/mean")})
    clip_keys = [
        k
        for k in ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean")
        if any(k in h for h in history)
    ]
    panels = [
        ("reward", ["reward", *reward_keys]),
        ("KL to the reference", ["kl"]),
        ("completion length (tokens)", ["completions/mean_length"]),
        ("clip ratio", clip_keys or ["clip_ratio/region_mean"]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, (title, keys) in zip(axes.flat, panels):
        drawn = False
        for key in keys:
            steps, values = _series(history, key)
            if steps:
                ax.plot(steps, values, marker="o", markersize=3, label=key)
                drawn = True
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(fontsize=8)
        else:
            ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[-1]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(f"GRPO run: {Path(output_dir).resolve().name}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
