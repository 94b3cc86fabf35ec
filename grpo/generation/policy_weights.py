"""The policy's weights as a vLLM engine loads them: `checkpoint_tensors` (every weight under its checkpoint name,
LoRA merged, shards gathered) and `adapter_tensors` (a PEFT model's active adapter alone); and
`zero3_gathered_for_generation`, the whole weights for `model.generate` under DeepSpeed ZeRO-3."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch import nn

_MODULES_TO_SAVE = re.compile(r"\.modules_to_save\.[^.]+\.")


def _full(param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a parameter that may be sharded across processes (every process must call this)."""
    if hasattr(param, "ds_id"):  # DeepSpeed ZeRO-3
        import deepspeed

        with deepspeed.zero.GatheredParameters([param]):
            return param.data.detach().clone()
    if hasattr(param, "full_tensor"):  # FSDP2 (DTensor)
        return param.full_tensor().detach()
    return param.detach()


@contextlib.contextmanager
def zero3_gathered_for_generation(engine, enabled: bool = True) -> Iterator[None]:
    """Under DeepSpeed ZeRO-3 (`engine` the trainer's DeepSpeed engine) and `enabled`: all of the model's weights
    gathered whole on every process for the length of the block, and ZeRO-3's module hooks removed (they would
    release each module's weights after its forward), put back after. Every process must enter it. Elsewhere, or
    with `enabled` False, nothing changes: `generate` then runs on the partitioned model, gathering each layer at
    every token (`ds3_gather_for_generation`, docs/distributed.md)."""
    offload = getattr(getattr(engine, "optimizer", None), "parameter_offload", None)
    if not enabled or offload is None:  # not ZeRO-3, or not training (no optimizer)
        yield
        return
    import deepspeed

    params = list(offload.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        for param in params:  # with the hooks gone no module releases them: leaving the block partitions them again
            param.ds_active_sub_modules.clear()
        for hook in (*offload.forward_hooks, *offload.backward_hooks):
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:  # re-registering also resets the order in which ZeRO-3 prefetches (its trace)
            offload._register_deepspeed_module(offload.module)


def checkpoint_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every weight of `model` under the names of its Hugging Face checkpoint, which the engine's
    loader expects. A PEFT model yields its base weights with the LoRA deltas merged in (W + scale * B A, computed
    here; the model is not modified) and drops the adapter tensors."""
    if any("_fsdp_wrapped_module" in name for name, _ in model.named_parameters()):
        raise NotImplementedError(
            "Weight sync to vLLM does not support FSDP version 1 (flattened parameters); use FSDP2 "
            "(`fsdp_version: 2` in the accelerate config) or DeepSpeed."
        )
    is_peft = getattr(model, "peft_config", None) is not None
    lora_layers = {}
    if is_peft:
        lora_layers = {
            name: module
            for name, module in model.named_modules()
            if hasattr(module, "get_delta_weight") and hasattr(module, "base_layer")
        }
    with torch.no_grad():
        for name, param in model.named_parameters():
            if is_peft and (".lora_" in name or ".original_module." in name):
                continue
            tensor = _full(param)
            owner, _, leaf = name.rpartition(".base_layer.")
            if owner in lora_layers and leaf == "weight":
                layer = lora_layers[owner]
                for adapter in layer.active_adapters:
                    if adapter in layer.lora_A:
                        tensor = tensor + layer.get_delta_weight(adapter).to(tensor.dtype)
            if is_peft:
                name = _MODULES_TO_SAVE.sub(".", name.removeprefix("base_model.model.").replace(".base_layer.", "."))
            yield name, tensor


def adapter_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for each weight of a PEFT model's active adapter, under the names PEFT's
    `get_peft_model_state_dict` gives them (those of adapter_model.safetensors, which vLLM loads), gathered whole
    when sharded (every process must iterate it)."""
    from peft import get_peft_model_state_dict

    (adapter,) = model.active_adapters
    parameters = dict(model.named_parameters())
    # The parameters themselves (not a state dict): only PEFT's selection and names are wanted, and `_full` gathers.
    selected = get_peft_model_state_dict(
        model, state_dict=parameters, adapter_name=adapter, save_embedding_layers=False
    )
    with torch.no_grad():
        for name, param in selected.items():
            yield name, _full(param)
