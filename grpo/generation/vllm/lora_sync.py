"""Syncing a LoRA policy to `grpo vllm-serve --enable-lora` as the adapter alone, not as merged weights.

Trainer side: `sync_mode` picks what a sync sends, `adapter_problems` lists what keeps vLLM from serving the adapter
(each with its fix), `adapter_config` is the JSON of its `LoraConfig` (the server writes it as adapter_config.json).
Server side: `write_adapter` writes the directory that vLLM's `LoRARequest` loads. The adapter's tensors themselves
come from `grpo.generation.vllm.client.adapter_tensors` and travel over the weight-sync group like merged weights
(grpo/generation/vllm/weight_sync.py). Nothing here imports vLLM or PEFT; docs/vllm.md#lora-merged-or-adapter-sync says which mode
to pick.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch

# vLLM 0.32 accepts these --max-lora-rank values only (vllm.config.lora.MaxLoRARanks).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# init_lora_weights values that only set the adapter's first weights; the others (PiSSA, OLoRA, CorDA, LoftQ) also
# change the base weights in the trainer, which the server's copy of the base model does not have.
_PLAIN_INITS = ("gaussian", "eva", "orthogonal", "mica", "lora_ga")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def sync_mode(is_peft: bool, server_info: dict) -> str:
    """ "adapter" when the policy is a PEFT model and the server was started with --enable-lora, else "merged"."""
    return "adapter" if is_peft and server_info.get("lora") else "merged"


def smallest_rank_at_least(rank: int) -> int | None:
    """The smallest --max-lora-rank vLLM accepts that holds `rank` (None: above them all)."""
    return next((allowed for allowed in MAX_LORA_RANKS if allowed >= rank), None)


def adapter_rank(config) -> int:
    """The largest rank of the adapter's layers: `r`, or a larger one from `rank_pattern`."""
    return max([config.r, *(getattr(config, "rank_pattern", None) or {}).values()])


def adapter_problems(config, max_lora_rank: int, active_adapters: Iterable[str] = ("default",)) -> list[str]:
    """Why vLLM cannot serve this PEFT adapter config as a LoRA adapter, one reason (with its fix) per item; [] when
    it can. Mirrors vLLM's own checks (vllm/lora/peft_helper.py), which would otherwise fail at the first sync with
    less context, and adds those that only the trainer can see (several active adapters, a changed base)."""
    problems = []
    active = list(active_adapters)
    if len(active) != 1:
        problems.append(f"{len(active)} adapters are active ({active}); vLLM serves one: keep one active")
    peft_type = str(getattr(getattr(config, "peft_type", None), "value", getattr(config, "peft_type", None)))
    if peft_type != "LORA":
        return problems + [f"its PEFT type is {peft_type}; vLLM serves LoRA adapters only"]
    rank = adapter_rank(config)
    if rank > max_lora_rank:
        fix = smallest_rank_at_least(rank)
        raise_it = f"restart it with --max-lora-rank {fix}" if fix else "no --max-lora-rank holds it"
        problems.append(f"its rank {rank} is above the server's --max-lora-rank {max_lora_rank} ({raise_it})")
    if getattr(config, "modules_to_save", None):
        problems.append(
            f"it trains whole modules besides the adapter (modules_to_save={sorted(config.modules_to_save)}), which "
            "vLLM's LoRA does not load"
        )
    if getattr(config, "use_dora", False):
        problems.append("it is a DoRA adapter (use_dora=True), which vLLM does not support")
    if getattr(config, "lora_bias", False):
        problems.append("it trains LoRA biases (lora_bias=True), which vLLM does not support")
    if getattr(config, "bias", "none") != "none":
        problems.append(f"it trains the base model's biases (bias={config.bias!r}), which vLLM does not load")
    init = getattr(config, "init_lora_weights", True)
    if isinstance(init, str) and init.lower() not in _PLAIN_INITS:
        problems.append(
            f"init_lora_weights={init!r} changed the base weights in the trainer; the server has the original ones"
        )
    for field, what in (
        ("target_parameters", "adapts parameters directly (target_parameters)"),
        ("layer_replication", "replicates layers (layer_replication)"),
        ("use_qalora", "is a QALoRA adapter"),
        ("alora_invocation_tokens", "is an activated LoRA (alora_invocation_tokens)"),
    ):
        if getattr(config, field, None):
            problems.append(f"it {what}, which vLLM does not support")
    return problems


def adapter_error(problems: list[str], base_url: str) -> str:
    """The first sync's error for an adapter the server cannot take: every reason, then the two fixes."""
    return (
        f"The vLLM server at {base_url} was started with --enable-lora, so weight sync would send the LoRA adapter "
        f"alone, but vLLM cannot serve this adapter: {'; '.join(problems)}. Either fix that, or restart the server "
        "without --enable-lora: every sync then sends the merged weights, which works for any PEFT model "
        "(docs/vllm.md#lora-merged-or-adapter-sync)."
    )


def _jsonable(value):
    if isinstance(value, (set, frozenset, tuple)):
        return sorted(value) if isinstance(value, (set, frozenset)) else list(value)
    return str(value)


def adapter_config(config) -> dict:
    """The PEFT config as the JSON object PEFT's `save_pretrained` writes to adapter_config.json (sets as sorted
    lists; enums as their values)."""
    return json.loads(json.dumps(config.to_dict(), default=_jsonable))


def write_adapter(directory: str | os.PathLike, tensors: Iterable[tuple[str, torch.Tensor]], config: dict) -> Path:
    """Write a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) that vLLM's `LoRARequest`
    loads. The directory is new and private to this user (mode 0700): it holds the policy being trained."""
    from safetensors.torch import save_file

    if config.get("peft_type") != "LORA":
        raise ValueError(f"not a LoRA adapter config (peft_type={config.get('peft_type')!r})")
    directory = Path(directory)
    directory.mkdir(mode=0o700, parents=False, exist_ok=False)
    weights = {name: tensor.detach().to("cpu").contiguous() for name, tensor in tensors}
    if not weights:
        raise ValueError("no adapter tensors were received")
    save_file(weights, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(config))
    return directory
