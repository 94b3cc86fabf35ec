"""`GRPOTrainer`: Group Relative Policy Optimization as a `transformers.Trainer`.

Run it like any Trainer:

    trainer = GRPOTrainer(model="path/or/hub-id", reward_funcs=my_reward, args=GRPOConfig(...), train_dataset=ds)
    trainer.train()

The trainer orchestrates; the arithmetic lives in `grpo.loss` (advantages, KL, clipped loss, aggregation) and
`grpo.logprobs` (log-probs), sampling in `grpo.generation` and reward calls in `grpo.scoring`. It overrides
`_prepare_inputs` (steps 1-7 below) and `compute_loss` (step 8) plus the data loaders and `log`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import torch
from accelerate.utils import gather, gather_object, set_seed
from transformers import (
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Trainer,
    TrainerCallback,
)
from transformers.trainer_utils import rotate_checkpoints
from transformers.utils import logging

from grpo.checkpoints import (
    ROUND_SETTINGS,
    STATE_FILE,
    CheckpointError,
    check_fresh_output_dir,
    describe_write_failure,
    load_reference,
    load_state,
    publish,
    remove_stale_staging,
    resolve_resume,
    save_reference,
    save_state,
    staging_dir,
)
from grpo.config import GRPOConfig
from grpo.data import check_prompt_dataset, decode_completions, pad, render_prompt, tokenize_prompts
from grpo.dynamic_sampling import gather_round, refill_indices, select_rows, zero_advantage_groups
from grpo.generation import cut_at_eos, make_generation_backend
from grpo.logprobs import completion_logprobs
from grpo.loss import entropy_threshold, group_reward_stats, mixed_advantages, policy_loss, sampling_correction
from grpo.metrics import MetricsWindow, format_completions, write_completions
from grpo.models import apply_peft, disable_dropout, frozen_copy, is_peft_model, load_causal_lm
from grpo.nonfinite import (
    NonFiniteError,
    gradient_message,
    gradients_finite,
    infinite_reward_message,
    infinite_rewards,
    nonfinite_terms,
    reward_overflow_message,
)
from grpo.process import is_process_reward, score_process
from grpo.reference import ReferenceUpdate
from grpo.sampler import RepeatSampler
from grpo.scoring import load_reward_funcs, reward_name, score_completions

logger = logging.get_logger(__name__)

RewardFunc = Callable[..., list] | PreTrainedModel | str

# Entries of a batch with one column per completion token (trimmed to each micro-batch's longest completion).
# Advantages are per token only with process rewards (B, T); per row (B,) they are not trimmed.
_COMPLETION_KEYS = (
    "completion_ids",
    "completion_mask",
    "loss_mask",
    "old_logps",
    "ref_logps",
    "sampling_logps",
    "advantages",
)


def _identity(features):
    return features


class _GradientGuard(TrainerCallback):
    """Runs `GRPOTrainer._guard_gradients` between gradient clipping and the optimizer step."""

    def __init__(self, trainer: GRPOTrainer):
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._guard_gradients()


class GRPOTrainer(Trainer):
    """Trains a causal LM with GRPO (DeepSeekMath, arXiv:2402.03300) and its variants (see `GRPOConfig.loss_type`).

    One optimizer step, as data flows (docs/method.md, "What one step computes"):
      1. The sampler repeats each prompt G times; one generation round feeds `steps_per_generation` micro-steps and
         is replayed `num_iterations` times from a buffer (`_prepare_inputs`).
      2. Generate one completion per row (`self.generation`).
      3. Cut each completion after its first EOS; flag the truncated ones.
      4. Score every completion with every reward function (process functions: step rewards); gather rewards
         from all processes. With `dynamic_sampling`, replace zero-advantage groups from extra rounds (4b).
      5. Group advantages over the gathered rewards (per token with process rewards); keep this process's rows.
      6. Old log-probs, only when the batch is reused (otherwise old = logp.detach()).
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
            column is passed to the reward functions.
        processing_class: the policy's tokenizer; loaded from the model's path when omitted.
        reward_processing_classes: tokenizers of the reward models, aligned with `reward_funcs` (None entries are
            loaded from each reward model's path).
        callbacks, optimizers: as for `transformers.Trainer`.
        peft_config: a `peft.PeftConfig` (e.g. `LoraConfig`): the model is wrapped with `peft.get_peft_model` and
            only the adapter trains. A `PeftModel` passed as `model` works the same. Either way the reference
            policy (beta != 0) is the same network with the adapter disabled, not a copy (docs/peft.md).
    """

    # compute_loss divides for gradient accumulation itself; Trainer must not divide again.
    loss_is_scaled_for_ga = True

    def __init__(
        self,
        model: str | os.PathLike | PreTrainedModel,
        reward_funcs: RewardFunc | list[RewardFunc],
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class: PreTrainedTokenizerBase | None = None,
        reward_processing_classes: PreTrainedTokenizerBase | list[PreTrainedTokenizerBase | None] | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        peft_config=None,
    ):
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        if args is None:
            name = model if isinstance(model, str) else model.config._name_or_path
            args = GRPOConfig(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a GRPOConfig, got {type(args).__name__}")

        # The policy and its tokenizer.
        if isinstance(model, str):
            model = load_causal_lm(model, args.model_init_kwargs)
        elif args.model_init_kwargs is not None:
            raise ValueError("model_init_kwargs only applies when `model` is a path or hub id; the model is loaded.")
        if processing_class is None:
            path = model.config._name_or_path
            if not path:
                raise ValueError(
                    "The model was built in code and has no path to load a tokenizer from; pass it as "
                    "`processing_class=`."
                )
            processing_class = AutoTokenizer.from_pretrained(path)
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token
        self.eos_token_ids = self._eos_token_ids(model, processing_class)
        if peft_config is not None:
            model = apply_peft(model, peft_config)
        if args.disable_dropout:
            disable_dropout(model)

        # Reward functions (reward models loaded from paths), their tokenizers, names and weights.
        self.reward_funcs, self.reward_tokenizers = load_reward_funcs(reward_funcs, reward_processing_classes)
        reward_funcs = self.reward_funcs
        self.reward_names = [reward_name(f) for f in reward_funcs]
        weights = args.reward_weights if args.reward_weights is not None else [1.0] * len(reward_funcs)
        if len(weights) != len(reward_funcs):
            raise ValueError(
                f"reward_weights has {len(weights)} entries but there are {len(reward_funcs)} reward functions "
                f"({self.reward_names}); give one weight per function."
            )
        self.reward_weights = torch.tensor(weights, dtype=torch.float32)
        # Process reward functions (@process_reward, grpo/process.py) score steps and are kept apart: from here on
        # reward_funcs, reward_tokenizers and reward_weights are the outcome functions', and reward_names lists the
        # outcome functions first, then the process functions (the order of the reward columns in metrics).
        is_process = [is_process_reward(f) for f in reward_funcs]
        self.process_funcs = [f for f, p in zip(reward_funcs, is_process) if p]
        self.process_weights = torch.tensor([w for w, p in zip(weights, is_process) if p], dtype=torch.float32)
        self.reward_funcs = [f for f, p in zip(reward_funcs, is_process) if not p]
        self.reward_tokenizers = [t for t, p in zip(self.reward_tokenizers, is_process) if not p]
        self.reward_weights = self.reward_weights[[not p for p in is_process]]
        self.reward_names = [reward_name(f) for f in self.reward_funcs] + [reward_name(f) for f in self.process_funcs]

        # The reference policy exists only when the KL term does: a frozen copy of the policy, or for a PEFT model
        # the same network with its adapter disabled (`_reference`), which costs no memory.
        self.ref_model = frozen_copy(model) if args.beta != 0 and not is_peft_model(model) else None
        self._reference_moves = args.sync_ref_model or args.ref_model_reset_steps is not None
        if self._reference_moves and self.ref_model is None:
            raise ValueError(
                "sync_ref_model / ref_model_reset_steps move the reference, but with a PEFT model the reference is "
                "the base model with the adapter disabled, which cannot move. Train without them, or merge the "
                "adapter (model.merge_and_unload()) and train the full model."
            )
        # Packing sequences without padding pays only with variable-length attention kernels (see GRPOConfig).
        attention = getattr(model.config, "_attn_implementation", None) or ""
        self.padding_free = args.padding_free if args.padding_free is not None else "flash_attention" in attention

        self._metrics = {"train": MetricsWindow(), "eval": MetricsWindow()}
        self._buffer: list[dict[str, torch.Tensor]] = []  # micro-batches of the current generation round
        self._step = 0  # training micro-steps taken (resumes from global_step)
        self._num_tokens = 0  # prompt + completion tokens seen in training, all processes
        self._samples: list[dict] = []  # the latest round's completions, for `log_completions`
        self._refill_prompts = None  # extra prompts for dynamic sampling (an iterator, made at first use)
        self._refill_position = 0  # indices taken from it so far (saved in checkpoints)
        self._loss_terms: list[dict[str, torch.Tensor]] = []  # this optimizer step's loss terms, for NonFiniteError
        self._staging_run_dir: str | None = None  # set while a checkpoint is written (see _save_checkpoint)

        # Reserved column names and bad prompts stop here, not when a bad row is drawn hours into the run.
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            check_prompt_dataset(dataset, name)

        super().__init__(
            model=model,
            args=args,
            data_collator=_identity,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.add_callback(_GradientGuard(self))
        if self._reference_moves:
            self.add_callback(ReferenceUpdate(self))
        if self.ref_model is not None:
            self.ref_model = self.accelerator.prepare_model(self.ref_model, evaluation_mode=True)
        self.reward_funcs = [
            self.accelerator.prepare_model(f, evaluation_mode=True) if isinstance(f, PreTrainedModel) else f
            for f in self.reward_funcs
        ]
        self.generation = make_generation_backend(
            args, self.accelerator, processing_class.pad_token_id, self.eos_token_ids
        )
        # Each process samples with its own seed: rows of one group on two processes must not share random draws.
        set_seed(args.seed, device_specific=True)

    @staticmethod
    def _eos_token_ids(model: PreTrainedModel, tokenizer) -> list[int]:
        ids = {tokenizer.eos_token_id}
        config_eos = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
        ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
        ids.discard(None)
        if not ids:
            raise ValueError(
                "Neither the tokenizer nor the model's generation config defines an EOS token; set "
                "`tokenizer.eos_token`."
            )
        return sorted(ids)

    # ---- Data loading: one loader batch = this process's share of a generation round (see grpo/sampler.py) ----

    def _get_train_sampler(self, train_dataset=None) -> RepeatSampler:
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        return RepeatSampler(
            num_samples=len(dataset),
            num_generations=self.args.num_generations,
            prompts_per_round=self.args.generation_batch_size // self.args.num_generations,
            repeat_count=self.args.steps_per_generation * self.args.num_iterations,
            shuffle=self.args.shuffle_dataset,
            seed=self.args.seed,
        )

    def get_train_dataloader(self):
        if self.train_dataset is None:
            raise ValueError("GRPOTrainer: training requires a train_dataset.")
        return self._get_dataloader(
            dataset=self.train_dataset,
            description="Training",
            batch_size=self.args.per_device_train_batch_size * self.args.steps_per_generation,
            sampler_fn=self._get_train_sampler,
            is_training=True,
        )

    def _get_eval_sampler(self, eval_dataset) -> RepeatSampler:
        rows = self.args.per_device_eval_batch_size * self.accelerator.num_processes
        if rows % self.args.num_generations != 0:
            raise ValueError(
                f"per_device_eval_batch_size x processes = {rows} is not a multiple of num_generations="
                f"{self.args.num_generations}: each evaluation batch must hold whole groups."
            )
        return RepeatSampler(
            num_samples=len(eval_dataset),
            num_generations=self.args.num_generations,
            prompts_per_round=rows // self.args.num_generations,
            shuffle=False,
        )

    # ---- Steps 1-7: generation rounds, buffered into micro-batches ----

    @property
    def _reuses_batches(self) -> bool:
        """A batch is off-policy for some micro-step when it is replayed, or when its round does not fit inside
        one optimizer step (rounds tile the steps only if the accumulation count is a multiple of the round's
        micro-steps); then the old log-probs must be recorded before any update."""
        args = self.args
        return args.num_iterations > 1 or args.gradient_accumulation_steps % args.steps_per_generation != 0

    def _prepare_inputs(self, inputs: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not self.model.training:  # evaluation: every batch is generated and scored afresh
            return self._split(self._generate_and_score(inputs, "eval"), num=1, window=1)[0]
        args = self.args
        if not self._buffer:  # first call, also after resuming from a checkpoint
            self._step = self.state.global_step * args.gradient_accumulation_steps
        if not self._buffer or self._step % (args.steps_per_generation * args.num_iterations) == 0:
            batch = self._generate_and_score(inputs, "train")
            window = args.gradient_accumulation_steps if args.loss_type == "dapo" else None
            self._buffer = self._split(batch, num=args.steps_per_generation, window=window)
        micro_batch = self._buffer[self._step % args.steps_per_generation]
        self._step += 1
        return micro_batch

    def _split(self, batch: dict[str, torch.Tensor], num: int, window: int | None) -> list[dict[str, torch.Tensor]]:
        """Cut a generation round into `num` micro-batches, each padded only to its own longest prompt and
        completion. With `window`, each micro-batch also carries `window_loss_tokens`: the loss tokens of the
        `window` consecutive micro-batches of its optimizer step, summed over all processes (dapo's normaliser)."""
        rows = batch["prompt_ids"].shape[0] // num
        micro_batches = [{k: v[i * rows : (i + 1) * rows] for k, v in batch.items()} for i in range(num)]
        if window is not None:
            local = torch.stack([mb["loss_mask"].sum() for mb in micro_batches]).float()  # (num,)
            per_micro = self.accelerator.reduce(local, reduction="sum")
            per_window = per_micro.view(-1, window).sum(dim=1).repeat_interleave(window)  # (num,)
            for mb, tokens in zip(micro_batches, per_window):
                mb["window_loss_tokens"] = tokens
        for mb in micro_batches:
            prompt_width = max(int(mb["prompt_mask"].sum(dim=1).max()), 1)
            completion_width = max(int(mb["completion_mask"].sum(dim=1).max()), 1)
            mb["prompt_ids"] = mb["prompt_ids"][:, -prompt_width:]
            mb["prompt_mask"] = mb["prompt_mask"][:, -prompt_width:]
            for key in _COMPLETION_KEYS:
                if key in mb and mb[key].dim() == 2:
                    mb[key] = mb[key][:, :completion_width]
        return micro_batches

    def _generate_and_score(self, inputs: list[dict[str, Any]], mode: str) -> dict[str, torch.Tensor]:
        """Steps 2-7 for one generation batch: this process's rows, ready for `_split`."""
        round_ = self._generate_round(inputs, mode)
        if mode == "train" and self.args.dynamic_sampling:
            round_ = self._dynamic_sampling(round_)
        return self._make_batch(round_, mode)

    def _generate_round(self, inputs: list[dict[str, Any]], mode: str) -> dict[str, Any]:
        """Steps 2-4: generate, cut and score this process's rows; rewards are gathered from all processes."""
        args, device, tokenizer = self.args, self.accelerator.device, self.processing_class
        if "prompt" not in inputs[0]:
            raise KeyError(f"Each example needs a 'prompt' field; got fields {sorted(inputs[0])}.")
        prompts = [example["prompt"] for example in inputs]
        columns = {key: [example[key] for example in inputs] for key in inputs[0] if key != "prompt"}

        # 2. Generate one completion per row.
        prompt_ids_list = tokenize_prompts(
            [render_prompt(p, tokenizer) for p in prompts], tokenizer, args.max_prompt_length
        )
        # A sampler with weights of its own (vLLM) first gets those of the latest optimizer step.
        policy = self.accelerator.unwrap_model(self.model)
        self.generation.sync_weights(policy, version=self.state.global_step)
        raw = self.generation.generate(policy, prompt_ids_list)

        # 3. Cut after the first EOS (kept); a completion without one is truncated.
        completion_ids_list, truncated = cut_at_eos(raw.ids, self.eos_token_ids, args.max_completion_length)
        prompt_ids, prompt_mask = pad(prompt_ids_list, tokenizer.pad_token_id, side="left")
        completion_ids, completion_mask = pad(completion_ids_list, tokenizer.pad_token_id, side="right")
        is_truncated = torch.tensor(truncated)
        loss_mask = (
            completion_mask * (~is_truncated).long().unsqueeze(1)
            if args.mask_truncated_completions
            else completion_mask
        )

        sampling_logps = None
        if raw.logprobs is not None:
            cut = [row[: len(ids)] for row, ids in zip(raw.logprobs, completion_ids_list)]
            width = completion_ids.shape[1]
            sampling_logps = torch.tensor([row + [0.0] * (width - len(row)) for row in cut], device=device)

        # 4. Score, then gather: a group may span processes.
        completions = decode_completions(completion_ids_list, prompts, tokenizer)
        scores = score_completions(
            self.reward_funcs,
            self.reward_tokenizers,
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids_list,
            columns=columns,
            trainer_state=self.state,
            errors=args.reward_errors,
            timeout=args.reward_timeout,
            num_workers=args.reward_num_workers,
            worker_type=args.reward_worker_type,
            model_batch_size=args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size,
        )
        self._record_reward_call_metrics(mode, scores.errors, scores.seconds)
        rewards_per_func = self._finite_rewards(gather(scores.rewards.to(device)), self.reward_names, len(prompts))
        # Process rewards: (B, K_process, T), each step's reward at its last token, NaN elsewhere; padded to the
        # longest completion of all processes before gathering.
        step_rewards = score_process(
            self.process_funcs,
            tokenizer,
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids_list,
            columns=columns,
            trainer_state=self.state,
            width=completion_ids.shape[1],
        ).to(device)
        step_rewards = gather(self.accelerator.pad_across_processes(step_rewards, dim=2, pad_index=torch.nan))
        step_rewards = self._finite_rewards(step_rewards, self.reward_names[len(self.reward_funcs) :], len(prompts))

        round_ = {
            "prompts": prompts,
            "completions": completions,
            "prompt_ids": prompt_ids.to(device),
            "prompt_mask": prompt_mask.to(device),
            "completion_ids": completion_ids.to(device),
            "completion_mask": completion_mask.to(device),
            "loss_mask": loss_mask.to(device),
            "is_truncated": is_truncated.to(device),
            "sampling_logps": sampling_logps,  # (B, T) the sampler's own log-probs (vLLM), or None
            "rewards_per_func": rewards_per_func,  # (B_global, K_outcome), gathered
            "step_rewards": step_rewards,  # (B_global, K_process, T_global), gathered
        }
        # Metrics cover every generated round, also those dynamic sampling drops.
        self._record_round_metrics(
            mode,
            *self._metric_rewards(round_),
            prompt_mask.to(device),
            completion_mask.to(device),
            round_["is_truncated"],
        )
        return round_

    def _finite_rewards(self, rewards: torch.Tensor, names: list[str], rows: int) -> torch.Tensor:
        """Stop at a +-inf reward (the same gathered tensor on every process, so all stop together), or with
        `nonfinite="skip"` turn it into NaN (unscored) and count it. `rows`: rows per process, for the message."""
        found = infinite_rewards(rewards)
        if not found:
            return rewards
        if self.args.nonfinite == "error":
            raise NonFiniteError(infinite_reward_message(found, names, self.state.global_step, rows))
        self._metrics["train"].add_sum("nonfinite/reward_rows", len({row for row, _, _ in found}))
        return torch.where(torch.isinf(rewards), torch.nan, rewards)

    def _metric_rewards(self, round_: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """(B_global, K) reward columns for metrics (a process function's column: the sum of its step rewards, NaN
        without steps) and the combined reward: the weighted sum over every function that scored the row."""
        steps = round_["step_rewards"]
        step_sums = torch.where(torch.isnan(steps).all(dim=2), torch.nan, steps.nansum(dim=2))  # (B_global, K_p)
        columns = torch.cat([round_["rewards_per_func"], step_sums], dim=1)
        weights = torch.cat([self.reward_weights, self.process_weights]).to(columns.device)
        scored = ~torch.isnan(columns).all(dim=1)
        return columns, torch.where(scored, (columns * weights).nansum(dim=1), torch.nan)

    def _advantages(self, round_: dict[str, Any]) -> torch.Tensor:
        """Step 5: advantages of all processes' rows, (B_global,), or (B_global, T_global) with process rewards."""
        rewards_per_func = round_["rewards_per_func"]
        weighted = rewards_per_func * self.reward_weights.to(rewards_per_func.device)
        scored = ~torch.isnan(rewards_per_func).all(dim=1)  # rows at least one outcome function scored
        rewards = torch.where(scored, weighted.nansum(dim=1), torch.nan)  # (B_global,)
        problem = reward_overflow_message(rewards, self.args.num_generations, self.state.global_step)
        if problem is not None:
            raise NonFiniteError(problem)
        weights = self.process_weights.to(rewards.device)
        return mixed_advantages(
            rewards, round_["step_rewards"], weights, self.args.num_generations, self.args.scale_rewards
        )

    def _dynamic_sampling(self, round_: dict[str, Any]) -> dict[str, Any]:
        """Step 4b (DAPO dynamic sampling): replace the groups whose advantages are all zero (equal rewards, so no
        gradient) by groups with a spread, generated from further prompts, at most `max_dynamic_sampling_rounds`
        extra rounds. Slots still empty then keep zero-advantage groups, so the batch size never changes. Works on
        all processes' rows (a kept group may come from another process) and returns this process's share."""
        args, G, pad_id = self.args, self.args.num_generations, self.processing_class.pad_token_id
        rows_per_process, num_groups = round_["prompt_ids"].shape[0], args.generation_batch_size // G
        rounds, kept, flat = [], [], []  # gathered rounds; (round, group) pairs with and without a spread
        while True:
            rounds.append(gather_round(self.accelerator, pad_id, round_))
            for g, is_zero in enumerate(zero_advantage_groups(self._advantages(rounds[-1]), G)):
                (flat if is_zero else kept).append((len(rounds) - 1, g))
            if len(kept) >= num_groups or len(rounds) > args.max_dynamic_sampling_rounds:
                break
            round_ = self._generate_round(self._next_refill_inputs(rows_per_process), "train")
        chosen = (kept + flat)[:num_groups]
        zero_kept = max(num_groups - len(kept), 0)  # slots the extra rounds could not fill
        metrics = self._metrics["train"]
        metrics.add_mean("dynamic_sampling/dropped_groups", len(flat) - zero_kept, 1)
        metrics.add_mean("dynamic_sampling/zero_std_groups_kept", zero_kept, 1)
        metrics.add_mean("dynamic_sampling/extra_rounds", len(rounds) - 1, 1)
        # Whole batch in the chosen order, then this process's contiguous share.
        rows = [(r, g * G + k) for r, g in chosen for k in range(G)]
        start = self.accelerator.process_index * rows_per_process
        return select_rows(rounds, rows, slice(start, start + rows_per_process), pad_id)

    def _next_refill_inputs(self, num_rows: int) -> list[dict[str, Any]]:
        """This process's share of a fresh round of prompts for dynamic sampling (see `refill_indices`)."""
        if self._refill_prompts is None:
            sampler = self._get_train_sampler()
            sampler.repeat_count, sampler.seed = 1, self.args.seed + 1  # a stream apart from the training order
            self._refill_prompts = refill_indices(sampler)
            for _ in range(self._refill_position):  # resumed: continue the stream where the checkpoint left it
                next(self._refill_prompts)
        indices = [next(self._refill_prompts) for _ in range(self.args.generation_batch_size)]
        self._refill_position += len(indices)
        start = self.accelerator.process_index * num_rows
        return [self.train_dataset[i] for i in indices[start : start + num_rows]]

    def _make_batch(self, round_: dict[str, Any], mode: str) -> dict[str, torch.Tensor]:
        """Steps 5-7 on a generated (and maybe resampled) round."""
        args = self.args
        prompts, completions = round_["prompts"], round_["completions"]

        # 5. Advantages over all processes' rows, then this process's share (per token: up to its longest row).
        advantages = self._advantages(round_)
        local = slice(
            self.accelerator.process_index * len(prompts), (self.accelerator.process_index + 1) * len(prompts)
        )
        width = round_["completion_ids"].shape[1]
        local_advantages = advantages[local] if advantages.dim() == 1 else advantages[local, :width]

        batch = {key: round_[key] for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
        batch["loss_mask"] = round_["loss_mask"]
        batch["advantages"] = local_advantages
        if round_.get("sampling_logps") is not None and args.vllm_importance_sampling_correction:
            batch["sampling_logps"] = round_["sampling_logps"]
        # 6-7. Old and reference log-probs, recorded once, before any update.
        with torch.no_grad():
            chunk = args.per_device_train_batch_size if mode == "train" else args.per_device_eval_batch_size
            if mode == "train" and self._reuses_batches:
                batch["old_logps"], _ = self._logprobs(self.model, batch, batch_size=chunk)
            if args.beta != 0:
                with self._reference() as reference:
                    batch["ref_logps"], _ = self._logprobs(reference, batch, batch_size=chunk)

        if args.log_completions and mode == "train":
            metric_columns, _ = self._metric_rewards(round_)
            self._samples = [
                {"prompt": p, "completion": c, "rewards": r, "advantage": a}
                for p, c, r, a in zip(
                    gather_object(prompts),
                    gather_object(completions),
                    metric_columns.tolist(),
                    # Per-token advantages are shown by their value at the first token.
                    (advantages if advantages.dim() == 1 else advantages[:, 0]).tolist(),
                )
            ]
        return batch

    def _record_reward_call_metrics(self, mode: str, errors: list[int], seconds: float) -> None:
        """Failed reward rows (summed over processes) and scoring time (the slowest process) of one round."""
        device = self.accelerator.device
        totals = self.accelerator.reduce(torch.tensor(errors, dtype=torch.float32, device=device), reduction="sum")
        if self.args.reward_errors == "skip":
            for name, count in zip(self.reward_names, totals.tolist()):
                self._metrics[mode].add_sum(f"rewards/{name}/errors", count)
        slowest = gather(torch.tensor([seconds], device=device)).max()
        self._metrics[mode].add_mean("timing/rewards", slowest, 1)

    def _record_round_metrics(self, mode, rewards_per_func, rewards, prompt_mask, completion_mask, is_truncated):
        """Metrics of one generation round, over the rows of all processes."""
        device = rewards.device
        metrics = self._metrics[mode]
        lengths = gather(completion_mask.sum(dim=1).to(device)).float()  # (B_global,)
        truncated = gather(is_truncated).float()
        metrics.add_mean("completions/mean_length", lengths.sum(), lengths.numel())
        metrics.add_min("completions/min_length", lengths.min())
        metrics.add_max("completions/max_length", lengths.max())
        metrics.add_mean("completions/clipped_ratio", truncated.sum(), truncated.numel())
        terminated = lengths[truncated == 0]
        metrics.add_mean("completions/mean_terminated_length", terminated.sum(), terminated.numel())
        for j, name in enumerate(self.reward_names):
            column = rewards_per_func[:, j]
            valid = column[~torch.isnan(column)]
            metrics.add_mean(f"rewards/{name}/mean", valid.sum(), valid.numel())
            if valid.numel() > 1:
                metrics.add_mean(f"rewards/{name}/std", valid.std(), 1)
        valid = rewards[~torch.isnan(rewards)]
        metrics.add_mean("reward", valid.sum(), valid.numel())
        for key, value in group_reward_stats(rewards, self.args.num_generations).items():
            metrics.add_mean(key, value, 1)
        if mode == "train":
            tokens = self.accelerator.reduce((prompt_mask.sum() + completion_mask.sum()).to(device), reduction="sum")
            self._num_tokens += int(tokens)
            metrics.set_last("num_tokens", self._num_tokens)

    # ---- Step 8: the loss ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return model outputs.")
        args = self.args
        mode = "train" if model.training else "eval"
        logps, entropy = self._logprobs(model, inputs, with_entropy=True)
        policy_mask = None
        if args.top_entropy_quantile < 1.0:
            # Train the policy term only on the highest-entropy tokens; the threshold is over the loss tokens of this
            # micro-step on every process (ragged widths are padded with NaN, which the quantile ignores).
            local = torch.where(inputs["loss_mask"].bool(), entropy, torch.nan).reshape(-1)
            everyone = gather(self.accelerator.pad_across_processes(local, dim=0, pad_index=torch.nan))
            policy_mask = entropy >= entropy_threshold(everyone, args.top_entropy_quantile)
        sampling_weights = None
        if "sampling_logps" in inputs:
            # The engine sampled from its own numerics, not exactly pi_old: truncated importance sampling. On-policy,
            # pi_old is the current policy (logps.detach()), so no extra forward pass is needed.
            old = inputs["old_logps"] if "old_logps" in inputs else logps.detach()
            sampling_weights, sampling_stats = sampling_correction(
                old,
                inputs["sampling_logps"],
                inputs["loss_mask"],
                mode=args.vllm_importance_sampling_mode,
                cap=args.vllm_importance_sampling_cap,
            )
            self._record_sampling_metrics(mode, sampling_stats, inputs["loss_mask"])
        normalizer = None
        if args.loss_type == "dapo":
            # Loss tokens of the whole optimizer step on all processes; divided by the process count because
            # data parallelism averages the gradients of the processes.
            normalizer = inputs["window_loss_tokens"] / self.accelerator.num_processes
        loss, stats = policy_loss(
            logps,
            inputs.get("old_logps"),
            inputs.get("ref_logps"),
            inputs["advantages"],
            inputs["loss_mask"],
            loss_type=args.loss_type,
            beta=args.beta,
            epsilon_low=args.epsilon,
            epsilon_high=args.epsilon_high,
            delta=args.delta,
            importance_sampling_level=args.importance_sampling_level,
            policy_mask=policy_mask,
            max_completion_length=args.max_completion_length,
            normalizer=normalizer,
            sampling_weights=sampling_weights,
        )
        if mode == "train" and args.loss_type != "dapo":
            # grpo, bnpo and dr_grpo are means over this micro-batch: average them over the accumulation steps
            # (dapo's normaliser already spans the whole step). Trainer does not divide again (loss_is_scaled_for_ga).
            loss = loss / self.current_gradient_accumulation_steps

        if mode == "train":  # read only if the gradients turn out non-finite (_GradientGuard)
            self._loss_terms.append(
                {"loss": loss.detach(), "logps": torch.where(inputs["loss_mask"].bool(), logps.detach(), 0.0), **stats}
            )

        # Token-weighted metrics, summed over processes.
        mask = inputs["loss_mask"].bool()
        tokens = mask.sum().float()
        stats["entropy"] = torch.where(mask, entropy, 0.0).sum() / tokens.clamp(min=1)
        names = sorted(stats)
        totals = self.accelerator.reduce(torch.stack([tokens] + [stats[n].float() * tokens for n in names]), "sum")
        for name, total in zip(names, totals[1:]):
            self._metrics[mode].add_mean(name, total, totals[0])
        return loss

    def _record_sampling_metrics(self, mode: str, stats: dict[str, torch.Tensor], loss_mask: torch.Tensor) -> None:
        """`sampling/*`: how far the engine's log-probs are from the trainer's, and the importance ratios, over the
        loss tokens of all processes (sequence modes: over the rows with a loss token)."""
        mask = loss_mask.bool()
        ratio = stats["ratio"]  # (B, T), or (B, 1) per sequence
        ratio = ratio[mask] if ratio.shape == mask.shape else ratio[mask.any(dim=1)].reshape(-1)
        difference = stats["logp_difference"][mask]
        floor = torch.full((1,), -torch.inf, device=mask.device)  # max() of nothing
        local = torch.stack(
            [
                difference.sum(),
                torch.tensor(float(difference.numel()), device=mask.device),
                ratio.sum(),
                torch.tensor(float(ratio.numel()), device=mask.device),
                torch.cat([difference, floor]).max(),
                torch.cat([ratio, floor]).max(),
                torch.cat([-ratio, floor]).max(),
            ]
        )
        everyone = gather(local.unsqueeze(0))  # (P, 7)
        sums, peaks = everyone[:, :4].sum(dim=0), everyone[:, 4:].amax(dim=0)
        metrics = self._metrics[mode]
        metrics.add_mean("sampling/sampling_logp_difference/mean", sums[0], sums[1])
        metrics.add_mean("sampling/importance_sampling_ratio/mean", sums[2], sums[3])
        if sums[1] > 0:
            metrics.add_max("sampling/sampling_logp_difference/max", peaks[0])
            metrics.add_max("sampling/importance_sampling_ratio/max", peaks[1])
            metrics.add_min("sampling/importance_sampling_ratio/min", -peaks[2])

    @contextlib.contextmanager
    def _reference(self) -> Iterator[torch.nn.Module]:
        """The reference policy pi_ref: the frozen copy, or the PEFT policy with its adapter switched off."""
        if self.ref_model is not None:
            yield self.ref_model
            return
        with self.accelerator.unwrap_model(self.model).disable_adapter():
            yield self.model

    def _logprobs(self, model, batch, with_entropy=False, batch_size=None):
        """Completion log-probs (and entropies) of `batch` under `model`, the same way for policy, old and ref."""
        return completion_logprobs(
            model,
            batch["prompt_ids"],
            batch["prompt_mask"],
            batch["completion_ids"],
            batch["completion_mask"],
            temperature=self.args.temperature,
            with_entropy=with_entropy,
            batch_size=batch_size,
            chunk_size=self.args.logprobs_chunk_size,
            padding_free=self.padding_free,
        )

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    # ---- Non-finite gradients (grpo/nonfinite.py) ----

    def _guard_gradients(self) -> None:
        """Before each optimizer step: all processes agree whether every gradient is finite; if not, stop with the
        loss terms that went non-finite, or with `nonfinite="skip"` drop the gradients so the step changes
        nothing."""
        terms, self._loss_terms = self._loss_terms, []
        local = gradients_finite(self.model.parameters()).to(self.accelerator.device)
        if self.accelerator.reduce(local.float(), reduction="sum") == self.accelerator.num_processes:
            return
        if self.args.nonfinite == "error":
            raise NonFiniteError(gradient_message(self.state.global_step, nonfinite_terms(terms)))
        for parameter in self.model.parameters():
            parameter.grad = None  # torch optimizers skip parameters without a gradient: no update, no moment change
        self._metrics["train"].add_sum("nonfinite/skipped_steps", 1)

    # ---- Checkpoints and exact resume (grpo/checkpoints.py) ----

    def train(self, resume_from_checkpoint: str | bool | None = None, trial=None, **kwargs):
        """`Trainer.train`, with `resume_from_checkpoint=True` meaning the newest *complete* checkpoint, this
        trainer's own state restored from it, and a new run refused over an earlier run's checkpoints."""
        checkpoint = resolve_resume(resume_from_checkpoint, self.args.output_dir)
        if checkpoint is None:
            check_fresh_output_dir(self.args.output_dir)
        else:
            self._restore_state(checkpoint)
        return super().train(resume_from_checkpoint=checkpoint, trial=trial, **kwargs)

    def _round_settings(self) -> dict[str, Any]:
        settings = {name: getattr(self.args, name) for name in ROUND_SETTINGS}
        settings["num_processes"] = self.accelerator.num_processes
        return settings

    def _resume_state(self) -> dict[str, Any]:
        """What this process needs beyond Trainer's checkpoint to continue exactly (see grpo/checkpoints.py)."""
        return {
            "settings": self._round_settings(),
            "step": self._step,
            "buffer": self._buffer,
            "num_tokens": self._num_tokens,
            "refill_position": self._refill_position,
            "samples": self._samples,
            "metrics": {mode: window.state_dict() for mode, window in self._metrics.items()},
        }

    def _restore_state(self, checkpoint: str) -> None:
        if self._reference_moves:
            load_reference(checkpoint, self.ref_model)
        state = load_state(checkpoint, self.accelerator.process_index, self._round_settings(), self.accelerator.device)
        if state is None:
            logger.warning(
                f"{checkpoint} has no {STATE_FILE.format(self.accelerator.process_index)} (written by another "
                "trainer): a generation round in progress is generated again, so the run will not match one that "
                "was never stopped."
            )
            return
        self._buffer, self._step, self._num_tokens = state["buffer"], state["step"], state["num_tokens"]
        self._refill_position, self._samples = state["refill_position"], state["samples"]
        for mode, window in state["metrics"].items():
            self._metrics[mode].load_state_dict(window)

    def _get_output_dir(self, trial) -> str:
        # While a checkpoint is written, Trainer's files go to the staging directory (see _save_checkpoint).
        return self._staging_run_dir or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        """Trainer's checkpoint plus this trainer's state, written under a temporary name, fsynced and renamed:
        a `checkpoint-N` directory only ever exists complete. A failed write (a full disk) removes what it wrote
        and raises `CheckpointError` on every process."""
        run_dir, step = self._get_output_dir(trial), self.state.global_step
        staged = staging_dir(run_dir, step)
        name = f"checkpoint-{step}"
        if self.args.should_save:
            remove_stale_staging(run_dir)
        self.accelerator.wait_for_everyone()
        failure = None
        self._staging_run_dir = staged
        try:
            super()._save_checkpoint(model, trial)
            path = os.path.join(staged, name, STATE_FILE.format(self.accelerator.process_index))
            save_state(path, self._resume_state())
            if self._reference_moves and self.args.should_save:  # the same on every process
                save_reference(os.path.join(staged, name), self.ref_model)
        except Exception as e:  # noqa: BLE001 - reported on every process below
            failure = e
        finally:
            self._staging_run_dir = None
        failed = gather_object([failure is not None])
        if any(failed):
            if self.args.should_save:
                shutil.rmtree(staged, ignore_errors=True)
            message = describe_write_failure(failure or OSError("another process failed"), step, run_dir)
            raise CheckpointError(message) from failure
        if self.args.should_save:
            if self.state.best_model_checkpoint == os.path.join(staged, name):
                self.state.best_model_checkpoint = os.path.join(run_dir, name)
                self.state.save_to_json(os.path.join(staged, name, "trainer_state.json"))
            publish(os.path.join(staged, name), os.path.join(run_dir, name))
            os.rmdir(staged)
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()

    # ---- Logging ----

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        metrics = self._metrics[mode].pop()
        if mode == "eval":
            metrics = {f"eval_{k}": v for k, v in metrics.items()}
        logs.update(metrics)  # in place: `evaluate()` returns this dict to the caller
        super().log(logs, start_time)
        if mode == "train" and self.args.log_completions and self._samples and self.accelerator.is_main_process:
            print(format_completions(self._samples, self.reward_names, self.args.num_completions_to_print))
            write_completions(
                os.path.join(self.args.output_dir, "completions.jsonl"),
                self.state.global_step,
                self._samples,
                self.reward_names,
            )
            self._samples = []
