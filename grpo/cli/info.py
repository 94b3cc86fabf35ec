"""What the command line says about itself: `grpo train --help` (every recipe key, with its default and help, from
the recipe's sections and `GRPOConfig`'s own field metadata) and `grpo env` (versions and the machine, for a bug
report). What a run draws while it trains is in progress.py."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import sys
import textwrap

# What the recipe's sections hold, one line each (the fields themselves are listed from the dataclasses).
SECTION_HELP = {
    "model": "the policy: `model: PATH_OR_HUB_ID` or a mapping",
    "dataset": "where the prompts come from and how they are shaped (exactly one of path and reasoning_gym)",
    "rewards": "a list of built-in names or 'module:function' paths, each optionally {name, weight, kwargs}",
    "run": "what grpo train does around training",
    "peft": "LoRA settings; absent means full fine-tuning",
    "tools": "a list of 'module:function' tools: each row becomes a multi-turn episode",
    "environment": "'module:attr' of an environment class or zero-argument factory (GRPOTrainer's "
    "environment_factory), or {name: 'module:attr', ...}, rows picking one by their `environment` column",
    "verifiers": "a verifiers environment, 'module:function' or an installed id, or {env, args, per_function}: its "
    "rollouts, rubric and data set (from_verifiers)",
    "agent": "'module:function' of an agent function f(row, endpoint) that calls the trainer's OpenAI-compatible "
    "endpoint itself (GRPOTrainer's agent_func)",
}
# Packages a bug report needs the version of; absent ones are said to be absent.
PACKAGES = ("grpo", "torch", "transformers", "accelerate", "datasets", "peft", "vllm", "deepspeed", "trl")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        return "required"
    return "null" if value is None else repr(value)


def _entry(name: str, default: str, help_text: str, width: int) -> list[str]:
    head = f"  --{name} (default {default})"
    body = textwrap.wrap(" ".join(help_text.split()), width=width - 6) if help_text else []
    return [head, *("      " + line for line in body)]


def keys_help(width: int = 100) -> str:
    """Every key a recipe (or an override) may set: the sections' keys, then `GRPOConfig`'s fields under its own
    section headings, then the `TrainingArguments` fields it inherits."""
    from grpo.cli.recipe import DatasetSection, ModelSection, PeftSection, RewardSpec, RunSection
    from grpo.config import GRPOConfig, options

    classes = {
        "model": ModelSection,
        "dataset": DatasetSection,
        "rewards": RewardSpec,
        "run": RunSection,
        "peft": PeftSection,
    }
    lines = ["recipe sections (YAML mappings; override one key with --section.key VALUE):"]
    for name, text in SECTION_HELP.items():
        lines.append(f"  {name}: {text}")
        for f in dataclasses.fields(classes[name]) if name in classes else ():
            lines.append(f"      {name}.{f.name} (default {_default(f)})")
    fields = {f.name: f for f in dataclasses.fields(GRPOConfig) if f.init}
    by_section: dict[str, list[str]] = {}
    for name, option in options().items():
        by_section.setdefault(option.section, []).append(name)
    for section, names in by_section.items():
        lines += ["", f"{section} (GRPOConfig):"]
        for name in names:
            lines += _entry(name, _default(fields[name]), fields[name].metadata.get("help", ""), width)
    inherited = [n for n in fields if n not in options()]
    lines += ["", "inherited from transformers.TrainingArguments:"]
    for name in inherited:
        lines += _entry(name, _default(fields[name]), fields[name].metadata.get("help", ""), width)
    return "\n".join(lines)


def _version(package: str) -> str:
    if package == "torch":  # the module's own version names its build (2.11.0+cu130); the wheel's metadata may not
        try:
            import torch

            return torch.__version__
        except ImportError:
            return "not installed"
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _cpu_flags() -> str:
    """The CPU's vector extensions (from /proc/cpuinfo where there is one) and torch's own view of them."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "fma", "neon", "asimd", "sve")
    flags = set()
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    found = [f for f in wanted if f in flags]
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # an old or broken torch: the report must still print
        capability = "unknown"
    return f"{' '.join(found) or 'none of ' + ', '.join(wanted)} (torch uses {capability})"


def _devices() -> str:
    try:
        import torch
    except ImportError:
        return "unknown (torch is not installed)"
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} CUDA device(s): {', '.join(names)} (CUDA {torch.version.cuda})"
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return "Apple MPS"
    return "CPU only (no accelerator found)"


def env_report() -> str:
    """`grpo env`: Python, the packages a run uses, the platform, the devices and the CPU's flags."""
    lines = [
        f"python:        {sys.version.split()[0]} ({sys.executable})",
        *(f"{name + ':':14} {_version(name)}" for name in PACKAGES),
        f"platform:      {platform.platform()}",
        f"cpu:           {os.cpu_count()} cores, {platform.machine()}; flags {_cpu_flags()}",
        f"device:        {_devices()}",
    ]
    offline = [
        f"{v}={os.environ[v]}" for v in ("HF_HUB_OFFLINE", "HF_HOME", "CUDA_VISIBLE_DEVICES") if v in os.environ
    ]
    if offline:
        lines.append(f"environment:   {' '.join(offline)}")
    return "\n".join(lines)
