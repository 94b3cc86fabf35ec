"""The `grpo` command line (also `python -m grpo`).

    grpo train RECIPE.yaml [--field value ...]    train from a recipe (docs/recipes.md); works under accelerate launch
    grpo check RECIPE.yaml [--field value ...]    validate a recipe without loading any weight; say what would run
    grpo plot OUTPUT_DIR                          the logged metrics that moved, against step, as a PNG
    grpo vllm-serve --model PATH_OR_ID [...]      a vLLM generation server for `use_vllm=True` (docs/vllm.md)
    grpo env                                      versions and the machine, for a bug report
    grpo --version; grpo train --help             (every recipe key with its default and help)

A mistake (a recipe, a path, the environment, a reward function's bug) is one line on stderr and exit status 2;
`--debug` (or GRPO_DEBUG=1) shows the traceback instead.

`grpo train` does, in order:
  1. validate everything that needs no weights (`grpo.cli.preflight.plan_run`: the recipe and overrides, the output
     directory, the model's source, the data, the rewards' imports and the batch arithmetic); load the prompts;
  2. build the `GRPOTrainer` (the weights load here) and print what is about to run;
  3. evaluate the held-out prompts: sampled (`eval_reward`, G samples per prompt) and greedy (one completion per
     prompt: `eval_greedy_accuracy`), when the recipe has held-out prompts and the run is not resumed;
  4. train; 5. evaluate again; 6. save the model, the trainer state and the plot; print before/after with the
     greedy completions of the first few prompts.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

# Only what imports nothing heavy: `grpo --help`, `--version` and the usage errors answer without loading torch, and
# each command imports what it needs (tests/test_cli_startup.py counts the modules).
from grpo.cli.errors import RecipeError
from grpo.errors import InputError


def greedy_samples(trainer, dataset, count: int | None = None, progress: bool = False) -> list[dict]:
    """Greedy completions of the first `count` rows of `dataset` (every row when None), each with its rewards (one
    per function), `reward`, their weighted sum (the trainer's `reward`), and `outcome`, the weighted sum of the
    outcome functions' alone (the episode's answer; `reward` when every function scores steps or turns), made the
    way the trainer makes a round
    (`GRPOTrainer.sample_round`, `score_round`) with a greedy sampler, `per_device_eval_batch_size` rows at a time. Every
    process decodes every row: the rows are few, and the report needs them all in one place. With `progress`, a bar
    counts the prompts answered (on the main process, unless `disable_tqdm`)."""
    from tqdm.auto import tqdm

    from grpo.generation import TransformersGeneration
    from grpo.rewards.scoring import combine_rewards

    count = len(dataset) if count is None else min(count, len(dataset))
    greedy = TransformersGeneration(
        max_completion_length=trainer.args.max_completion_length,
        pad_token_id=trainer.tokenizer.pad_token_id,
        eos_token_ids=trainer.eos_token_ids,
        greedy=True,
        cache_implementation=trainer.args.cache_implementation,
        pad_to_multiple_of=trainer.args.pad_to_multiple_of,
        cpu_decode_kernel=trainer.args.cpu_decode_kernel,
        cpu_inverse_cdf_sampling=trainer.args.cpu_inverse_cdf_sampling,
    )
    samples, size = [], max(1, trainer.args.per_device_eval_batch_size)
    shown = progress and trainer.is_world_process_zero() and not trainer.args.disable_tqdm
    bar = tqdm(total=count, desc="greedy answers", unit="prompt", dynamic_ncols=True, disable=not shown)
    for start in range(0, count, size):
        rows = [dataset[i] for i in range(start, min(start + size, count))]
        rollout, columns = trainer.sample_round(rows, greedy)
        rollout = trainer.rounds.score_round(rollout, columns, None, trainer.state)
        # All processes' rows (a round may span processes), then this process's.
        per_func, total = trainer.rewards.columns(rollout.rewards_per_func, rollout.step_rewards, rollout.turn_rewards)
        outcome = total
        if trainer.rewards.outcome_funcs:
            outcome = combine_rewards(rollout.rewards_per_func, trainer.rewards.outcome_weights)
        local = rollout.local_slice(trainer.accelerator.process_index)
        samples += [
            {"prompt": p, "completion": c, "rewards": r, "reward": t, "outcome": o, "cut": bool(cut)}
            for p, c, r, t, o, cut in zip(
                rollout.prompts,
                rollout.completions,
                per_func[local].tolist(),
                total[local].tolist(),
                outcome[local].tolist(),
                rollout.is_truncated.tolist(),
            )
        ]
        bar.update(len(rows))
    bar.close()
    return samples


def greedy_metrics(samples: list[dict], tools: bool = False) -> dict[str, float]:
    """The held-out metrics of greedy completions (`greedy_samples` of every held-out row): `eval_greedy_accuracy`,
    the share of prompts whose greedy completion earns an outcome reward of at least 1 (a correct answer, for
    rewards that pay 1 for one, like the demo's and the built-in `accuracy`; turn and step scores do not count), and
    `eval_greedy_reward`, their mean reward over every function, and `eval_greedy_clipped_ratio`, the share of them
    cut at `max_completion_length` (no EOS within it). With
    `tools` (multi-turn episodes), also `eval_greedy_tool_use`: the share of prompts whose greedy episode called a
    tool (a well-formed call of one of its tools; a malformed one is a parse failure, not a use)."""
    if not samples:
        return {}
    rewards = [s["reward"] for s in samples]
    metrics = {
        "eval_greedy_accuracy": sum(_right(s) for s in samples) / len(samples),
        "eval_greedy_reward": sum(r for r in rewards if r == r) / len(rewards),
    }
    if all("cut" in s for s in samples):
        metrics["eval_greedy_clipped_ratio"] = sum(s["cut"] for s in samples) / len(samples)
    if tools:
        used = [any(m.get("tool_calls") for m in s["completion"]) for s in samples]
        metrics["eval_greedy_tool_use"] = sum(used) / len(used)
    return metrics


def _right(sample: dict) -> bool:
    """Whether a greedy sample counts as a correct answer: an outcome reward of at least 1 (NaN, unscored, is not)."""
    return sample.get("outcome", sample["reward"]) >= 1


def evaluate_held_out(trainer, held_out) -> tuple[dict[str, float], list[dict]]:
    """Sampled (`trainer.evaluate()`: `eval_reward` over G samples per prompt) and greedy (`greedy_metrics`)
    metrics of the held-out prompts, and the greedy samples. The greedy metrics are logged too, so they land in
    `trainer_state.json` (and any `report_to` tracker) beside `eval_reward`, at the same step."""
    from grpo.cli.progress import evaluation_bar

    evaluation_bar(trainer)  # drawn from the start, at 0 of its batches
    metrics = dict(trainer.evaluate())
    samples = greedy_samples(trainer, held_out, progress=True)
    greedy = greedy_metrics(samples, tools=trainer.agent is not None)
    trainer.log(dict(greedy))  # a copy: `log` adds its own keys (epoch) to the dict it is given
    return {**metrics, **greedy}, samples


def _text(value) -> str:
    """A prompt's or completion's text (`completion_text`) on one line, control characters escaped (`printable`)."""
    from grpo.data import completion_text
    from grpo.training.metrics import printable

    return printable(completion_text(value))


def before_after_report(before: dict | None, after: dict, samples_before, samples_after, names, shown=4) -> str:
    """The summary `grpo train` prints: held-out metrics before and after (sampled, then greedy), then how the
    greedy answers changed, with `shown` of them (`_greedy_changes`)."""
    keys = ["eval_reward", "eval_greedy_accuracy"]
    # The mean greedy reward says something of its own only when rewards are not all 0 or 1.
    if any(v not in (0.0, 1.0) for s in [*(samples_before or []), *samples_after] for v in s["rewards"]):
        keys.append("eval_greedy_reward")
    keys += [f"eval_rewards/{n}/mean" for n in names if len(names) > 1]
    keys += ["eval_tools/call_frequency", "eval_greedy_tool_use"]  # with tools only
    keys += ["eval_completions/mean_length", "eval_completions/clipped_ratio", "eval_greedy_clipped_ratio"]
    lines = [f"{'held-out metric':36} {'before':>8} {'after':>8} {'change':>8}"]
    for key in keys:
        if key not in after:
            continue
        if before is not None and key in before:
            lines.append(f"{key:36} {before[key]:8.3f} {after[key]:8.3f} {after[key] - before[key]:+8.3f}")
        else:
            lines.append(f"{key:36} {'-':>8} {after[key]:8.3f}")
    if samples_after:
        lines.append(
            f"(eval_reward: mean reward of sampled completions, {len(samples_after)} prompts; eval_greedy_accuracy: "
            "share of those prompts whose greedy completion earns outcome reward >= 1; clipped_ratio: share of "
            "completions cut at max_completion_length, with no end-of-sequence token)"
        )
    return "\n".join(lines + _greedy_changes(samples_before or [], samples_after, shown))


def _greedy_changes(samples_before: list[dict], samples_after: list[dict], shown: int) -> list[str]:
    """How the greedy answers changed (counts over every held-out prompt, correct meaning `_right`), then the
    completions of `shown` prompts: those whose answer turned right or wrong first, in data order, so that what is
    printed is what changed, in the proportions the counts give."""
    paired = len(samples_before) == len(samples_after)  # the same rows, in the same order (greedy_samples)
    pairs = list(zip(samples_before, samples_after)) if paired else [(None, a) for a in samples_after]
    lines = []
    if paired and pairs:
        kinds = [(_right(b), _right(a)) for b, a in pairs]
        lines.append(
            f"greedy answers of the {len(pairs)} prompts: {kinds.count((False, True))} turned right, "
            f"{kinds.count((True, False))} turned wrong, {kinds.count((True, True))} right before and after, "
            f"{kinds.count((False, False))} wrong before and after"
        )
        changed = [i for i, (was, now) in enumerate(kinds) if was != now]
        order = changed + [i for i in range(len(pairs)) if i not in changed]
        pairs = [pairs[i] for i in order]
    for earlier, sample in pairs[:shown]:
        lines += ["", f"prompt: {_text(sample['prompt'])[-160:]}"]
        if earlier is not None:
            lines.append(f"  before ({_rewards(earlier['rewards'])}): {_text(earlier['completion'])[:200]}")
        lines.append(f"  after  ({_rewards(sample['rewards'])}): {_text(sample['completion'])[:200]}")
    return lines


def _rewards(values) -> str:
    return ", ".join("-" if v != v else f"{v:.2f}" for v in values)


class _DeepSpeedCpuNotice(logging.Filter):
    """Drops DeepSpeed's "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect
    it." and nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Setting accelerator to CPU.")


