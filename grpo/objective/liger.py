"""Liger's fused linear GRPO loss (`use_liger_kernel=True`): the loss that trains is liger-kernel's
`LigerFusedLinearGRPOLoss`, which takes the final hidden states and the output head, projects them in chunks of rows
and computes the loss and its gradients in one sweep, never building the (B, T, V) logits.

What a run with `use_liger_kernel=True` does, decided when the trainer is built (`choose`) and said in one log line
on the main process:
  - Liger's fused loss, where liger-kernel is installed and its options cover the run's loss: every loss type, beta,
    epsilon / epsilon_high, delta, importance_sampling_level, use_bias_correction_kl, sapo's and vespo's knobs, the
    temperature, and the sampler's correction without a KL term. It is written in torch and runs on any device;
    torch.compile (Liger's default) only on a GPU. On a CPU it is slower than this library's path
    (docs/performance.md).
  - else this library's own path (chunked log-probs, which never build the full logits either, and `policy_loss`),
    the line naming what Liger lacks (`missing_option`, `head_reason`) or that the package is missing.
  - Liger's layer kernels (RMSNorm, SwiGLU, RoPE, ...) are applied by `transformers.Trainer` at `train()`, as for any
    model, where Triton and a GPU let them run; elsewhere Trainer gets the args without `use_liger_kernel` (it would
    fail importing them), and the line says so. Its fused linear cross-entropy is refused with the config
    (grpo/training/inherited_fields.py).
A micro-batch Liger cannot take (per-token advantages; the sampler's correction with a KL term: `batch_reason`) runs
this library's path, said once per reason. Evaluation always does: it needs no gradient.

The logged metrics are the same as without Liger: `policy_loss`'s statistics and the entropy, from one no-grad
projection of the same hidden states; Liger's loss alone carries the gradient. A Liger step thus costs the backbone's
forward and backward, Liger's projection (forward and backward, done together in its forward) and that no-grad one.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import logging

import torch

from grpo.objective.logprobs import chunked_logprobs, output_projection, projection_is_whole
from grpo.objective.loss import spans_the_step
from grpo.objective.settings import LogProbSettings, LossSettings, ObjectiveSettings
from grpo.objective.step_loss import StepContext, StepLoss, StepLossResult
from grpo.rollout import MicroBatch

logger = logging.getLogger(__name__)

# What this module passes to liger-kernel's GRPO loss, which its older releases lack.
NEEDED_OPTIONS = (
    "delta",
    "use_bias_correction_kl",
    "importance_sampling_level",
    "vespo_k_pos",
    "sapo_temperature_pos",
)
NEEDED_INPUTS = ("vllm_is_ratio", "num_items_in_batch")


def choose(model, args, settings: ObjectiveSettings, accelerator, router_coef: float = 0.0):
    """The run's `StepLoss` and the args to give `transformers.Trainer`: Liger's (`LigerStepLoss`) where
    `args.use_liger_kernel` asks for it and it can run the run's loss, else the plain one; with
    `use_liger_kernel=True`, one log line (main process) says which, and whether Liger's layer kernels apply. Where
    they cannot, the args returned are a copy with `use_liger_kernel=False`, so that Trainer does not try them at
    `train()`; the caller's args are left as they are. Refuses a PEFT adapter on the output head (`check_head`)."""
    if not args.use_liger_kernel:
        return StepLoss(settings.loss, accelerator, router_coef), args
    check_head(model)
    kernels = layer_kernels_reason(accelerator.device)
    if kernels is not None:
        args = copy.copy(args)
        args.use_liger_kernel = False
    reason = package_reason() or missing_option(settings.loss, settings.logprobs) or head_reason(model)
    if accelerator.is_main_process:
        logger.warning(announcement(reason, kernels, accelerator.device))
    if reason is not None:
        return StepLoss(settings.loss, accelerator, router_coef), args
    module = loss_module(settings.loss, settings.logprobs.temperature, compiled=accelerator.device.type == "cuda")
    return LigerStepLoss(settings.loss, accelerator, router_coef, module, settings.logprobs), args


def announcement(reason: str | None, kernels: str | None, device: torch.device) -> str:
    """The log line of `choose`: what computes the loss (and why not Liger), and whether Liger's layer kernels
    apply (`kernels`: why not, or None)."""
    if reason is None:
        compiled = "compiled" if device.type == "cuda" else f"not compiled on {device.type}"
        if device.type == "cpu":  # docs/performance.md, "Liger's fused GRPO loss"
            compiled += ", where it is slower than this library's path: use_liger_kernel=False runs that"
        loss = f"the loss runs through Liger's fused linear GRPO loss ({compiled})"
    else:
        loss = (
            f"not Liger's fused linear GRPO loss, since {reason}: the loss runs on this library's chunked "
            "log-probs, which never build the full logits either"
        )
    layers = "applied by Trainer at train()" if kernels is None else f"not applied, since {kernels}"
    return f"use_liger_kernel=True: {loss}; Liger's layer kernels are {layers}."


