import math
import re

import pytest
import torch

from grpo import GRPOConfig
from grpo._docs import own_fields
from grpo.config import INHERITED_RANGES, Interval, Section, field_kinds, numeric_ranges, options


def make(**kwargs):
    return GRPOConfig(output_dir="/tmp/grpo-test-config", report_to="none", **kwargs)


def test_defaults_resolve():
    args = make(per_device_train_batch_size=4, gradient_accumulation_steps=2)
    assert args.steps_per_generation == 2 and args.generation_batch_size == 8
    assert args.epsilon_high == args.epsilon == 0.2
    assert args.loss_type == "dapo" and args.beta == 0.0 and args.top_k == 0
    # bf16 where a CUDA device supports it, else off: the same script runs unchanged on a CPU-only machine.
    assert args.bf16 is (torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    # use_cpu=True trains on the CPU even where a GPU is: no bf16 autocast there unless asked for.
    assert GRPOConfig(output_dir="unused", report_to="none", use_cpu=True).bf16 is False
    assert args.remove_unused_columns is False


def test_generation_batch_size_resolves_steps_per_generation():
    args = make(per_device_train_batch_size=4, generation_batch_size=16)
    assert args.steps_per_generation == 4


def test_scale_rewards_accepts_booleans():
    assert make(scale_rewards=True).scale_rewards == "group"
    assert make(scale_rewards=False).scale_rewards == "none"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_generations": 1}, "at least 2 completions"),
        ({"loss_type": "ppo"}, "loss_type='ppo' is not one of"),
        ({"scale_rewards": "sometimes"}, "scale_rewards='sometimes'"),
        ({"temperature": 0.0}, "temperature=0.0 must be > 0"),
        ({"top_p": 0.0}, "top_p=0.0"),
        ({"top_k": -1}, "top_k=-1"),
        ({"min_p": 2.0}, "min_p=2.0"),
        ({"beta": -0.1}, "beta=-0.1"),
        ({"epsilon": 0.0}, "epsilon=0.0"),
        ({"num_iterations": 0}, "num_iterations=0"),
        ({"delta": 1.2}, r"delta=1.2 must be > 1 \+ epsilon_high = 1.2"),
        ({"delta": 1.25, "epsilon_high": 0.28}, "Raise delta, or set None"),
        ({"importance_sampling_level": "row"}, "importance_sampling_level='row' is not one of"),
        ({"top_entropy_quantile": 0.0}, "top_entropy_quantile=0.0 must be in"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile=1.5 must be in"),
        ({"max_dynamic_sampling_rounds": -1}, "max_dynamic_sampling_rounds=-1 must be >= 0"),
        ({"max_completion_length": 0}, "max_completion_length=0"),
        ({"max_prompt_length": 0}, "max_prompt_length=0"),
        ({"logprobs_chunk_size": 0}, "logprobs_chunk_size=0 must be >= 1"),
        ({"generation_batch_size": 16, "steps_per_generation": 2}, "not both"),
        ({"per_device_train_batch_size": 4, "generation_batch_size": 6}, "multiple of per_device_train_batch_size"),
        ({"per_device_train_batch_size": 3, "num_generations": 4}, "not a multiple of num_generations=4"),
        (
            {
                "per_device_train_batch_size": 4,
                "gradient_accumulation_steps": 2,
                "steps_per_generation": 3,
                "num_generations": 4,
            },
            "steps_per_generation a multiple of",
        ),
        ({"eval_strategy": "steps", "per_device_eval_batch_size": 3}, "per_device_eval_batch_size"),
    ],
)
def test_invalid_settings_raise_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"loss_type": "cispo"}, r"epsilon_high=0.2, below the ratio 1 .* e.g. epsilon_high=5.0"),
        ({"loss_type": "sapo", "delta": 2.0}, "delta=2.0 caps the ratio of PPO's clipped term"),
        ({"loss_type": "luspo"}, "Set importance_sampling_level='sequence'"),
        ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, "Leave importance_sampling_level='token'"),
        (
            {"loss_type": "vespo", "use_vllm": True, "vllm_importance_sampling_mode": "sequence_mask"},
            "Set vllm_importance_sampling_mode='token_truncate' or 'token_mask'",
        ),
        ({"loss_type": "sapo", "sapo_temperature_neg": 0.0}, "sapo_temperature_neg=0.0 must be > 0"),
        ({"loss_type": "vespo", "vespo_lambda_pos": -1.0}, "vespo_lambda_pos=-1.0 must be >= 0"),
        (
            {"loss_type": "cispo", "epsilon_high": 5.0, "gradient_accumulation_steps": 2, "steps_per_generation": 3},
            "loss_type='cispo' with steps_per_generation=3",
        ),
    ],
)
def test_loss_types_refuse_what_their_term_cannot_use(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make(per_device_train_batch_size=8, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"loss_type": "grpo", "sapo_temperature_pos": 2.0},
            r"sapo_temperature_pos=2.0 shapes the term of loss_type='sapo', which loss_type='grpo' does not use.*"
            r"Set loss_type='sapo', or leave the default: sapo_temperature_pos=1.0\.",
        ),
        ({"loss_type": "dapo", "sapo_temperature_neg": 2.0}, "sapo_temperature_neg=2.0 shapes the term of"),
        ({"loss_type": "sapo", "vespo_lambda_neg": 1.0}, "which loss_type='sapo' does not use"),
        ({"loss_type": "vespo", "sapo_temperature_pos": 0.5}, "which loss_type='vespo' does not use"),
    ],
)
def test_a_knob_of_another_loss_types_term_is_refused(kwargs, message):
    # Issue 50: TRL accepts SAPO's temperatures (and VESPO's shape) under any loss type and ignores them.
    with pytest.raises(ValueError, match=message):
        make(per_device_train_batch_size=8, **kwargs)


