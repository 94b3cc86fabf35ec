"""Metrics accumulated between two log calls, reduced the right way.

Token-level metrics (kl, entropy, clip ratios) are weighted by the number of loss tokens they were measured on, so
the logged value is the mean over every token of the logging window, on every process, and not a mean of per-step
means. Lengths keep a true minimum and maximum. The trainer adds values that are already summed or gathered over
processes; this class only accumulates them over micro-steps and generation rounds.
"""

from __future__ import annotations

import json
import math
import os
import sys
import unicodedata
import warnings

import torch
from accelerate.utils import gather_object

from grpo.data import completion_text
from grpo.objective.advantages import group_reward_stats
from grpo.training.logged_images import save_logged_images


class MetricsWindow:
    def __init__(self):
        self._sums: dict[str, list[float]] = {}  # name -> [weighted total, total weight]
        self._mins: dict[str, float] = {}
        self._maxs: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._totals: dict[str, float] = {}

    def add_mean(self, name: str, total: float | torch.Tensor, weight: float | torch.Tensor = 1.0) -> None:
        """Add `total` (a value already multiplied by its weight) and its `weight`. Tensors are summed where they
        live and read once, when the window is: on a GPU the trainer's micro-steps never wait for the device to
        log a token-weighted metric (benchmarks/host_syncs.py)."""
        entry = self._sums.setdefault(name, [0.0, 0.0])
        entry[0] = entry[0] + (total.detach() if isinstance(total, torch.Tensor) else total)
        entry[1] = entry[1] + (weight.detach() if isinstance(weight, torch.Tensor) else weight)

    def add_sum(self, name: str, value: float) -> None:
        """A count: the logged value is the total over the window."""
        self._totals[name] = self._totals.get(name, 0.0) + float(value)

    def add_min(self, name: str, value: float) -> None:
        self._mins[name] = min(self._mins.get(name, math.inf), float(value))

    def add_max(self, name: str, value: float) -> None:
        self._maxs[name] = max(self._maxs.get(name, -math.inf), float(value))

    def set_last(self, name: str, value: float) -> None:
        self._last[name] = float(value)

    def state_dict(self) -> dict[str, dict]:
        """What the window holds, as plain dicts of floats (saved in checkpoints: a resumed run logs what it would
        have)."""
        state = {key: dict(value) for key, value in vars(self).items()}
        state["_sums"] = {name: [float(total), float(weight)] for name, (total, weight) in self._sums.items()}
        return state

    def load_state_dict(self, state: dict[str, dict]) -> None:
        for key, value in state.items():
            setattr(self, key, dict(value))

    def pop(self) -> dict[str, float]:
        """The reduced metrics of the window, then an empty window. A mean with zero weight is NaN (nothing was
        measured: e.g. no row had a reward from that function)."""
        sums = {name: (float(total), float(weight)) for name, (total, weight) in self._sums.items()}
        out = {name: (total / weight if weight > 0 else math.nan) for name, (total, weight) in sums.items()}
        out.update(self._mins)
        out.update(self._maxs)
        out.update(self._last)
        out.update(self._totals)
        self.__init__()
        return out


def add_prompt_metrics(window: MetricsWindow, cut: torch.Tensor, args, warned: bool, conversations: bool) -> bool:
    """`prompts/truncated`: the fraction of a round's prompts, all processes' rows `cut` (B_g,) long (0: whole;
    else the prompt was cut to max_prompt_length: the whole turns a conversation lost, 1 for a string), that were
    cut; with `conversations`, `prompts/turns_cut`: the mean number of whole turns a prompt lost. The first round
    with a cut prompt warns, unless `warned`; returns whether it was warned."""
    shortened = (cut > 0).float()
    window.add_mean("prompts/truncated", shortened.sum(), cut.numel())
    if conversations:
        window.add_mean("prompts/turns_cut", cut.float().sum(), cut.numel())
    count = int(shortened.sum())
    if count and not warned:
        if conversations:
            how = (
                f"lost their oldest whole turns ({int(cut.sum())} turns in all; a leading system message and the "
                "last turn are always kept)"
            )
        else:
            kept = "the end" if args.truncation_side == "left" else "the start"
            how = f"were cut on the {args.truncation_side} (truncation_side), keeping {kept}"
        warnings.warn(
            f"{count} of {cut.numel()} prompts of this round are longer than max_prompt_length="
            f"{args.max_prompt_length} tokens and {how}. Raise max_prompt_length, set it to None to keep whole "
            "prompts (as TRL does), or shorten those prompts; `prompts/truncated` logs the fraction cut in every "
            f"round{' and `prompts/turns_cut` the turns each lost' if conversations else ''}.",
            stacklevel=3,
        )
    return warned or count > 0


