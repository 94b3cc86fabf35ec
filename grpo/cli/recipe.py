"""Recipes: one YAML file that says which model, which data, which rewards and which `GRPOConfig` to train with.

    grpo train examples/recipes/demo.yaml --learning_rate 2e-5 --dataset.size 200

A recipe has these top-level keys (docs/recipes.md has the reference):

    model:    {name_or_path: ...}       or just `model: some/path` (a folder, a hub id, or "smollm2-135m-instruct")
    dataset:  where the prompts come from (a local file, a hub data set or a reasoning-gym task) and how to shape them
    rewards:  a list of built-in names or `module:function` paths, each optionally with a weight and settings (may be
              empty when the data set holds scored completions: docs/offline.md)
    run:      what `grpo train` does around `trainer.train()` (evaluation before/after, sample completions, plot)
    peft:     optional LoRA settings ({r: 16, lora_alpha: 32, target_modules: all-linear}): train an adapter only
    tools:    optional `module:function` paths of tool functions: each row becomes a multi-turn episode (docs/agents.md)
    environment: optional `module:attr` of an environment class (or zero-argument factory), or `{name: module:attr}`
              for several (rows pick one by their `environment` column): GRPOTrainer's `environment_factory`
    verifiers: optional verifiers environment, `module:function` (its `load_environment`) or an installed environment's
              id, or {env: ..., args: {...}, per_function: true}: its rollouts, rubric and data set (`from_verifiers`);
              `dataset:` is then optional and `rewards:` must be empty
    agent:    optional `module:function` of an agent function `f(row, endpoint)` that calls the trainer's
              OpenAI-compatible endpoint itself (GRPOTrainer's `agent_func`); not beside tools, environment, verifiers
    anything else: a `GRPOConfig` field (learning_rate, num_generations, max_steps, ...)

Command-line overrides (`--field value`, `--section.field value`) are applied on top of the file, with the value read
as YAML (`--max_steps 5`, `--report_to "[tensorboard]"`). Every unknown key is an error that names the closest valid
one; so are YAML syntax errors (with the line), values of the wrong type, and local model or data paths that do not
exist. Nothing here trains: `load_recipe` only parses and validates, so a recipe can be checked without a model.
Every error is a `RecipeError`, which `grpo train` prints as one line before exiting with status 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import numbers
import os
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grpo.cli.errors import RecipeError
from grpo.config import GRPOConfig
from grpo.data import InputError
from grpo.models import SMOLLM2_NAME, looks_local
from grpo.rewards.names import import_from_folders, resolve_reward_name, reward_kind

LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


# Chat templates a recipe can name (`model.chat_template`); the value is the module attribute holding the template.
BUILTIN_CHAT_TEMPLATES = {"chatml_tools": "CHATML_TOOLS_TEMPLATE"}


@dataclasses.dataclass
class ModelSection:
    name_or_path: str = "smollm2-135m-instruct"
    # The tokenizer's chat template, replaced: a built-in name (BUILTIN_CHAT_TEMPLATES) or a Jinja template's text.
    chat_template: str | None = None

    def chat_template_text(self) -> str | None:
        """The Jinja text of `chat_template` (None: keep the tokenizer's own)."""
        if self.chat_template not in BUILTIN_CHAT_TEMPLATES:
            return self.chat_template
        from grpo.generation import episodes

        return getattr(episodes, BUILTIN_CHAT_TEMPLATES[self.chat_template])


@dataclasses.dataclass
class DatasetSection:
    # Where the rows come from: exactly one of `path` (a local .jsonl/.json/.csv/.parquet file, or a hub data set
    # name for `datasets.load_dataset`) and `reasoning_gym` (an offline task name, e.g. basic_arithmetic).
    path: str | None = None
    name: str | None = None  # the hub data set's configuration (e.g. "main" for openai/gsm8k)
    split: str = "train"
    reasoning_gym: str | None = None
    task_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # reasoning-gym task settings
    size: int | None = None  # rows to train on (reasoning-gym: rows to generate; files: the first `size` rows)
    seed: int = 0  # reasoning-gym generation seed, and the shuffle seed of the held-out split
    # Shaping: rename columns ({source: target}); `prompt_column` is a shortcut for {prompt_column: "prompt"}.
    columns: dict[str, str] = dataclasses.field(default_factory=dict)
    prompt_column: str = "prompt"
    prompt_template: str | None = None  # e.g. "{prompt}\nAnswer with a number." (any column can be named)
    system_prompt: str | None = None
    chat: bool = False  # wrap string prompts as [{"role": "user", "content": ...}] (for chat models)
    # Worked examples: chat messages ({role, content}; user, assistant and tool turns) put after the system prompt and
    # before each row's question, so that the model sees whole example conversations (few-shot turns).
    examples: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # Held-out prompts for the evaluation: `eval_split` of the same source, or `eval_size` rows kept apart.
    eval_split: str | None = None
    eval_size: int = 0


@dataclasses.dataclass
class RewardSpec:
    name: str  # a built-in name, "module:function", or a reward model's folder or hub id (grpo.rewards.names.reward_kind)
    weight: float | None = None
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)  # settings for a reward factory


