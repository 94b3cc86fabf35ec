"""The reference policy pi_ref (`make_reference`, `reference_policy`), and a reference that moves: soft updates (`sync_ref_model`) and the iterative scheme (`ref_model_reset_steps`).

    ref <- alpha * policy + (1 - alpha) * ref      every `ref_model_sync_steps` steps  (TR-DPO, arXiv:2404.09656)
    ref <- policy                                  every `ref_model_reset_steps` steps (DeepSeekMath, Algorithm 1)

Both are `mix_into` (a reset is alpha = 1), applied by `ReferenceUpdate`, a callback the trainer adds, at the end of
the optimizer step whose number is a multiple of the interval (before that step's checkpoint, which saves the moved
reference). After a reset, every callback with an `on_reference_reset(args, state, control, trainer=...)` method is
called: that is where the iterative scheme refreshes its reward model on the newest samples (docs/method.md,
examples/iterative_reward_model.py). `ReferenceResetCallback` is a base class with that method, for discoverability.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import TrainerCallback

from grpo.models import frozen, frozen_copy, is_peft_model, is_zero3_partitioned, load_causal_lm, unwrap_parallel


def reference_moves(args, peft: bool) -> bool:
    """Whether the reference policy moves (`sync_ref_model`, `ref_model_reset_steps`). With a PEFT model (`peft`)
    pi_ref is the same network with its adapter disabled, which cannot move, so a moving reference is refused; this
    needs no weights, and the trainer asks before it loads the model."""
    moves = bool(args.sync_ref_model or args.ref_model_reset_steps is not None)
    if moves and peft:
        raise ValueError(
            "sync_ref_model / ref_model_reset_steps move the reference, but with a PEFT model the reference is "
            "the base model with the adapter disabled, which cannot move. Train without them, or merge the "
            "adapter (model.merge_and_unload()) and train the full model."
        )
    return moves


@contextlib.contextmanager
def reference_policy(model: nn.Module, ref_model: nn.Module | None) -> Iterator[nn.Module]:
    """pi_ref for the training `model` (maybe wrapped for parallelism): `ref_model`, the frozen copy, or when there
    is none (a PEFT policy) the policy itself with its adapter switched off for the duration."""
    if ref_model is not None:
        yield ref_model
        return
    with unwrap_parallel(model).disable_adapter():
        yield model


def make_reference(model: nn.Module, args, source: str | nn.Module | None = None) -> tuple[nn.Module | None, bool]:
    """The reference policy for `args`, and whether it moves (`reference_moves`). None when there is no KL term
    (beta == 0) or when `model` is a PEFT model: then pi_ref is the same network with its adapter disabled, which
    costs no memory but cannot move. Otherwise a frozen copy of the policy; under DeepSpeed ZeRO-3, whose
    `from_pretrained` partitions the weights as it loads them (a partitioned model cannot be copied), the reference
    is loaded again from `source`, the path or hub id the policy came from."""
    moves = reference_moves(args, is_peft_model(model))
    if args.beta == 0 or is_peft_model(model):
        reference = None
    elif not is_zero3_partitioned(model):
        reference = frozen_copy(model)
    elif not isinstance(source, str):
        raise ValueError(
            "Under DeepSpeed ZeRO-3 the model's weights were partitioned across processes as it was loaded, and a "
            "partitioned model cannot be copied for the reference policy (beta != 0). Pass the model as a path or "
            "hub id (GRPOTrainer(model='org/name')) so that the reference is loaded the same way, or train with "
            "beta=0."
        )
    elif moves:
        raise ValueError(
            "sync_ref_model / ref_model_reset_steps are not supported under DeepSpeed ZeRO-3 yet: the reference's "
            "partitioned weights would have to be gathered to be mixed with the policy's and to be checkpointed. "
            "Use ZeRO-2, or a fixed reference."
        )
    else:
        reference = frozen(load_causal_lm(source, args.model_init_kwargs, args.trust_remote_code))
    return reference, moves


@torch.no_grad()
def mix_into(reference: nn.Module, policy: nn.Module, alpha: float) -> None:
    """reference <- alpha * policy + (1 - alpha) * reference, parameter by parameter and buffer by buffer (floating
    point ones; others are copied). alpha = 1 copies the policy exactly. A tensor shared under two names (tied
    embeddings) is updated once."""
    ref_state, policy_state = reference.state_dict(keep_vars=True), policy.state_dict(keep_vars=True)
    if ref_state.keys() != policy_state.keys():
        missing = sorted(set(ref_state) ^ set(policy_state))[:3]
        raise ValueError(f"The reference and the policy have different tensors (e.g. {missing}); cannot mix them.")
    done = set()
    for name, ref in ref_state.items():
        if id(ref) in done:
            continue
        done.add(id(ref))
        value = policy_state[name].detach().to(ref.device, ref.dtype)
        if alpha == 1 or not torch.is_floating_point(ref):
            ref.copy_(value)
        else:
            ref.lerp_(value, alpha)  # ref + alpha * (policy - ref)


class ReferenceResetCallback(TrainerCallback):
    """Subclass and override `on_reference_reset` to act between iterations of the iterative scheme."""

    def on_reference_reset(self, args, state, control, trainer=None, **kwargs):
        """Called right after the reference became the policy (step `state.global_step`)."""


class ReferenceUpdate(TrainerCallback):
    """Moves `trainer.ref_model` at the end of the optimizer steps the config names (see the module docstring)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_step_end(self, args, state, control, **kwargs):
        trainer, step = self.trainer, state.global_step
        policy = trainer.accelerator.unwrap_model(trainer.model)
        if args.sync_ref_model and step % args.ref_model_sync_steps == 0:
            mix_into(trainer.ref_model, policy, args.ref_model_mixup_alpha)
        if args.ref_model_reset_steps is not None and step % args.ref_model_reset_steps == 0:
            mix_into(trainer.ref_model, policy, 1.0)
            for callback in trainer.callback_handler.callbacks:
                if hasattr(callback, "on_reference_reset"):
                    callback.on_reference_reset(args, state, control, trainer=trainer)
