"""Scoring completions with reward functions and reward models: every function of a `RewardSet` on one batch.

A reward function is a plain callable `f(prompts, completions, **kwargs) -> list[float | None]`, or an `async def`
one. It receives, as keyword arguments and only if its signature accepts them (or it takes `**kwargs`): `prompts`,
`completions`, `completion_ids`, `trainer_state`, and every other dataset column as a list with one entry per row
(a positional-only parameter, or `*args` alone, is refused by `grpo.rewards.names.check_reward_signature`). `None`
means "does not apply to this row" and becomes NaN, which the advantage computation ignores.

A reward model is a `PreTrainedModel` with one output label (`AutoModelForSequenceClassification`); it scores the
prompt and completion text, rendered with the chat template for conversational data, using its own tokenizer.

A process reward function (`@process_reward`, grpo/rewards/process.py) is called the same way and returns a
`StepRewards` (or None) per row instead of a number; a turn reward function (`@turn_reward`, grpo/rewards/turns.py)
returns a list with one number per policy turn of an episode. `RewardSet` keeps the kinds apart for the trainer and
scores them all in one pass (`RewardSet.score`, or `score_rewards` for the functions given as lists).

Rewards given as strings are resolved, and every check that needs no weights is made, in grpo/rewards/names.py; how
the functions are called (async, threads, worker processes, `timeout`, `errors`) is grpo/rewards/runner.py.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel

from grpo.data import RESERVED_COLUMNS, is_conversational
from grpo.rewards import REWARD_ERRORS, REWARD_WORKER_TYPES
from grpo.rewards.names import distinct_names, load_reward_funcs, reward_name
from grpo.rewards.process import check_step_rewards, is_process_reward, lay_out_steps, step_reward_sums
from grpo.rewards.runner import check_rewards, run_reward_functions
from grpo.rewards.turns import (
    check_turn_credit,
    check_turn_rewards,
    is_turn_reward,
    lay_out_turns,
    policy_turns,
    turn_reward_sums,
)


class RewardScores(NamedTuple):
    # (B, K_outcome) float32, NaN where an outcome function returned None (or failed, under errors="skip")
    rewards: torch.Tensor
    # per function, outcome functions first, then process functions, then turn functions: rows whose call failed or
    # timed out (always 0 under errors="raise")
    errors: list[int]
    seconds: float  # wall-clock time of the whole scoring
    # (B, K_process, width) float32: each step's reward at its last token, NaN elsewhere (and on rows a process
    # function returned None for or failed on); (B, 0, width) without process functions
    step_rewards: torch.Tensor | None = None
    # (B, K_turn, N) float32: turn function k's score of each row's policy turn n (N: the most turns of a row), NaN
    # past a row's turns and where it gave none; (B, 0, N) without turn functions
    turn_rewards: torch.Tensor | None = None


def combine_rewards(rewards_per_func: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The reward of each row: the weighted sum over the functions that scored it (NaN entries are skipped).

        r_i = sum_{k: r_ik not NaN} w_k * r_ik,   NaN when no function scored row i

    `rewards_per_func` (B, K), `weights` (K,); returns (B,). A NaN reward means "unscored": its advantage is 0.
    The last step of the rewards stage: the trainer's advantages (grpo/objective/loss.py) start from r_i.
    """
    weighted = rewards_per_func * weights.to(rewards_per_func.device)
    scored = ~torch.isnan(rewards_per_func).all(dim=1)
    return torch.where(scored, weighted.nansum(dim=1), torch.nan)


@torch.no_grad()
def score_with_model(
    model: PreTrainedModel,
    tokenizer,
    prompts: Sequence,
    completions: Sequence,
    batch_size: int | None = None,
    chat_template_kwargs: dict | None = None,
) -> list[float]:
    """Scalar score of each (prompt, completion) pair from a one-label sequence-classification model, computed in
    chunks of `batch_size` rows (all at once when None); conversations rendered with the reward model's chat
    template and `chat_template_kwargs`."""
    if is_conversational(prompts[0]):
        # A prompt ending in an assistant message (prefill) is continued: that text already starts the completion.
        texts = [
            tokenizer.apply_chat_template(
                (p[:-1] if p[-1]["role"] == "assistant" else p) + c, tokenize=False, **(chat_template_kwargs or {})
            )
            for p, c in zip(prompts, completions)
        ]
    else:
        texts = [p + c for p, c in zip(prompts, completions)]
    device = next(model.parameters()).device
    batch_size = batch_size or len(texts)
    scores = []
    for start in range(0, len(texts), batch_size):
        inputs = tokenizer(
            texts[start : start + batch_size],
            return_tensors="pt",
            padding=True,
            padding_side="right",
            add_special_tokens=False,
        )
        logits = model(**{k: v.to(device) for k, v in inputs.items()}).logits  # (b, 1)
        scores += logits[:, 0].float().tolist()
    return scores