def test_a_term_knob_left_at_its_default_is_accepted_under_any_loss_type():
    # Only a value moved off the default is a setting that does nothing: a config listing every field still builds.
    args = make(loss_type="grpo", sapo_temperature_pos=1.0, sapo_temperature_neg=1.05, vespo_k_pos=2.0)
    assert args.loss_type == "grpo"


def test_each_loss_type_builds_with_its_settings():
    for kwargs in (
        {"loss_type": "cispo", "epsilon_high": 5.0},
        {"loss_type": "sapo"},
        {"loss_type": "luspo", "importance_sampling_level": "sequence", "delta": 1.5},
        {"loss_type": "vespo", "use_vllm": True},  # the default correction mode is per token
    ):
        assert make(per_device_train_batch_size=8, **kwargs).loss_type == kwargs["loss_type"]


def test_multi_objective_aggregation_takes_trls_values():
    assert make().multi_objective_aggregation == "sum_then_normalize"
    assert make(multi_objective_aggregation="normalize_then_sum").multi_objective_aggregation == "normalize_then_sum"
    with pytest.raises(ValueError, match="multi_objective_aggregation='gdpo' is not one of"):
        make(multi_objective_aggregation="gdpo")
    with pytest.raises(ValueError, match="Set offline_baseline=None"):
        make(multi_objective_aggregation="normalize_then_sum", offline_baseline=0.5)


def test_importance_sampling_bounds_take_trls_names_and_the_old_cap():
    args = make()
    assert (args.vllm_importance_sampling_clip_min, args.vllm_importance_sampling_clip_max) == (None, 2.0)
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap=4.0 is deprecated") as caught:
        args = make(vllm_importance_sampling_cap=4.0)
    assert args.vllm_importance_sampling_clip_max == 4.0 and len(caught) == 1
    assert make(vllm_importance_sampling_clip_min=0.5).vllm_importance_sampling_clip_min == 0.5
    with pytest.raises(ValueError, match="clip_min=3.0 must be below vllm_importance_sampling_clip_max=2.0"):
        make(vllm_importance_sampling_clip_min=3.0)
    with pytest.raises(ValueError, match="but both are None"):
        make(vllm_importance_sampling_clip_max=None)
    # A mask mode with no bound at all masks nothing: allowed, as in TRL.
    assert (
        make(
            vllm_importance_sampling_clip_max=None, vllm_importance_sampling_mode="token_mask"
        ).vllm_importance_sampling_clip_max
        is None
    )


def test_dapo_misalignment_is_fine_for_other_loss_types():
    args = make(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        steps_per_generation=3,
        num_generations=4,
        loss_type="grpo",
    )
    assert args.generation_batch_size == 12


def test_every_field_has_help():
    from dataclasses import fields

    from transformers import TrainingArguments

    own = {f.name for f in fields(GRPOConfig)} - {f.name for f in fields(TrainingArguments)}
    assert "num_generations" in own
    for f in fields(GRPOConfig):
        if f.name in own or f.name in {"learning_rate", "logging_steps", "bf16", "remove_unused_columns"}:
            assert f.metadata.get("help"), f.name


