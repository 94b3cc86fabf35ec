"""What `grpo check` validates and `grpo train` validates first: every mistake that can be found without loading a
weight, each raised as a `RecipeError` (one line, exit status 2), and what the run would do.

    grpo check examples/recipes/demo.yaml --max_steps 5

`plan_run` does, in order:
  1. the environment: the distributed variables (LOCAL_RANK, RANK, WORLD_SIZE, ...) are integers, the Hugging Face
     cache folders are usable;
  2. the recipe and its overrides (`load_recipe`), then the `GRPOConfig` they give;
  3. the output directory: a directory (or one that can be made), writable, names the file system accepts, no
     earlier run in it unless resuming; the file-size limit (`ulimit -f`) leaves room for the weights;
  4. the model: a local folder, the offline SmolLM2, or a well-formed hub id that is cached when the hub is off;
     `report_to` names trackers that are installed;
  5. the data, the rewards, the tools and the environment: loaded and imported (no weights), then the checks
     `GRPOTrainer` runs before it loads the policy (columns, batch arithmetic, the tools' schemas, one object of each
     environment made, checked and closed, reward signatures against the data's columns, and weights); with tools
     or a recipe's chat template, the tokenizer, which must render the tools.
`describe_plan` is what `grpo check` prints; `run_summary` is what `grpo train` prints once the model is loaded.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from grpo.cli.recipe import (
    Recipe,
    RecipeError,
    load_recipe,
    resolve_agent,
    resolve_environment,
    resolve_reward,
    resolve_tool,
    resolve_verifiers,
)
from grpo.config import GRPOConfig
from grpo.models import SMOLLM2_NAME, looks_local

# Variables that torchrun / accelerate launch set; transformers reads them with int() when the config is built.
DISTRIBUTED_VARIABLES = ("LOCAL_RANK", "RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")
# The caches a run writes to (models, data sets); an unusable one fails deep inside a download otherwise.
CACHE_VARIABLES = ("HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE")
# report_to names and transformers' availability check for each (transformers.integrations).
TRACKERS = {
    "wandb": ("is_wandb_available", "wandb"),
    "tensorboard": ("is_tensorboard_available", "tensorboard"),
    "mlflow": ("is_mlflow_available", "mlflow"),
    "comet_ml": ("is_comet_available", "comet_ml"),
    "clearml": ("is_clearml_available", "clearml"),
    "trackio": ("is_trackio_available", "trackio"),
    "swanlab": ("is_swanlab_available", "swanlab"),
    "neptune": ("is_neptune_available", "neptune"),
    "dvclive": ("is_dvclive_available", "dvclive"),
    "codecarbon": ("is_codecarbon_available", "codecarbon"),
    "azure_ml": ("is_azureml_available", "azureml-core"),
}


@dataclasses.dataclass
class RunPlan:
    """A validated recipe with what it loaded before any weight: the config, the checkpoint to resume from (None:
    a fresh run), the prompts, the reward functions (reward models still as names), the tools, the
    `environment_factory` (None, a factory, or a dict of them) and the JSON schemas of every tool an episode may be
    offered (the environments' methods included), for the chat template's check."""

    recipe: Recipe
    args: GRPOConfig
    resume: str | None
    train_data: Any
    held_out: Any
    reward_funcs: list
    tools: list
    environment: Any = None
    tool_schemas: list = dataclasses.field(default_factory=list)
    agent_func: Any = None  # a verifiers environment's (`verifiers:`)
    tokenizer: Any = None  # the policy's, when the recipe sets a chat template or offers tools (`check_chat_template`)


def check_environment() -> None:
    """1. Environment variables that would fail later under another name."""
    for name in DISTRIBUTED_VARIABLES:
        value = os.environ.get(name)
        if value is not None and not value.strip().lstrip("-").isdigit():
            raise RecipeError(
                f"The environment variable {name}={value!r} is not an integer (torchrun and accelerate launch set it "
                f"to a process number). Unset it (unset {name}), or start the run with accelerate launch."
            )
    for name in CACHE_VARIABLES:
        value = os.environ.get(name)
        if value:
            problem = _unwritable(Path(value).expanduser())
            if problem:
                raise RecipeError(
                    f"The Hugging Face cache folder {name}={value!r} cannot be used: {problem}. Point {name} at a "
                    f"folder you can write to, or unset it (default ~/.cache/huggingface)."
                )


def _unwritable(path: Path) -> str | None:
    """Why `path` cannot be written to or created as a folder, or None. Probes with a temporary file in the deepest
    folder that exists (permissions alone do not show a read-only file system)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{str(existing)!r} is a file, not a folder"
    try:
        handle, probe = tempfile.mkstemp(dir=existing, prefix=".grpo-probe-")
    except OSError as e:
        return f"{str(existing)!r} is not writable ({e.strerror or e})"
    os.close(handle)
    os.unlink(probe)
    return None


def check_output_dir(output_dir: str) -> None:
    """3. The output directory can hold the run: a directory or creatable as one, every name within the file
    system's length limit, writable."""
    path = Path(output_dir).expanduser()
    try:
        limit = os.pathconf(_deepest_existing(path), "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for part in path.parts:
        if len(os.fsencode(part)) > limit:
            raise RecipeError(
                f"output_dir: the name {part[:40]!r}... is {len(os.fsencode(part))} bytes long, over this file "
                f"system's limit of {limit}. Use a shorter output_dir."
            )
    if path.exists() and not path.is_dir():
        raise RecipeError(
            f"output_dir {output_dir!r} is a file, not a directory. Give a directory (it is created when missing), "
            "or move the file away."
        )
    problem = _unwritable(path)
    if problem:
        raise RecipeError(
            f"output_dir {output_dir!r} cannot be written: {problem}. Use an output_dir you can write to "
            "(--output_dir PATH)."
        )


def _deepest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path if path.is_dir() else path.parent


# The config keys that decide the weights' shapes: a checkpoint of a model that differs in one cannot be loaded.
SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def check_resume_matches_model(checkpoint: str, model: str) -> None:
    """3. A checkpoint resumed into a model of another shape would fail deep in `load_state_dict` with a page of
    size mismatches; compared here from the two `config.json` files (a local model folder; an adapter checkpoint
    has none and is not compared)."""
    saved, own = Path(checkpoint) / "config.json", Path(model).expanduser() / "config.json"
    if not (saved.is_file() and own.is_file()):
        return
    before, now = json.loads(saved.read_text()), json.loads(own.read_text())
    differ = [
        f"{key} {before.get(key)} there, {now.get(key)} here" for key in SHAPE_KEYS if before.get(key) != now.get(key)
    ]
    if differ:
        raise RecipeError(
            f"resume_from_checkpoint: {checkpoint} holds a model of another shape than {model!r} ({'; '.join(differ)}). "
            "Resume with the model the run started from, or start a new run in a new output_dir."
        )


def check_file_size_limit(model: str) -> None:
    """The file-size limit (`ulimit -f`) must admit the weights every checkpoint and the final save write; known
    for a local model folder only (the size of its weight files)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    folder = Path(model).expanduser()
    if soft == resource.RLIM_INFINITY or not folder.is_dir():
        return
    size = max((p.stat().st_size for p in folder.glob("*.safetensors")), default=0)
    size = size or max((p.stat().st_size for p in folder.glob("*.bin")), default=0)
    if size > soft:
        raise RecipeError(
            f"The file-size limit (ulimit -f) is {soft / 2**20:.1f} MiB, smaller than the model's weights "
            f"({size / 2**20:.1f} MiB), which every checkpoint and the final save write: raise it (ulimit -f "
            "unlimited) and run again. (Free disk space is not the problem.)"
        )


def _hub_offline() -> bool:
    from huggingface_hub import constants

    flags = (os.environ.get(v, "").upper() for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return constants.HF_HUB_OFFLINE or any(f in ("1", "ON", "YES", "TRUE") for f in flags)


def check_model_source(name: str, what: str = "model") -> None:
    """4. A model that is not a local folder or the offline SmolLM2 is a hub id: well formed, and in the local cache
    when the hub is off (HF_HUB_OFFLINE=1), so that nothing waits on the network to fail."""
    if name == SMOLLM2_NAME or looks_local(name) or Path(name).expanduser().exists():
        return
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError as e:
        raise RecipeError(
            f"{what}: {name!r} is neither a local folder nor a hub id ({' '.join(str(e).split())}). Give a folder "
            f"that exists, a hub id such as 'HuggingFaceTB/SmolLM2-135M-Instruct', or '{SMOLLM2_NAME}'."
        ) from e
    if _hub_offline() and not isinstance(try_to_load_from_cache(name, "config.json"), str):
        raise RecipeError(
            f"{what}: {name!r} is a hub id that is not in the local cache, and HF_HUB_OFFLINE=1 forbids downloading "
            f"it. Download it where there is network (hf download {name}), or give its local folder."
        )


def check_report_to(report_to: list[str]) -> None:
    """4. Every tracker `report_to` names is installed (transformers would fail at construction, after loading)."""
    from transformers import integrations

    for name in report_to:
        check, package = TRACKERS.get(name, (None, None))
        available = getattr(integrations, check, None) if check else None
        if available is not None and not available():
            raise RecipeError(
                f"report_to names {name!r}, but the {package} package is not installed. Install it (pip install "
                f"{package}), or leave {name} out of report_to (--report_to none)."
            )


def check_precision(config: dict) -> None:
    """2. `bf16: true` or `fp16: true` on a device that cannot run it: said with the fix before `GRPOConfig` is built
    (transformers' own message for bf16 does not give it; fp16 on a CPU would be ignored without a word). bf16 needs
    a GPU that supports it, or `use_cpu` (bfloat16 autocast on the CPU), as transformers decides; fp16 needs an
    accelerator, and is not used with `use_cpu`."""
    import torch
    from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

    use_cpu = bool(config.get("use_cpu"))
    accelerator = torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()
    if config.get("bf16") and not use_cpu and not is_torch_bf16_gpu_available() and not is_torch_xla_available():
        where = "this GPU does not support bfloat16" if accelerator else "this machine has no GPU"
        raise RecipeError(
            f"bf16: true asks for bfloat16 mixed precision, but {where}. Leave bf16 out: the default turns it on "
            "where the device supports it (or set use_cpu: true for bfloat16 autocast on the CPU)."
        )
    if config.get("fp16") and (use_cpu or not accelerator):
        where = "use_cpu is set" if use_cpu else "this machine has no GPU"
        raise RecipeError(
            f"fp16: true asks for float16 mixed precision, which runs on a GPU only, and {where}: it would do "
            "nothing. Leave fp16 out: the default (bf16 where the device supports it) picks the precision."
        )


def check_trainer_inputs(plan: RunPlan) -> None:
    """5. The checks `GRPOTrainer.__init__` runs before it loads the policy, in its order, on the recipe's data,
    rewards, tools and environment: the data set's images and columns, the batch arithmetic, whether the reference may move, the
    tools' schemas and the environments (`make_toolbox` makes one object of each, which is closed here once its
    tools are described: `plan.tool_schemas`), and the rewards' signatures and weights (reward models are not
    loaded). Their ValueError and TypeError become `RecipeError`s, message unchanged."""
    from grpo.data import check_prompt_dataset, offline
    from grpo.data.image_checks import scan_images
    from grpo.data.sampler import train_sampler
    from grpo.objective.reference import reference_moves
    from grpo.rewards.environments import with_environment_rewards
    from grpo.rewards.names import check_reward_funcs
    from grpo.rewards.scoring import reward_keywords
    from grpo.rewards.stored import offline_rewards

    args = plan.args
    toolbox = None
    try:
        stored = offline.offline_groups(plan.train_data, plan.held_out, args, plan.reward_funcs or None)
        scan_images(plan.train_data, plan.held_out)  # every image opened once (the processor's check: the trainer's)
        train_data = stored if stored is not None else plan.train_data
        check_prompt_dataset(train_data, "train_dataset")
        check_prompt_dataset(plan.held_out, "eval_dataset")
        train_sampler(args, len(train_data), groups=stored is not None)
        reference_moves(args, peft=plan.recipe.peft is not None)
        toolbox = _probe_toolbox(plan)
        plan.tool_schemas = toolbox.schemas() if toolbox is not None else []
        funcs, weights = with_environment_rewards(plan.reward_funcs or None, toolbox, args.reward_weights)
        funcs, _, weights = offline_rewards(stored, funcs, None, weights)
        if funcs:
            check_reward_funcs(funcs, None, weights)
            episodes = (plan.tools, plan.environment, plan.agent_func, None)
            check_reward_columns(plan, funcs, reward_keywords(train_data, plan.held_out, toolbox, stored, episodes))
    except (ValueError, TypeError) as e:
        raise RecipeError(str(e)) from e
    finally:
        if toolbox is not None:
            toolbox.close()  # the probe objects: the trainer makes its own


def check_reward_columns(plan: RunPlan, funcs: list, keywords) -> None:
    """5. Every reward function's parameters are among the `keywords` it will be called with (`reward_keywords`;
    None: known only at the first round): a column it names that the data lacks gets the recipe's column mapping
    as the fix, with the data's own name for the column it most likely means."""
    from grpo.data import RESERVED_COLUMNS
    from grpo.rewards.names import check_reward_keywords, missing_arguments, reward_name, stand_in_column

    mapping = plan.recipe.dataset.columns if plan.recipe.dataset is not None else {}
    original = {target: source for source, target in mapping.items()}  # a column's name before the mapping
    columns = sorted(k for k in keywords or () if k not in RESERVED_COLUMNS and k != "environments")
    for func in funcs:
        standard = (*RESERVED_COLUMNS, "environments")
        missing = [name for name in missing_arguments(func, keywords or ()) if name not in standard]
        if keywords is None or not missing or difflib.get_close_matches(missing[0], standard, 1, 0.8):
            continue  # a misspelt standard argument: `check_reward_keywords` below says which
        source = stand_in_column(missing[0], [c for c in columns if c not in missing])
        source = original.get(source, source) if source is not None else "<column>"
        raise RecipeError(
            f"Reward '{reward_name(func)}' takes `{'`, `'.join(missing)}`, but the data has no such column (its "
            f"columns, after the recipe's column mapping: {', '.join(['prompt', *columns])}). Map a column to it "
            f"in the recipe: `dataset: {{columns: {{{source}: {missing[0]}}}}}`."
        )
    check_reward_keywords(funcs, keywords)


