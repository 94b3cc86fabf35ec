"""`GRPOTrainer`: Group Relative Policy Optimization as a `transformers.Trainer`. It sequences one step (see the
class docstring); generation, rewards, the `Rollout`, the loss and the checkpoints live in their own modules
(docs/architecture.md).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from accelerate.utils import gather, set_seed
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TrainerCallback,
)

from grpo.config import GRPOConfig
from grpo.data import check_prompt_dataset, check_prompt_lengths, offline
from grpo.data.sampler import check_dataset_sizes
from grpo.data.vision import check_vision_run, has_images, text_tokenizer
from grpo.generation import SamplingRNG, TransformersGeneration, make_generation_backend, sample_rollout
from grpo.generation.episodes import make_agent
from grpo.generation.policy_weights import zero3_gathered_for_generation
from grpo.generation.tools import Toolbox
from grpo.models import is_peft_model, load_policy, prepare_frozen, unwrap_parallel
from grpo.objective import old_policy
from grpo.objective.advantages import advantage_settings, mixed_advantages
from grpo.objective.logprobs import completion_logprobs, logprob_settings
from grpo.objective.loss import accumulation, loss_settings, policy_loss, spans_the_step, window_token_totals
from grpo.objective.reference import ReferenceUpdate, make_reference, reference_moves, reference_policy
from grpo.objective.regularizers import loss_terms, router_aux_term
from grpo.objective.shared_prompt import forward_layout
from grpo.objective.token_weights import keeps_sampling_logps, policy_mask, sampling_weights
from grpo.rewards.environments import with_environment_rewards
from grpo.rewards.scoring import RewardSet, call_settings, combine_rewards
from grpo.rewards.stored import offline_rewards
from grpo.rollout import MicroBatch, Rollout, TokenBatch, gather_rows
from grpo.training import hub_log, metrics
from grpo.training.async_rounds import AsyncRounds
from grpo.training.checkpoints import (
    STATE_FILE,
    ResumableTrainer,
    load_reference,
    load_state,
    round_settings,
    save_reference,
    save_state,
)
from grpo.training.dynamic_sampling import RefillPrompts, fill_groups
from grpo.training.loaders import RoundLoaders
from grpo.training.metrics import MetricsWindow
from grpo.training.nonfinite import GradientGuard, LossRecord, check_reward_spread, finite_rewards
from grpo.training.output_dir import own_output_dir
from grpo.training.rollouts_file import save_round
from grpo.training.signal_watch import SignalWatch

RewardFunc = Callable[..., list] | PreTrainedModel | str


class GRPOTrainer(RoundLoaders, ResumableTrainer):
    """Trains a causal LM with GRPO (DeepSeekMath, arXiv:2402.03300) and its variants (see `GRPOConfig.loss_type`).

    One optimizer step, as data flows (docs/method.md, "What one step computes"):
      1. The sampler repeats each prompt G times; one generation round feeds `steps_per_generation` micro-steps and
         is replayed `num_iterations` times from a buffer (`_prepare_inputs`).
      2. Generate one completion per row (`self.generation`).
      3. Cut each completion after its first EOS; flag the truncated ones.
      4. Score every completion with every reward function (process functions: step rewards); gather rewards
         from all processes. With `dynamic_sampling`, replace zero-advantage groups from extra rounds (4b).
         With `async_generation`, the next round's steps 2-4 on this process run in a producer thread while this one
         trains (grpo/training/async_rounds.py); the rewards are gathered when the trainer takes the round.
      5. Group advantages over the gathered rewards (per token with process rewards); keep this process's rows.
      6. pi_old: a micro-batch trained before its round's first optimizer step has it in its own training pass
         (old = logp.detach(), kept for replays); the others get old log-probs from a pass before any update.
      7. Reference log-probs, only when beta != 0.
      8. `compute_loss`: policy log-probs and the clipped objective, scaled once for gradient accumulation.

    Args:
        model: a path or hub id (loaded with `AutoModelForCausalLM.from_pretrained` and `args.model_init_kwargs`),
            or a `PreTrainedModel`.
        reward_funcs: one or a list of reward functions `f(prompts, completions, **kwargs) -> list[float | None]`
            (plain or `async def`), reward models (`PreTrainedModel` with one label) or paths/hub ids of reward
            models. Built-ins are in `grpo.rewards`; how they are called is set by `reward_errors`,
            `reward_timeout`, `reward_num_workers` and `reward_worker_type` (docs/rewards.md).
        args: a `GRPOConfig`; default `GRPOConfig(output_dir="<model name>-GRPO")`.
        train_dataset, eval_dataset: datasets with a `prompt` column (string or list of chat messages); every other
            column is passed to the reward functions. A train_dataset of scored completions (a `completion` column)
            is trained on without generation, and then reward_funcs may be None (grpo/data/offline.py).
        processing_class: the tokenizer, or a VLM's processor (docs/vlm.md); loaded from the model's path if omitted.
        reward_processing_classes: tokenizers of the reward models, aligned with `reward_funcs` (None entries are
            loaded from each reward model's path).
        callbacks, optimizers: as for `transformers.Trainer`.
        peft_config: a `peft.PeftConfig` (e.g. `LoraConfig`): the model is wrapped with `peft.get_peft_model` and
            only the adapter trains. A `PeftModel` passed as `model` works the same. Either way the reference
            policy (beta != 0) is the same network with the adapter disabled, not a copy (docs/peft.md).
    """

    # compute_loss divides for gradient accumulation itself; Trainer must not divide again.
    loss_is_scaled_for_ga = True
    _warned_truncation = False  # set once prompts were cut to max_prompt_length and warned about

    def __init__(
        self,
        model: str | os.PathLike | PreTrainedModel,
        reward_funcs: RewardFunc | list[RewardFunc] | None = None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase | None] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        peft_config=None,
        tools: list[Callable] | None = None,
        environment_factory=None,
    ):
        model = source = os.fspath(model) if isinstance(model, os.PathLike) else model
        args = GRPOConfig.for_model(model) if args is None else args
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a GRPOConfig, got {type(args).__name__}")
        own_output_dir(args, model)  # absolute from now on (a reward's os.chdir cannot move it), outside the model

        # Checks needing no weights come first. self.offline_data: stored, scored completions as groups (data/offline.py).
        self.offline_data = offline.offline_groups(train_dataset, eval_dataset, args, reward_funcs)
        self.vision = images = has_images(train_dataset, eval_dataset)  # images beside the prompts: docs/vlm.md
        train_dataset = self.offline_data if self.offline_data is not None else train_dataset
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            check_prompt_dataset(dataset, name)
        check_dataset_sizes(args, train_dataset, eval_dataset, groups=self.offline_data is not None)  # not at train()
        reference_moves(args, peft=peft_config is not None or is_peft_model(model))  # PEFT: pi_ref cannot move
        check_vision_run(args, processing_class, images, tools or environment_factory, self.offline_data)  # VLMs
        # Tools and environments (multi-turn episodes): schemas and environments checked now; get_reward scores.
        self.toolbox = Toolbox(tools or (), environment_factory) if tools or environment_factory else None
        reward_funcs, weights = with_environment_rewards(reward_funcs, self.toolbox, args.reward_weights)
        self.completions_hub = hub_log.for_run(args)  # log_completions_hub_repo: token and repository, checked now
        # Reward functions: names, signatures and weights checked, then reward models named by path loaded; by kind.
        rewards = offline_rewards(self.offline_data, reward_funcs, reward_processing_classes, weights)
        self.rewards = RewardSet(*rewards, trust_remote_code=args.trust_remote_code)
        model, processing_class, self.eos_token_ids = load_policy(model, processing_class, peft_config, args, images)
        self.tokenizer = tokenizer = text_tokenizer(processing_class)  # a vision-language model's: its processor's
        check_prompt_lengths(tokenizer, model.config, args, train_dataset, eval_dataset)  # room to complete
        self.agent = make_agent(self.toolbox, tokenizer, self.eos_token_ids, args, train_dataset)
        self.ref_model, self._reference_moves = make_reference(model, args, source)  # pi_ref (objective/reference.py)
        self.entropy_control, self.router_aux_coef = loss_terms(args, model.config)  # beside the objective
        self.padding_free, self.share_prompt = forward_layout(args, model, announce=args.process_index == 0)

        self.metric_windows = {"train": MetricsWindow(), "eval": MetricsWindow()}
        self._buffer: list[MicroBatch] = []  # micro-batches of the current generation round
        self._step = 0  # training micro-steps taken (resumes from global_step)
        self._num_tokens = 0  # prompt + completion tokens seen in training, all processes
        self._samples: list[dict] = []  # the latest round's completions, for `log_completions`
        self._refill = RefillPrompts(args)  # extra prompts for dynamic sampling

        super().__init__(
            model=model,
            args=args,
            data_collator=list,  # a loader batch is the list of its dataset rows
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=[*(callbacks or []), SignalWatch()] if args.learning_signal_warnings else callbacks,
            optimizers=optimizers,
        )
        if args.keep_freed_cpu_memory and self.accelerator.device.type == "cpu":
            # Opt-in CPU tuning: process-wide malloc settings (grpo/contrib/cpu/memory.py), loaded only when asked for.
            from grpo.contrib.cpu import memory

            memory.keep_freed_memory()
        self.gradient_guard = GradientGuard(self.accelerator, args.nonfinite, self.metric_windows["train"])
        self.add_callback(self.gradient_guard)
        if self._reference_moves:
            self.add_callback(ReferenceUpdate(self))
        self._prepare_frozen_models()
        # The sampler (offline: stored completions replayed), with a random stream of its own (generation/base.py).
        rng = self.sampling_rng = SamplingRNG(args.seed + self.accelerator.process_index, self.accelerator.device)
        self.generation = make_generation_backend(
            args, self.accelerator, processing_class, self.eos_token_ids, self.offline_data, rng
        )
        # With async_generation, rounds made ahead in a background thread on a shared sampler (grpo/training/async_rounds.py).
        self._async = AsyncRounds(self) if args.async_generation else None
        set_seed(args.seed, device_specific=True)  # each process's own seed for torch's generators too

    def _prepare_frozen_models(self) -> None:
        """The reference and the reward models on the accelerator's device (ZeRO-3: as DeepSpeed engines)."""
        self._frozen_engines = []  # DeepSpeed engines of frozen ZeRO-3 models (grpo.models.prepare_frozen)
        if self.ref_model is not None:
            self.ref_model = prepare_frozen(self.ref_model, self.accelerator, self._frozen_engines)
        self.rewards.outcome_funcs = [
            prepare_frozen(f, self.accelerator, self._frozen_engines) if isinstance(f, PreTrainedModel) else f
            for f in self.rewards.outcome_funcs
        ]

    @property
    def reward_names(self) -> list[str]:
        """The reward functions' names: outcome functions first, then process functions (the metric columns)."""
        return self.rewards.names

    @property
    def reward_funcs(self) -> list:
        """The outcome reward functions and reward models (process functions: `self.rewards.process_funcs`)."""
        return self.rewards.outcome_funcs

    # ---- Steps 1-7: generation rounds, buffered into micro-batches ----

    def _prepare_inputs(self, inputs: list[dict[str, Any]]) -> MicroBatch:
        if not self.model.training:  # evaluation: every batch is generated and scored afresh
            return self._micro_batches(self._generate_and_score(inputs, "eval"), num=1, window=1)[0]
        args, schedule = self.args, self.step_schedule
        if not self._buffer:  # first call; after a resume only when the checkpoint held no buffer (another trainer's)
            self._step = schedule.first_micro_step(self.state.global_step)
        if self._async is not None:  # the sampler gets the weights of every optimizer step, not only at a round
            self.generation.sync_weights(unwrap_parallel(self.model), version=self.state.global_step)
        if not self._buffer or self._step % args.micro_steps_per_round == 0:
            rollout = self._generate_and_score(inputs, "train")
            window = args.gradient_accumulation_steps if spans_the_step(args.loss_type) else None
            self._buffer = self._micro_batches(rollout, num=args.steps_per_generation, window=window)
            # Step 6: a pass for pi_old now, only for the micro-batches no training pass can give it to.
            with torch.no_grad():
                logprobs = lambda micro_batch: self.logprobs(self.model, micro_batch)[0]  # noqa: E731
                steps_left = schedule.steps_left(self._step)
                old_policy.plan(self._buffer, self._step, steps_left, args, self.state.global_step, logprobs)
        micro_batch = self._buffer[self._step % args.steps_per_generation]
        self._step += 1
        return micro_batch

    def _micro_batches(self, rollout: Rollout, num: int, window: int | None) -> list[MicroBatch]:
        """This process's rows in `num` micro-batches. With `window`, each also carries `window_loss_tokens`: the
        loss tokens of the `window` micro-batches of its optimizer step on all processes (dapo's normaliser)."""
        micro_batches = rollout.micro_batches(num)
        if window is not None:
            local = torch.stack([mb.loss_mask.sum() for mb in micro_batches]).float()  # (num,)
            totals = window_token_totals(self.accelerator.reduce(local, reduction="sum"), window)
            for mb, tokens in zip(micro_batches, totals):
                mb.window_loss_tokens = tokens
        return micro_batches

    def _generate_and_score(self, inputs: list[dict[str, Any]], mode: str) -> Rollout:
        """Steps 2-7 for one generation batch."""
        rollout = self._generate_round(inputs, mode)
        if mode == "train" and self.args.dynamic_sampling:
            rollout = self._dynamic_sampling(rollout)
        return self._prepare_rollout(rollout, mode)

    def _generate_round(self, inputs: list[dict[str, Any]], mode: str) -> Rollout:
        """Steps 2-4: generate, cut and score this process's rows; rewards are gathered from all processes."""
        # A sampler with weights of its own (vLLM) first gets those of the latest optimizer step.
        self.generation.sync_weights(unwrap_parallel(self.model), version=self.state.global_step)
        if self._async is not None and mode == "train":  # made ahead, this process's rows scored
            rollout, columns, scores = self._async.take(inputs, self._step)
        else:
            rollout, columns = self.sample_round(inputs, self.generation)
            scores = self.local_scores(rollout, columns, mode)
        rollout = self.score_round(rollout, columns, mode, scores)
        # Metrics cover every generated round, also those dynamic sampling drops.
        self._record_round_metrics(mode, rollout)
        return rollout

    def sample_round(self, inputs: list[dict[str, Any]], backend) -> tuple[Rollout, dict[str, list]]:
        """Steps 2-3 for the dataset rows `inputs` with `backend` (`sample_rollout`), on this process's device:
        (Rollout, the rows' other columns); offline (`StoredCompletions`), the stored completions of the drawn groups.
        Public for the async producer and the CLI's before/after report, which sample rounds the way training does."""
        policy, args = unwrap_parallel(self.model), self.args
        own = isinstance(backend, TransformersGeneration)  # `model.generate` on the policy's own weights
        # ZeRO-3: the weights gathered whole (unless ds3_gather_for_generation=False). Mixed precision: one autocast
        # region around the round, so each weight is cast to bf16 / fp16 once, not at every generated token.
        gathered = zero3_gathered_for_generation(self.model_wrapped, own and args.ds3_gather_for_generation)
        # Episodes of a sharded policy (FSDP, ZeRO-3) generate collectively: every process runs as many turns.
        lockstep = self._any_process if own and self.accelerator.num_processes > 1 else None
        with gathered, self.accelerator.autocast() if own else contextlib.nullcontext():
            rollout, columns = sample_rollout(
                inputs, backend, policy, self.processing_class, self.eos_token_ids, args, self.agent, lockstep
            )
        return rollout.to(self.accelerator.device), columns

    def local_scores(self, rollout: Rollout, columns: dict[str, list], mode: str | None):
        """Every reward function on this process's rows (`RewardSet.score`); no collective call, so the async
        producer thread calls it too."""
        return self.rewards.score(
            prompts=rollout.prompts,
            completions=rollout.completions,
            completion_ids=rollout.completion_lists(),
            columns=columns,
            trainer_state=self.state,
            tokenizer=self.tokenizer,
            width=rollout.completion_ids.shape[1],
            **call_settings(self.args, mode),
        )

    def score_round(self, rollout: Rollout, columns: dict[str, list], mode: str | None, scores=None) -> Rollout:
        """Step 4: every reward function on this process's rows (unless `scores` has them), then the rewards of
        all processes (a group may span processes); a collective call, on every process. `mode` None: no metrics
        recorded."""
        args, device = self.args, self.accelerator.device
        scores = self.local_scores(rollout, columns, mode) if scores is None else scores
        if mode is not None:  # failed rows summed over processes, the slowest process's time
            errors = self.accelerator.reduce(torch.tensor(scores.errors, dtype=torch.float32, device=device), "sum")
            slowest = gather(torch.tensor([scores.seconds], device=device)).max()
            skip = args.reward_errors == "skip"
            metrics.add_reward_call_metrics(
                self.metric_windows[mode], errors, slowest, self.rewards.names, count_errors=skip
            )
        rewards = self._finite_rewards(scores.rewards.to(device), self.rewards.names, rollout.num_rows)
        # Step rewards: (B, K_p, T), padded to the longest completion of all processes before gathering.
        steps = self.accelerator.pad_across_processes(scores.step_rewards.to(device), dim=2, pad_index=torch.nan)
        steps = self._finite_rewards(steps, self.rewards.names[len(self.rewards.outcome_funcs) :], rollout.num_rows)
        return replace(rollout, rewards_per_func=rewards, step_rewards=steps)

    def _finite_rewards(self, rewards: torch.Tensor, names: list[str], rows: int) -> torch.Tensor:
        """All processes' `rewards` (gathered) through `finite_rewards` (grpo/training/nonfinite.py), counting rows it unscored."""
        rewards = gather_rows(self.accelerator, rewards, torch.nan)
        rewards, count = finite_rewards(rewards, names, self.args.nonfinite, self.state.global_step, rows)
        if count:
            self.metric_windows["train"].add_sum("nonfinite/reward_rows", count)
        return rewards

    def _advantages(self, rollout: Rollout, mode: str = "train") -> torch.Tensor:
        """Step 5: advantages of all processes' rows, (B_global,), or (B_global, T_global) with process rewards."""
        rewards = combine_rewards(rollout.rewards_per_func, self.rewards.outcome_weights)  # (B_global,)
        groups = rollout.groups(self.args.generations(mode))  # G, or each group's size (offline)
        check_reward_spread(rewards, groups, self.state.global_step)
        weights = self.rewards.process_weights.to(rewards.device)
        per_func = (rollout.rewards_per_func, self.rewards.outcome_weights.to(rewards.device))  # GDPO's inputs
        settings = advantage_settings(self.args)  # scale_rewards, offline_baseline, multi_objective_aggregation
        return mixed_advantages(rewards, rollout.step_rewards, weights, groups, per_func=per_func, **settings)

    def _dynamic_sampling(self, rollout: Rollout) -> Rollout:
        """Step 4b (DAPO dynamic sampling, grpo/training/dynamic_sampling.py): zero-advantage groups replaced by groups
        with a spread from extra rounds; this process's share of the chosen groups."""
        args, pad_id, rows = self.args, self.tokenizer.pad_token_id, rollout.num_rows
        index = self.accelerator.process_index
        rounds, chosen, counts = fill_groups(
            rollout,
            gather=lambda r: r.gather(self.accelerator, pad_id),
            advantages=self._advantages,
            next_rollout=lambda: self._generate_round(self._refill.take(self.train_dataset, index, rows), "train"),
            num_groups=args.generation_batch_size // args.num_generations,
            num_generations=args.num_generations,
            max_extra_rounds=args.max_dynamic_sampling_rounds,
        )
        for name, count in counts.items():
            self.metric_windows["train"].add_mean(name, count, 1)
        return Rollout.select(rounds, chosen, rollout.local_slice(self.accelerator.process_index), pad_id)

    def _prepare_rollout(self, rollout: Rollout, mode: str) -> Rollout:
        """Steps 5 and 7 on a generated (and maybe resampled) rollout: this process's advantages, then the reference
        log-probs, recorded once, before any update."""
        args = self.args
        advantages = self._advantages(rollout, mode)
        local = advantages[rollout.local_slice(self.accelerator.process_index)]
        rollout = replace(
            rollout,
            advantages=local if local.dim() == 1 else local[:, : rollout.completion_ids.shape[1]],
            sampling_logps=rollout.sampling_logps if keeps_sampling_logps(args) else None,
        )
        chunk = args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size
        if args.beta != 0:
            with torch.no_grad(), reference_policy(self.model, self.ref_model) as reference:
                rollout.ref_logps, _ = self.logprobs(reference, rollout, batch_size=chunk)
        if args.log_completions and mode == "train":  # with log_multimodal, the prompts' images saved beside
            main = self.accelerator.is_main_process
            self._samples = metrics.round_samples(rollout, self.rewards, advantages, args.output_dir, main)
        if args.save_rollouts and mode == "train":  # to output_dir/rollouts.jsonl
            save_round(args.output_dir, self.accelerator, rollout, self.rewards, self.state.global_step)
        return replace(rollout, images=None)

    def _record_round_metrics(self, mode: str, rollout: Rollout) -> None:
        """Metrics of one generation round, over the rows of all processes (grpo/training/metrics.py)."""
        columns, rewards = self.rewards.columns(rollout.rewards_per_func, rollout.step_rewards)
        lengths = gather_rows(self.accelerator, rollout.sampled_mask.sum(dim=1))  # (B_global,) policy tokens
        truncated = gather_rows(self.accelerator, rollout.is_truncated)
        window, groups = self.metric_windows[mode], rollout.groups(self.args.generations(mode))
        metrics.add_round_metrics(window, lengths, truncated, columns, rewards, self.rewards.names, groups)
        if rollout.prompt_truncated is not None:  # prompts cut to max_prompt_length: counted, and warned of once
            cut = gather_rows(self.accelerator, rollout.prompt_truncated)
            self._warned_truncation = metrics.add_prompt_metrics(window, cut, self.args, self._warned_truncation)
        if rollout.episode_stats is not None:  # multi-turn episodes: tools/* per episode, over all processes
            metrics.add_episode_metrics(window, rollout.episode_stats, self.accelerator)
        if mode == "train":
            tokens = rollout.prompt_mask.sum() + rollout.completion_mask.sum()
            self._num_tokens += int(self.accelerator.reduce(tokens, reduction="sum"))
            window.set_last("num_tokens", self._num_tokens)

    # ---- Step 8: the loss ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return model outputs.")
        mode = "train" if model.training else "eval"
        control, aux_losses = self.entropy_control, [] if self.router_aux_coef else None
        extra = {"entropy_grad": control.enabled, "aux_losses": aux_losses}
        logps, entropy = self.logprobs(model, inputs, with_entropy=True, **extra)
        old_logps = old_policy.take(inputs, logps, self.state.global_step)  # None: on-policy, logps.detach()
        weights, sampling = sampling_weights(logps, inputs, self.args)
        if sampling is not None:  # every process's share of the sampling/* metrics
            metrics.add_sampling_metrics(self.metric_windows[mode], gather(sampling[None]))
        # How this micro-batch's loss joins its optimizer step's: the loss type decides (objective/loss.py).
        micro_steps = self.current_gradient_accumulation_steps if mode == "train" else 1
        processes = self.accelerator.num_processes
        normalizer, factor = accumulation(self.args.loss_type, micro_steps, inputs.window_loss_tokens, processes)
        keep = policy_mask(entropy.detach(), logps, inputs, self.args, self.accelerator)
        loss, stats = policy_loss(
            logps, old_logps, inputs.ref_logps, inputs.advantages, inputs.loss_mask, policy_mask=keep,
            sampling_weights=weights, normalizer=normalizer, entropy=entropy, entropy_coef=control.coefficient,
            **loss_settings(self.args),
        )  # fmt: skip
        # Trainer does not divide again (loss_is_scaled_for_ga); a MoE router's loss joins as a mean over micro-steps.
        aux, aux_stats = router_aux_term(aux_losses, self.router_aux_coef, micro_steps)
        loss, stats = loss * factor + aux, {**stats, **aux_stats}
        coef = control.observe(entropy, inputs.loss_mask, keep, self.accelerator) if mode == "train" else None
        if coef is not None:  # the step's last micro-batch: the coefficient the next step starts from
            self.metric_windows[mode].add_mean("entropy_coef", coef)
        if mode == "train":
            # Checked at the optimizer step, with what names the row of a non-finite term (grpo/training/nonfinite.py).
            terms = {"loss": loss.detach(), **stats}
            self.gradient_guard.record(LossRecord.of(inputs, logps, old_logps, terms, self.args))
        # Token-weighted metrics, summed over processes.
        totals, names = metrics.token_metric_totals(stats, entropy.detach(), inputs.loss_mask)
        metrics.add_token_metrics(self.metric_windows[mode], self.accelerator.reduce(totals, reduction="sum"), names)
        return loss

    def logprobs(self, model, batch: TokenBatch | MicroBatch | Rollout, with_entropy=False, batch_size=None, **extra):
        """Completion log-probs (and entropies) of `batch` under `model`, the same way for policy, old and ref; in one
        autocast region (mixed precision: the head in bf16 unless cast_lm_head_to_fp32; each weight cast once)."""
        with self.accelerator.autocast():
            return completion_logprobs(
                model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                with_entropy=with_entropy, batch_size=batch_size, padding_free=self.padding_free,
                vision=getattr(batch, "vision", None),  # images (vision-language models), or None
                **logprob_settings(self.args, self.share_prompt), **extra,  # temperature, chunk, fp32 head, sharing
            )  # fmt: skip

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _end_training(self) -> None:
        if self._async is not None:
            self._async.close()
        if self.agent is not None:
            self.agent.close()
        if self.completions_hub is not None:
            self.completions_hub.wait()

    # ---- Exact resume: the state beyond Trainer's checkpoint (grpo/training/checkpoints.py, `ResumableTrainer`) ----

    def _save_state(self, checkpoint_dir: str) -> None:
        """What this process needs beyond Trainer's checkpoint to continue exactly (see grpo/training/checkpoints.py)."""
        state = {
            "settings": round_settings(self.args, self.accelerator.num_processes),
            "step": self._step,
            "buffer": [micro_batch.state_dict() for micro_batch in self._buffer],
            "num_tokens": self._num_tokens,
            "refill_position": self._refill.position,
            "samples": self._samples,
            "metrics": {mode: window.state_dict() for mode, window in self.metric_windows.items()},
            "sampling_rng": self.sampling_rng.state_dict(),
            "entropy_control": self.entropy_control.state_dict(),
        }
        save_state(os.path.join(checkpoint_dir, STATE_FILE.format(self.accelerator.process_index)), state)
        if self._reference_moves and self.args.should_save:  # the same on every process
            save_reference(checkpoint_dir, self.ref_model)

    def _restore_state(self, checkpoint: str) -> None:
        if self._reference_moves:
            load_reference(checkpoint, self.ref_model)
        settings = round_settings(self.args, self.accelerator.num_processes)
        state = load_state(checkpoint, self.accelerator.process_index, settings, self.accelerator.device)
        if state is not None:
            self._buffer = [MicroBatch.from_state_dict(micro_batch) for micro_batch in state["buffer"]]
            self._step, self._num_tokens = state["step"], state["num_tokens"]
            self._refill.position, self._samples = state["refill_position"], state["samples"]
            for mode, window in state["metrics"].items():
                self.metric_windows[mode].load_state_dict(window)
            self.sampling_rng.load_state_dict(state.get("sampling_rng"))  # None: written before it had one
            self.entropy_control.load_state_dict(state.get("entropy_control"))

    # ---- Logging ----

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        logged = self.metric_windows[mode].pop()
        if mode == "eval":
            logged = {f"eval_{k}": v for k, v in logged.items()}
        logs.update(logged)  # in place: `evaluate()` returns it; a skipped step's inf loss replaces Trainer's stand-in
        super().log(logs, start_time)
        if mode == "train" and self.args.log_completions and self._samples and self.accelerator.is_main_process:
            path, step = os.path.join(self.args.output_dir, "completions.jsonl"), self.state.global_step
            shown, unique = self.args.num_completions_to_print, self.args.log_unique_prompts
            run = getattr(self, "run_started", None)
            metrics.report_samples(self._samples, self.reward_names, path, step, shown, run, unique_prompts=unique)
            if self.completions_hub is not None:
                self.completions_hub.push(path, step)
            self._samples = []