@dataclasses.dataclass
class RunSection:
    evaluate_before: bool = True  # evaluate the held-out prompts before training too, and print both
    sample_completions: int = 4  # held-out prompts whose greedy completions are printed (changed answers first)
    save_model: bool = True
    plot: bool = True


@dataclasses.dataclass
class PeftSection:
    # The fields of `peft.LoraConfig` that a recipe may set; absent `peft:` means full fine-tuning (docs/peft.md).
    r: int = 16  # the adapter's rank
    lora_alpha: int | float = 32  # the adapter's output is scaled by lora_alpha / r
    target_modules: str | list[str] = "all-linear"  # "all-linear" (every linear layer but the output head) or names
    lora_dropout: float = 0.0
    bias: str = "none"  # "none", "all" or "lora_only": which biases train
    modules_to_save: list[str] | None = None  # modules trained in full beside the adapter (e.g. [lm_head])
    use_rslora: bool = False  # scale by lora_alpha / sqrt(r) instead (rank-stabilised LoRA)

    def lora_config(self):
        """The `peft.LoraConfig` of these settings (task CAUSAL_LM); LoraConfig itself checks almost nothing, so
        the values that would fail only once the model is wrapped are checked here."""
        if self.r < 1:
            raise RecipeError(f"peft.r must be a positive rank such as 8 or 16, got {self.r}.")
        if not 0 <= self.lora_dropout < 1:
            raise RecipeError(f"peft.lora_dropout must be in [0, 1), got {self.lora_dropout}.")
        if self.bias not in ("none", "all", "lora_only"):
            raise RecipeError(f"peft.bias must be 'none', 'all' or 'lora_only', got {self.bias!r}.")
        try:
            from peft import LoraConfig
        except ImportError as e:
            raise RecipeError("The recipe's `peft:` section needs the `peft` package: pip install peft.") from e
        try:
            return LoraConfig(task_type="CAUSAL_LM", **dataclasses.asdict(self))
        except (TypeError, ValueError) as e:
            raise RecipeError(f"peft: {e}") from e


@dataclasses.dataclass
class Recipe:
    model: ModelSection
    dataset: DatasetSection | None  # None: the verifiers environment's own data set
    rewards: list[RewardSpec]
    run: RunSection
    config: dict[str, Any]  # GRPOConfig keyword arguments
    source: Path | None = None
    peft: PeftSection | None = None  # None: full fine-tuning
    tools: list[str] = dataclasses.field(default_factory=list)  # `module:function` paths (multi-turn episodes)
    # `module:attr` of the environment_factory, or {name: module:attr} (rows routed by their `environment` column).
    environment: str | dict[str, str] | None = None
    # {env: `module:function` or an environment id, args: {...}, per_function: bool} of a verifiers environment.
    verifiers: dict[str, Any] | None = None
    # `module:function` of an agent function `f(row, endpoint)` (GRPOTrainer's `agent_func`).
    agent: str | None = None

    def peft_config(self):
        """The `peft.LoraConfig` for `GRPOTrainer(peft_config=...)`, or None without a `peft:` section."""
        return self.peft.lora_config() if self.peft is not None else None

    def grpo_config(self) -> GRPOConfig:
        """The `GRPOConfig`, with the rewards' weights; its `__post_init__` errors (ValueError, TypeError) become
        `RecipeError`s naming the recipe, message unchanged."""
        config = dict(self.config)
        weights = [r.weight for r in self.rewards]
        if any(w is not None for w in weights):
            if "reward_weights" in config:
                raise RecipeError("Weights are given both in `rewards` and as `reward_weights`; keep one of the two.")
            config["reward_weights"] = [1.0 if w is None else float(w) for w in weights]
        try:
            return GRPOConfig(**config)
        except (TypeError, ValueError) as e:
            raise RecipeError(f"{self.source or 'recipe'}: {e}") from e