def check_chat_template(plan: RunPlan) -> None:
    """5. The policy's tokenizer (no weights) with the recipe's `model.chat_template`, checked to render the tools:
    `plan.tool_schemas` are those of every tool an episode may be offered, the environments' methods included (from
    the check's own environment objects, already closed). Kept as `plan.tokenizer` for the trainer; None (the
    trainer loads it) when the recipe sets no template and its episodes offer no tools."""
    model, args = plan.recipe.model, plan.args
    template = model.chat_template_text()
    if template is None and not plan.tool_schemas:
        return
    from transformers import AutoTokenizer

    from grpo.generation.episodes import check_template_renders_tools
    from grpo.models import smollm2_path

    path = str(smollm2_path()) if model.name_or_path == SMOLLM2_NAME else model.name_or_path
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    if template is not None:
        tokenizer.chat_template = template
    try:
        check_template_renders_tools(tokenizer, plan.tool_schemas, args.chat_template_kwargs)
    except ValueError as e:
        raise RecipeError(f"{e} In a recipe: `model: {{chat_template: chatml_tools}}` for a ChatML model.") from e
    plan.tokenizer = tokenizer


def _probe_toolbox(plan: RunPlan):
    """The run's `Toolbox` (`make_toolbox`: None without tools or environment), as the trainer will build it; an
    environment whose construction raises is one line naming the recipe's key (the traceback with --debug)."""
    from grpo.generation.environment_checks import EnvironmentFactoryError
    from grpo.generation.tools import ToolDefinitionError, make_toolbox

    try:
        return make_toolbox(plan.tools, plan.environment, plan.args)
    except ToolDefinitionError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's constructor (or its server) can fail in any way
        # The constructor's own exception, not the trainer's wrapping of it (which names the Python argument).
        error = e.__cause__ if isinstance(e, EnvironmentFactoryError) and e.__cause__ is not None else e
        raise RecipeError(
            f"environment: making an object of {plan.recipe.environment} failed with {type(error).__name__}: "
            f"{error}. Fix the environment's constructor (or start the server it connects to); --debug shows the "
            "traceback."
        ) from e


