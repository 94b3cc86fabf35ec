"""A reference policy that moves: soft updates (`sync_ref_model`) and the iterative scheme (`ref_model_reset_steps`).

    ref <- alpha * policy + (1 - alpha) * ref      every `ref_model_sync_steps` steps  (TR-DPO, arXiv:2404.09656)
    ref <- policy                                  every `ref_model_reset_steps` steps (DeepSeekMath, Algorithm 1)

Both are `mix_into` (a reset is alpha = 1), applied by `ReferenceUpdate`, a callback the trainer adds, at the end of
the optimizer step whose number is a multiple of the interval (before that step's checkpoint, which saves the moved
reference). After a reset, every callback with an `on_reference_reset(args, state, control, trainer=...)` method is
called: that is where the iterative scheme refreshes its reward model on the newest samples (docs/method.md,
examples/iterative_reward_model.py). `ReferenceResetCallback` is a base class with that method, for discoverability.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import TrainerCallback

from grpo.models import frozen_copy, is_peft_model


def make_reference(model: nn.Module, args) -> tuple[nn.Module | None, bool]:
    """The reference policy for `args`, and whether it moves. None when there is no KL term (beta == 0) or when
    `model` is a PEFT model: then pi_ref is the same network with its adapter disabled, which costs no memory but
    cannot move, so a moving reference with PEFT is refused here, before any training."""
    reference = frozen_copy(model) if args.beta != 0 and not is_peft_model(model) else None
    moves = bool(args.sync_ref_model or args.ref_model_reset_steps is not None)
    if moves and reference is None:
        raise ValueError(
            "sync_ref_model / ref_model_reset_steps move the reference, but with a PEFT model the reference is "
            "the base model with the adapter disabled, which cannot move. Train without them, or merge the "
            "adapter (model.merge_and_unload()) and train the full model."
        )
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
