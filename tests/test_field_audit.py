"""Every field `GRPOConfig` accepts, its own and the ones it inherits from `transformers.TrainingArguments`, is in
exactly one of the lists below: done by `Trainer` itself (this trainer's hooks leave it alone), done by this library,
refused when set to a value this trainer would ignore (grpo/training/inherited_fields.py, with the reason), or
handled by another part of the work. A field that a new transformers adds, or that GRPOConfig gains, fails
`test_every_field_is_accounted_for` until it is placed in one; an accepted field must never be silently ignored."""

import dataclasses
import re
from pathlib import Path

import pytest
from transformers import TrainingArguments

from grpo import GRPOConfig
from grpo.data.sampler import train_sampler
from grpo.training.inherited_fields import UNHONOURED, UNHONOURED_ACCELERATOR

ROOT = Path(__file__).resolve().parents[1]

# Inherited fields `Trainer` acts on and this trainer leaves alone (it overrides compute_loss, prediction_step, log
# and its loaders, not the optimizer, schedule, precision, logging, saving, hub or launcher machinery).
TRAINER = {
    "num_train_epochs": "epochs of the sampler's whole rounds",
    "max_steps": "optimizer steps",
    "lr_scheduler_type": "the schedule",
    "lr_scheduler_kwargs": "the schedule",
    "warmup_steps": "the schedule",
    "optim": "the optimizer",
    "optim_args": "the optimizer",
    "optim_target_modules": "the optimizer (GaLore, APOLLO)",
    "weight_decay": "the optimizer",
    "adam_beta1": "the optimizer",
    "adam_beta2": "the optimizer",
    "adam_epsilon": "the optimizer",
    "max_grad_norm": "gradient clipping at the optimizer step",
    "fp16": "mixed precision (generation and log-prob passes run in the accelerator's autocast)",
    "bf16_full_eval": "casts the model for evaluate() outside training",
    "fp16_full_eval": "casts the model for evaluate() outside training",
    "tf32": "matmul precision",
    "activation_checkpointing": "on the model before training",
    "activation_checkpointing_kwargs": "on the model before training",
    "gradient_checkpointing": "transformers' alias of activation_checkpointing",
    "gradient_checkpointing_kwargs": "transformers' alias of activation_checkpointing_kwargs",
    "torch_compile": "the training forward (generation uses the uncompiled model)",
    "torch_compile_backend": "the training forward",
    "torch_compile_mode": "the training forward",
    "use_cache": "model.config.use_cache; generation asks for its KV cache itself",
    "torch_empty_cache_steps": "Trainer's training_step, not overridden",
    "logging_strategy": "when log() is called",
    "logging_first_step": "when log() is called",
    "log_on_each_node": "logging",
    "logging_nan_inf_filter": "Trainer's loss logging",
    "log_level": "logging",
    "log_level_replica": "logging",
    "disable_tqdm": "progress bars",
    "report_to": "trackers",
    "run_name": "trackers",
    "project": "trackers",
    "trackio_space_id": "trackers",
    "trackio_bucket_id": "trackers",
    "trackio_static_space_id": "trackers",
    "eval_strategy": "when evaluate() is called",
    "eval_steps": "when evaluate() is called",
    "eval_delay": "when evaluate() is called",
    "eval_on_start": "when evaluate() is called",
    "save_only_model": "checkpoints (a resume then needs the optimizer and this trainer's state, as in Trainer)",
    "save_strategy": "checkpoints",
    "save_steps": "checkpoints",
    "save_on_each_node": "checkpoints",
    "save_total_limit": "checkpoints",
    "push_to_hub": "the hub",
    "hub_token": "the hub",
    "hub_private_repo": "the hub",
    "hub_model_id": "the hub",
    "hub_strategy": "the hub",
    "hub_always_push": "the hub",
    "hub_revision": "the hub",
    "load_best_model_at_end": "best checkpoint by an eval_ metric (eval_reward, ...)",
    "metric_for_best_model": "best checkpoint",
    "greater_is_better": "best checkpoint",
    "ignore_data_skip": "a resumed epoch restarts its data (as asked: the resume is then not exact)",
    "restore_callback_states_from_checkpoint": "callbacks",
    "full_determinism": "deterministic kernels",
    "use_cpu": "the device",
    "ddp_find_unused_parameters": "DDP",
    "ddp_bucket_cap_mb": "DDP",
    "ddp_broadcast_buffers": "DDP",
    "ddp_static_graph": "DDP",
    "ddp_backend": "DDP",
    "ddp_timeout": "DDP",
    "fsdp": "FSDP (docs/distributed.md)",
    "fsdp_config": "FSDP",
    "deepspeed": "DeepSpeed",
    "debug": "debug modes",
    "skip_memory_metrics": "memory metrics",
    "local_rank": "the launcher",
    "do_train": "read by training scripts, not by Trainer (in any trainer)",
    "do_eval": "read by training scripts, not by Trainer",
    "do_predict": "read by training scripts, not by Trainer",
    "resume_from_checkpoint": "read by training scripts (and `grpo train`), passed to train()",
}