def add_round_metrics(
    window: MetricsWindow,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    reward_columns: torch.Tensor,
    rewards: torch.Tensor,
    names: list[str],
    num_generations: int,
) -> None:
    """The metrics of one generation round, from all processes' rows (B_g): completion `lengths` (B_g,),
    `truncated` (B_g,) 0/1, each function's reward column (B_g, K) and the combined `rewards` (B_g,), NaN where
    unscored (ignored by the means)."""
    lengths, truncated = lengths.float(), truncated.float()
    window.add_mean("completions/mean_length", lengths.sum(), lengths.numel())
    window.add_min("completions/min_length", lengths.min())
    window.add_max("completions/max_length", lengths.max())
    window.add_mean("completions/clipped_ratio", truncated.sum(), truncated.numel())
    terminated = lengths[truncated == 0]
    window.add_mean("completions/mean_terminated_length", terminated.sum(), terminated.numel())
    for j, name in enumerate(names):
        column = reward_columns[:, j]
        valid = column[~torch.isnan(column)]
        window.add_mean(f"rewards/{name}/mean", valid.sum(), valid.numel())
        if valid.numel() > 1:
            window.add_mean(f"rewards/{name}/std", valid.std() * valid.numel(), valid.numel())
    valid, rows = rewards[~torch.isnan(rewards)], rewards.numel()
    window.add_mean("reward", valid.sum(), valid.numel())
    # A round's statistics count by its rows: rounds of one run differ in size in evaluation (a last, shorter
    # batch) and with offline groups of different sizes.
    for key, value in group_reward_stats(rewards, num_generations).items():
        window.add_mean(key, value * rows, rows)
    # Unscored rows (NaN: None, a failed call, or +-inf under nonfinite="skip") get nothing from that function.
    missing = torch.isnan(torch.cat([reward_columns, rewards.unsqueeze(1)], dim=1)).float().mean(dim=0).tolist()
    unscored, none = dict(zip(names, missing[:-1])), missing[-1]  # by function; by every function
    for name, fraction in unscored.items():
        window.add_mean(f"rewards/{name}/unscored_ratio", fraction * rows, rows)
    window.add_mean("frac_reward_unscored", none * rows, rows)
    warn_mostly_unscored(unscored, none, rewards.numel())


def warn_mostly_unscored(unscored: dict[str, float], none: float, rows: int) -> None:
    """A `UserWarning` for a generation round of `rows` rows in which most rewards are missing: more than half of
    the rows unscored by some function (`unscored`: each function's fraction of unscored rows), or by every function
    (`none`; then by each, too). NaN rewards are not an error (they mark rows a function does not apply to), but a
    round where most are NaN usually means a broken function, and a row no function scores gets advantage 0."""
    mostly = [f"by reward function '{name}' {fraction:.0%}" for name, fraction in unscored.items() if fraction > 0.5]
    if not mostly and none <= 0.5:
        return
    warnings.warn(
        f"Most rewards of a generation round of {rows} rows are missing. Rows unscored: "
        f"{'; '.join(mostly + [f'by every function {none:.0%}'])} (the function returned None, failed, or gave an "
        "infinite reward under nonfinite='skip'). A row no function scores gets advantage 0 and trains nothing: "
        "check that these functions apply to the data (logged as rewards/<name>/unscored_ratio and "
        "frac_reward_unscored).",
        stacklevel=3,
    )


def add_sampling_metrics(window: MetricsWindow, summaries: torch.Tensor) -> None:
    """Reduce every process's `sampling_summary` (grpo/objective/token_weights.py; (P, 7), gathered) into the window."""
    sums, peaks = summaries[:, :4].sum(dim=0), summaries[:, 4:].amax(dim=0)
    window.add_mean("sampling/sampling_logp_difference/mean", sums[0], sums[1])
    window.add_mean("sampling/importance_sampling_ratio/mean", sums[2], sums[3])
    if sums[1] > 0:
        window.add_max("sampling/sampling_logp_difference/max", peaks[0])
        window.add_max("sampling/importance_sampling_ratio/max", peaks[1])
        window.add_min("sampling/importance_sampling_ratio/min", -peaks[2])


