"""The `transformers.TrainingArguments` fields `GRPOConfig` inherits that this trainer cannot honour: each is refused
when set, with why and what to do instead, rather than accepted and ignored. `GRPOConfig.__post_init__` calls
`check_inherited_fields`; tests/test_field_audit.py holds the audit of every field (done by `Trainer` itself, done
here, refused here, or handled by another part of the library), so a field a new transformers adds fails until it is
placed. Imports nothing: building a config stays cheap.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class Unhonoured(NamedTuple):
    """An inherited field this trainer cannot honour: the one value it runs with (`TrainingArguments`' default), and
    why another is refused, with what to do instead."""

    accepted: Any
    why: str


# What evaluation here gives: metrics of sampled completions (rewards, lengths, the loss), no predictions.
_NO_PREDICTIONS = (
    "concerns the predictions Trainer gathers for compute_metrics; evaluation here samples completions and logs "
    "their rewards, lengths and loss, and has no predictions to gather (GRPOTrainer takes no compute_metrics)"
)

UNHONOURED = {
    "auto_find_batch_size": Unhonoured(
        False,
        "halves per_device_train_batch_size after an out-of-memory error, which would cut the groups of "
        "num_generations rows and change generation_batch_size in the middle of a run. Lower "
        "per_device_train_batch_size (and raise gradient_accumulation_steps) yourself",
    ),
    "average_tokens_across_devices": Unhonoured(
        True,
        "sets how Trainer's own loss averages tokens over processes; the GRPO loss is normalised by its loss_type, "
        "over every process's tokens or rows (docs/method.md), whatever this field says",
    ),
    "label_smoothing_factor": Unhonoured(
        0.0,
        "smooths the labels of a supervised loss; the GRPO loss has no labels (its targets are the sampled tokens, "
        "weighted by their advantages)",
    ),
    "label_names": Unhonoured(
        None, "names the label columns of a supervised batch; GRPO batches have none (rewards come from reward_funcs)"
    ),
    "neftune_noise_alpha": Unhonoured(
        None,
        "adds noise to the input embeddings in every training forward pass, so the log-probs trained on would not "
        "be those of the policy that sampled (the ratio pi / pi_old would not be 1 on-policy)",
    ),
    "include_num_input_tokens_seen": Unhonoured(
        "no",
        "counts the input_ids of Trainer's batches, which this trainer's batches (data set rows) do not have; the "
        "`num_tokens` metric logs the prompt and completion tokens of every round instead",
    ),
    "train_sampling_strategy": Unhonoured(
        "random",
        "chooses Trainer's sampler, which this trainer replaces with its own rounds of G copies of each prompt. "
        "For the data set's own order ('sequential') set shuffle_dataset=False",
    ),
    "length_column_name": Unhonoured(
        "length", "is read only by train_sampling_strategy='group_by_length', which this trainer refuses"
    ),
    "enable_jit_checkpoint": Unhonoured(
        False,
        "installs Trainer's own SIGTERM handler; this trainer already stops on SIGTERM at the end of the step in "
        "progress, with a checkpoint (docs/reliability.md#preemption)",
    ),
    "eval_do_concat_batches": Unhonoured(True, _NO_PREDICTIONS),
    "eval_use_gather_object": Unhonoured(False, _NO_PREDICTIONS),
    "eval_accumulation_steps": Unhonoured(None, _NO_PREDICTIONS),
    "include_for_metrics": Unhonoured([], _NO_PREDICTIONS),
    "batch_eval_metrics": Unhonoured(False, _NO_PREDICTIONS),
}

# `accelerator_config` keys that would change which rows each process's loader batch holds.
UNHONOURED_ACCELERATOR = {
    "split_batches": Unhonoured(
        False,
        "would split each process's loader batch, its share of a generation round, again across the processes",
    ),
    "dispatch_batches": Unhonoured(
        None, "would have process 0 read every process's rows and send them out, in place of this trainer's rounds"
    ),
}


def check_inherited_fields(args) -> None:
    """Refuse an inherited field of `args` (a `GRPOConfig`, after `TrainingArguments.__post_init__`) set to a value
    this trainer would ignore (`UNHONOURED`, and `accelerator_config`'s `UNHONOURED_ACCELERATOR`)."""
    for name, (accepted, why) in UNHONOURED.items():
        value = getattr(args, name)
        if value != accepted and not (accepted == [] and value is None):
            raise ValueError(f"{name}={value!r} is not supported by GRPOTrainer: it {why}. Leave it at {accepted!r}.")
    accelerator = getattr(args, "accelerator_config", None)
    for name, (accepted, why) in UNHONOURED_ACCELERATOR.items():
        value = getattr(accelerator, name, accepted)
        if value != accepted and not (accepted is None and value is False):
            raise ValueError(
                f"accelerator_config {name}={value!r} is not supported by GRPOTrainer: it {why}. Leave it unset."
            )
    check_liger_kernel_config(args)


def check_liger_kernel_config(args) -> None:
    """With `use_liger_kernel`, refuse Liger's fused linear cross-entropy in `liger_kernel_config`, and turn it off
    where the config leaves it to Liger's default (on), as TRL 1.16 does; Liger's other layer kernels apply
    (grpo/objective/liger.py)."""
    if not args.use_liger_kernel:
        return
    kernels = args.liger_kernel_config or {}
    if not isinstance(kernels, dict):
        raise ValueError(
            f"liger_kernel_config={kernels!r} must be a dict of Liger kernel names to booleans, e.g. "
            '{"rms_norm": True, "swiglu": False}.'
        )
    if kernels.get("fused_linear_cross_entropy"):
        raise ValueError(
            'liger_kernel_config={"fused_linear_cross_entropy": True} is not supported by GRPOTrainer: it replaces '
            "the model's forward with one that computes a cross-entropy loss against labels, and GRPO has none (the "
            "loss reads the final hidden states: Liger's fused linear GRPO loss, or this library's chunked "
            "log-probs). Leave fused_linear_cross_entropy out of liger_kernel_config; the other kernels apply."
        )
    args.liger_kernel_config = {**kernels, "fused_linear_cross_entropy": False}