# Inherited fields this library reads itself (beside, or instead of, Trainer).
HERE = {
    "output_dir": "made absolute once, outside the model's folder (grpo/training/output_dir.py)",
    "per_device_train_batch_size": "rows of a micro-batch; with G and accumulation, the generation round",
    "per_device_eval_batch_size": "rows of an evaluation batch (grpo/data/sampler.py eval_batches)",
    "gradient_accumulation_steps": "micro-steps per optimizer step; the round's size",
    "seed": "the data order (unless data_seed), the sampling stream, torch's generators",
    "data_seed": "the training data order (grpo/data/sampler.py train_sampler)",
    "dataloader_drop_last": "evaluation drops its last, shorter batch (training rounds are always whole)",
    "dataloader_num_workers": "the training loader (Trainer's) and the evaluation loader (loaders.py)",
    "dataloader_pin_memory": "both loaders; off without CUDA",
    "dataloader_persistent_workers": "both loaders",
    "dataloader_prefetch_factor": "both loaders",
    "dataloader_multiprocessing_context": "both loaders",
    "dataloader_in_order": "both loaders",
    "accelerator_config": "Trainer's, but split_batches and dispatch_batches are refused (UNHONOURED_ACCELERATOR)",
    "prediction_loss_only": "evaluation gives the loss and metrics only, no predictions (no compute_metrics here)",
    "use_liger_kernel": "Liger's fused linear GRPO loss, and Trainer's layer kernels where they run (objective/liger.py)",
    "liger_kernel_config": "Trainer's layer kernels; fused_linear_cross_entropy refused (tests/test_liger.py)",
    # TrainingArguments fields GRPOConfig redeclares with TRL's defaults.
    "learning_rate": "1e-6, as TRL; refused above 1.0 unless allow_large_learning_rate",
    "bf16": "None: on only where CUDA supports bfloat16",
    "logging_steps": "10, as TRL",
    "remove_unused_columns": "False; True refused (the reward functions read the columns)",
}

# GRPOConfig's own fields (TRL 1.16's and this library's), declared with `option` in grpo/config.py.
OWN = (
    "allow_large_learning_rate",
    "model_init_kwargs",
    "train_vision_tower",
    "trust_remote_code",
    "disable_dropout",
    "cast_lm_head_to_fp32",
    "logprobs_chunk_size",
    "padding_free",
    "share_prompt",
    "tiled_mlp_tokens",
    "activation_offloading",
    "cpu_decode_kernel",
    "cpu_inverse_cdf_sampling",
    "keep_freed_cpu_memory",
    "num_generations",
    "num_generations_eval",
    "max_prompt_length",
    "truncation_side",
    "max_completion_length",
    "generation_batch_size",
    "steps_per_generation",
    "shuffle_dataset",
    "pad_to_multiple_of",
    "chat_template_kwargs",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "generation_kwargs",
    "cache_implementation",
    "ds3_gather_for_generation",
    "use_transformers_continuous_batching",
    "transformers_continuous_batching_config",
    "use_transformers_paged",
    "reward_weights",
    "multi_objective_aggregation",
    "reward_errors",
    "nonfinite",
    "reward_timeout",
    "reward_num_workers",
    "reward_worker_type",
    "scale_rewards",
    "turn_advantage",
    "turn_advantage_coef",
    "dynamic_sampling",
    "max_dynamic_sampling_rounds",
    "loss_type",
    "beta",
    "sync_ref_model",
    "ref_model_mixup_alpha",
    "ref_model_sync_steps",
    "ref_model_reset_steps",
    "epsilon",
    "epsilon_high",
    "delta",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
    "use_bias_correction_kl",
    "off_policy_mask_threshold",
    "importance_sampling_level",
    "top_entropy_quantile",
    "entropy_coef",
    "use_adaptive_entropy",
    "entropy_coef_min",
    "entropy_coef_max",
    "entropy_coef_delta",
    "entropy_target",
    "router_aux_loss_coef",
    "num_iterations",
    "mask_truncated_completions",
    "use_vllm",
    "vllm_mode",
    "vllm_model_impl",
    "vllm_structured_outputs_regex",
    "vllm_server_base_url",
    "vllm_server_host",
    "vllm_server_port",
    "vllm_server_timeout",
    "vllm_request_timeout",
    "vllm_group_port",
    "vllm_sync_bucket_mb",
    "vllm_gpu_memory_utilization",
    "vllm_tensor_parallel_size",
    "vllm_enable_sleep_mode",
    "vllm_max_model_length",
    "vllm_importance_sampling_correction",
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_cap",
    "async_generation",
    "max_staleness",
    "max_tool_calling_iterations",
    "tool_timeout",
    "tool_errors",
    "tool_num_workers",
    "environment_group_seed",
    "tool_max_hung_calls",
    "tool_call_parser",
    "agent_timeout",
    "agent_failure_reward",
    "offline_completion_column",
    "offline_reward_column",
    "offline_logprobs_column",
    "offline_baseline",
    "save_rollouts",
    "log_completions",
    "num_completions_to_print",
    "log_unique_prompts",
    "log_multimodal",
    "log_completions_hub_repo",
    "learning_signal_warnings",
    "preemption_timeout",
)

