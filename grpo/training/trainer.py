"""`GRPOTrainer`: GRPO as a `transformers.Trainer`. It sequences one step (see the class docstring); generation,
rewards, the `Rollout`, the loss and the checkpoints live in their own modules (docs/architecture.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from accelerate.utils import set_seed
from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback

from grpo.config import GRPOConfig
from grpo.data import check_prompt_dataset, check_prompt_lengths, image_checks, offline
from grpo.data.sampler import check_dataset_sizes
from grpo.data.vision import check_vision_run, text_tokenizer
from grpo.generation.environment_checks import check_environment_rows
from grpo.generation.episodes import make_agent
from grpo.generation.rollout_function import check_episodes, make_function_agent
from grpo.generation.tools import make_toolbox
from grpo.models import is_peft_model, load_policy, prepare_frozen
from grpo.objective import activation_memory, liger, old_policy
from grpo.objective.logprobs import LogProbs
from grpo.objective.reference import ReferenceUpdate, make_reference, reference_moves
from grpo.objective.regularizers import router_aux_coef
from grpo.objective.shared_prompt import forward_layout
from grpo.objective.step_loss import StepContext
from grpo.rewards.environments import with_environment_rewards
from grpo.rewards.scoring import RewardSet, reward_keywords
from grpo.rewards.stored import offline_rewards
from grpo.rollout import MicroBatch
from grpo.training import checkpoints, hub_log, metrics
from grpo.training.checkpoints import ResumableTrainer
from grpo.training.loaders import RoundLoaders
from grpo.training.metrics import MetricsWindow
from grpo.training.nonfinite import GradientGuard, LossRecord
from grpo.training.output_dir import own_output_dir
from grpo.training.rounds import RoundContext, RoundMaker
from grpo.training.signal_watch import SignalWatch

RewardFunc = Callable[..., list] | PreTrainedModel | str


class GRPOTrainer(RoundLoaders, ResumableTrainer):
    """Trains a causal LM with GRPO (DeepSeekMath, arXiv:2402.03300) and its variants (see `GRPOConfig.loss_type`).

    One optimizer step, as data flows (docs/method.md, "What one step computes"):
      1. The sampler repeats each prompt G times; one generation round feeds `steps_per_generation` micro-steps and
         is replayed `num_iterations` times from a buffer (`_prepare_inputs`). Steps 2-7 are the round maker's
         (`self.rounds`, grpo/training/rounds.py), step 8 the step loss's (`self.step_loss`, objective/step_loss.py).
      2. Generate one completion per row (`self.rounds.generation`).
      3. Cut each completion after its first EOS; flag the truncated ones.
      4. Score every completion with every reward function (process: step rewards; turn: turn scores); gather rewards
         from all processes. With `dynamic_sampling`, replace zero-advantage groups from extra rounds (4b).
         With `async_generation`, the next round's steps 2-4 on this process run in a producer thread while this one
         trains (grpo/training/async_rounds.py); the rewards are gathered when the trainer takes the round.
      5. Group advantages over the gathered rewards (per token with process rewards or turn credit); keep own rows.
      6. pi_old: a micro-batch trained before its round's first optimizer step has it in its own training pass
         (old = logp.detach(), kept for replays); the others get old log-probs from a pass before any update.
      7. Reference log-probs, only when beta != 0.
      8. `compute_loss`: policy log-probs in one forward pass, then the clipped objective, scaled once for gradient
         accumulation (`StepLoss`), and its record (metrics; what the non-finite guard checks at the step). With
         `use_liger_kernel`, Liger's fused linear GRPO loss computes the loss that trains (objective/liger.py).

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
        tools, environment_factory: the functions the model may call, or environments with methods (docs/agents.md).
        agent_func: any agent, run unchanged: `f(row, endpoint)` (sync or async) calls the trainer's OpenAI-compatible
            endpoint and returns a dict of columns for the rewards, or None (docs/agents.md, "Any agent").
        rollout_func: TRL's `f(prompts, trainer) -> dict` (prompt_ids, completion_ids, logprobs, optional env_mask,
            extra fields for the rewards) makes each round itself (docs/agents.md, "TRL's rollout_func").
    """

    # compute_loss divides for gradient accumulation itself; Trainer must not divide again.
    loss_is_scaled_for_ga = True

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
        agent_func: Callable | None = None,
        rollout_func: Callable | None = None,
    ):
        model = source = os.fspath(model) if isinstance(model, os.PathLike) else model
        args = GRPOConfig.for_model(model) if args is None else args
        if not isinstance(args, GRPOConfig):
            raise TypeError(f"args must be a GRPOConfig, got {type(args).__name__}")
        own_output_dir(args, model)  # absolute from now on (a reward's os.chdir cannot move it), outside the model
        self.settings = args.stage_settings()  # the objective's typed settings, checked (objective/settings.py)
        # 1. Everything that needs no weights, then the rewards (reward models named by path load here).
        reference_moves(args, peft=peft_config is not None or is_peft_model(model))  # a PEFT reference cannot move
        episodes = (tools, environment_factory, agent_func, rollout_func)
        train_dataset = self._before_weights(
            args, reward_funcs, reward_processing_classes, train_dataset, eval_dataset, processing_class, episodes
        )
        # 2. The policy and its tokenizer, the agent, the reference, and how the forward pass reads the model.
        model, processing_class, self.eos_token_ids = load_policy(
            model, processing_class, peft_config, args, self.vision
        )
        self.tokenizer = tokenizer = text_tokenizer(processing_class)  # a vision-language model's: its processor's
        check_prompt_lengths(tokenizer, model.config, args, train_dataset, eval_dataset)  # room to complete
        self.agent = make_function_agent(episodes, self, tokenizer, self.eos_token_ids, args) or make_agent(
            self.toolbox, tokenizer, self.eos_token_ids, args, train_dataset
        )
        self.ref_model, self._reference_moves = make_reference(model, args, source)  # pi_ref (objective/reference.py)
        layout = forward_layout(args, model, announce=args.process_index == 0)  # padding-free, shared prompt
        router_coef = router_aux_coef(model.config, args.router_aux_loss_coef)  # a MoE router's loss, checked
        self.metric_windows = {"train": MetricsWindow(), "eval": MetricsWindow()}
        self._buffer: list[MicroBatch] = []  # micro-batches of the current generation round
        self._step = 0  # training micro-steps taken (resumes from global_step)
        if args.learning_signal_warnings:
            callbacks = [*(callbacks or []), SignalWatch()]
        super().__init__(
            model=model,
            args=args,
            data_collator=list,  # a loader batch is the list of its dataset rows
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self._on_the_accelerator(layout, router_coef, processing_class, train_dataset)
        set_seed(args.seed, device_specific=True)  # each process's own seed for torch's generators too

    def _before_weights(
        self, args, reward_funcs, reward_processing_classes, train_dataset, eval_dataset, processing_class, episodes
    ):
        """Step 1 of the constructor: the checks that need no weights, then the rewards. Sets `offline_data` (stored,
        scored completions as groups, data/offline.py, or None), `vision` (images beside the prompts, docs/vlm.md),
        `toolbox` (from `episodes`: the tools and the environment factory), `completions_hub` and `rewards`; returns
        the training set the loaders draw from (offline: the groups)."""
        self.offline_data = offline.offline_groups(train_dataset, eval_dataset, args, reward_funcs)
        self.vision = image_checks.scan_images(train_dataset, eval_dataset)  # each image opened, or None: none
        train_dataset = self.offline_data if self.offline_data is not None else train_dataset
        for name, dataset in (("train_dataset", train_dataset), ("eval_dataset", eval_dataset)):
            check_prompt_dataset(dataset, name)
        check_dataset_sizes(args, train_dataset, eval_dataset, groups=self.offline_data is not None)  # not at train()
        check_episodes(*episodes, vision=self.vision, offline=self.offline_data)  # each alone, callable, on its data
        check_vision_run(args, processing_class, self.vision, episodes[0] or episodes[1], self.offline_data)
        self.toolbox = make_toolbox(*episodes[:2], args)  # multi-turn episodes: schemas and environments checked now
        check_environment_rows(self.toolbox, train_dataset, eval_dataset)  # dict of factories: each row names one
        turn_credit = args.turn_advantage is not None  # environments' get_turn_rewards score each turn too
        reward_funcs, weights = with_environment_rewards(reward_funcs, self.toolbox, args.reward_weights, turn_credit)
        self.completions_hub = hub_log.for_run(args)  # log_completions_hub_repo: token and repository, checked now
        rewards = offline_rewards(self.offline_data, reward_funcs, reward_processing_classes, weights)
        passed = reward_keywords(train_dataset, eval_dataset, self.toolbox, self.offline_data, episodes)
        self.rewards = RewardSet(*rewards, trust_remote_code=args.trust_remote_code, keywords=passed)
        self.rewards.check_run(args, self.toolbox)  # settings these functions would leave doing nothing
        return train_dataset

    def _on_the_accelerator(self, layout: tuple[bool, bool], router_coef: float, processing_class, train_dataset):
        """Step 3 of the constructor, once Trainer made the accelerator: the log-prob pass (forward `layout`:
        padding-free, shared prompt; tiled MLPs, offloaded activations), the step loss, the non-finite guard, the
        reference's updates, the frozen models on the device, and the round maker with its sampler."""
        if self.args.keep_freed_cpu_memory and self.accelerator.device.type == "cpu":
            from grpo.contrib.cpu import memory  # opt-in CPU tuning (process-wide malloc settings), only when asked

            memory.keep_freed_memory()
        context = activation_memory.forward_context(self.model, self.accelerator, self.args)  # tiled MLPs, offloading
        self.logprobs = LogProbs(self.settings.logprobs, *layout, autocast=context)
        self.step_loss, self.args = liger.choose(self.model, self.args, self.settings, self.accelerator, router_coef)
        self.gradient_guard = GradientGuard(self.accelerator, self.args.nonfinite, self.metric_windows["train"])
        self.add_callback(self.gradient_guard)
        if self._reference_moves:
            self.add_callback(ReferenceUpdate(self))
        if self.logprobs.sequence_parallel is not None:  # its attention set up once accelerate prepared the model
            self.add_callback(self.logprobs.sequence_parallel)
        self._frozen_engines = []  # DeepSpeed engines of frozen ZeRO-3 models (grpo.models.prepare_frozen)
        if self.ref_model is not None:  # the reference and the reward models placed on the accelerator's device
            self.ref_model = prepare_frozen(self.ref_model, self.accelerator, self._frozen_engines)
        self.rewards.outcome_funcs = [
            prepare_frozen(f, self.accelerator, self._frozen_engines) if isinstance(f, PreTrainedModel) else f
            for f in self.rewards.outcome_funcs
        ]
        self.rounds = RoundMaker(
            self.args,
            self.accelerator,
            self.settings,
            self.rewards,
            processing_class=processing_class,
            eos_token_ids=self.eos_token_ids,
            agent=self.agent,
            logprobs=self.logprobs,
            metric_windows=self.metric_windows,
            train_dataset=train_dataset,
            offline_data=self.offline_data,
        )

    @property
    def generation(self):
        """The sampler (a `GenerationBackend`): the round maker's."""
        return self.rounds.generation

    @generation.setter
    def generation(self, backend) -> None:
        self.rounds.generation = backend

    num_generations = property(lambda self: self.args.num_generations)  # TRL's G, which rollout functions read
    num_generations_eval = property(lambda self: self.args.eval_generations)  # G in evaluation

    @property
    def reward_names(self) -> list[str]:
        """The reward functions' names: outcome, then process, then turn functions (the metric columns)."""
        return self.rewards.names

    @property
    def reward_funcs(self) -> list:
        """The outcome reward functions and reward models (process functions: `self.rewards.process_funcs`)."""
        return self.rewards.outcome_funcs

    def round_context(self) -> RoundContext:
        """What a round reads of this trainer now (rounds.py): models, state, micro-step, step schedule (training)."""
        schedule = self.step_schedule if self.model.training and self.train_dataset is not None else None
        return RoundContext(self.model, self.model_wrapped, self.ref_model, self.state, self._step, schedule)

    def sample_round(self, inputs: list[dict[str, Any]], backend):
        """Steps 2-3 for the dataset rows `inputs` with `backend`, as training samples them
        (`RoundMaker.sample_round`): (Rollout, the rows' other columns)."""
        return self.rounds.sample_round(inputs, backend, self.round_context())

    # ---- Steps 1-7: generation rounds, buffered into micro-batches ----

    def _prepare_inputs(self, inputs: list[dict[str, Any]]) -> MicroBatch:
        """Steps 1 and 6: at every `micro_steps_per_round`-th micro-step a new round (`RoundMaker.make`), cut into
        micro-batches, pi_old given to those no training pass can give it to; one micro-batch per call."""
        if not self.model.training:  # evaluation: every batch is generated and scored afresh
            return self.rounds.micro_batches(self.rounds.make(inputs, "eval", self.round_context()), "eval")[0]
        args, schedule, rounds = self.args, self.step_schedule, self.rounds
        if not self._buffer:  # first call; after a resume only when the checkpoint held no buffer (another trainer's)
            self._step = schedule.first_micro_step(self.state.global_step)
        if rounds.async_rounds is not None:  # the sampler gets every optimizer step's weights, not only a round's
            rounds.sync_weights(self.model, self.state.global_step)
        if not self._buffer or self._step % args.micro_steps_per_round == 0:
            self._buffer = rounds.micro_batches(rounds.make(inputs, "train", self.round_context()), "train")
            with torch.no_grad():  # step 6: a pass for pi_old now, only where no training pass can give it
                steps_left, step = schedule.steps_left(self._step), self.state.global_step
                old_policy.plan(self._buffer, self._step, steps_left, args, step, self._old_logprobs)
        micro_batch = self._buffer[self._step % args.steps_per_generation]
        self._step += 1
        return micro_batch

    def _old_logprobs(self, micro_batch: MicroBatch) -> torch.Tensor:  # step 6: a no-grad pass of the policy
        return self.logprobs(self.model, micro_batch)[0]

    # ---- Step 8: the loss ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Step 8: the policy's log-probs of the micro-batch in one forward pass, its loss (`StepLoss`), and its
        record: the metrics, and in training what the non-finite guard checks at the optimizer step."""
        if return_outputs:
            raise ValueError("GRPOTrainer.compute_loss does not return model outputs.")
        training = model.training
        micro_steps = self.current_gradient_accumulation_steps if training else 1
        context = StepContext(training, micro_steps, self.state.global_step)
        logps, result = self.step_loss.run(self.logprobs, model, inputs, context)  # Liger's fused loss, where it runs
        metrics.add_loss_metrics(self.metric_windows["train" if training else "eval"], result)
        if training:  # checked at the optimizer step, with what names the row of a non-finite term (nonfinite.py)
            level = self.settings.loss.importance_sampling_level
            self.gradient_guard.record(LossRecord.of(inputs, logps, result, level))
        return result.loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss = self.compute_loss(model, inputs)
        return loss.detach(), None, None

    def _end_training(self) -> None:
        self.rounds.close()
        if self.completions_hub is not None:
            self.completions_hub.wait()

    # ---- Exact resume: the state beyond Trainer's checkpoint (grpo/training/checkpoints.py, `ResumableTrainer`) ----

    def _save_state(self, checkpoint_dir: str) -> None:
        """What this process needs beyond Trainer's checkpoint to continue exactly (see grpo/training/checkpoints.py)."""
        state = {
            "settings": checkpoints.round_settings(self.args, self.accelerator.num_processes),
            "step": self._step,
            "buffer": [micro_batch.state_dict() for micro_batch in self._buffer],
            "metrics": {mode: window.state_dict() for mode, window in self.metric_windows.items()},
            "entropy_control": self.step_loss.entropy_control.state_dict(),
            **self.rounds.state_dict(),  # tokens seen, refill position, completions to log, the sampler's stream
        }
        checkpoints.save_state(
            os.path.join(checkpoint_dir, checkpoints.STATE_FILE.format(self.accelerator.process_index)), state
        )
        if self._reference_moves and self.args.should_save:  # the same on every process
            checkpoints.save_reference(checkpoint_dir, self.ref_model)

    def _restore_state(self, checkpoint: str) -> None:
        if self._reference_moves:
            checkpoints.load_reference(checkpoint, self.ref_model)
        settings = checkpoints.round_settings(self.args, self.accelerator.num_processes)
        state = checkpoints.load_state(checkpoint, self.accelerator.process_index, settings, self.accelerator.device)
        if state is not None:
            self._buffer = [MicroBatch.from_state_dict(micro_batch) for micro_batch in state["buffer"]]
            self._step = state["step"]
            for mode, window in state["metrics"].items():
                self.metric_windows[mode].load_state_dict(window)
            self.step_loss.entropy_control.load_state_dict(state.get("entropy_control"))
            self.rounds.load_state_dict(state)

    # ---- Logging ----

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        mode = "train" if self.model.training else "eval"
        logged = self.metric_windows[mode].pop()
        if mode == "eval":
            logged = {f"eval_{k}": v for k, v in logged.items()}
        logs.update(logged)  # in place: `evaluate()` returns it; a skipped step's inf loss replaces Trainer's stand-in
        super().log(logs, start_time)
        if mode == "train" and self.args.log_completions and self.rounds.samples and self.accelerator.is_main_process:
            path, step = os.path.join(self.args.output_dir, "completions.jsonl"), self.state.global_step
            shown, unique = self.args.num_completions_to_print, self.args.log_unique_prompts
            run = getattr(self, "run_started", None)
            samples = self.rounds.take_samples()
            metrics.report_samples(samples, self.reward_names, path, step, shown, run, unique_prompts=unique)
            if self.completions_hub is not None:
                self.completions_hub.push(path, step)