def _quiet_deepspeed_on_cpu() -> None:
    """Where DeepSpeed is installed (the dev extra), accelerate imports it in every run (`unwrap_model` checks for a
    DeepSpeed engine), and its accelerator detection warns "Setting accelerator to CPU ..." on a machine without
    one, in runs that never use DeepSpeed. Where torch finds no accelerator either, that one message is dropped by a
    filter on DeepSpeed's logger ("DeepSpeed"): nothing else changes, DeepSpeed's choice and its other messages
    included."""
    import torch

    found = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    deepspeed_logger = logging.getLogger("DeepSpeed")  # the same object DeepSpeed configures when it is imported
    if not found and not any(isinstance(f, _DeepSpeedCpuNotice) for f in deepspeed_logger.filters):
        deepspeed_logger.addFilter(_DeepSpeedCpuNotice())


def _build_trainer(plan):
    """The `GRPOTrainer` of a checked run (`plan_run`); a model that cannot be fetched is one line."""
    from grpo.training.trainer import GRPOTrainer

    recipe = plan.recipe
    try:
        return GRPOTrainer(
            model=recipe.model.name_or_path,
            reward_funcs=plan.reward_funcs,
            args=plan.args,
            train_dataset=plan.train_data,
            eval_dataset=plan.held_out,
            processing_class=plan.tokenizer,
            peft_config=recipe.peft_config(),
            tools=plan.tools or None,
            environment_factory=plan.environment,
            agent_func=plan.agent_func,
        )
    except (OSError, ConnectionError) as e:
        if isinstance(e, FileNotFoundError | PermissionError):
            raise
        # A hub model that cannot be fetched (no network, a wrong or private id): transformers says which.
        raise RecipeError(
            f"model {recipe.model.name_or_path!r} could not be loaded: {type(e).__name__}: {e} Check the id and "
            "the network, or give the model's local folder."
        ) from e