_SECTIONS = {"model": ModelSection, "dataset": DatasetSection, "run": RunSection, "peft": PeftSection}
# Top-level keys that are neither sections nor GRPOConfig fields.
_LISTS = ("rewards", "tools", "environment", "verifiers", "agent")


def config_fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(GRPOConfig) if f.init}


# TRL's command-line and YAML keys (its ScriptArguments and ModelConfig) that are spelt otherwise in a recipe
# (docs/from-trl.md); GRPOConfig's own fields keep TRL's names.
TRL_KEYS = {
    "model_name_or_path": "model",
    "model_revision": "model_init_kwargs: {revision: ...}",
    "torch_dtype": "model_init_kwargs: {dtype: ...}",
    "dtype": "model_init_kwargs: {dtype: ...}",
    "attn_implementation": "model_init_kwargs: {attn_implementation: ...}",
    "dataset_name": "dataset.path",
    "dataset_config": "dataset.name",
    "dataset_train_split": "dataset.split",
    "dataset_test_split": "dataset.eval_split",
    "reward_funcs": "rewards",
    "reward_model_name_or_path": "rewards",
    "use_peft": "peft",
    "lora_r": "peft.r",
    "lora_alpha": "peft.lora_alpha",
    "lora_dropout": "peft.lora_dropout",
    "lora_target_modules": "peft.target_modules",
    "lora_modules_to_save": "peft.modules_to_save",
    "use_rslora": "peft.use_rslora",
    "environment_factory": "environment",  # GRPOTrainer's argument
    "agent_func": "agent",  # GRPOTrainer's argument
}


# TrainingArguments fields transformers renamed, keeping the old (TRL's) name as an alias that warns on every run.
RENAMED_FIELDS = {
    "gradient_checkpointing": "activation_checkpointing",
    "gradient_checkpointing_kwargs": "activation_checkpointing_kwargs",
}


def _current_name(key: str, fields: dict) -> str:
    """The name this transformers uses for a recipe key: a recipe may keep TRL's `gradient_checkpointing` and run
    without the deprecation warning (the installed transformers has the new name from 5.2x on)."""
    new = RENAMED_FIELDS.get(key)
    return new if new in fields else key


def _unknown(key: str, valid, where: str) -> RecipeError:
    if key in TRL_KEYS and "section" not in where:
        return RecipeError(
            f"Unknown key '{key}' in {where}: that is TRL's name. Did you mean '{TRL_KEYS[key]}'? (docs/from-trl.md "
            "maps TRL's keys.)"
        )
    close = difflib.get_close_matches(key, list(valid), n=1, cutoff=0.6)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return RecipeError(f"Unknown key '{key}' in {where}.{hint} See docs/recipes.md for the valid keys.")


def _matches(value: Any, hint: Any) -> bool:
    """Whether a YAML value fits a section field's annotation (str, int, float, bool, dict[...], Any, or a union)."""
    if hint is Any:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_matches(value, arm) for arm in typing.get_args(hint))
    hint = typing.get_origin(hint) or hint
    if hint is type(None):
        return value is None
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    return isinstance(value, hint)