def check_head(model) -> None:
    """Refuse a PEFT adapter on `model`'s output head: Liger's fused loss projects with the head's own weight, which
    holds no adapter's update (TRL refuses it too)."""
    head = output_projection(model)[0]
    if hasattr(head, "base_layer"):  # a PEFT tuner layer (LoRA, ...) wraps the head
        raise ValueError(
            "use_liger_kernel=True computes the loss with the output head's own weight (Liger's fused linear GRPO "
            "loss), but a PEFT adapter targets the head (target_modules includes lm_head), so its update would be "
            "left out. Remove lm_head from the adapter's target_modules, or set use_liger_kernel=False."
        )


def installed(package: str) -> bool:
    """Whether `package` is on the path here (looked up, not imported)."""
    return importlib.util.find_spec(package) is not None


def layer_kernels_reason(device: torch.device) -> str | None:
    """Why Liger's layer kernels (Triton kernels that Trainer applies to the model) cannot run here, or None."""
    if not installed("liger_kernel"):
        return "liger-kernel is not installed"
    if not installed("triton"):
        return "they need Triton, which is not installed"
    if device.type == "cpu":
        return "they need a GPU"
    return None


def package_reason() -> str | None:
    """Why liger-kernel's GRPO loss cannot be used here (not installed, or a release without what this module
    passes it), or None."""
    if not installed("liger_kernel"):
        return "liger-kernel is not installed (pip install 'grpo[liger]')"
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except ImportError as error:
        return f"liger-kernel does not import here ({error})"
    options = inspect.signature(LigerFusedLinearGRPOLoss.__init__).parameters
    inputs = inspect.signature(LigerFusedLinearGRPOLoss.forward).parameters
    lacking = [name for name in NEEDED_OPTIONS if name not in options] + [n for n in NEEDED_INPUTS if n not in inputs]
    if lacking:
        return (
            f"the installed liger-kernel's GRPO loss has no {', '.join(lacking)} (pip install -U 'liger-kernel>=0.8')"
        )
    return None


def missing_option(loss: LossSettings, logprobs: LogProbSettings) -> str | None:
    """The first setting of a run that Liger's fused GRPO loss does not implement, in words, or None where it covers
    the run."""
    if loss.top_entropy_quantile < 1.0:
        return f"it has no top_entropy_quantile={loss.top_entropy_quantile} (a mask of the high-entropy tokens)"
    if loss.off_policy_mask_threshold is not None:
        return "it has no off_policy_mask_threshold (off-policy sequence masking)"
    if loss.entropy.enabled:
        return "it has no entropy bonus (entropy_coef, use_adaptive_entropy)"
    if loss.loss_type == "luspo" and loss.beta != 0:
        return "its loss_type='luspo' scales the KL term of padding positions too (beta != 0)"
    if logprobs.head_fp32:
        return "it has no cast_lm_head_to_fp32=True (it projects in the hidden states' dtype)"
    if logprobs.sequence_parallel_size > 1:
        return "it has no sequence parallelism (each process would hold a shard of every sequence)"
    return None


def head_reason(model) -> str | None:
    """What of `model`'s output projection Liger's fused loss cannot apply, in words, or None for a plain linear
    head, whole on this process."""
    head, scale, softcap = output_projection(model)
    if softcap is not None:
        return f"it has no logit soft cap (the model's final_logit_softcapping={softcap})"
    if scale != 1.0:
        return f"it has no logit scaling (the model multiplies its logits by {scale})"
    if not projection_is_whole(head.weight):
        return "it needs the whole output head, which is partitioned across processes here (ZeRO-3, FSDP)"
    return None


def batch_reason(batch: MicroBatch, loss: LossSettings) -> str | None:
    """What of one micro-batch Liger's fused loss cannot take, in words, or None."""
    if batch.advantages.dim() == 2:
        return "per-token advantages (process rewards, turn credit)"
    if loss.beta != 0 and loss.sampling.enabled and batch.sampling_logps is not None:
        return "the sampler's correction and a KL term (Liger weights only the policy term by it, this library both)"
    return None