def _finished(message: str | None) -> bool:
    """Print the line of a finished run (`finished_run_message`), if there is one; whether there was."""
    if message is not None and int(os.environ.get("RANK", "0")) == 0:
        print(f"grpo train: {message}")
    return message is not None


def train(recipe_path: str, overrides: list[str]) -> dict:
    """Run `grpo train`; returns the held-out metrics before and after training (empty dicts without held-out
    prompts)."""
    # 1. Everything that needs no weights (grpo check does the same), then the trainer. Imported here so that a
    # bad recipe fails in a second.
    from grpo.cli.preflight import plan_run, run_summary
    from grpo.cli.progress import label_progress, lines_above_bars
    from grpo.training.checkpoint_checks import finished_run_message

    _quiet_deepspeed_on_cpu()
    plan = plan_run(recipe_path, overrides)
    args, resume = plan.args, plan.resume
    # A finished run resumed again (a re-queued job) has nothing to train: said in one line, before any weight loads.
    if resume is not None and args.max_steps > 0 and _finished(finished_run_message(resume, args.max_steps, args)):
        return {"before": {}, "after": {}}

    # 2. The trainer; the weights load here, after the thread check (said once, here or while training).
    said = _check_threads_at_start()
    trainer = _build_trainer(plan)
    if resume is not None and _finished(trainer.finished_run(resume)):  # num_train_epochs: known with the trainer
        return {"before": {}, "after": {}}
    label_progress(trainer)
    _watch_threads(trainer, said)
    if trainer.accelerator.is_main_process:
        print(run_summary(trainer, plan), flush=True)
    # Steps 3-6 draw bars: every warning and log line from here on is written above them, not on their line.
    with lines_above_bars():
        return _evaluate_train_report(trainer, plan)


