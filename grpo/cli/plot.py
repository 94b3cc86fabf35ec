"""`grpo plot OUTPUT_DIR`: the training curves of a run as one PNG, from the log history `Trainer` saves in
`trainer_state.json` (at the end of `grpo train`, and in every checkpoint).

Panels, each against the optimizer step (integer ticks), and each only when its metric moved in this run (a KL of 0
or absent with beta = 0, a clip ratio of 0 on-policy, would be empty boxes): the reward, with a band of one
`reward_std` either side and one curve per reward function when there are several; the mean completion length; the
share of completions cut at `max_completion_length` (`completions/clipped_ratio`, also when it stays above 0
without moving: at 1, no answer fits); the entropy; KL; the clip ratios; the loss; the learning rate; the gradient
norm; and the held-out evaluations (`eval_reward` and `eval_greedy_accuracy`, before and after training). Value
axes show the values themselves (no offset such as "+5.5e0"), and a panel whose values barely move is drawn around
them at a scale of at least 1% of their size, so that a change of 0.0002 in an entropy of 5.5 looks flat, not like
a cliff.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

CUT = "completions/clipped_ratio"  # the share of completions cut at max_completion_length


def load_log_history(output_dir: str | Path) -> list[dict]:
    """Every log line of a run: `output_dir/trainer_state.json`, else the newest checkpoint's."""
    output_dir = Path(output_dir)
    candidates = [output_dir / "trainer_state.json"]
    checkpoints = sorted(
        output_dir.glob("checkpoint-*"),
        key=lambda p: int(p.name.split("-")[-1]) if p.name.split("-")[-1].isdigit() else -1,
    )
    candidates += [c / "trainer_state.json" for c in reversed(checkpoints)]
    for path in candidates:
        if path.is_file():
            return json.loads(path.read_text()).get("log_history", [])
    raise FileNotFoundError(
        f"No trainer_state.json in {output_dir} or its checkpoints. Point `grpo plot` at the output_dir of a run "
        "that finished (grpo train writes it) or saved a checkpoint."
    )


def split_history(history: list[dict]) -> tuple[list[dict], list[dict]]:
    """(training steps, evaluations): evaluation lines carry eval_* keys, the final summary carries
    train_runtime and is neither."""
    steps = [h for h in history if "step" in h]
    evaluations = [h for h in steps if any(k.startswith("eval_") for k in h)]
    training = [h for h in steps if h not in evaluations and "train_runtime" not in h]
    return training, evaluations


def _series(history: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [
        (h["step"], h[key])
        for h in history
        if isinstance(h.get(key), int | float) and not isinstance(h[key], bool) and not math.isnan(h[key])
    ]
    return [p[0] for p in points], [p[1] for p in points]


def moves(history: list[dict], key: str) -> bool:
    """Whether `key` was logged with at least two different values (a constant says nothing in a plot)."""
    return len(set(_series(history, key)[1])) > 1


def panels(training: list[dict], evaluations: list[dict]) -> list[tuple[str, list[str]]]:
    """(title, metric keys) of each panel worth drawing for this run, in order; the reward always."""
    reward_keys = sorted({k for h in training for k in h if k.startswith("rewards/") and k.endswith("/mean")})
    chosen = [
        (
            "reward (band: ± reward_std, the spread within groups)",
            ["reward", *(reward_keys if len(reward_keys) > 1 else [])],
        )
    ]
    for title, keys in [
        ("completion length (tokens)", ["completions/mean_length"]),
        ("cut at max_completion_length (share of completions)", [CUT]),
        ("entropy (nats per token)", ["entropy"]),
        ("KL to the reference", ["kl"]),
        ("clip ratio", ["clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean"]),
        ("loss", ["loss"]),
        ("learning rate", ["learning_rate"]),
        ("gradient norm (before clipping)", ["grad_norm"]),
    ]:
        # The cut share even when it stays put: constant at 1, no answer fits in max_completion_length.
        keys = [k for k in keys if moves(training, k) or (k == CUT and any(_series(training, k)[1]))]
        if keys:
            chosen.append((title, keys))
    held_out = [k for k in ("eval_reward", "eval_greedy_accuracy") if _series(evaluations, k)[0]]
    if held_out:
        chosen.append(("held-out prompts (sampled reward, greedy accuracy)", held_out))
    return chosen


def _at_least_one_percent(ax, values: list[float]) -> None:
    """Widen the value axis to at least 1% of the values' size around them (autoscaling would stretch any spread,
    however small, over the whole panel)."""
    if not values:
        return
    low, high = min(values), max(values)
    floor = 0.01 * max(abs(low), abs(high))
    if 0 < high - low < floor:
        middle = (low + high) / 2
        ax.set_ylim(middle - floor, middle + floor)


def plot_run(output_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the PNG (default `output_dir/training.png`) and return its path."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("Plotting needs matplotlib: pip install 'grpo[plot]' (or pip install matplotlib).") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    training, evaluations = split_history(load_log_history(output_dir))
    out = Path(out) if out is not None else Path(output_dir) / "training.png"
    chosen = panels(training, evaluations)
    rows = math.ceil(len(chosen) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(11, 3.4 * rows + 0.6), squeeze=False)
    for ax, (title, keys) in zip(axes.flat, chosen):
        held_out = title.startswith("held-out")
        _draw_panel(ax, title, keys, evaluations if held_out else training, held_out)
    for ax in list(axes.flat)[len(chosen) :]:
        ax.set_visible(False)
    fig.suptitle(f"GRPO run: {Path(output_dir).resolve().name}")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _draw_panel(ax, title: str, keys: list[str], source: list[dict], held_out: bool) -> None:
    """One panel: each key's curve from `source` (the reward with its `reward_std` band), and for the held-out
    evaluations each value written beside its point."""
    from matplotlib.ticker import MaxNLocator

    for key in keys:
        steps, values = _series(source, key)
        if not steps:
            continue
        line = ax.plot(steps, values, marker="o", markersize=3 if len(steps) > 2 else 6, label=key)[0]
        if key == "reward":  # the spread of the rewards within a round, one std either side
            _std_band(ax, source, steps, values, line.get_color())
        if held_out:  # the values, the first series' below its points and the next above
            offset = (0, -13) if key == keys[0] and len(keys) > 1 else (0, 6)
            for s, v in zip(steps, values):
                ax.annotate(
                    f"{v:.2f}",
                    (s, v),
                    textcoords="offset points",
                    xytext=offset,
                    ha="center",
                    fontsize=8,
                    color=line.get_color(),
                )
    if held_out:
        ax.margins(x=0.08, y=0.2)  # room for the value labels
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.ticklabel_format(axis="y", useOffset=False)
    _at_least_one_percent(ax, [v for key in keys for v in _series(source, key)[1]])
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    else:  # only the reward panel is drawn unconditionally
        ax.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=ax.transAxes)


def _std_band(ax, source: list[dict], steps: list[int], values: list[float], color) -> None:
    """A band of one `reward_std` either side of the reward curve, at the steps that logged both."""
    std = dict(zip(*_series(source, "reward_std")))
    band = [(s, v, std[s]) for s, v in zip(steps, values) if s in std]
    if band:
        xs, ys, sd = zip(*band)
        lows, highs = [y - d for y, d in zip(ys, sd)], [y + d for y, d in zip(ys, sd)]
        ax.fill_between(xs, lows, highs, color=color, alpha=0.2, linewidth=0)