def _section(cls, values: Any, where: str):
    if values is None:
        return cls()
    if not isinstance(values, dict):
        raise RecipeError(f"'{where}' must be a mapping of keys to values, got {type(values).__name__}: {values!r}")
    names = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key, value in values.items():
        if key not in names:
            raise _unknown(key, names, f"the '{where}' section")
        if not _matches(value, hints[key]):
            hint = hints[key]
            expected = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
            expected = expected.replace("None", "null")  # the YAML spelling
            raise RecipeError(
                f"{where}.{key}: {value!r} ({type(value).__name__}) is not of type {expected}. Write it as that type "
                "(numbers unquoted, true/false for yes/no, a {key: value} mapping for a dict)."
            )
    return cls(**values)


def _reward(entry: Any, index: int) -> RewardSpec:
    where = f"rewards[{index}]"
    if isinstance(entry, str):
        return RewardSpec(name=entry)
    if isinstance(entry, dict) and not isinstance(entry.get("name", ""), str):
        raise RecipeError(f"{where}.name must be a string such as 'accuracy' or 'my_module:my_reward', got {entry!r}")
    if not isinstance(entry, dict) or "name" not in entry:
        raise RecipeError(
            f"{where} must be a name ('accuracy', 'my_module:my_reward') or a mapping with a 'name' key, got {entry!r}"
        )
    return _section(RewardSpec, entry, where)


def _coerce(name: str, value: Any) -> Any:
    """YAML reads `1e-5` as a string (YAML 1.1 floats need a dot); turn strings into the numbers a field expects."""
    if not isinstance(value, str):
        return value
    annotation = str(config_fields()[name].type)
    for kind in (int, float):
        if kind.__name__ in annotation:
            try:
                return kind(value)
            except ValueError:
                continue
    return value


def parse_overrides(argv: list[str]) -> list[tuple[str, Any]]:
    """`["--max_steps", "5", "--dataset.size=10"]` -> `[("max_steps", 5), ("dataset.size", 10)]`, values read as YAML.
    Dashes in names become underscores, so `--max-steps` works too."""
    import yaml

    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise RecipeError(f"Expected an override like --field value, got {arg!r}.")
        key, sep, value = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise RecipeError(f"The override --{key} needs a value: --{key} VALUE (or --{key}=VALUE).")
            value = argv[i + 1]
            i += 1
        try:
            parsed = yaml.load(value, Loader=_loader()) if value != "" else ""
        except yaml.YAMLError as e:
            raise RecipeError(
                f"The override --{key} {value!r} is not valid YAML ({getattr(e, 'problem', e)}); quote the value, "
                f"e.g. --{key} '\"{value}\"'."
            ) from e
        pairs.append((key.replace("-", "_"), parsed))
        i += 1
    return pairs


def apply_overrides(raw: dict[str, Any], overrides: list[tuple[str, Any]]) -> dict[str, Any]:
    raw = dict(raw)
    for key, value in overrides:
        section, dot, field = key.partition(".")
        if dot:
            if section not in _SECTIONS:
                raise _unknown(section, _SECTIONS, "the command-line overrides (--section.field)")
            existing = raw.get(section) or {}
            if section == "model" and isinstance(existing, str):  # `model: PATH` is short for {name_or_path: PATH}
                existing = {"name_or_path": existing}
            raw[section] = {**existing, field: value}
        else:
            raw[key] = value
    return raw