def _evaluate_train_report(trainer, plan) -> dict:
    """Steps 3-6 of `grpo train` (the module docstring), with the trainer built; returns what `train` does."""
    args, resume, held_out, run = plan.args, plan.resume, plan.held_out, plan.recipe.run
    main = trainer.accelerator.is_main_process
    # 3. Before training (not when resuming: the weights are the checkpoint's only once training starts).
    before, samples_before = None, []
    if held_out is not None and run.evaluate_before and resume is None:
        before, samples_before = evaluate_held_out(trainer, held_out)

    # 4. Train.
    if resume is not None and main:
        print(f"resuming from {resume}")
    evaluated_before = list(trainer.state.log_history)
    trainer.train(resume_from_checkpoint=resume)
    # `train()` starts a fresh TrainerState: put the evaluation before training back at the head of the log, so
    # that trainer_state.json and the plot hold the before values too.
    trainer.state.log_history[:0] = evaluated_before

    # 5. After training.
    after, samples_after = {}, []
    if held_out is not None:
        after, samples_after = evaluate_held_out(trainer, held_out)

    # 6. Save and report.
    if run.save_model:
        trainer.save_model(args.output_dir)
    trainer.save_state()
    if main:
        _report(trainer, plan, before, after, samples_before, samples_after)
    if trainer.agent is not None:  # the environment objects that the evaluation after training made
        trainer.agent.close()
    return {"before": before or {}, "after": after}


