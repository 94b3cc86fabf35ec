"""`RoundMaker`: steps 2-7 of a generation round in one object, from the data loader's rows to the `Rollout` the
trainer cuts into micro-batches (docs/architecture.md, "One optimizer step").

    2-3. sample: render and tokenize the prompts, generate, cut each completion after its first EOS (`sample_round`)
    4.   score every completion on the process that made it, gather the rewards of all processes, check them
         (`score_round`); with `async_generation`, steps 2-4's local part was made ahead (async_rounds.py)
    4b.  dynamic sampling: zero-advantage groups replaced from extra rounds (`dynamic_sampling`)
    5.   group advantages over the gathered rewards; this process keeps its rows, or with sequence parallelism its
         group's (`prepare`)
    7.   the reference policy's log-probs, when beta != 0 (`prepare`); the round's metrics recorded throughout

It owns the sampler (the generation backend), its random stream and what a checkpoint must carry of the rounds
(`state_dict`). What it reads of the trainer at a round (the models and counters, which `Trainer` may replace during
a run) comes in a `RoundContext`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import warnings
import weakref
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from accelerate.utils import gather
from transformers import TrainerState

from grpo.data import InputError, is_conversational, is_stream
from grpo.data.sampler import StepSchedule
from grpo.data.stream import train_stream
from grpo.data.vision import text_tokenizer
from grpo.generation import SamplingRNG, TransformersGeneration, make_generation_backend, sample_rollout
from grpo.generation.policy_weights import zero3_gathered_for_generation
from grpo.generation.tools import tool_set
from grpo.models import unwrap_parallel
from grpo.objective.advantages import mixed_advantages, turn_credit_advantages
from grpo.objective.loss import window_token_totals
from grpo.objective.reference import reference_policy
from grpo.objective.settings import ObjectiveSettings
from grpo.rewards.scoring import RewardSet, call_settings, combine_rewards
from grpo.rollout import MicroBatch, Rollout, first_row, gather_rows
from grpo.training import metrics
from grpo.training.async_rounds import AsyncRounds
from grpo.training.checkpoint_checks import changed_tools
from grpo.training.checkpoints import any_process
from grpo.training.dynamic_sampling import RefillPrompts, fill_groups
from grpo.training.metrics import MetricsWindow
from grpo.training.nonfinite import check_reward_spread, finite_rewards
from grpo.training.rollouts_file import save_round

logger = logging.getLogger(__name__)


class RoundContext(NamedTuple):
    """What a round reads of the trainer when it is made: the policy as `Trainer` holds it (`model`) and wrapped for
    its engine (`wrapped`: a ZeRO-3 engine gathers the weights for generation), the `reference` policy (None when
    beta = 0), Trainer's `state` (its global_step; reward functions get it as `trainer_state`), the `micro_step`
    the round starts at, and the run's `schedule` of optimizer steps (None outside training)."""

    model: torch.nn.Module
    wrapped: torch.nn.Module
    reference: torch.nn.Module | None
    state: TrainerState
    micro_step: int = 0
    schedule: StepSchedule | None = None


