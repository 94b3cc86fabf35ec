"""What the generation stage reads from a `GRPOConfig`, and the checks of the generation fields.

`SamplingSettings` is what completions are drawn from: the distribution (temperature, top_p, top_k, min_p,
repetition_penalty, `generation_kwargs`), the length (`max_completion_length`) and vLLM's constraint
(`vllm_structured_outputs_regex`). It is one frozen value, built by `SamplingSettings.from_config` and handed to
whichever backend `make_generation_backend` picks, so no backend reads those fields from the config itself. How a
backend computes (its cache, padding, kernels, engine memory, server address) stays an argument of that backend.

The checks of the generation fields live here, beside what they protect, and run when a `GRPOConfig` is built:
`GRPOConfig.__post_init__` calls `check_generation_kwargs` among its value checks and `check_continuous_batching` and
`check_vllm_engine` after them. These checks also resolve fields in place (a deprecated alias, JSON text from a
command line), so they run once, there, and `SamplingSettings.from_config` only reads the resolved fields. Like
the config, this module imports nothing heavier than transformers (no vLLM).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import json
import re
import warnings
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig, GenerationMixin

# What `vllm_model_impl` may be: the values of vLLM's `--model-impl` for language models.
VLLM_MODEL_IMPLS = ("vllm", "transformers", "auto")

# Keyword arguments of `model.generate` itself: generation_kwargs become a `GenerationConfig`, which would keep
# these as inert attributes, so they are refused with their own message.
_GENERATE_ONLY = set(inspect.signature(GenerationMixin.generate).parameters) - {"self", "kwargs"}


@functools.cache
def generation_config_fields() -> frozenset[str]:
    """The keys `generation_kwargs` may hold with the `model.generate` backend: `GenerationConfig`'s fields."""
    return frozenset(k for k in vars(GenerationConfig()) if not k.startswith("_") and k != "transformers_version")


@dataclass(frozen=True)
class SamplingSettings:
    """What every completion is drawn from, under GRPOConfig's names (`structured_outputs_regex` is its
    `vllm_structured_outputs_regex`). The defaults are GRPOConfig's; a backend built on its own (the CLI, tests,
    benchmarks) may take them. No value is checked here: the config's checks ran when it was built, and a backend
    used directly may be given what the config refuses (temperature 0 for greedy vLLM tests)."""

    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    min_p: float | None = None  # None: off
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] | None = None  # `GenerationConfig` fields for transformers' samplers
    structured_outputs_regex: str | None = None  # vLLM only: every completion must match it

    def __post_init__(self):
        # A copy: a later change to the config's dict must not reach a value that is meant not to change.
        if self.generation_kwargs is not None:
            object.__setattr__(self, "generation_kwargs", dict(self.generation_kwargs))

    @classmethod
    def from_config(cls, args) -> SamplingSettings:
        """The settings of `args`, a `GRPOConfig`, whose generation fields were checked (and two of them resolved in
        place: `check_continuous_batching`) when it was built."""
        return cls(
            max_completion_length=args.max_completion_length,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            generation_kwargs=args.generation_kwargs,
            structured_outputs_regex=args.vllm_structured_outputs_regex,
        )

    def vllm_params(self) -> dict[str, Any]:
        """The distribution and the length under vLLM's names (`SamplingParams`, and the server's request), min_p
        None as 0 (off). The regex is left to each vLLM backend: the server sends it by name, the colocated engine
        as a structured-outputs object."""
        return {
            "max_tokens": self.max_completion_length,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p or 0.0,
            "repetition_penalty": self.repetition_penalty,
        }


def resolve_sampling(sampling: SamplingSettings | None, fields: dict[str, Any]) -> SamplingSettings:
    """A backend's sampling settings: `sampling` (the trainer's, from `SamplingSettings.from_config`), or, for a
    backend built on its own, the `SamplingSettings` of the `fields` it was given as keywords (an unknown name is a
    TypeError, as it would be for any keyword argument). Not both: one of them would be silently ignored."""
    if sampling is None:
        return SamplingSettings(**fields)
    if fields:
        raise TypeError(f"Give the sampling settings or their fields ({', '.join(sorted(fields))}), not both.")
    return sampling