def _warn_unscored(rewards: torch.Tensor, step_rewards: torch.Tensor, turn_rewards: torch.Tensor, failed: bool):
    """Warn about rows that no function scored: no outcome value, step reward or turn score. They get advantage 0."""
    if rewards.shape[1] + step_rewards.shape[1] + turn_rewards.shape[1] == 0:  # nothing was asked to score
        return
    no_steps = torch.isnan(step_rewards).flatten(1).all(dim=1)  # (B,), True when K_process = 0
    no_turns = torch.isnan(turn_rewards).flatten(1).all(dim=1)  # (B,), True when K_turn = 0
    unscored = (torch.isnan(rewards).all(dim=1) & no_steps & no_turns).nonzero().flatten().tolist()
    if unscored:
        warnings.warn(
            f"No reward function scored row(s) {unscored[:20]}{' ...' if len(unscored) > 20 else ''} of this batch "
            f"({len(unscored)} of {rewards.shape[0]}): each returned None{' or failed' if failed else ''}. "
            "These rows get advantage 0. Make sure at least one reward function applies to every row.",
            stacklevel=4,
        )


def score_rewards(
    outcome_funcs: Sequence[Callable | PreTrainedModel],
    outcome_tokenizers: Sequence[Any],
    process_funcs: Sequence[Callable],
    turn_funcs: Sequence[Callable] = (),
    *,
    prompts: list,
    completions: list,
    completion_ids: list[list[int]],
    columns: dict[str, list],
    trainer_state: Any = None,
    tokenizer: Any = None,
    width: int | None = None,
    errors: str = "raise",
    timeout: float | None = None,
    num_workers: int = 0,
    worker_type: str = "thread",
    model_batch_size: int | None = None,
    chat_template_kwargs: dict | None = None,
) -> RewardScores:
    """Score every row under every outcome function or reward model (`outcome_tokenizers`: the reward models'
    tokenizers, aligned) and every process function, all called the same way (see grpo/rewards/runner.py for
    `errors`, `timeout`, `num_workers` and `worker_type`). Returns the (B, K_outcome) rewards, the
    (B, K_process, width) step rewards (`tokenizer`: the policy's, which maps `char_ends` to tokens; `width`: the
    longest completion when None), the (B, K_turn, N) scores of each policy turn (`turn_funcs`; a row's turns are
    its completion's assistant messages), the failed rows per function (outcome functions first) and the time
    taken. Reward models render conversations with `chat_template_kwargs`."""
    if errors not in REWARD_ERRORS:
        raise ValueError(f"errors={errors!r} must be one of {REWARD_ERRORS}.")
    if worker_type not in REWARD_WORKER_TYPES:
        raise ValueError(f"worker_type={worker_type!r} must be one of {REWARD_WORKER_TYPES}.")
    began = time.perf_counter()
    num_rows = len(prompts)
    width = max((len(ids) for ids in completion_ids), default=0) if width is None else width
    available = {**columns, "prompts": prompts, "completions": completions, "completion_ids": completion_ids}
    available["trainer_state"] = trainer_state
    funcs = [*outcome_funcs, *process_funcs, *turn_funcs]
    checks = [check_rewards] * len(outcome_funcs) + [check_step_rewards] * len(process_funcs)
    checks += [check_turn_rewards] * len(turn_funcs)
    values, failed = run_reward_functions(
        funcs, checks, available, errors=errors, timeout=timeout, num_workers=num_workers, worker_type=worker_type
    )

    rewards = torch.full((num_rows, len(outcome_funcs)), math.nan)  # (B, K_outcome)
    for k, (func, reward_tokenizer) in enumerate(zip(outcome_funcs, outcome_tokenizers)):
        if isinstance(func, PreTrainedModel):
            scores = score_with_model(
                func, reward_tokenizer, prompts, completions, model_batch_size, chat_template_kwargs
            )
            rewards[:, k] = torch.tensor(scores)
        else:
            rewards[:, k] = torch.tensor([math.nan if v is None else v for v in values[k]], dtype=torch.float32)
    turns_start = len(funcs) - len(turn_funcs)  # values: outcome, then process, then turn functions
    process_values = values[len(outcome_funcs) : turns_start]
    step_rewards = _step_rewards(process_funcs, process_values, completion_ids, completions, tokenizer, width)
    turn_rewards = _turn_rewards(turn_funcs, values[turns_start:], completions)
    _warn_unscored(rewards, step_rewards, turn_rewards, any(failed))
    return RewardScores(rewards, failed, time.perf_counter() - began, step_rewards, turn_rewards)