def test_generation_kwargs_override_and_reserved_keys():
    from grpo.generation import TransformersGeneration

    backend = TransformersGeneration(
        max_completion_length=4,
        pad_token_id=0,
        eos_token_ids=[1],
        top_p=0.9,
        generation_kwargs={"top_p": 0.5, "typical_p": 0.8},
    )
    assert backend.generation_config.top_p == 0.5 and backend.generation_config.typical_p == 0.8
    with pytest.raises(ValueError, match="use GRPOConfig.temperature"):
        make(generation_kwargs={"temperature": 0.5})


def test_config_rejects_dropping_columns_and_empty_generation_batch():
    with pytest.raises(ValueError, match="remove_unused_columns=True would drop"):
        make(remove_unused_columns=True)
    with pytest.raises(ValueError, match="positive multiple"):
        make(generation_batch_size=0)


def test_reward_call_options_are_checked():
    assert make(reward_errors="skip", reward_timeout=2.5, reward_num_workers=4).reward_num_workers == 4
    with pytest.raises(ValueError, match="reward_errors='ignore' is not one of"):
        make(reward_errors="ignore")
    with pytest.raises(ValueError, match="reward_timeout=0 must be > 0"):
        make(reward_timeout=0)
    with pytest.raises(ValueError, match="reward_num_workers=-1 must be >= 0"):
        make(reward_num_workers=-1)
    with pytest.raises(ValueError, match="reward_worker_type='gpu' is not one of"):
        make(reward_worker_type="gpu")


# ---- What each field declares: its docs section and its valid range ----


def test_every_field_declares_its_docs_section():
    # A field declared with plain `field(...)` has no section and would be missing from docs/config-reference.md.
    sections = {v for k, v in vars(Section).items() if not k.startswith("_")}
    declared = options()
    for f in own_fields():
        assert f.name in declared, f"{f.name} is declared with field(), not option(section=..., help=...)"
        assert declared[f.name].section in sections, (f.name, declared[f.name].section)
    assert set(INHERITED_RANGES).isdisjoint(declared)  # a redeclared field gives its range in option() instead


def outside(interval: Interval, kind: type) -> list:
    """Values of type `kind` just outside `interval`: at an open end, below a closed one, above the top."""
    step = 1 if kind is int else 0.5
    values = []
    if interval.low is not None:
        values.append(interval.low if interval.open_low else interval.low - step)
    if interval.high is not None:
        values.append(interval.high + step)
    return values


@pytest.mark.parametrize("name", list(numeric_ranges()))
def test_every_declared_range_is_enforced(name):
    interval = numeric_ranges()[name]
    kind, _ = field_kinds().get(name, (None, False))
    assert kind in (int, float), f"{name} declares a range but is not an int or float field"
    values = outside(interval, kind)
    if not values:  # unbounded: only the finiteness check applies
        assert kind is float and interval.why, name
        values = [math.nan]
    for value in values:
        with pytest.raises(ValueError, match=f"^{re.escape(f'{name}={value!r}')} "):
            make(**{name: value})


def test_outside_values_are_just_outside():
    # The helper above, checked on the shapes it meets: an open and a closed low end, a top, an int and a float field.
    assert outside(Interval(2), int) == [1]
    assert outside(Interval(0, 1, open_low=True), float) == [0, 1.5]
    assert outside(Interval(0, 2**32 - 1), int) == [-1, 2**32]
    assert outside(Interval(), float) == []


def test_argument_parser_reads_the_config(monkeypatch):
    # TRL's scripts parse GRPOConfig with HfArgumentParser, which hands every metadata key to argparse: a key other
    # than "help" in a field's metadata makes building the parser fail.
    from dataclasses import fields

    from transformers import HfArgumentParser

    for f in fields(GRPOConfig):  # the parser replaces each field's annotation string with the type; put them back
        monkeypatch.setattr(f, "type", f.type)
    (args,) = HfArgumentParser(GRPOConfig).parse_args_into_dataclasses(
        ["--output_dir", "/tmp/grpo-test-config", "--report_to", "none", "--num_generations", "4", "--beta", "0.04"]
    )
    assert args.num_generations == 4 and args.beta == 0.04