@functools.cache
def _loader() -> type:
    """PyYAML's safe loader with YAML 1.2's booleans: only true and false. YAML 1.1 also reads yes, no, on and off
    as booleans, so `save_strategy: no` (or `--save_strategy no`) became False and failed as "False is not a valid
    SaveStrategy"; here they stay strings, and a bool field given one says it wants true or false."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    bool_tag = "tag:yaml.org,2002:bool"
    Loader.yaml_implicit_resolvers = {
        first: [(tag, pattern) for tag, pattern in resolvers if tag != bool_tag]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver(bool_tag, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
    return Loader


def _read_yaml(source: Path) -> dict[str, Any]:
    """The top-level mapping of a recipe file; a missing file or a YAML error names the line and the usual fix."""
    import yaml

    if not source.is_file():
        raise RecipeError(f"Recipe file {str(source)!r} not found.")
    text = source.read_text()
    try:
        node = yaml.compose(text, Loader=_loader())
        if node is None:  # nothing but comments and blank lines
            raise RecipeError(
                f"{source} is empty: a recipe needs at least a `dataset:` section (and usually `model:` and "
                "`rewards:`). Start from a copy of examples/recipes/demo.yaml (docs/recipes.md)."
            )
        _check_duplicate_keys(node, source)
        raw = yaml.load(text, Loader=_loader())
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        at = f" at line {line}, column {mark.column + 1}" if mark is not None else ""
        quoted = f" ({text.splitlines()[line - 1].strip()!r})" if line and line <= len(text.splitlines()) else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise RecipeError(
            f"{source}: YAML syntax error{at}{quoted}: {problem}. Fix that line: each key is followed by a colon "
            "and a space, nesting is by consistent spaces (no tabs), and quotes and brackets must close."
        ) from e
    if not isinstance(raw, dict):
        raise RecipeError(f"{source} must hold a mapping of keys to values at the top level.")
    return raw


def _check_duplicate_keys(node, source: Path, where: str = "") -> None:
    """A key given twice in one mapping, at any depth, is an error naming it and both lines: YAML loaders keep the
    last one silently, so `learning_rate` written twice trained with whichever came last."""
    import yaml

    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_duplicate_keys(item, source, f"{where}[{i}]")
    if not isinstance(node, yaml.MappingNode):
        return
    lines: dict[Any, int] = {}
    for key, value in node.value:
        name = key.value if isinstance(key, yaml.ScalarNode) else None
        path = f"{where}.{name}" if where else str(name)
        if name is not None and name != "<<":
            if name in lines:
                raise RecipeError(
                    f"{source}: the key {path!r} is given twice, at line {lines[name]} and line "
                    f"{key.start_mark.line + 1}; only the last would count. Keep one of them."
                )
            lines[name] = key.start_mark.line + 1
        _check_duplicate_keys(value, source, path)


def _dataset_section(raw: Any) -> DatasetSection:
    """The `dataset:` section, with exactly one source; a local path that does not exist fails now."""
    dataset = _section(DatasetSection, raw, "dataset")
    if (dataset.path is None) == (dataset.reasoning_gym is None):
        raise RecipeError(
            "The dataset section needs exactly one source: `path` (a local file or a hub data set name) or "
            "`reasoning_gym` (an offline task name such as basic_arithmetic)."
        )
    if dataset.path is not None:
        path = Path(dataset.path).expanduser()
        if (path.suffix.lower() in LOCAL_SUFFIXES or looks_local(dataset.path)) and not path.exists():
            raise RecipeError(
                f"dataset.path: {dataset.path!r} not found (relative paths start from the working directory "
                f"{Path.cwd()}). Fix the path, or give a hub data set name such as 'openai/gsm8k'."
            )
    return dataset


def load_recipe(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> Recipe:
    """Parse and validate a recipe file plus command-line overrides. Builds no model and loads no data."""
    source = Path(path) if path is not None else None
    raw = _read_yaml(source) if source is not None else {}
    raw = apply_overrides(raw, parse_overrides(overrides or []))

    fields = config_fields()
    valid = set(fields) | set(_SECTIONS) | set(_LISTS)
    config = {}
    for key, value in raw.items():
        if key in _SECTIONS or key in _LISTS:
            continue
        if key not in fields:
            raise _unknown(key, valid, str(source) if source else "the recipe")
        config[_current_name(key, fields)] = _coerce(key, value)
    model = raw.get("model")
    model = ModelSection(name_or_path=model) if isinstance(model, str) else _section(ModelSection, model, "model")
    _check_chat_template(model.chat_template)
    # A local path that does not exist fails now; a hub id is left to from_pretrained (it may need the network).
    name = model.name_or_path
    if name != SMOLLM2_NAME and looks_local(name) and not Path(name).expanduser().exists():
        raise RecipeError(
            f"model: {name!r} does not exist (relative paths start from the working directory {Path.cwd()}). Fix "
            f"the path, or give a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct' or '{SMOLLM2_NAME}'."
        )
    rewards = raw.get("rewards") or []
    if isinstance(rewards, str | dict):
        rewards = [rewards]
    # No rewards is valid for a data set of scored completions (offline training, docs/offline.md); for prompts the
    # trainer refuses it before it loads the model.
    verifiers = _verifiers(raw.get("verifiers"), raw)
    dataset = None if verifiers is not None and raw.get("dataset") is None else _dataset_section(raw.get("dataset"))
    if "output_dir" not in config:
        stem = source.stem if source else "grpo"
        config["output_dir"] = os.path.join("outputs", stem)
    recipe = Recipe(
        model=model,
        dataset=dataset,
        rewards=[_reward(entry, i) for i, entry in enumerate(rewards)],
        run=_section(RunSection, raw.get("run"), "run"),
        config=config,
        source=source,
        # `peft: null` (or `--peft null`) turns LoRA off; `peft: {}` is LoRA with the defaults above.
        peft=_section(PeftSection, raw["peft"], "peft") if raw.get("peft") is not None else None,
        tools=_tools(raw.get("tools")),
        environment=_environment(raw.get("environment")),
        verifiers=verifiers,
        agent=_agent(raw.get("agent"), raw),
    )
    if recipe.peft is not None:
        recipe.peft_config()  # a bad rank, dropout or bias fails here, before any model loads
    for i, spec in enumerate(recipe.rewards):
        try:  # typos of built-in names and missing local paths, before anything is imported or downloaded
            reward_kind(spec.name, [source.parent.resolve()] if source else [])
        except InputError as e:
            raise RecipeError(f"rewards[{i}]: {e}") from e
    return recipe


def _check_chat_template(value: str | None) -> None:
    """A chat template is a built-in name or Jinja text (it holds `{{` or `{%`); anything else is most likely a
    misspelt name."""
    if value is None or value in BUILTIN_CHAT_TEMPLATES or "{{" in value or "{%" in value:
        return
    close = difflib.get_close_matches(value, list(BUILTIN_CHAT_TEMPLATES), n=1, cutoff=0.6)
    hint = f"Did you mean '{close[0]}'? " if close else ""
    raise RecipeError(
        f"model.chat_template: {value!r} is neither a built-in template ({', '.join(BUILTIN_CHAT_TEMPLATES)}) nor a "
        f"Jinja template's text. {hint}Name a built-in one, or give the template itself."
    )


_TOOL_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _tools(raw: Any) -> list[str]:
    """The `tools:` list (one string alone is a list of one): `module:function` paths, checked for their form here
    and imported by `resolve_tool`."""
    if raw is None:
        return []
    entries = [raw] if isinstance(raw, str) else raw
    if not isinstance(entries, list):
        raise RecipeError(f"tools must be a list of 'module:function' paths, got {type(raw).__name__}: {raw!r}")
    for i, entry in enumerate(entries):
        if not isinstance(entry, str) or not _TOOL_PATH.match(entry):
            raise RecipeError(
                f"tools[{i}]: {entry!r} is not a 'module:function' path. Name the module (a .py file in the working "
                "directory or the recipe's folder, or an installed package) and the function, e.g. "
                "'my_tools:multiply'."
            )
    return list(entries)


def _import_attr(path: str, search_dirs: typing.Sequence[Path], what: str) -> Any:
    """The attribute a `module:attr` path names (None when the module has no such attribute), the module imported
    with the working directory and `search_dirs` on the import path, as rewards' `module:function` are."""
    module_name, _, attr = path.partition(":")
    try:
        module = import_from_folders(module_name, search_dirs, what=what)
    except InputError as e:
        raise RecipeError(str(e)) from e
    return getattr(module, attr, None)