def add_token_metrics(window: MetricsWindow, totals: torch.Tensor, names: list[str]) -> None:
    """Token-weighted means: `totals` is [loss tokens, value_1 * tokens, ...] summed over processes."""
    for name, total in zip(names, totals[1:]):
        window.add_mean(name, total, totals[0])


def add_loss_metrics(window: MetricsWindow, result) -> None:
    """One micro-step's `StepLossResult` (grpo/objective/step_loss.py): its token-weighted statistics and entropy,
    the sampler's correction (sampling/*), at a step's end the entropy coefficient the next step starts from, and
    in evaluation the batch's loss (which replaces Trainer's eval_loss, a plain mean over batches)."""
    if result.sampling is not None:
        add_sampling_metrics(window, result.sampling)
    if result.entropy_coef is not None:
        window.add_mean("entropy_coef", result.entropy_coef)
    add_token_metrics(window, result.token_totals, result.token_names)
    if result.evaluated is not None:  # evaluation: `loss` (eval_loss), each batch counted by its rows
        window.add_mean("loss", result.evaluated[0], result.evaluated[1])


def add_reward_call_metrics(
    window: MetricsWindow, errors: torch.Tensor, slowest: torch.Tensor, names: list[str], count_errors: bool
) -> None:
    """One round's reward calls: failed rows per function (`errors`, summed over processes, logged as
    `rewards/<name>/errors` when failures are skipped rather than raised) and the slowest process's seconds."""
    if count_errors:
        for name, count in zip(names, errors.tolist()):
            window.add_sum(f"rewards/{name}/errors", count)
    window.add_mean("timing/rewards", slowest, 1)


def round_samples(rollout, rewards, advantages: torch.Tensor, output_dir: str, is_main: bool) -> list[dict]:
    """`log_completions`: the records of a scored round's rows of every process (`sample_records`); a collective
    call. Rows that carry images (`log_multimodal`) get them saved under `output_dir` (logged_images.py)."""
    columns, _ = rewards.columns(rollout.rewards_per_func, rollout.step_rewards, rollout.turn_rewards)
    prompts, completions = gather_object(rollout.prompts), gather_object(rollout.completions)
    images = None if rollout.images is None else save_logged_images(output_dir, rollout.images, is_main)
    return sample_records(prompts, completions, columns, advantages, images)


def sample_records(
    prompts: list, completions: list, rewards: torch.Tensor, advantages: torch.Tensor, images: list | None = None
) -> list[dict]:
    """One record per completion for `log_completions`: prompt, completion, each function's reward (B, K) and the
    advantage (B,), or per token (B, T) shown by its value at the first token; with `images`, each row's image
    paths under output_dir."""
    first = advantages if advantages.dim() == 1 else advantages[:, 0]
    records = [
        {"prompt": p, "completion": c, "rewards": r, "advantage": a}
        for p, c, r, a in zip(prompts, completions, rewards.tolist(), first.tolist())
    ]
    for record, paths in zip(records, images or []):
        record["images"] = paths
    return records


def report_samples(
    samples: list[dict],
    reward_names: list[str],
    path: str,
    step: int,
    max_rows: int | None,
    run: str | None = None,
    unique_prompts: bool = False,
) -> None:
    """`log_completions`: print a table of a round's completions (with `unique_prompts`, the first row of each
    prompt only, as TRL's `log_unique_prompts`) and append them all to `path` (JSON lines). Written through tqdm,
    which takes the progress bar off its line first and draws it again below: a plain print left a copy of the bar
    above each table."""
    from tqdm.auto import tqdm

    shown = first_of_each_prompt(samples) if unique_prompts else samples
    tqdm.write(format_completions(shown, reward_names, max_rows), file=sys.stdout)
    sys.stdout.flush()
    write_completions(path, step, samples, reward_names, run)


