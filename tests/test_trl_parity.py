"""Every field of TRL 1.16.0's `GRPOConfig`, against ours: each one exists here with TRL's default, unless the table
"Deliberate differences from TRL 1.16" of docs/from-trl.md lists it with the reason (a default chosen otherwise, or
a field left out). A field TRL has that is missing here, or a default that differs, without a row there fails.

The field list is data, read from TRL 1.16.0's source (trl/trainer/grpo_config.py and the `_BaseConfig` it
subclasses, trl/trainer/base_config.py): the fields those classes declare, including the `TrainingArguments`
defaults they override. TRL need not be installed, so the check runs in the normal test run; where TRL 1.16.0 is
installed (`make parity`, in .venv-trl), the same check also runs against TRL's classes themselves."""

import ast
import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest
from transformers import TrainingArguments

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


# TRL 1.16 fields that work in progress beside this check may add: missing for now. Empty: every field exists. A
# field in it that exists here already fails the check, so the set cannot outlive the work.
GAPS_BEING_CLOSED: set[str] = set()
DIFFERENCES_HEADING = "## Deliberate differences from TRL 1.16"
# TRL fields whose default here is TrainingArguments' own, which differs between transformers versions: the
# differences table gives the current one, and only that it differs from TRL's is checked.
INHERITED_DEFAULTS = {f.name for f in dataclasses.fields(TrainingArguments)} - set(vars(GRPOConfig)["__annotations__"])


def from_trl_rows() -> dict[str, tuple[str, str]]:
    """{name: (status, note)} from the rows of docs/from-trl.md's tables that name a field or argument, outside the
    table of deliberate differences."""
    rows = {}
    for line in page_outside_differences():
        row = re.match(r"^\| `(\w+)` \| ([^|]+?) \|(.*)\|$", line)
        if row:
            name, status, note = row.groups()
            rows.setdefault(name, (status, note.strip()))
    return rows


def page_outside_differences() -> list[str]:
    lines, inside = [], False
    for line in FROM_TRL.read_text().splitlines():
        if line.startswith("## "):
            inside = line.startswith(DIFFERENCES_HEADING)
        if not inside:
            lines.append(line)
    return lines


def deliberate_differences() -> dict[str, tuple[Any, Any, str]]:
    """{field: (TRL's default, ours or MISSING, why)} from the table under DIFFERENCES_HEADING: rows
    `| `field` | `TRL's default` | `ours` | why |`, the defaults as Python literals, "not here" for a field left out."""
    differences, inside = {}, False
    for line in FROM_TRL.read_text().splitlines():
        if line.startswith("## "):
            inside = line.startswith(DIFFERENCES_HEADING)
        row = re.match(r"^\| `(\w+)` \| `([^`]*)` \| (`[^`]*`|not here) \| (.*) \|$", line) if inside else None
        if row:
            name, theirs, ours, why = row.groups()
            here = dataclasses.MISSING if ours == "not here" else ast.literal_eval(ours.strip("`"))
            differences[name] = (ast.literal_eval(theirs), here, why.strip())
    return differences


def our_defaults() -> dict:
    def default(f):
        return f.default_factory() if f.default is dataclasses.MISSING else f.default

    return {f.name: default(f) for f in dataclasses.fields(GRPOConfig)}


def same_default(ours, theirs) -> bool:
    if isinstance(ours, float) or isinstance(theirs, float):
        return isinstance(ours, int | float) and isinstance(theirs, int | float) and math.isclose(ours, theirs)
    return ours == theirs and type(ours) is type(theirs)