def resolve_tool(path: str, search_dirs: typing.Sequence[Path] = ()) -> Callable:
    """The function a `tools:` entry names, imported with the working directory and `search_dirs` (the recipe's
    folder) on the import path, as rewards' `module:function` are."""
    func = _import_attr(path, search_dirs, f"Tool '{path}'")
    if not callable(func):
        module_name, _, attr = path.partition(":")
        raise RecipeError(
            f"Tool '{path}': module '{module_name}' has no function '{attr}'. Check the name: 'module:function'."
        )
    return func


def _environment(raw: Any) -> str | dict[str, str] | None:
    """The `environment:` key: one `module:attr` path, or a non-empty mapping of names to paths; checked for its form
    here and imported by `resolve_environment`."""
    if raw is None:
        return None
    if isinstance(raw, dict):
        if not raw:
            raise RecipeError(
                "environment: the mapping is empty. Name one environment ('my_env:Game'), or map names to them "
                "({game: 'my_env:Game', maze: 'my_env:Maze'}), or leave the key out."
            )
        for name, path in raw.items():
            if not isinstance(name, str) or not name:
                raise RecipeError(
                    f"environment: the name {name!r} ({type(name).__name__}) is not a string. Name each environment "
                    f"with a word ({{game: 'my_env:Game'}}), the value the rows' `environment` column holds for it; "
                    "quote it if YAML reads it as a number."
                )
            _check_environment_path(path, f"environment.{name}")
        return dict(raw)
    _check_environment_path(raw, "environment")
    return raw