def first_of_each_prompt(samples: list[dict]) -> list[dict]:
    """The first sample of each distinct prompt, in order. Prompts are strings or lists of messages, compared by
    their JSON text."""
    seen, kept = set(), []
    for sample in samples:
        key = json.dumps(sample["prompt"], sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            kept.append(sample)
    return kept


def printable(text) -> str:
    """`text` on one line with every control character escaped (newline as \\n, tab as \\t, ESC as \\x1b): model
    output printed raw could move the cursor, clear the screen or recolour the terminal."""
    return "".join(
        ch.encode("unicode_escape").decode("ascii") if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") else ch
        for ch in str(text)
    )


def format_completions(samples: list[dict], reward_names: list[str], max_rows: int | None = None) -> str:
    """A plain-text table of sampled completions: prompt, completion, each reward and the advantage."""
    rows = samples if max_rows is None else samples[:max_rows]

    def clip(value, width):
        if isinstance(value, list) and len(value) > 1:  # a multi-turn episode: each message clipped on its own
            return " / ".join(clip(f"{m.get('name') or m['role']}: {m['content']}", width // 2) for m in value)
        text = printable(completion_text(value))
        return text if len(text) <= width else text[: width - 3] + "..."

    header = ["prompt", "completion", *reward_names, "advantage"]
    lines = [" | ".join(header)]
    for s in rows:
        rewards = [f"{r:.3f}" for r in s["rewards"]]
        lines.append(" | ".join([shown_prompt(s), clip(s["completion"], 60), *rewards, f"{s['advantage']:+.3f}"]))
    return "\n".join(lines)


def shown_prompt(sample: dict, width: int = 40) -> str:
    """The prompt's table cell, after `[N images]` when the images were logged: the question, that is the last user
    message of a conversation (its system message and earlier turns are the same on every row, and clipping them
    all left no room for it), or the whole string prompt; a long one keeps its end, where the question usually is."""
    images = sample.get("images")
    prompt = sample["prompt"]
    if isinstance(prompt, list):
        users = [m for m in prompt if m.get("role") == "user"]
        prompt = users[-1]["content"] if users else prompt[-1:]
    text = printable(completion_text(prompt))
    text = text if len(text) <= width else "..." + text[-(width - 3) :]
    return (f"[{len(images)} image{'s' * (len(images) != 1)}] " if images else "") + text


def write_completions(
    path: str, step: int, samples: list[dict], reward_names: list[str], run: str | None = None
) -> None:
    """Append every sample of a logged round to a JSON-lines file: one object per completion with the step, the
    prompt, the completion, each reward by name (None where a function gave none), the advantage and `run`, the
    UTC start of the `train()` call that wrote it (a resumed run's lines are told apart from the killed run's)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "a") as f:
        for s in samples:
            rewards = {name: (None if math.isnan(r) else r) for name, r in zip(reward_names, s["rewards"])}
            record = {"step": step, "prompt": s["prompt"], "completion": s["completion"], "rewards": rewards}
            record["advantage"] = None if math.isnan(s["advantage"]) else s["advantage"]
            if "images" in s:  # log_multimodal: the prompt's images, as paths under output_dir
                record["images"] = s["images"]
            record["run"] = run
            f.write(json.dumps(record) + "\n")


def add_episode_metrics(window: MetricsWindow, stats: dict[str, float], accelerator) -> None:
    """The tool metrics of a round of multi-turn episodes (grpo/generation/episodes.py), from this process's sums
    (`episode_stats`) summed over processes: per episode `tools/turns` (policy turns), `tools/call_frequency`,
    `tools/errors`, `tools/timeouts`, `tools/parse_failures` and `tools/budget_cut_ratio` (episodes whose tool
    answers did not fit in max_completion_length); `tools/failure_frequency`, TRL's (errors + timeouts + unknown
    tools) / (calls + unknown tools): TRL counts a call of an unknown tool as a failed call."""
    names = list(stats)
    totals = accelerator.reduce(torch.tensor([stats[n] for n in names], device=accelerator.device), reduction="sum")
    total = dict(zip(names, totals.tolist()))
    episodes = total.pop("episodes")
    unknown = total.pop("unknown_tools", 0.0)  # counted in tools/parse_failures already
    renamed = {"tool_calls": "call_frequency", "tool_errors": "errors", "tool_timeouts": "timeouts"}
    for name, value in total.items():
        name = "budget_cut_ratio" if name == "budget_cuts" else renamed.get(name, name)
        window.add_mean(f"tools/{name}", value, episodes)
    failed = total["tool_errors"] + total["tool_timeouts"] + unknown
    window.add_mean("tools/failure_frequency", failed, max(total["tool_calls"] + unknown, 1.0))
