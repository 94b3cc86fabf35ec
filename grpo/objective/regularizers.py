"""The loss terms beside the policy objective: the entropy bonus's coefficient, fixed or under Skywork-OR1's adaptive
control, and a Mixture-of-Experts model's load-balancing loss.

The entropy bonus itself is a per-token term of `policy_loss` (loss.py), aggregated with the policy term; this module
decides its coefficient c_k for optimizer step k (docs/method.md, "Entropy regularisation"):

    fixed      c_k = entropy_coef
    adaptive   c_k = coef_k if H_{k-1} <= entropy_target else 0                 (the bonus only once entropy is low)
               coef_{k+1} = min(coef_k + delta, coef_max) if H_k <= entropy_target
                            max(coef_k - delta, coef_min) otherwise
               coef_0 = entropy_coef, H_{-1} = +inf (no bonus before a first measurement)

H_k is the mean entropy over the tokens the policy term trained in step k, on every process (Skywork-OR1,
arXiv:2505.22312, section 3.2; TRL 1.16's rule). The router's loss (`router_aux_term`) is the model's own
`aux_loss` (Switch Transformer's load balancing) times `router_aux_loss_coef`.
"""

from __future__ import annotations

import math

import torch


def adaptive_entropy_coef(
    coef: float, entropy: float, *, target: float, delta: float, minimum: float, maximum: float
) -> float:
    """Skywork-OR1's update after a step whose mean entropy was `entropy`: up by `delta` when it is at or below
    `target` (the policy is collapsing), down by `delta` otherwise, kept within [minimum, maximum].

        adaptive_entropy_coef(0.01, 0.1, target=0.2, delta=0.005, minimum=0, maximum=1) -> 0.015
        adaptive_entropy_coef(0.01, 0.3, target=0.2, delta=0.005, minimum=0, maximum=1) -> 0.005
    """
    if entropy <= target:
        return min(coef + delta, maximum)
    return max(coef - delta, minimum)


class EntropyControl:
    """The entropy bonus's coefficient through a run: `coefficient` is the c_k every micro-batch of the current
    optimizer step applies; `observe` gathers the step's entropy and, at its last micro-batch, moves the adaptive
    coefficient. Its state (`state_dict`) goes into checkpoints, so a resumed run applies the same coefficients."""

    def __init__(
        self,
        coef: float = 0.0,
        adaptive: bool = False,
        *,
        target: float = 0.2,
        delta: float = 0.005,
        minimum: float = 0.0,
        maximum: float = 1.0,
    ):
        self.coef, self.adaptive = coef, adaptive
        self.rule = dict(target=target, delta=delta, minimum=minimum, maximum=maximum)
        self.last_entropy = math.inf  # H_{k-1}: none measured yet
        self._window: torch.Tensor | None = None  # (entropy sum, tokens) of the current step's micro-batches

    @classmethod
    def from_settings(cls, settings) -> EntropyControl:
        """The control of an `EntropySettings` (settings.py)."""
        return cls(
            settings.coef,
            settings.adaptive,
            target=settings.target,
            delta=settings.delta,
            minimum=settings.minimum,
            maximum=settings.maximum,
        )

    @property
    def enabled(self) -> bool:
        """Whether the loss has an entropy term at all (adaptive: always, since the coefficient may rise from 0); only
        then does the log-prob pass give the entropy a gradient."""
        return self.coef != 0.0 or self.adaptive

    @property
    def coefficient(self) -> float:
        """c_k: the coefficient of this step's bonus (0 under adaptive control while the entropy is above target)."""
        if self.adaptive and not self.last_entropy <= self.rule["target"]:
            return 0.0
        return self.coef

    def observe(self, entropy: torch.Tensor, loss_mask: torch.Tensor, policy_mask, accelerator) -> float | None:
        """One training micro-batch: its entropy (B, T) over the tokens its policy term trains (`loss_mask` and
        `policy_mask`, (B, T) or None) joins the step's sums. At the step's last micro-batch (the accelerator's
        `sync_gradients`) the sums of every process (`accelerator.reduce`) give H_k, the adaptive coefficient moves,
        and the coefficient is returned (to be logged); None before, or without a bonus. No device sync before."""
        if not self.enabled:
            return None
        if self.adaptive:
            mask = loss_mask.bool() if policy_mask is None else loss_mask.bool() & policy_mask.bool()
            sums = torch.stack([torch.where(mask, entropy.detach(), 0.0).sum(), mask.sum().to(entropy.dtype)])
            self._window = sums if self._window is None else self._window + sums
        if not accelerator.sync_gradients:
            return None
        if self.adaptive:
            total, tokens = accelerator.reduce(self._window, reduction="sum").tolist()
            self._window = None
            self.last_entropy = total / max(tokens, 1.0)
            self.coef = adaptive_entropy_coef(self.coef, self.last_entropy, **self.rule)
        return self.coef

    def state_dict(self) -> dict[str, float] | None:
        """The adaptive coefficient and the last step's entropy (None for a fixed coefficient: the config's)."""
        return {"coef": self.coef, "last_entropy": self.last_entropy} if self.adaptive else None

    def load_state_dict(self, state: dict[str, float] | None) -> None:
        """Restores an adaptive run's state; a fixed coefficient stays the config's, and a checkpoint without one
        (None: written with a fixed coefficient, or before it was saved) leaves the adaptive control at its start."""
        if self.adaptive and state is not None:
            self.coef, self.last_entropy = state["coef"], state["last_entropy"]


def router_aux_coef(model_config, coef: float | None) -> float:
    """The weight of the load-balancing loss: `router_aux_loss_coef`, or the model's own when it is None (0 for a
    dense model). A Mixture-of-Experts config is one that has `output_router_logits` (Mixtral, Qwen2/3-MoE, OLMoE,
    ...); a weight set on any other model is an error."""
    config = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    moe = hasattr(config, "output_router_logits")
    if coef is None:
        return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if moe else 0.0
    if coef != 0.0 and not moe:
        raise ValueError(
            f"router_aux_loss_coef={coef} weighs a Mixture-of-Experts load-balancing loss, but "
            f"{getattr(config, 'model_type', type(config).__name__)} is not a MoE model (its config has no "
            "output_router_logits). Remove router_aux_loss_coef (or set it to 0.0)."
        )
    return float(coef)


def router_aux_term(
    aux_losses: list[torch.Tensor] | None, coef: float, micro_steps: int
) -> tuple[torch.Tensor | float, dict[str, torch.Tensor]]:
    """coef * mean(aux_losses) / micro_steps: this micro-batch's share of the load-balancing loss, one per forward
    pass (`completion_logprobs(aux_losses=...)`), joined to its optimizer step as a mean over its `micro_steps`
    micro-batches, whatever the loss type (the router's loss is a mean over tokens of its own). Returns (the term, 0
    without any; {"aux_loss": the mean, detached}, empty without any)."""
    if not aux_losses or coef == 0.0:
        return 0.0, {}
    aux = torch.stack(aux_losses).mean()
    return coef * aux / micro_steps, {"aux_loss": aux.detach()}