def _verifiers(raw: Any, recipe: dict) -> dict[str, Any] | None:
    """The `verifiers:` key, in its long form {env, args, per_function}; checked for its form here and loaded by
    `resolve_verifiers`. It runs whole episodes and scores them itself, so `tools`, `environment` and `rewards` are
    refused beside it."""
    if raw is None:
        return None
    spec = {"env": raw} if isinstance(raw, str) else dict(raw) if isinstance(raw, dict) else None
    unknown = sorted(set(spec or {}) - {"env", "args", "per_function"})
    if spec is None or unknown or not isinstance(spec.get("env"), str) or not spec["env"]:
        raise RecipeError(
            f"verifiers: {raw!r} is not an environment. Give 'module:load_environment' (a .py file in the working "
            "directory or the recipe's folder, or an installed package), an installed environment's id, or "
            "{env: ..., args: {...}, per_function: true}" + (f"; unknown keys {unknown}." if unknown else ".")
        )
    if not isinstance(spec.setdefault("args", {}), dict):
        raise RecipeError(f"verifiers.args must be a mapping of the environment's arguments, got {spec['args']!r}.")
    if not isinstance(spec.setdefault("per_function", False), bool):
        raise RecipeError(f"verifiers.per_function must be true or false, got {spec['per_function']!r}.")
    beside = [key for key in ("tools", "environment", "rewards") if recipe.get(key)]
    if beside:
        raise RecipeError(
            f"verifiers: the environment runs its own episodes and its rubric gives the rewards, so {beside} cannot "
            "be given beside it. Remove them (add a reward function to the environment's rubric instead)."
        )
    return spec


def _agent(raw: Any, recipe: dict) -> str | None:
    """The `agent:` key, a `module:function` path, checked for its form here and imported by `resolve_agent`. The
    agent runs whole episodes and calls its own tools, so `tools`, `environment` and `verifiers` are refused beside
    it."""
    if raw is None:
        return None
    if not isinstance(raw, str) or not _TOOL_PATH.match(raw):
        raise RecipeError(
            f"agent: {raw!r} is not a 'module:function' path. Name the module (a .py file in the working directory or "
            "the recipe's folder, or an installed package) and the agent function `f(row, endpoint)` in it, e.g. "
            "'my_agent:solve'."
        )
    beside = [key for key in ("tools", "environment", "verifiers") if recipe.get(key)]
    if beside:
        raise RecipeError(
            f"agent: the agent function runs whole episodes and calls its own tools, so {beside} cannot be given "
            "beside it. Keep one way of running episodes."
        )
    return raw


def resolve_agent(path: str | None, search_dirs: typing.Sequence[Path] = ()) -> Callable | None:
    """The agent function an `agent:` key names, imported with `search_dirs` (the recipe's folder) on the import path;
    the trainer checks that it takes (row, endpoint)."""
    if path is None:
        return None
    function = _import_attr(path, search_dirs, f"agent '{path}'")
    if function is None or not callable(function):
        raise RecipeError(
            f"agent '{path}': module '{path.partition(':')[0]}' has no function '{path.partition(':')[2]}'. Check "
            "the name: 'module:function', the agent function `f(row, endpoint)`."
        )
    return function