def _step_rewards(
    process_funcs: Sequence[Callable],
    values: list,
    completion_ids: list[list[int]],
    completions: list,
    tokenizer: Any,
    width: int,
) -> torch.Tensor:
    """The process functions' results (`values`, aligned with them) laid out on the completions' tokens
    (`lay_out_steps`): (B, K_process, width), NaN where no step ends."""
    laid_out = [
        lay_out_steps(step_values, completion_ids, completions, tokenizer, width, reward_name(func))
        for func, step_values in zip(process_funcs, values)
    ]
    return torch.stack(laid_out, dim=1) if laid_out else torch.empty(len(completion_ids), 0, width)


def _turn_rewards(turn_funcs: Sequence[Callable], values: list, completions: list) -> torch.Tensor:
    """The turn functions' results (`values`, aligned with them) per policy turn (`lay_out_turns`): (B, K_turn, N),
    N the most turns of a row, NaN past a row's turns and where a function gave no score."""
    counts = [policy_turns(c) for c in completions]
    most = max(counts, default=0)
    laid_out = [lay_out_turns(v, counts, most, reward_name(f)) for f, v in zip(turn_funcs, values)]
    return torch.stack(laid_out, dim=1) if laid_out else torch.empty(len(completions), 0, most)


class RewardSet:
    """The trainer's reward functions, built once: names, signatures (against the `keywords` they will be called
    with, when known: `reward_keywords`) and weights checked before any reward model loads, then rewards given as
    strings resolved and reward-model tokenizers loaded (`load_reward_funcs`), and the functions split by kind, since
    outcome, process and turn functions give different advantages (grpo/objective/advantages.py) but are called the
    same way (`score`).

    Attributes: `names` (outcome functions first, then process functions, then turn functions: the order of the
    reward columns in metrics and of `RewardScores.errors`), `outcome_funcs` and `outcome_tokenizers` (reward
    functions and reward models, with the models' tokenizers; a caller may replace the models, e.g. with ones
    prepared for its devices), `outcome_weights`, `process_weights` and `turn_weights` (float32 tensors),
    `process_funcs` (`@process_reward` functions) and `turn_funcs` (`@turn_reward` ones and environments'
    `get_turn_rewards`)."""

    def __init__(
        self,
        reward_funcs,
        reward_processing_classes=None,
        reward_weights: Sequence[float] | None = None,
        trust_remote_code: bool = False,
        keywords: Collection[str] | None = None,
    ):
        funcs, tokenizers = load_reward_funcs(
            reward_funcs, reward_processing_classes, reward_weights, trust_remote_code, keywords
        )
        weights = list(reward_weights) if reward_weights is not None else [1.0] * len(funcs)
        kinds = ["process" if is_process_reward(f) else "turn" if is_turn_reward(f) else "outcome" for f in funcs]
        self.outcome_funcs = [f for f, k in zip(funcs, kinds) if k == "outcome"]
        self.outcome_tokenizers = [t for t, k in zip(tokenizers, kinds) if k == "outcome"]
        self.process_funcs = [f for f, k in zip(funcs, kinds) if k == "process"]
        self.turn_funcs = [f for f, k in zip(funcs, kinds) if k == "turn"]
        self.outcome_weights, self.process_weights, self.turn_weights = (
            torch.tensor([w for w, k in zip(weights, kinds) if k == kind], dtype=torch.float32)
            for kind in ("outcome", "process", "turn")
        )
        # Two functions of one name get `<name>` and `<name>_2`: their metrics would otherwise merge.
        self.names = distinct_names(
            [reward_name(f) for f in [*self.outcome_funcs, *self.process_funcs, *self.turn_funcs]]
        )

    def check_run(self, args, toolbox) -> None:
        """Refuse, when the trainer is built, settings of `args` (its `GRPOConfig`) that these functions would leave
        doing nothing: turn credit without turns or turn scores (`check_turn_credit`; `toolbox`: the trainer's tools
        and environments, or None), reward weights that are all 0, a `scale_rewards` that GDPO ignores; and warn
        where `reward_timeout` would end a sandboxed reward's call before one run's own wall-clock limit."""
        check_turn_credit(args.turn_advantage, toolbox, self.turn_funcs)
        weights = torch.cat([self.outcome_weights, self.process_weights, self.turn_weights]).tolist()
        if weights and not any(weights):
            listed = ", ".join(f"{name}: {weight:g}" for name, weight in zip(self.names, weights))
            raise ValueError(
                f"All reward_weights are 0 ({listed}): every reward counts for nothing, so every advantage is 0 and "
                "the run would train nothing. Give at least one reward function a non-zero weight."
            )
        # GDPO normalises each outcome function by its group's std and their sum by the batch's, whatever
        # scale_rewards says (TRL 1.16 ignores it there too); only process rewards and turn credit still read it.
        gdpo = args.multi_objective_aggregation == "normalize_then_sum"
        if gdpo and args.scale_rewards != "group" and not self.process_funcs and args.turn_advantage is None:
            raise ValueError(
                f"scale_rewards={args.scale_rewards!r} does nothing under multi_objective_aggregation="
                "'normalize_then_sum' (GDPO): each reward function is divided by its group's std and the weighted "
                "sum by the batch's std, as in TRL, which ignores scale_rewards there too; it applies only to "
                "process rewards (@process_reward) and turn credit (turn_advantage), which this run has none of. "
                "Leave scale_rewards at 'group', or set multi_objective_aggregation='sum_then_normalize'."
            )
        warn_if_timeout_cuts_runs([*self.outcome_funcs, *self.process_funcs, *self.turn_funcs], args.reward_timeout)

    def score(self, **keywords) -> RewardScores:
        """Every function of the set on one batch, in one pass: `score_rewards` with this set's functions and the
        same keywords (prompts, completions, completion_ids, columns, trainer_state, tokenizer, width, errors,
        timeout, num_workers, worker_type, model_batch_size, chat_template_kwargs). `rewards` is (B, K_outcome),
        `step_rewards` (B, K_process, width), `turn_rewards` (B, K_turn, N) and `errors` has one count per function
        in `names` order."""
        return score_rewards(
            self.outcome_funcs, self.outcome_tokenizers, self.process_funcs, self.turn_funcs, **keywords
        )

    def columns(
        self, rewards_per_func: torch.Tensor, step_rewards: torch.Tensor, turn_rewards: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, K) one reward column per function in `names` order (a process function's: the sum of its step
        rewards, NaN without steps; a turn function's: the sum of its turn scores, NaN without any) and the combined
        reward of each row over every function that scored it."""
        if turn_rewards is None:
            turn_rewards = rewards_per_func.new_empty(rewards_per_func.shape[0], len(self.turn_funcs), 0)
        sums = [rewards_per_func, step_reward_sums(step_rewards), turn_reward_sums(turn_rewards)]
        weights = torch.cat([self.outcome_weights, self.process_weights, self.turn_weights])
        return torch.cat(sums, dim=1), combine_rewards(torch.cat(sums, dim=1), weights)


def warn_if_timeout_cuts_runs(funcs: Sequence[Callable], reward_timeout: float | None) -> None:
    """Warn about each reward function that says how long one row's run may take (a `wall_seconds` attribute: the
    sandbox limit of `code_execution`, grpo/rewards/builtin.py) when `reward_timeout` does not leave it that long:
    one row whose code runs to its limit would time the whole call out, failing every row of it (`reward_errors`),
    and the call's sandboxes would be killed before the code's own limit."""
    for func in funcs:
        wall = getattr(func, "wall_seconds", None)
        if reward_timeout is None or not isinstance(wall, (int, float)) or wall < reward_timeout:
            continue
        warnings.warn(
            f"The reward '{reward_name(func)}' runs each row's code for up to {wall} s (wall_seconds={wall}), but "
            f"reward_timeout={reward_timeout} s ends the whole call first: one row whose code runs that long fails "
            "every row of the call (see reward_errors), not only its own, and the call's sandboxes are killed. Set "
            "reward_timeout above the wall time (a call runs its rows max_parallel at a time: a few times it), or "
            f"build the reward with wall_seconds below {reward_timeout} s.",
            UserWarning,
            stacklevel=3,
        )


def reward_keywords(train_dataset, eval_dataset, toolbox, offline_data, episodes: Sequence) -> frozenset[str] | None:
    """The keywords `score_rewards` calls the reward functions with on the rows of these data sets: the standard
    ones (RESERVED_COLUMNS), every column but `prompt` (which arrives as `prompts`) that both data sets have, and
    `environments` in episodes with tools or environments (`toolbox`). None where they are known only at the first
    round: offline data (`offline_data`), an agent or rollout function (`episodes`: the trainer's tools,
    environment_factory, agent_func and rollout_func), a data set that does not list its columns."""
    if offline_data is not None or any(f is not None for f in episodes[2:]):
        return None
    given = [d for d in (train_dataset, eval_dataset) if d is not None]
    listed = [getattr(d, "column_names", None) for d in given]
    if not given or any(columns is None for columns in listed):
        return None
    shared = set.intersection(*(set(columns) for columns in listed)) - {"prompt"}
    return frozenset({*RESERVED_COLUMNS, *shared, *(["environments"] if toolbox is not None else [])})


def call_settings(args, mode: str) -> dict[str, Any]:
    """How a `GRPOConfig` has reward functions called (`RewardSet.score` keywords) in `mode` ("train"/"eval")."""
    return {
        "errors": args.reward_errors,
        "timeout": args.reward_timeout,
        "num_workers": args.reward_num_workers,
        "worker_type": args.reward_worker_type,
        "model_batch_size": args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size,
        "chat_template_kwargs": args.chat_template_kwargs,
    }