class RoundMaker:
    """Steps 2-7 of every generation round of one trainer (module docstring). `metric_windows`: the trainer's
    windows by mode, which the round's metrics go into; `logprobs`: the run's log-prob pass (objective/logprobs.py
    `LogProbs`), for the reference's log-probs and a policy copy's under async generation."""

    def __init__(
        self,
        args,
        accelerator,
        settings: ObjectiveSettings,
        rewards: RewardSet,
        *,
        processing_class,
        eos_token_ids,
        agent,
        logprobs,
        metric_windows: dict[str, MetricsWindow],
        train_dataset,
        offline_data,
    ):
        self.args, self.accelerator, self.settings, self.rewards = args, accelerator, settings, rewards
        self.processing_class, self.eos_token_ids = processing_class, eos_token_ids
        self.tokenizer = text_tokenizer(processing_class)  # a vision-language model's: its processor's
        self.agent, self.logprobs, self.metric_windows = agent, logprobs, metric_windows
        self.train_dataset, self.offline_data = train_dataset, offline_data
        # A streamed training set: its rounds, read in order (data/stream.py); the loader and checkpoints use it.
        self.stream = train_stream(args, train_dataset) if is_stream(train_dataset) else None
        # The sampler (offline: stored completions replayed), with a random stream of its own (generation/base.py).
        self.sampling_rng = SamplingRNG(args.seed + accelerator.process_index, accelerator.device)
        self.generation = make_generation_backend(
            args, accelerator, processing_class, eos_token_ids, offline_data, self.sampling_rng
        )
        self.refill = RefillPrompts(args)  # extra prompts for dynamic sampling
        self.num_tokens = 0  # prompt + completion tokens seen in training, all processes
        self.samples: list[dict] = []  # the latest round's completions, for `log_completions`
        self.warned_truncation = False  # prompts were cut to max_prompt_length and warned about
        self.warned_extra_sequences = False  # an agent's extra sequences were dropped and warned about
        # With async_generation, rounds made ahead in a producer thread on a shared sampler (async_rounds.py).
        self.async_rounds = AsyncRounds(self) if args.async_generation else None
        # A sampler that holds something to release (a colocated vLLM engine, and the environment variables it set)
        # is closed with the round maker, not at the end of training: evaluation after `train()` samples with it, and
        # vLLM cannot build a second engine in a process of a distributed run.
        if hasattr(self.generation, "close"):
            weakref.finalize(self, self.generation.close)

    # ---- Steps 2-7 ----

    def make(self, inputs: list[dict[str, Any]], mode: str, context: RoundContext) -> Rollout:
        """Steps 2-7 for the loader's rows `inputs` in `mode` ("train" or "eval"): this process's rows, with their
        advantages and (beta != 0) reference log-probs."""
        if mode == "train" and self.stream is not None:
            self.check_same_stream()
        rollout = self.sample_and_score(inputs, mode, context)
        if mode == "eval" and rollout.first_row is None:  # a last, shorter batch may split unevenly among processes
            rollout.first_row = first_row(self.accelerator, rollout.num_rows)
        if mode == "train" and self.args.dynamic_sampling:
            rollout = self.dynamic_sampling(rollout, context)
        return self.prepare(rollout, mode, context)

    def check_same_stream(self) -> None:
        """Every process must have read the same round of a stream (a group may span processes): a stream that
        gives each reader other rows (a queue, an unseeded shuffle) is refused at its first round, not trained on."""
        if self.accelerator.num_processes == 1:
            return
        mine = torch.tensor([self.stream.fingerprint()], dtype=torch.int64, device=self.accelerator.device)
        everyone = gather(mine)
        if not bool((everyone == mine).all()):
            raise InputError(
                f"The processes read different rows from train_dataset, a stream ({type(self.train_dataset).__name__}), "
                f"at round {self.stream.current[0]}: each process reads the whole stream and takes its rows of every "
                "round, so the stream must give every reader the same rows in the same order. Seed any shuffling "
                "it does, or load the data set whole."
            )

    def sync_weights(self, model: torch.nn.Module, global_step: int) -> None:
        """A sampler with weights of its own (vLLM, async generation's copy) gets those of the latest step."""
        self.generation.sync_weights(unwrap_parallel(model), version=global_step)

    def sample_and_score(self, inputs: list[dict[str, Any]], mode: str, context: RoundContext) -> Rollout:
        """Steps 2-4: generate, cut and score this process's rows; rewards are gathered from all processes."""
        self.sync_weights(context.model, context.state.global_step)
        if self.async_rounds is not None and mode == "train":  # made ahead, this process's rows scored
            rollout, columns, scores = self.async_rounds.take(inputs, context)
        else:
            rollout, columns = self.sample_round(inputs, self.generation, context)
            scores = self.local_scores(rollout, columns, mode, context.state)
        rollout = self.score_round(rollout, columns, mode, context.state, scores)
        self.record_metrics(mode, rollout)  # every generated round, also those dynamic sampling drops
        return rollout

    def sample_round(self, inputs: list[dict[str, Any]], backend, context: RoundContext):
        """Steps 2-3 for the dataset rows `inputs` with `backend` (`sample_rollout`), on this process's device:
        (Rollout, the rows' other columns); offline (`StoredCompletions`), the stored completions of the drawn groups.
        The async producer and the CLI's before/after report sample rounds this way too."""
        policy, args = unwrap_parallel(context.model), self.args
        own = isinstance(backend, TransformersGeneration)  # `model.generate` on the policy's own weights
        # ZeRO-3: the weights gathered whole (unless ds3_gather_for_generation=False). Mixed precision: one autocast
        # region around the round, so each weight is cast to bf16 / fp16 once, not at every generated token.
        gathered = zero3_gathered_for_generation(context.wrapped, own and args.ds3_gather_for_generation)
        # Episodes of a sharded policy (FSDP, ZeRO-3) generate collectively: every process runs as many turns.
        lockstep = (
            functools.partial(any_process, self.accelerator) if own and self.accelerator.num_processes > 1 else None
        )
        with gathered, self.accelerator.autocast() if own else contextlib.nullcontext():
            rollout, columns = sample_rollout(
                inputs, backend, policy, self.processing_class, self.eos_token_ids, args, self.agent, lockstep
            )
        return rollout.to(self.accelerator.device), columns

    def local_scores(self, rollout: Rollout, columns: dict[str, list], mode: str | None, state: TrainerState):
        """Every reward function on this process's rows (`RewardSet.score`); no collective call, so the async
        producer thread calls it too. The episodes' environment objects, which the rewards see live, are then free
        for the next round's episodes."""
        try:
            scores = self.rewards.score(
                prompts=rollout.prompts,
                completions=rollout.completions,
                completion_ids=rollout.completion_lists(),
                columns=columns,
                trainer_state=state,
                tokenizer=self.tokenizer,
                width=rollout.completion_ids.shape[1],
                **call_settings(self.args, mode),
            )
            # agent_func's failed episodes (generation/agent_function.py) get agent_failure_reward.
            score_failures = getattr(self.agent, "score_failures", None)
            return scores if score_failures is None else score_failures(scores, columns)
        finally:
            if self.agent is not None:
                self.agent.give_back(columns)

    def score_round(self, rollout: Rollout, columns, mode: str | None, state: TrainerState, scores=None) -> Rollout:
        """Step 4: every reward function on this process's rows (unless `scores` has them), then the rewards of
        all processes (a group may span processes), checked (`finite_rewards`); a collective call, on every
        process. `mode` None: no metrics recorded."""
        device, names, global_step = self.accelerator.device, self.rewards.names, state.global_step
        scores = self.local_scores(rollout, columns, mode, state) if scores is None else scores
        if mode is not None:  # failed rows summed over processes, the slowest process's time
            errors = self.accelerator.reduce(torch.tensor(scores.errors, dtype=torch.float32, device=device), "sum")
            slowest = gather(torch.tensor([scores.seconds], device=device)).max()
            skip = self.args.reward_errors == "skip"
            metrics.add_reward_call_metrics(self.metric_windows[mode], errors, slowest, names, count_errors=skip)
        rewards = self.finite_rewards(scores.rewards.to(device), names, rollout.num_rows, global_step)
        # Step rewards: (B, K_p, T), padded to the longest completion of all processes before gathering.
        steps = self.accelerator.pad_across_processes(scores.step_rewards.to(device), dim=2, pad_index=torch.nan)
        kinds = len(self.rewards.outcome_funcs), len(self.rewards.process_funcs)
        steps = self.finite_rewards(steps, names[kinds[0] : sum(kinds)], rollout.num_rows, global_step)
        if rollout.turn_index is None:  # single-turn completions: nothing per turn
            return replace(rollout, rewards_per_func=rewards, step_rewards=steps)
        # Multi-turn episodes: each token's turn and each turn's scores, gathered like the step rewards (N: turns).
        turns = self.accelerator.pad_across_processes(rollout.turn_index, dim=1, pad_index=-1)
        turns = gather_rows(self.accelerator, turns, -1)
        turn_rewards = self.accelerator.pad_across_processes(
            scores.turn_rewards.to(device), dim=2, pad_index=torch.nan
        )
        turn_rewards = self.finite_rewards(turn_rewards, names[sum(kinds) :], rollout.num_rows, global_step)
        return replace(
            rollout, rewards_per_func=rewards, step_rewards=steps, turn_index=turns, turn_rewards=turn_rewards
        )

    def finite_rewards(self, rewards: torch.Tensor, names: list[str], rows: int, step: int) -> torch.Tensor:
        """All processes' `rewards` (gathered) through `finite_rewards` (nonfinite.py), counting what it unscored."""
        rewards = gather_rows(self.accelerator, rewards, torch.nan)
        rewards, count = finite_rewards(rewards, names, self.args.nonfinite, step, rows)
        if count:
            self.metric_windows["train"].add_sum("nonfinite/reward_rows", count)
        return rewards

    def advantages(self, rollout: Rollout, mode: str, step: int) -> torch.Tensor:
        """Step 5: advantages of all processes' rows, (B_global,), or (B_global, T_global) with process rewards or
        turn-level credit."""
        rewards = combine_rewards(rollout.rewards_per_func, self.rewards.outcome_weights)  # (B_global,)
        groups = rollout.groups(self.args.generations(mode))  # G, or each group's size (offline)
        check_reward_spread(rewards, groups, step)
        weights = self.rewards.process_weights.to(rewards.device)
        per_func = (rollout.rewards_per_func, self.rewards.outcome_weights.to(rewards.device))  # GDPO's inputs
        s = self.settings.advantages
        advantages = mixed_advantages(
            rewards,
            rollout.step_rewards,
            weights,
            groups,
            s.scale_rewards,
            baseline=s.baseline,
            aggregation=s.aggregation,
            per_func=per_func,
        )
        if s.turn_scheme is None or rollout.turn_rewards is None:
            return advantages
        return turn_credit_advantages(
            advantages,
            rollout.turn_rewards,
            self.rewards.turn_weights.to(rewards.device),
            rollout.turn_index,
            groups,
            s.turn_scheme,
            s.turn_coef,
            s.scale_rewards,
        )

    def dynamic_sampling(self, rollout: Rollout, context: RoundContext) -> Rollout:
        """Step 4b (DAPO dynamic sampling, dynamic_sampling.py): zero-advantage groups replaced by groups with a
        spread from extra rounds; this process's share of the chosen groups."""
        args, pad_id, index = self.args, self.tokenizer.pad_token_id, self.accelerator.process_index

        def next_rollout() -> Rollout:  # a round from prompts no round of this epoch has drawn
            return self.sample_and_score(
                self.refill.take(self.train_dataset, index, rollout.num_rows), "train", context
            )

        rounds, chosen, counts = fill_groups(
            rollout,
            gather=lambda r: r.gather(self.accelerator, pad_id),
            advantages=lambda r: self.advantages(r, "train", context.state.global_step),
            next_rollout=next_rollout,
            num_groups=args.generation_batch_size // args.num_generations,
            num_generations=args.num_generations,
            max_extra_rounds=args.max_dynamic_sampling_rounds,
        )
        for name, count in counts.items():
            self.metric_windows["train"].add_mean(name, count, 1)
        return Rollout.select(rounds, chosen, rollout.local_slice(index), pad_id)

    def prepare(self, rollout: Rollout, mode: str, context: RoundContext) -> Rollout:
        """Steps 5 and 7 on a generated (and maybe resampled) rollout: this process's advantages, then the reference
        log-probs, recorded once, before any update; the completions log and the rollouts file."""
        args = self.args
        advantages = self.advantages(rollout, mode, context.state.global_step)
        local = advantages[rollout.local_slice(self.accelerator.process_index)]
        rollout = replace(
            rollout,
            advantages=local if local.dim() == 1 else local[:, : rollout.completion_ids.shape[1]],
            sampling_logps=rollout.sampling_logps if self.settings.loss.keeps_sampling_logps else None,
        )
        if args.log_completions and mode == "train":  # with log_multimodal, the prompts' images saved beside
            main = self.accelerator.is_main_process
            self.samples = metrics.round_samples(rollout, self.rewards, advantages, args.output_dir, main)
        if args.save_rollouts and mode == "train":  # to output_dir/rollouts.jsonl
            step = context.state.global_step
            save_round(args.output_dir, self.accelerator, rollout, self.rewards, step)
        rollout = self.with_extra_sequences(replace(rollout, images=None))
        group = getattr(self.logprobs, "sequence_parallel", None)
        if group is not None:  # a sequence-parallel group trains its processes' rows together
            rollout = rollout.pooled(group.gather_objects, self.tokenizer.pad_token_id)
        chunk = args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size
        if self.settings.loss.beta != 0:
            with torch.no_grad(), reference_policy(context.model, context.reference) as reference:
                rollout.ref_logps, _ = self.logprobs(reference, rollout, batch_size=chunk)
        return rollout

    def with_extra_sequences(self, rollout: Rollout) -> Rollout:
        """An agent's episodes with several trained sequences (agent_function.py): the extra ones become rows of
        their own, with their episode's advantage. Per-token advantages (process rewards, turn-level credit) belong
        to each row's own tokens, so there the extra sequences are not trained, and a warning says so once."""
        if rollout.extra_sequences is None:
            return rollout
        if rollout.advantages.dim() == 2:
            if not self.warned_extra_sequences and any(rollout.extra_sequences):
                self.warned_extra_sequences = True
                logger.warning(
                    "Some agent episodes have several trained sequences (the agent edited its history), but the "
                    "advantages are per token (process rewards or turn_advantage), which only the first sequence "
                    "has: the others are not trained. Keep the agent's history growing, or use outcome rewards."
                )
            return replace(rollout, extra_sequences=None)
        return rollout.with_extra_sequences(self.tokenizer.pad_token_id, self.args.mask_truncated_completions)

    def record_metrics(self, mode: str, rollout: Rollout) -> None:
        """Metrics of one generation round, over the rows of all processes (metrics.py)."""
        columns, rewards = self.rewards.columns(rollout.rewards_per_func, rollout.step_rewards, rollout.turn_rewards)
        lengths = gather_rows(self.accelerator, rollout.sampled_mask.sum(dim=1))  # (B_global,) policy tokens
        truncated = gather_rows(self.accelerator, rollout.is_truncated)
        window, groups = self.metric_windows[mode], rollout.groups(self.args.generations(mode))
        metrics.add_round_metrics(window, lengths, truncated, columns, rewards, self.rewards.names, groups)
        if rollout.prompt_truncated is not None:  # prompts cut to max_prompt_length: counted, and warned of once
            cut = gather_rows(self.accelerator, rollout.prompt_truncated)
            chats = is_conversational(rollout.prompts[0]) if rollout.prompts else False
            self.warned_truncation = metrics.add_prompt_metrics(window, cut, self.args, self.warned_truncation, chats)
        if rollout.episode_stats is not None:  # multi-turn episodes: tools/* per episode, over all processes
            metrics.add_episode_metrics(window, rollout.episode_stats, self.accelerator)
        if mode == "train":
            tokens = rollout.prompt_mask.sum() + rollout.completion_mask.sum()
            self.num_tokens += int(self.accelerator.reduce(tokens, reduction="sum"))
            window.set_last("num_tokens", self.num_tokens)

    def micro_batches(self, rollout: Rollout, mode: str) -> list[MicroBatch]:
        """This process's rows as the micro-batches `compute_loss` reads: `steps_per_generation` of them in training,
        one in evaluation. Each carries `window_loss_tokens`, the loss tokens of its optimizer step's micro-batches
        on all processes, when the loss type normalises over the whole step (one micro-batch's in evaluation)."""
        training = mode == "train"
        micro_batches = rollout.micro_batches(self.args.steps_per_generation if training else 1)
        window = 1  # evaluation: each micro-batch is a step of its own
        if training:
            window = self.args.gradient_accumulation_steps if self.settings.loss.spans_the_step else None
        if window is not None:
            local = torch.stack([mb.loss_mask.sum() for mb in micro_batches]).float()  # (num,)
            totals = window_token_totals(self.accelerator.reduce(local, reduction="sum"), window)
            for mb, tokens in zip(micro_batches, totals):
                mb.window_loss_tokens = tokens
        return micro_batches

    def take_samples(self) -> list[dict]:
        """The latest round's completions for the completions log, once."""
        samples, self.samples = self.samples, []
        return samples

    # ---- What a checkpoint carries of the rounds, and the end of a run ----

    def state_dict(self) -> dict[str, Any]:
        """The rounds' state beyond the buffer: tokens seen, the refill prompts' position, the completions not yet
        logged, the sampler's random stream, a streamed training set's position, and the tools offered (`tool_set`:
        a resume with other tools warns)."""
        return {
            "tools": tool_set(getattr(self.agent, "toolbox", None)),
            "num_tokens": self.num_tokens,
            "refill_position": self.refill.position,
            "samples": self.samples,
            "sampling_rng": self.sampling_rng.state_dict(),
            "stream": None if self.stream is None else self.stream.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        changed = changed_tools(state.get("tools"), tool_set(getattr(self.agent, "toolbox", None)))  # None: not saved
        if changed and self.args.should_save:
            warnings.warn(changed, stacklevel=3)
        self.num_tokens = state["num_tokens"]
        self.refill.position = state["refill_position"]
        self.samples = state["samples"]
        self.sampling_rng.load_state_dict(state.get("sampling_rng"))  # None: written before it had one
        if self.stream is not None and state.get("stream") is not None:  # else read again up to the resumed round
            self.stream.load_state_dict(state["stream"])

    def close(self) -> None:
        """At the end of training: stop the producer thread, then close the agent's tool executor and environments
        (evaluation after `train()` makes new ones). The sampler stays: evaluation after `train()` samples with it
        (its own `close` runs when the round maker is collected)."""
        if self.async_rounds is not None:
            self.async_rounds.close()
        if self.agent is not None:
            self.agent.close()