def _single_process() -> bool:
    """One process on this machine: the only case the thread check covers (launchers of several processes set
    their thread counts themselves: torchrun sets OMP_NUM_THREADS=1)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) == 1


def _compute_threads() -> int:
    import torch

    return torch.get_num_threads()


def _say(line: str) -> None:
    """A line above the progress bars (`tqdm.write` lifts them), or plainly where none is drawn."""
    from tqdm.auto import tqdm

    tqdm.write(line)
    sys.stdout.flush()


def _check_threads_at_start() -> bool:
    """Whether `grpo train`'s compute threads share their cores with other work (`grpo.cli.threads`), said before
    the weights load (this process: one thread at work so far); whether it was said."""
    from grpo.cli.threads import check_threads

    return _single_process() and check_threads(_compute_threads(), own=1.0, say=_say)


def _watch_threads(trainer, said: bool) -> None:
    """The same check at each logged step while training (`ThreadWatch`), unless it was said at the start."""
    if _single_process():
        from grpo.cli.threads import ThreadWatch

        trainer.add_callback(ThreadWatch(_compute_threads(), _say, said))


def _report(trainer, plan, before: dict | None, after: dict, samples_before: list, samples_after: list) -> None:
    """What `grpo train` prints once the run is saved (step 6): the held-out prompts' metrics and greedy completions
    before and after training, where the model went, and the plot."""
    recipe, run, output_dir = plan.recipe, plan.recipe.run, plan.args.output_dir
    if plan.held_out is not None:
        print(f"\n=== {recipe.source.name if recipe.source else 'grpo train'}: held-out prompts ===")
        print(
            before_after_report(
                before, after, samples_before, samples_after, trainer.reward_names, run.sample_completions
            )
        )
    if run.save_model:
        print(f"\nmodel saved to {output_dir}")
    if run.plot:
        from grpo.cli.plot import plot_run

        try:
            print(f"plot written to {plot_run(output_dir)}")
        except ImportError as e:  # the run itself succeeded; say how to get the plot
            print(f"no plot: {e} Then run `grpo plot {output_dir}`.")


def check(recipe_path: str, overrides: list[str]) -> None:
    """Run `grpo check`: validate as `grpo train` does before any weight loads, and print what the run would do."""
    from grpo.cli.preflight import describe_plan, plan_run

    print(describe_plan(plan_run(recipe_path, overrides)))


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("grpo")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: run from a checkout with `pip install -e .`)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo", description="Group Relative Policy Optimization for language models."
    )
    parser.add_argument("--version", action="version", version=f"grpo {_version()}")
    parser.add_argument(
        "--debug", action="store_true", help="show the traceback of an error instead of one line (or GRPO_DEBUG=1)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    for name, text in (("train", "train from a recipe YAML file"), ("check", "validate a recipe without training")):
        # The keys are listed by `--help` itself (`_print_recipe_help`): the epilog would be built on every call.
        sub = commands.add_parser(
            name,
            help=text,
            add_help=False,
            description=f"{text[0].upper()}{text[1:]}. Any GRPOConfig field or section key (--dataset.size) can be "
            "overridden; --help lists them all, with defaults.",
        )
        sub.add_argument("-h", "--help", action="store_true", help="list every recipe key with its default and help")
        sub.add_argument("recipe", nargs="?", help="path to the recipe YAML file (see examples/recipes/)")
        sub.add_argument(
            "overrides", nargs=argparse.REMAINDER, help="--field value or --section.field value, read as YAML"
        )

    plot_parser = commands.add_parser("plot", help="plot a run's logged metrics to a PNG")
    plot_parser.add_argument("output_dir", help="the run's output_dir (holds trainer_state.json)")
    plot_parser.add_argument("--out", default=None, help="where to write the PNG (default OUTPUT_DIR/training.png)")

    # Its options are read by the command itself (`_serve`): they are defined beside the server, whose package loads
    # torch, which `grpo --help` should not wait for.
    commands.add_parser("vllm-serve", help=SERVE_HELP, add_help=False)
    commands.add_parser("env", help="print versions and the machine, for a bug report")
    return parser


SERVE_HELP = "serve a vLLM engine for generation during training (docs/vllm.md)"


def _serve(options: list[str]) -> None:
    """`grpo vllm-serve OPTIONS`: the options parsed (`--help` lists them) and the server started."""
    from grpo.generation.vllm.serve import add_arguments, serve

    parser = argparse.ArgumentParser(
        prog="grpo vllm-serve",
        description="Serve a vLLM engine over HTTP for GRPOTrainer(use_vllm=True): generation with n completions per "
        "prompt and weight updates from the trainer. Needs vLLM installed in this environment.",
    )
    add_arguments(parser)
    serve(parser.parse_args(options))


def _print_recipe_help(parser: argparse.ArgumentParser, command: str) -> None:
    from grpo.cli.info import keys_help

    sub = parser._subparsers._group_actions[0].choices[command]  # argparse keeps its subparsers only here
    print(sub.format_help())
    print(keys_help())


def _run(cli, parser) -> None:
    if cli.command in ("train", "check"):
        if cli.help or any(a in ("-h", "--help") for a in cli.overrides):
            _print_recipe_help(parser, cli.command)
        elif cli.recipe is None:
            raise RecipeError(f"Name a recipe: grpo {cli.command} RECIPE.yaml (see examples/recipes/).")
        elif cli.command == "train":
            train(cli.recipe, cli.overrides)
        else:
            check(cli.recipe, cli.overrides)
    elif cli.command == "plot":
        from grpo.cli.plot import plot_run

        print(plot_run(cli.output_dir, cli.out))
    elif cli.command == "vllm-serve":
        _serve(cli.options)
    elif cli.command == "env":
        from grpo.cli.info import env_report

        print(env_report())


def _close_progress_bars() -> None:
    """Clear the progress bars still open (a step that failed midway), so that the error line starts a line of its
    own and no bar is redrawn after it."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.leave = False
        bar.close()