def loss_module(loss: LossSettings, temperature: float, compiled: bool = False):
    """liger-kernel's `LigerFusedLinearGRPOLoss` for `loss` (a `LossSettings`) at the sampling `temperature`, one row
    per chunk (its default); `compiled`: its loss math under torch.compile."""
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    return LigerFusedLinearGRPOLoss(
        beta=loss.beta,
        compiled=compiled,
        use_ref_model=loss.beta != 0.0,
        epsilon_low=loss.epsilon_low,
        epsilon_high=loss.epsilon_high,
        loss_type=loss.loss_type,
        max_completion_length=loss.max_completion_length,
        importance_sampling_level=loss.importance_sampling_level,
        temperature=temperature,
        delta=loss.delta,
        use_bias_correction_kl=loss.bias_correction_kl,
        **loss.term_knobs,  # sapo's and vespo's knobs, under Liger's names (TRL's)
    )


def fused_policy_loss(
    module,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    batch: MicroBatch,
    old_logps: torch.Tensor | None = None,
    sampling_weights: torch.Tensor | None = None,
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """`policy_loss` of `batch` (no policy mask, no entropy bonus), computed by Liger's fused loss `module`
    (`loss_module`) from the final hidden states `hidden` (N, H) of the positions predicting its completion tokens
    (row-major order of completion_mask == 1) and the output head's `weight` (V, H) and `bias` (V,) or None: the same
    value and the same gradients, which flow to `hidden`, `weight` and `bias`.

    `old_logps` (B, T): pi_old (None: on-policy); `sampling_weights` (B, T) or (B, 1): the sampler's correction;
    `normalizer`: the step's token count / P for the loss types normalised over the step (`accumulation`), given to
    Liger as its `num_items_in_batch`, which it divides by its own world size. Masked positions of the inputs may
    hold anything: they are zeroed (weights: set to 1) before Liger reads them."""
    predicted = batch.completion_mask.bool()  # (B, T)
    inputs = hidden.new_zeros(*predicted.shape, hidden.shape[-1]).masked_scatter(predicted[..., None], hidden)
    mask = batch.loss_mask.bool()

    def finite(values, fill=0.0):
        return None if values is None else torch.where(mask, values, fill) if values.shape == mask.shape else values

    if normalizer is None and spans_the_step(module.loss_type):
        normalizer = mask.sum()  # as `aggregate` (Liger would sum the mask over its processes)
    items = None
    if normalizer is not None:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        items = torch.as_tensor(normalizer, dtype=torch.float32, device=mask.device) * world
    loss, _ = module(
        inputs,  # (B, T, H)
        weight,
        batch.completion_ids,
        mask.float(),
        batch.advantages.float(),  # (B,)
        bias=bias,
        ref_per_token_logps=finite(batch.ref_logps),
        old_per_token_logps=finite(old_logps),
        vllm_is_ratio=finite(sampling_weights, 1.0),
        num_items_in_batch=items,
    )
    return loss


class LigerStepLoss(StepLoss):
    """`StepLoss` whose training passes train on Liger's fused loss (`module`, from the same `LossSettings`) of the
    pass's hidden states, with the statistics of `policy_loss` on that pass's log-probs (no gradient; module
    docstring). Evaluation, and a micro-batch with a `batch_reason` (said once each), run the plain pass."""

    def __init__(self, settings: LossSettings, collectives, router_coef: float, module, logprobs: LogProbSettings):
        super().__init__(settings, collectives, router_coef)
        self.module, self.logprob_settings, self.said = module, logprobs, set()

    def run(self, logprobs, model, batch: MicroBatch, context: StepContext) -> tuple[torch.Tensor, StepLossResult]:
        reason = batch_reason(batch, self.settings) or head_reason(model)  # FSDP shards the head only at train()
        if reason is not None and reason not in self.said:
            self.said.add(reason)
            if getattr(self.collectives, "is_main_process", True):
                logger.warning(f"use_liger_kernel=True: a micro-batch with {reason} runs this library's loss path.")
        if reason is not None or not torch.is_grad_enabled():
            return super().run(logprobs, model, batch, context)
        aux_losses = self.forward_options["aux_losses"]
        hidden = logprobs.hidden_states(model, batch, aux_losses)  # (N, H)
        head, mask = output_projection(model)[0], batch.completion_mask.bool()
        with torch.no_grad(), logprobs.autocast():  # the metrics' log-probs and entropy
            values = chunked_logprobs(
                hidden.detach(),
                head.weight,
                batch.completion_ids[mask],
                bias=head.bias,
                temperature=self.logprob_settings.temperature,
                chunk_size=self.logprob_settings.chunk_size,
                with_entropy=True,
            )
        logps, entropy = (v.new_zeros(mask.shape).masked_scatter(mask, v) for v in values)  # (B, T)

        def fused(old_logps, sampling_weights, normalizer):
            with logprobs.autocast():
                args = (old_logps, sampling_weights, normalizer)
                return fused_policy_loss(self.module, hidden, head.weight, head.bias, batch, *args)

        return logps, self(logps, entropy, aux_losses, batch, context, fused=fused)