def _check_environment_rows(plan: RunPlan) -> None:
    """With a mapping of environments, every training and held-out row names one of them in its `environment`
    column (the trainer would fail at the first round without)."""
    names = plan.recipe.environment
    if not isinstance(names, dict):
        return
    for label, data in (("training", plan.train_data), ("held-out", plan.held_out)):
        if data is None or not len(data):
            continue
        if "environment" not in data.column_names:
            raise RecipeError(
                f"environment maps names to environments ({', '.join(names)}), but the {label} rows have no "
                "`environment` column naming each row's one. Add that column to the data (or rename one with "
                "`dataset.columns`), or name a single environment: `environment: module:attr`."
            )
        unknown = sorted({str(v) for v in data["environment"]} - set(names))
        if unknown:
            raise RecipeError(
                f"The {label} rows' `environment` column holds {unknown}, not among the recipe's environments "
                f"({', '.join(names)}). Add them to `environment:` or fix the rows."
            )


def plan_run(recipe_path: str, overrides: list[str]) -> RunPlan:
    """Steps 1-5 of the module docstring: a run's inputs, validated and loaded short of any weight."""
    from grpo.training.checkpoints import check_fresh_output_dir, resolve_resume
    from grpo.training.output_dir import check_outside_model

    check_environment()
    recipe = load_recipe(recipe_path, overrides)
    check_precision(recipe.config)
    args = recipe.grpo_config()
    # The model's own folder first: the checks below would take its weights for an earlier run's model.
    check_outside_model(args.output_dir, recipe.model.name_or_path)
    check_output_dir(args.output_dir)
    # Resume (`--resume_from_checkpoint DIR|true`), or refuse to write over an earlier run's checkpoints.
    resume = resolve_resume(args.resume_from_checkpoint, args.output_dir)
    if resume is None:
        check_fresh_output_dir(args.output_dir)
    else:
        check_resume_matches_model(resume, recipe.model.name_or_path)
    check_model_source(recipe.model.name_or_path)
    check_file_size_limit(recipe.model.name_or_path)
    check_report_to(args.report_to or [])

    from grpo.cli.datasets import load_prompt_datasets

    search = [recipe.source.parent.resolve()] if recipe.source else []
    made = resolve_verifiers(recipe.verifiers, search) or {}
    try:
        # Without a `dataset:` section, the verifiers environment's own (its held-out rows are not evaluated here).
        train_data, held_out = (
            load_prompt_datasets(recipe.dataset) if recipe.dataset is not None else (made["train_dataset"], None)
        )
    except ConnectionError as e:  # a hub data set, not cached, with no network or HF_HUB_OFFLINE=1
        raise RecipeError(
            f"dataset.path {recipe.dataset.path!r} names a hub data set that could not be fetched ({e}). Download it "
            "where there is network (it is then cached), or give a local .jsonl/.json/.csv/.parquet file."
        ) from e
    reward_funcs = [resolve_reward(spec, search, args.trust_remote_code) for spec in recipe.rewards]
    reward_funcs += made.get("reward_funcs", [])
    if made.get("reward_weights") is not None and args.reward_weights is None:
        args.reward_weights = made["reward_weights"]  # per_function: the rubric's weights
    for spec in recipe.rewards:
        if isinstance(spec.name, str) and ":" not in spec.name and "/" in spec.name:
            check_model_source(spec.name, what="reward model")
    tools = [resolve_tool(path, search) for path in recipe.tools]
    environment = resolve_environment(recipe.environment, search)
    if (tools or environment) and len(train_data) and isinstance(train_data[0]["prompt"], str):
        which = "tools need" if not environment else "environment needs" if not tools else "tools and environment need"
        raise RecipeError(
            f"The recipe's {which} conversational prompts (the chat template renders the tools); these are "
            "strings. Set `dataset.chat: true` (or a `dataset.system_prompt`)."
        )
    plan = RunPlan(recipe, args, resume, train_data, held_out, reward_funcs, tools, environment)
    plan.agent_func = made.get("agent_func") or resolve_agent(recipe.agent, search)
    _check_environment_rows(plan)
    check_trainer_inputs(plan)
    check_chat_template(plan)
    return plan


