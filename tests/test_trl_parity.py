"""Every field of TRL 1.16.0's `GRPOConfig`, against ours: each one either exists here with TRL's default, or
docs/from-trl.md says how it differs and why. The field list is data, read from TRL 1.16.0's source
(trl/trainer/grpo_config.py and the `_BaseConfig` it subclasses, trl/trainer/base_config.py): the fields those
classes declare, including the `TrainingArguments` defaults they override. TRL need not be installed; where
exactly TRL 1.16.0 is, the table is also checked against it."""

import dataclasses
import math
import re
from pathlib import Path

import pytest

from grpo import GRPOConfig

FROM_TRL = Path(__file__).resolve().parent.parent / "docs" / "from-trl.md"

# name -> TRL 1.16.0's default. "overridden" marks a TrainingArguments field whose default TRL's classes redeclare.
TRL_1_16_FIELDS = {
    # _BaseConfig (overridden TrainingArguments defaults)
    "logging_steps": 10,
    "gradient_checkpointing": True,
    "bf16": None,
    "lr_scheduler_kwargs": None,
    "use_liger_kernel": False,
    "torch_empty_cache_steps": None,
    # GRPOConfig: model and training
    "learning_rate": 1e-06,
    "model_init_kwargs": None,
    "trust_remote_code": False,
    "router_aux_loss_coef": None,
    "disable_dropout": False,
    "cast_lm_head_to_fp32": False,
    "remove_unused_columns": False,
    # data and generation
    "num_generations": 8,
    "num_generations_eval": None,
    "max_completion_length": 512,
    "ds3_gather_for_generation": True,
    "shuffle_dataset": True,
    "pad_to_multiple_of": "auto",
    "generation_batch_size": None,
    "steps_per_generation": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "generation_kwargs": None,
    "chat_template_kwargs": None,
    "repetition_penalty": 1.0,
    "cache_implementation": None,
    # vLLM
    "use_vllm": False,
    "vllm_mode": "colocate",
    "vllm_model_impl": "vllm",
    "vllm_enable_sleep_mode": False,
    "vllm_structured_outputs_regex": None,
    "vllm_server_base_url": None,
    "vllm_server_host": "0.0.0.0",
    "vllm_server_port": 8000,
    "vllm_server_timeout": 240.0,
    "vllm_group_port": 51216,
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_max_model_length": None,
    "vllm_tensor_parallel_size": 1,
    # the objective
    "beta": 0.0,
    "num_iterations": 1,
    "epsilon": 0.2,
    "delta": None,
    "epsilon_high": None,
    "sapo_temperature_neg": 1.05,
    "sapo_temperature_pos": 1.0,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
    "importance_sampling_level": "token",
    "reward_weights": None,
    "multi_objective_aggregation": "sum_then_normalize",
    "scale_rewards": "group",
    "loss_type": "dapo",
    "mask_truncated_completions": False,
    "sync_ref_model": False,
    "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512,
    "top_entropy_quantile": 1.0,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "entropy_coef_min": 0.0,
    "entropy_coef_max": 1.0,
    "entropy_coef_delta": 0.005,
    "entropy_target": 0.2,
    "max_tool_calling_iterations": None,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None,
    "off_policy_mask_threshold": None,
    "use_bias_correction_kl": True,
    # logging, other generation backends, deprecated names
    "log_completions": False,
    "log_multimodal": True,
    "num_completions_to_print": None,
    "log_unique_prompts": False,
    "log_completions_hub_repo": None,
    "use_transformers_continuous_batching": False,
    "transformers_continuous_batching_config": None,
    "use_transformers_paged": False,
    "vllm_importance_sampling_cap": None,
}


def from_trl_rows() -> dict[str, tuple[str, str]]:
    """{name: (status, note)} from every table row of docs/from-trl.md that names a field or argument."""
    rows = {}
    for line in FROM_TRL.read_text().splitlines():
        row = re.match(r"^\| `(\w+)` \| ([^|]+?) \|(.*)\|$", line)
        if row:
            name, status, note = row.groups()
            rows.setdefault(name, (status, note.strip()))
    return rows


def our_defaults() -> dict:
    def default(f):
        return f.default_factory() if f.default is dataclasses.MISSING else f.default

    return {f.name: default(f) for f in dataclasses.fields(GRPOConfig)}


def same_default(ours, theirs) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        return isinstance(ours, int | float) and isinstance(theirs, int | float) and math.isclose(ours, theirs)
    return ours == theirs and type(ours) is type(theirs)


@pytest.mark.parametrize("name", TRL_1_16_FIELDS)
def test_every_trl_field_is_here_with_its_default_or_documented(name):
    status, note = from_trl_rows().get(name, (None, ""))
    assert status is not None, f"docs/from-trl.md has no row for TRL's GRPOConfig field {name}: add one"
    ours, theirs = our_defaults(), TRL_1_16_FIELDS[name]
    if name not in ours:
        assert status == "not supported" and note, f"{name} is missing here: from-trl.md must say so, and why"
    elif same_default(ours[name], theirs):
        assert status in ("same", "same name, different behaviour"), f"{name}: from-trl.md says {status!r}"
    else:
        assert status == "same name, different behaviour" and note, (
            f"{name}: the default here is {ours[name]!r}, TRL's {theirs!r}; from-trl.md lists it as {status!r}. "
            "Mark it 'same name, different behaviour' and say why, or take TRL's default."
        )


def test_the_table_is_trl_1_16s_where_trl_is_installed():
    trl = pytest.importorskip("trl", reason="TRL is not installed (make install-trl builds .venv-trl)")
    if trl.__version__ != "1.16.0":
        pytest.skip(f"TRL {trl.__version__} is installed; the table is 1.16.0's")
    from transformers import TrainingArguments

    base = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    declared = {}
    for cls in trl.GRPOConfig.__mro__:
        if cls.__module__.startswith("trl.") and dataclasses.is_dataclass(cls):
            for name in cls.__annotations__:
                f = cls.__dataclass_fields__[name]
                declared[name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    assert set(declared) == set(TRL_1_16_FIELDS)
    for name, default in declared.items():
        assert same_default(default, TRL_1_16_FIELDS[name]) or name in base, name


def test_the_parity_check_can_fail():
    # A field TRL has that nothing here mentions, and a default that differs without a row saying so, both fail.
    rows = from_trl_rows()
    assert "not_a_trl_field" not in rows
    assert not same_default(our_defaults()["max_completion_length"], TRL_1_16_FIELDS["max_completion_length"])
    assert rows["max_completion_length"][0] == "same name, different behaviour"
    assert same_default(1, 1) and not same_default(1, 1.5) and not same_default(None, 0) and not same_default(True, 1)