def main(argv: list[str] | None = None) -> int:
    # `--debug` may come anywhere (`grpo train r.yaml --debug`): taken out before the overrides are read.
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("GRPO_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != "--debug"]
    parser = _parser()
    cli, unknown = parser.parse_known_args(argv)
    cli.options = unknown  # vllm-serve's own (`_serve`); any other command takes none
    if unknown and cli.command != "vllm-serve":
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")  # as parse_args says it: exit status 2
    try:
        _run(cli, parser)
    except (InputError, FileNotFoundError) as e:
        # Bad input (a recipe, its data, a reward, a path; RecipeError is one): one line, exit status 2.
        if debug:
            raise
        _close_progress_bars()
        message = " ".join(str(e).split())
        print(f"grpo {cli.command}: error: {message}", file=sys.stderr)
        return 2
    except _loaded("grpo.generation.vllm.client:VLLMServerError") as e:
        # No server at the address (not started, another port), or one that refused: the message names it.
        if debug:
            raise
        _close_progress_bars()
        print(f"grpo {cli.command}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except _loaded("grpo.training.nonfinite:NonFiniteError", "grpo.training.checkpoints:CheckpointError") as e:
        # Training stopped to protect the weights or a checkpoint: the message says what is intact and what to do.
        if debug:
            raise
        _close_progress_bars()
        print(f"grpo {cli.command}: error: {e}", file=sys.stderr)
        return 1
    except _loaded("grpo.training.preemption:Preempted") as e:
        # SIGTERM (a scheduler's notice): the step's checkpoint is written; one line says how to go on.
        _close_progress_bars()
        if e.main:
            print(
                f"grpo {cli.command}: stopped on SIGTERM after step {e.step}; checkpoint written: {e.checkpoint}. "
                f"Resume with: {_resume_command(cli)}",
                file=sys.stderr,
            )
        return sys.modules["grpo.training.preemption"].EXIT_STATUS
    except KeyboardInterrupt:
        # Ctrl-C: one line with the way back, not the traceback of wherever it landed.
        if debug:
            raise
        _close_progress_bars()
        print(f"grpo {cli.command}: interrupted (Ctrl-C).{_after_interrupt(cli)}", file=sys.stderr)
        return 130  # 128 + SIGINT, as a shell reports a process Ctrl-C ended
    except BrokenPipeError:  # `grpo train --help | head`: the reader has all it wanted
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - so that the interpreter's flush at exit is quiet too
        return 0
    return 0


def _loaded(*names: str) -> tuple[type, ...]:
    """The exception classes among `names` ("module:Class") whose module is imported, for an `except` clause (which
    evaluates them only once an exception reaches it): a module never imported raised none of its errors, and
    importing it only to compare would load torch after a mistake that needed none."""
    found = []
    for name in names:
        module, _, attr = name.partition(":")
        if module in sys.modules:
            found.append(getattr(sys.modules[module], attr))
    return tuple(found)


def _resume_command(cli) -> str:
    """`grpo train RECIPE [the same overrides] --resume_from_checkpoint true`, ready to paste."""
    import shlex

    overrides, skip = [], False
    for arg in cli.overrides:
        if skip:
            skip = False
        elif arg.replace("-", "_") == "__resume_from_checkpoint":
            skip = True  # its value follows
        elif not arg.replace("-", "_").startswith("__resume_from_checkpoint="):
            overrides.append(arg)
    return shlex.join(["grpo", "train", cli.recipe, *overrides, "--resume_from_checkpoint", "true"])


def _after_interrupt(cli) -> str:
    """For `grpo train`: where the run can be resumed from, or that it starts again; empty for other commands."""
    if cli.command != "train" or cli.recipe is None:
        return ""
    from grpo.cli.recipe import load_recipe
    from grpo.training.checkpoints import newest_checkpoint

    try:
        newest = newest_checkpoint(os.path.abspath(load_recipe(cli.recipe, cli.overrides).config["output_dir"]))
    except Exception:  # noqa: BLE001 - interrupted before the recipe was valid: nothing to resume
        return ""
    if newest is None:
        return " No checkpoint was written: run the same command to start again."
    return f" The newest checkpoint is {newest}: resume with: {_resume_command(cli)}"


if __name__ == "__main__":
    sys.exit(main())