# Refused when set to anything but the value this trainer runs with, with the reason (inherited_fields.py): a value
# each is tried with.
REFUSED = {
    "auto_find_batch_size": True,
    "average_tokens_across_devices": False,
    "label_smoothing_factor": 0.1,
    "label_names": ["labels"],
    "neftune_noise_alpha": 5.0,
    "include_num_input_tokens_seen": "all",
    "train_sampling_strategy": "group_by_length",
    "length_column_name": "n_tokens",
    "enable_jit_checkpoint": True,
    "eval_do_concat_batches": False,
    "eval_use_gather_object": True,
    "eval_accumulation_steps": 2,
    "include_for_metrics": ["inputs"],
    "batch_eval_metrics": True,
}

# Handled by a mechanism with tests of its own.
ELSEWHERE = {
    "parallelism_config": "sp_size: sequence parallelism; cp_size > 1 refused (tests/test_sequence_parallel.py)",
}


def config(tmp_path, **settings) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none", **settings)


def test_every_field_is_accounted_for():
    lists = {"TRAINER": TRAINER, "HERE": HERE, "OWN": OWN, "REFUSED": REFUSED, "ELSEWHERE": ELSEWHERE}
    placed = [name for names in lists.values() for name in names]
    twice = sorted({name for name in placed if placed.count(name) > 1})
    assert not twice, f"fields in more than one list: {twice}"
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    unplaced = sorted(fields - set(placed))
    assert not unplaced, (
        f"GRPOConfig accepts {unplaced}, which no list of tests/test_field_audit.py holds (a new transformers or TRL "
        "field?). Find what it does: if Trainer does it and this trainer's hooks leave it alone, put it in TRAINER; "
        "if this library must act on it, do so and put it in HERE (or OWN); if this trainer cannot honour it, refuse "
        "other values in grpo/training/inherited_fields.py and put it in REFUSED."
    )
    assert not set(placed) - fields, f"listed but not fields: {sorted(set(placed) - fields)}"
    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert not set(OWN) & inherited, "OWN holds GRPOConfig's own fields only"
    assert set(REFUSED) == set(UNHONOURED), "REFUSED and inherited_fields.UNHONOURED must name the same fields"


def test_own_fields_are_read_by_the_library(tmp_path):
    """An own field no module but grpo/config.py names is read by nothing, unless the config acts on it itself."""
    acted_on_in_config = {
        "allow_large_learning_rate": "lifts the learning_rate check",
        "vllm_tensor_parallel_size": "only 1 is built; others are refused",
        "vllm_importance_sampling_cap": "TRL's old name, folded into vllm_importance_sampling_clip_max",
    }
    sources = "\n".join(p.read_text() for p in (ROOT / "grpo").rglob("*.py") if p.name != "config.py")
    unread = [n for n in OWN if n not in acted_on_in_config and not re.search(rf"\b{n}\b", sources)]
    assert not unread, f"GRPOConfig fields no module reads: {unread}"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_field_this_trainer_would_ignore_is_refused_with_the_reason(tmp_path, name):
    config(tmp_path)  # the accepted value, its default, builds
    with pytest.raises(ValueError, match=rf"^{name}=.* is not supported by GRPOTrainer: it .+\. Leave it at "):
        config(tmp_path, **{name: REFUSED[name]})


@pytest.mark.parametrize("name", sorted(UNHONOURED_ACCELERATOR))
def test_accelerator_settings_that_would_move_rows_between_processes_are_refused(tmp_path, name):
    with pytest.raises(ValueError, match=rf"accelerator_config {name}=True is not supported by GRPOTrainer"):
        config(tmp_path, accelerator_config={name: True})
    config(tmp_path, accelerator_config={"even_batches": False})  # the other keys are Trainer's


def test_data_seed_orders_the_training_data(tmp_path):
    # TrainingArguments' data_seed seeds the order of the data, apart from seed (which the sampler used alone).
    args = config(tmp_path, num_generations=2, per_device_train_batch_size=2, seed=1)
    seeded = config(tmp_path, num_generations=2, per_device_train_batch_size=2, seed=1, data_seed=7)
    other_seed = config(tmp_path, num_generations=2, per_device_train_batch_size=2, seed=2, data_seed=7)
    order = list(train_sampler(args, 16))
    assert list(train_sampler(seeded, 16)) != order
    assert list(train_sampler(seeded, 16)) == list(train_sampler(other_seed, 16))  # data_seed alone decides