def resolve_verifiers(spec: dict[str, Any] | None, search_dirs: typing.Sequence[Path] = ()) -> dict | None:
    """What `from_verifiers` gives `GRPOTrainer` (agent_func, reward_funcs, train_dataset, eval_dataset) for the
    environment a `verifiers:` key names: `module:function` imported with `search_dirs` (the recipe's folder) on the
    import path and called with `args`, or an id given to verifiers' `load_environment`."""
    if spec is None:
        return None
    from grpo.generation.verifiers_env import from_verifiers, load_verifiers, rubric_weights

    target, args = spec["env"], spec["args"]
    try:
        if _TOOL_PATH.match(target):
            made = _import_attr(target, search_dirs, f"verifiers '{target}'")
            if made is None:
                raise RecipeError(f"verifiers '{target}': the module has no attribute '{target.partition(':')[2]}'.")
            env = made(**args) if callable(made) else made
        else:
            env = load_verifiers(target, **args)
        made = from_verifiers(env, per_function=spec["per_function"])
        if spec["per_function"]:
            made["reward_weights"] = rubric_weights(env)
        return made
    except RecipeError:
        raise
    except InputError as e:
        raise RecipeError(f"verifiers: {e}") from e


def _check_environment_path(path: Any, where: str) -> None:
    if not isinstance(path, str) or not _TOOL_PATH.match(path):
        raise RecipeError(
            f"{where}: {path!r} is not a 'module:attr' path. Name the module (a .py file in the working directory "
            "or the recipe's folder, or an installed package) and the environment class or zero-argument factory "
            "in it, e.g. 'my_env:Game'; for several environments, map names to such paths."
        )


def resolve_environment(
    spec: str | dict[str, str] | None, search_dirs: typing.Sequence[Path] = ()
) -> Callable | dict[str, Callable] | None:
    """The `environment_factory` an `environment:` key names (a dict of them for a mapping), each imported with the
    working directory and `search_dirs` (the recipe's folder) on the import path. The object must be callable with
    no argument: a class, a zero-argument function, or a class made by `openenv_environment(...)`."""
    if spec is None:
        return None
    if isinstance(spec, dict):
        return {name: _environment_factory(path, search_dirs, f"environment.{name}") for name, path in spec.items()}
    return _environment_factory(spec, search_dirs, "environment")


def _environment_factory(path: str, search_dirs: typing.Sequence[Path], where: str) -> Callable:
    module_name, _, attr = path.partition(":")
    factory = _import_attr(path, search_dirs, f"{where} '{path}'")
    if factory is None:
        raise RecipeError(
            f"{where} '{path}': module '{module_name}' has no attribute '{attr}'. Check the name: 'module:attr', "
            "the environment class (or the zero-argument function that makes one)."
        )
    if not callable(factory):
        raise RecipeError(
            f"{where} '{path}' is not callable (a {type(factory).__name__} object): name the environment's "
            "class (or a zero-argument function returning a new object), not one object of it; each episode needs "
            "an object of its own."
        )
    try:
        inspect.signature(factory).bind()
    except TypeError as e:
        raise RecipeError(
            f"{where} '{path}' cannot be called without arguments ({e}): the trainer makes each environment object "
            "with no argument. Give its arguments defaults, or name a zero-argument function that makes one "
            "(functools.partial in the module works too)."
        ) from e
    except ValueError:  # no signature to read (a builtin): left to the call
        pass
    return factory


def resolve_reward(
    spec: RewardSpec, search_dirs: typing.Sequence[Path] = (), trust_remote_code: bool = False
) -> Callable:
    """The reward of a recipe entry, resolved as in Python (`grpo.rewards.names.resolve_reward_name`), with `search_dirs`
    (the recipe's folder) on the import path for `module:function`."""
    try:
        return resolve_reward_name(spec.name, spec.kwargs, search_dirs, trust_remote_code)
    except RecipeError:
        raise
    except InputError as e:
        raise RecipeError(str(e)) from e