def check_generation_kwargs(args) -> None:
    """generation_kwargs must be `GenerationConfig` fields that GRPOConfig does not set itself."""
    kwargs = args.generation_kwargs
    if kwargs is None:
        return
    if not isinstance(kwargs, dict):
        raise TypeError(f"generation_kwargs={kwargs!r} must be a dict of GenerationConfig fields, or None.")
    if args.use_vllm and kwargs:
        raise ValueError(
            f"generation_kwargs={kwargs} are `model.generate` options, which the vLLM server does not take; use "
            "the GRPOConfig sampling fields (temperature, top_p, top_k, min_p, repetition_penalty)."
        )
    fixed = {"temperature", "max_new_tokens", "do_sample"} & set(kwargs)
    if fixed:
        raise ValueError(
            f"generation_kwargs sets {sorted(fixed)}: use GRPOConfig.temperature and max_completion_length "
            "instead (the loss computes log-probs at the sampling temperature, and GRPO always samples)."
        )
    valid = generation_config_fields()
    for key in kwargs:
        if key in valid:
            continue
        if key in _GENERATE_ONLY:
            raise ValueError(
                f"generation_kwargs key {key!r} is an argument of `model.generate` itself, not a GenerationConfig "
                "field; generation_kwargs become a GenerationConfig, where it would be ignored. Remove it."
            )
        close = difflib.get_close_matches(str(key), sorted(valid), n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"generation_kwargs key {key!r} is not a field of transformers.GenerationConfig, so `model.generate` "
            f"would ignore it.{hint} Fix or remove the key (valid keys: GenerationConfig's fields, e.g. "
            "'typical_p', 'no_repeat_ngram_size')."
        )


def check_vllm_engine(args) -> None:
    """vllm_model_impl is one vLLM takes; the structured-outputs regex compiles and has a vLLM engine to apply it."""
    if args.vllm_model_impl not in VLLM_MODEL_IMPLS:
        raise ValueError(
            f"vllm_model_impl={args.vllm_model_impl!r} is not one of {VLLM_MODEL_IMPLS}: 'vllm' runs vLLM's own "
            "model code, 'transformers' the transformers modeling code."
        )
    if args.use_vllm and args.vllm_mode == "colocate" and args.vllm_model_impl == "transformers":
        # vLLM's transformers backend decorates the transformers model class in place (for torch.compile), so
        # the policy, an instance of the same class in the same process, fails at its next forward.
        raise ValueError(
            "vllm_model_impl='transformers' with vllm_mode='colocate': vLLM's transformers backend changes the "
            "transformers model class in place, which breaks the policy's own forward pass in the same process. "
            "Use server mode (vllm_mode='server', `grpo vllm-serve --model-impl transformers`), or "
            "vllm_model_impl='vllm'."
        )
    regex = args.vllm_structured_outputs_regex
    if regex is None:
        return
    if not args.use_vllm:
        raise ValueError(
            "vllm_structured_outputs_regex is set, but use_vllm=False: only a vLLM engine constrains completions "
            "to a pattern. Set use_vllm=True, or remove the regex."
        )
    try:
        re.compile(regex)
    except (re.error, TypeError) as error:
        raise ValueError(
            f"vllm_structured_outputs_regex={regex!r} is not a valid regular expression ({error}). Fix it."
        ) from None
    if args.vllm_importance_sampling_correction:
        warnings.warn(
            "vllm_structured_outputs_regex with vllm_importance_sampling_correction=True: the engine reports the "
            "log-probs of the constrained distribution (the tokens the pattern forbids masked out), the trainer "
            "computes the unconstrained policy's, so the importance-sampling correction then weights each token "
            "by pi_theta / pi_constrained, often far below 1 (0.02 on average in this project's test), which "
            "shrinks the policy gradient as much. Set vllm_importance_sampling_correction=False unless you want "
            "that weighting (docs/vllm.md#model-implementation-and-structured-outputs).",
            stacklevel=4,  # the GRPOConfig(...) call, through __post_init__ and __init__
        )