def parity_problems(trl: dict, ours: dict, differences: dict, gaps: set) -> list[str]:
    """What keeps `ours` ({field: default}) from matching `trl` ({field: TRL's default}): a field missing here, a
    default that differs, neither listed in `differences` (`deliberate_differences()`) nor, for a missing field, in
    `gaps`; a row of `differences` that states other defaults than the code's, or that no longer differs; a gap that
    is closed."""
    problems = []
    for name, theirs in trl.items():
        row = differences.get(name)
        if name not in ours:
            if name not in gaps and row is None:
                problems.append(
                    f"{name}: TRL 1.16 has it, GRPOConfig does not. Add it with TRL's default, or list "
                    f"it under '{DIFFERENCES_HEADING}' in docs/from-trl.md as not here, with why."
                )
            continue
        if name in gaps:
            problems.append(f"{name} exists now: remove it from GAPS_BEING_CLOSED (tests/test_trl_parity.py).")
        if row is None:
            if not same_default(ours[name], theirs):
                problems.append(
                    f"{name}: the default here is {ours[name]!r}, TRL's {theirs!r}. Take TRL's, or list it "
                    f"under '{DIFFERENCES_HEADING}' in docs/from-trl.md with why."
                )
            continue
        listed_theirs, listed_ours, why = row
        if not why:
            problems.append(f"{name}: its row under '{DIFFERENCES_HEADING}' says no why.")
        # A default GRPOConfig inherits from TrainingArguments changes with the transformers version (False, None).
        wrong = listed_ours is dataclasses.MISSING or not same_default(listed_ours, ours[name])
        if wrong and name not in INHERITED_DEFAULTS:
            problems.append(
                f"{name}: the differences table gives our default as {listed_ours!r}; it is {ours[name]!r}."
            )
        if not same_default(listed_theirs, theirs):
            problems.append(
                f"{name}: the differences table gives TRL's default as {listed_theirs!r}; it is {theirs!r}."
            )
        if same_default(ours[name], theirs):
            problems.append(f"{name}: the default is TRL's now; remove its row under '{DIFFERENCES_HEADING}'.")
    problems += [
        f"{name}: listed under '{DIFFERENCES_HEADING}' but not a TRL 1.16 field."
        for name in set(differences) - set(trl)
    ]
    return problems


def test_every_trl_field_is_here_with_trls_default_or_a_deliberate_difference():
    problems = parity_problems(TRL_1_16_FIELDS, our_defaults(), deliberate_differences(), GAPS_BEING_CLOSED)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("name", TRL_1_16_FIELDS)
def test_from_trl_md_has_a_row_that_agrees(name):
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


def installed_trl_defaults() -> dict:
    """{field: default} of the installed TRL's GRPOConfig: the fields its own classes declare."""
    trl = pytest.importorskip("trl", reason="TRL is not installed (make install-trl builds .venv-trl; make parity)")
    if trl.__version__ != "1.16.0":
        pytest.skip(f"TRL {trl.__version__} is installed; the table is 1.16.0's")
    declared = {}
    for cls in trl.GRPOConfig.__mro__:
        if cls.__module__.startswith("trl.") and dataclasses.is_dataclass(cls):
            for name in cls.__annotations__:
                f = cls.__dataclass_fields__[name]
                declared[name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
    return declared


def test_the_table_is_trl_1_16s_where_trl_is_installed():

    declared = installed_trl_defaults()
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    assert set(declared) == set(TRL_1_16_FIELDS)
    for name, default in declared.items():
        assert same_default(default, TRL_1_16_FIELDS[name]) or name in base, name


def test_the_parity_check_passes_against_installed_trl():
    # TRL's own classes, not the table above: the check cannot drift from the TRL it names.
    problems = parity_problems(installed_trl_defaults(), our_defaults(), deliberate_differences(), GAPS_BEING_CLOSED)
    assert not problems, "\n".join(problems)


def test_the_parity_check_can_fail():
    trl, ours = {"a": 1, "b": "x", "c": None}, {"a": 1, "b": "x", "c": None}
    assert parity_problems(trl, ours, {}, set()) == []
    missing = {"a": 1, "b": "x"}
    assert "c: TRL 1.16 has it" in parity_problems(trl, missing, {}, set())[0]
    assert parity_problems(trl, missing, {}, {"c"}) == []  # a gap being closed
    assert parity_problems(trl, missing, {"c": (None, dataclasses.MISSING, "why")}, set()) == []  # left out on purpose
    assert "remove it from GAPS_BEING_CLOSED" in parity_problems(trl, ours, {}, {"c"})[0]
    changed = {**ours, "b": "y"}
    assert "the default here is 'y', TRL's 'x'" in parity_problems(trl, changed, {}, set())[0]
    assert parity_problems(trl, changed, {"b": ("x", "y", "because")}, set()) == []
    assert "says no why" in parity_problems(trl, changed, {"b": ("x", "y", "")}, set())[0]
    assert "remove its row" in parity_problems(trl, ours, {"b": ("x", "x", "because")}, set())[-1]
    assert "our default as 'z'" in parity_problems(trl, changed, {"b": ("x", "z", "because")}, set())[0]
    assert "not a TRL 1.16 field" in parity_problems(trl, ours, {"d": (1, 2, "why")}, set())[0]
    # The real table is read: its rows are the documented differences, with TRL's and our defaults.
    differences = deliberate_differences()
    assert differences["max_completion_length"] == (512, 256, differences["max_completion_length"][2])
    assert len(differences) >= 6
    assert same_default(1, 1) and not same_default(1, 1.5) and not same_default(None, 0) and not same_default(True, 1)