def _backend(args: GRPOConfig) -> str:
    if args.use_vllm and args.vllm_mode == "colocate":
        return "vLLM engine in this process (vllm_mode=colocate)"
    if args.use_vllm:
        where = args.vllm_server_base_url or f"http://{args.vllm_server_host}:{args.vllm_server_port}"
        return f"vLLM server at {where} (start it with grpo vllm-serve)"
    return "model.generate in this process"


def _steps(args: GRPOConfig, rows: int) -> str:
    if args.max_steps > 0:
        return f"{args.max_steps} (max_steps)"
    per_step = args.per_device_train_batch_size * args.gradient_accumulation_steps
    steps = max(1, int(args.num_train_epochs * rows * args.num_generations // per_step))
    return f"about {steps} on one process ({args.num_train_epochs:g} epochs of {rows} prompts)"


def describe_plan(plan: RunPlan) -> str:
    """What the run would do, as `grpo check` prints it."""
    args, recipe = plan.args, plan.recipe
    rows = len(plan.train_data)
    completions = args.per_device_train_batch_size * args.gradient_accumulation_steps
    prompt_tokens = args.max_prompt_length if args.max_prompt_length is not None else "the prompt's"
    names = [s.name + (f" (weight {s.weight:g})" if s.weight is not None else "") for s in recipe.rewards]
    held_out = f", {len(plan.held_out)} held out" if plan.held_out is not None else ""
    lines = [
        f"{recipe.source or 'recipe'}: valid (no weights were loaded).",
        f"  model:        {recipe.model.name_or_path}" + (" + LoRA adapter" if recipe.peft else ""),
        f"  data:         {rows} training prompts{held_out}",
        f"  rewards:      {', '.join(names) or 'the stored ones (offline data)'}" if not recipe.verifiers else None,
        f"  verifiers:    {recipe.verifiers['env']} (its rollouts, rubric: "
        f"{', '.join(f.__name__ for f in plan.reward_funcs)}"
        f"{'' if recipe.dataset is not None else ', data set'})"
        if recipe.verifiers
        else None,
        f"  tools:        {', '.join(recipe.tools)}" if recipe.tools else None,
        f"  environment:  {_environment_line(plan)}" if recipe.environment else None,
        f"  steps:        {_steps(args, rows)}",
        f"  per step:     {completions // args.num_generations} prompts x G={args.num_generations} completions per "
        f"process, at most {args.max_completion_length} tokens each (prompts: {prompt_tokens} tokens at most)",
        f"  loss:         {args.loss_type}, beta={args.beta:g}, learning_rate={args.learning_rate:g}",
        f"  generation:   {_backend(args)}",
        f"  output_dir:   {args.output_dir}" + (f" (resuming from {plan.resume})" if plan.resume else ""),
    ]
    return "\n".join(line for line in lines if line is not None)


def _environment_line(plan: RunPlan) -> str:
    """The recipe's environment(s) and the tools their objects offer, as `grpo check` prints them."""
    spec = plan.recipe.environment
    named = ", ".join(f"{name}={path}" for name, path in spec.items()) if isinstance(spec, dict) else spec
    own = {getattr(tool, "__name__", "") for tool in plan.tools}  # the standalone tools, listed on their own line
    offered = [s["function"]["name"] for s in plan.tool_schemas if s["function"]["name"] not in own]
    return f"{named} (its tools: {', '.join(offered) or 'none'})"


def run_summary(trainer, plan: RunPlan) -> str:
    """What `grpo train` prints once the model is loaded: the model and its parameters, the trainable share, the
    data, G, steps, tokens per step, the generation backend and the output directory."""
    from grpo.models import unwrap_parallel

    args = trainer.args
    model = unwrap_parallel(trainer.model)
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    processes = trainer.accelerator.num_processes
    completions = args.per_device_train_batch_size * args.gradient_accumulation_steps * processes
    tokens = completions * ((args.max_prompt_length or 0) + args.max_completion_length)
    prompt_part = "" if args.max_prompt_length is not None else " (completion tokens; prompts are not capped)"
    held_out = f", {len(plan.held_out)} held out" if plan.held_out is not None else ""
    lines = [
        f"model:      {plan.recipe.model.name_or_path}: {total / 1e6:.1f}M parameters, "
        f"{trainable / 1e6:.1f}M trainable ({100 * trainable / max(total, 1):.1f}%)",
        f"data:       {len(plan.train_data)} training prompts{held_out}",
        f"steps:      {_steps(args, len(plan.train_data))}; {completions // args.num_generations} prompts x "
        f"G={args.num_generations} = {completions} completions per step on {processes} process(es), at most "
        f"{tokens} tokens{prompt_part}",
        f"generation: {_backend(args)}",
        f"output_dir: {args.output_dir}",
    ]
    return "\n".join(lines)