def check_continuous_batching(args) -> None:
    """use_transformers_continuous_batching (the deprecated use_transformers_paged sets it) and its settings."""
    settings = _continuous_batching_settings(args)
    if not args.use_transformers_continuous_batching:
        if settings:
            raise ValueError(
                "transformers_continuous_batching_config is set, but use_transformers_continuous_batching=False, "
                "so nothing would read it. Set use_transformers_continuous_batching=True, or remove it."
            )
        return
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        raise ImportError(
            "use_transformers_continuous_batching=True needs transformers >= 5.8 (ContinuousBatchingConfig); "
            "upgrade with `pip install -U transformers`, or set it False."
        ) from None
    if args.use_vllm:
        raise ValueError(
            "use_transformers_continuous_batching=True and use_vllm=True both choose the generation backend; "
            "pick one (set the other False)."
        )
    if args.repetition_penalty != 1.0 or (args.generation_kwargs or {}).get("repetition_penalty", 1.0) != 1.0:
        raise ValueError(
            "use_transformers_continuous_batching=True cannot apply a repetition_penalty: transformers' engine "
            "shows a logits processor only each row's last token. Set repetition_penalty=1.0, or "
            "use_transformers_continuous_batching=False."
        )
    if args.cache_implementation is not None:
        raise ValueError(
            f"cache_implementation={args.cache_implementation!r} sets the KV cache of `model.generate`, but "
            "use_transformers_continuous_batching=True samples with transformers' engine, whose cache is paged. "
            "Remove cache_implementation (the engine's cache: transformers_continuous_batching_config)."
        )
    ignored = sorted({"min_length", "min_new_tokens"} & set(args.generation_kwargs or {}))
    if ignored:
        raise ValueError(
            f"generation_kwargs sets {ignored}, which transformers' continuous-batching engine ignores (it builds "
            "no minimum-length processor). Remove them, or set use_transformers_continuous_batching=False."
        )
    _check_engine_keys(settings or {}, {f.name for f in dataclasses.fields(ContinuousBatchingConfig)})


def _continuous_batching_settings(args) -> dict | None:
    """`transformers_continuous_batching_config` as a dict or None, resolved in place on `args`: JSON text (from a
    command line, as in TRL) parsed, and the deprecated `use_transformers_paged` folded into
    `use_transformers_continuous_batching`."""
    if args.use_transformers_paged:
        warnings.warn(
            "use_transformers_paged is deprecated: it is used as use_transformers_continuous_batching=True, TRL's "
            "name since 1.2. Set that instead.",
            FutureWarning,
            stacklevel=5,  # the GRPOConfig(...) call, through check_continuous_batching, __post_init__ and __init__
        )
        args.use_transformers_continuous_batching = True
    settings = args.transformers_continuous_batching_config
    if isinstance(settings, str):
        try:
            settings = args.transformers_continuous_batching_config = json.loads(settings)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"transformers_continuous_batching_config={settings!r} is not valid JSON ({error}); give a dict "
                "or its JSON text, e.g. '{\"page_size\": 64}'."
            ) from None
    if settings is not None and not isinstance(settings, dict):
        raise TypeError(
            f"transformers_continuous_batching_config={settings!r} must be a dict of ContinuousBatchingConfig "
            "arguments (e.g. {'page_size': 64}), or None."
        )
    return settings


def _check_engine_keys(settings: dict, valid: set[str]) -> None:
    """Every key of `transformers_continuous_batching_config` is a `ContinuousBatchingConfig` argument (`valid`),
    and none is the seed, which the trainer's sampling stream owns."""
    for key in settings:
        if key == "seed":
            raise ValueError(
                "transformers_continuous_batching_config sets 'seed': every round would then draw the same "
                "numbers. Remove it: each round's seed comes from the trainer's sampling stream (GRPOConfig.seed)."
            )
        if key not in valid:
            close = difflib.get_close_matches(str(key), sorted(valid), n=1, cutoff=0.6)
            raise ValueError(
                f"transformers_continuous_batching_config key {key!r} is not an argument of transformers' "
                f"ContinuousBatchingConfig.{f' Did you mean {close[0]!r}?' if close else ''} Fix or remove it."
            )
