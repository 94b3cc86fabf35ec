"""What the user passed as rewards, checked and resolved, before anything is scored.

A reward given as a string means the same in Python as in a recipe (`resolve_reward_name`): a built-in name
(`BUILTIN_REWARDS`), `module:function`, a local reward-model folder, or else a hub reward-model id. A name close to a
built-in one is refused with a suggestion, and a local-looking path that does not exist is refused, before any
import or download.

`check_reward_funcs` runs every check that needs no weights (names, signatures, one tokenizer and one weight per
reward), so that a mistake fails before any model loads; `load_reward_funcs` then loads the reward models named by
path or hub id, and their tokenizers. `reward_name` is the name a reward has in metrics and error messages;
`distinct_names` tells apart rewards that share one.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import sys
import warnings
from collections.abc import Callable, Collection, Sequence
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedModel

from grpo.data import RESERVED_COLUMNS, InputError
from grpo.models import check_reward_model, load_reward_model, looks_local
from grpo.rewards import builtin
from grpo.rewards.process import is_process_reward

# Built-in rewards by name (in grpo/rewards/builtin.py): (attribute, whether it is a factory called with the settings).
BUILTIN_REWARDS = {
    "accuracy": ("accuracy", False),
    "reasoning_gym": ("reasoning_gym", False),
    "format_reward": ("format_reward", True),
    "soft_overlong_punishment": ("soft_overlong_punishment", True),
    "code_execution": ("code_execution", True),
}


def reward_name(func: Callable | PreTrainedModel | str) -> str:
    """The name used in metrics (`rewards/<name>/mean`) and error messages; for a reward model named by path or hub
    id and not loaded yet, the name it will have."""
    if isinstance(func, str):
        return func.rstrip("/").split("/")[-1]
    if isinstance(func, PreTrainedModel):
        return func.config._name_or_path.rstrip("/").split("/")[-1] or type(func).__name__
    return getattr(func, "__name__", None) or type(func).__name__


def distinct_names(names: Sequence[str]) -> list[str]:
    """`names` (one per reward, in order) made distinct, for metrics: a name given again becomes `<name>_2`,
    `<name>_3`, ... (skipping any another reward has), with one warning, so that two functions of one name (two
    lambdas, two rewards built by one factory) log `rewards/<name>/mean` apart rather than merged into one."""
    taken, distinct, renamed = set(names), [], {}
    for name in names:
        if name not in distinct:
            distinct.append(name)
            continue
        suffix = 2
        while f"{name}_{suffix}" in taken:
            suffix += 1
        taken.add(f"{name}_{suffix}")
        distinct.append(f"{name}_{suffix}")
        renamed.setdefault(name, [name]).append(f"{name}_{suffix}")
    if renamed:
        listed = "; ".join(f"{len(new)} named {name!r}, logged as {', '.join(new)}" for name, new in renamed.items())
        warnings.warn(
            f"Reward functions share a name ({listed}, in the order given): their metrics (rewards/<name>/mean, "
            "...) are told apart by those suffixes. To choose the names, give each function its own: a def of its "
            "own, or set its __name__.",
            stacklevel=3,
        )
    return distinct


def reward_kind(name: str, search_dirs: Sequence[Path] = ()) -> str:
    """What a reward string names, decided without importing or downloading anything: 'builtin', 'function'
    (`module:function`), 'path' (an existing local reward-model folder) or 'hub' (a reward-model id). Raises
    `InputError` for a local-looking path that does not exist, for a name close to a built-in one and for TRL's
    dotted 'module.function' of a module found here (`search_dirs`: a recipe's folder)."""
    if name in BUILTIN_REWARDS:
        return "builtin"
    if looks_local(name):
        if not Path(name).expanduser().exists():
            raise InputError(
                f"Reward {name!r} looks like a local reward-model path, but it does not exist (relative paths start "
                f"from the working directory {Path.cwd()}). Fix the path, or name a built-in reward "
                f"({', '.join(BUILTIN_REWARDS)}) or your own as 'module:function'."
            )
        return "path"
    if ":" in name:
        return "function"
    if Path(name).is_dir():
        return "path"
    colon = _dotted_function(name, search_dirs)
    if colon is not None:
        raise InputError(
            f"Reward {name!r}: a function is named 'module:function' here, with a colon (TRL's dotted form would be "
            f"tried as a hub model id). Did you mean {colon!r}?"
        )
    close = difflib.get_close_matches(name, list(BUILTIN_REWARDS), n=1, cutoff=0.6) if "/" not in name else []
    if close:
        raise InputError(
            f"Unknown reward {name!r}: it is not a built-in reward. Did you mean {close[0]!r}? (Built-ins: "
            f"{', '.join(BUILTIN_REWARDS)}; your own function: 'module:function'; a reward model: a local folder or "
            "a hub id such as 'org/name'.)"
        )
    return "hub"


def import_from_folders(module_name: str, search_dirs: Sequence[Path] = (), what: str = ""):
    """Import `module_name` with the working directory and `search_dirs` (a recipe's folder) on the import path:
    how a `module:function` reward, or a recipe's tool, finds a file beside the recipe. Every failure is an
    `InputError` that starts with `what` (e.g. "Reward 'my_rewards:short'") and says which of these it is: the module
    is not found, a module it imports is missing (install it), it has a syntax error (file and line), or its own code
    raised while it was imported.

    The folders are on `sys.path` only while the module imports, so that no recipe's folder stays on the process's
    import path, shadowing other modules of its files' names for the rest of the run. What the module imports at its
    top, siblings beside it included, stays imported and keeps working. A sibling imported only when a
    function runs is not found then: import it at the module's top, or make the folder a package, whose submodules
    (`from . import helpers`) are found through the package. Worker processes (reward_worker_type="process") get the
    module's folder on their own path (grpo/rewards/runner.py)."""
    folders = [Path.cwd(), *search_dirs]
    # Searched first, and the recipe's folder before the working directory.
    added = [str(folder) for folder in reversed(folders) if str(folder) not in sys.path]
    sys.path[:0] = added
    try:
        _forget_if_from_elsewhere(module_name, folders)
        return _import(module_name, what or f"Module '{module_name}'", folders)
    finally:
        for folder in added:  # only what was added here: the module's own code may have changed sys.path too
            if folder in sys.path:
                sys.path.remove(folder)


def _import(module_name: str, what: str, folders: Sequence[Path] = ()):
    """`importlib.import_module(module_name)`, its failures as the `InputError`s `import_from_folders` describes; a
    module not found gets the closest name of a module in `folders`."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name != e.name and not module_name.startswith(e.name + "."):
            raise InputError(
                f"{what}: module '{module_name}' imports '{e.name}', which is not installed. Install it in this "
                f"environment (pip install {e.name.split('.')[0]}), or remove that import."
            ) from e
        raise InputError(
            f"{what}: cannot import module '{module_name}' ({e}).{_closest_module(module_name, folders)} Put "
            f"{module_name.split('.')[0]}.py in the working directory or the recipe's folder, or install the package "
            "that provides it."
        ) from e
    except SyntaxError as e:
        where = f"{e.filename}, line {e.lineno}" if e.filename else f"line {e.lineno}"
        raise InputError(
            f"{what}: module '{module_name}' has a syntax error ({where}): {e.msg}. Fix that line."
        ) from e
    except Exception as e:
        frame = _last_frame_in(e, module_name)
        raise InputError(
            f"{what}: importing module '{module_name}' raised {type(e).__name__}: {e}{frame}. Fix the module's "
            "top-level code (it runs when the module is imported)."
        ) from e


def _closest_module(module_name: str, folders: Sequence[Path]) -> str:
    """' Did you mean 'x'?' for the module of `folders` (a .py file or a package folder) whose name is closest to
    the top-level name of `module_name`; '' when none is close."""
    top = module_name.split(".")[0]
    names = {p.stem for folder in folders for p in Path(folder).glob("*.py")}
    names |= {p.parent.name for folder in folders for p in Path(folder).glob("*/__init__.py")}
    close = difflib.get_close_matches(top, sorted(names - {top}), n=1, cutoff=0.6)
    return f" Did you mean '{module_name.replace(top, close[0], 1)}'?" if close else ""


def closest_attribute(module, attr: str) -> str:
    """' Did you mean 'x'?' for the public name of `module` closest to `attr` (a misspelt function or class); ''
    when none is close."""
    names = [n for n in vars(module) if not n.startswith("_")]
    close = difflib.get_close_matches(attr, names, n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def _forget_if_from_elsewhere(module_name: str, folders: Sequence[Path]) -> None:
    """A module of this name imported earlier in the process from another place (a second run in one process, from
    another folder, whose `my_rewards.py` is another file) would be reused as is: forget it, so that the file in
    these folders is imported."""
    cached = sys.modules.get(module_name)
    if cached is None or "." in module_name or not getattr(cached, "__file__", None):
        return
    here = [
        path
        for folder in folders
        for path in (Path(folder) / f"{module_name}.py", Path(folder) / module_name / "__init__.py")
        if path.is_file()
    ]
    if here and Path(cached.__file__).resolve() not in {path.resolve() for path in here}:
        del sys.modules[module_name]
        importlib.invalidate_caches()  # a file written since the folder was last listed is found


def _last_frame_in(error: BaseException, module_name: str) -> str:
    """' (at FILE, line N)' for the deepest traceback frame in the module's own file, or ''."""
    import traceback

    stem = module_name.rsplit(".", 1)[-1]
    frames = [f for f in traceback.extract_tb(error.__traceback__) if Path(f.filename).stem == stem]
    return f" (at {frames[-1].filename}, line {frames[-1].lineno})" if frames else ""


def _dotted_function(name: str, search_dirs: Sequence[Path] = ()) -> str | None:
    """'module:function' when `name` is TRL's dotted form 'module.function' of a module found here (a .py file in
    the working directory or `search_dirs`, or an installed top-level module), else None. Such a name is not a hub
    id, and trying it as one costs retries and, offline, a misleading error."""
    if "/" in name or ":" in name or "." not in name:
        return None
    module, _, attr = name.rpartition(".")
    top = module.split(".")[0]
    if not (module and attr.isidentifier() and all(part.isidentifier() for part in module.split("."))):
        return None
    if any((Path(folder) / f"{top}.py").is_file() for folder in [Path.cwd(), *search_dirs]):
        return f"{module}:{attr}"
    try:
        found = importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        found = False
    return f"{module}:{attr}" if found else None


def resolve_reward_name(
    name: str, kwargs: dict | None = None, search_dirs: Sequence = (), trust_remote_code: bool = False
) -> Callable | PreTrainedModel:
    """The reward a string names (see `reward_kind`), the one resolver behind both `GRPOTrainer(reward_funcs="...")`
    and recipes. `module:function` is imported with the working directory and `search_dirs` on the import path; a
    factory (built-in or imported) is called with `kwargs` when they are given; a reward model's own code runs only
    with `trust_remote_code`."""
    kind = reward_kind(name, search_dirs)
    kwargs = kwargs or {}
    if kind in ("path", "hub"):
        if kwargs:
            raise InputError(f"Reward model {name!r} takes no settings; remove its `kwargs`.")
        if kind == "path":
            return load_reward_model(str(Path(name).expanduser()), trust_remote_code)
        try:
            return load_reward_model(name, trust_remote_code)
        except InputError:
            raise
        except Exception as e:
            raise InputError(
                f"Reward {name!r} is not a built-in reward ({', '.join(BUILTIN_REWARDS)}), a 'module:function' or a "
                f"local folder, so it was loaded as a reward model from the hub, which failed: {type(e).__name__}: "
                f"{e}. Fix the name, or pass the reward model's local folder."
            ) from e
    if kind == "function":
        module_name, _, attr = name.partition(":")
        module = import_from_folders(module_name, search_dirs, what=f"Reward '{name}'")
        if not hasattr(module, attr):
            raise InputError(
                f"Reward '{name}': module '{module_name}' has no attribute '{attr}'.{closest_attribute(module, attr)} "
                "Check the function's name: 'module:function'."
            )
        func = getattr(module, attr)
        return func(**kwargs) if kwargs else func
    attr, is_factory = BUILTIN_REWARDS[name]
    func = getattr(builtin, attr)
    if not is_factory:
        if kwargs:
            raise InputError(f"The built-in reward '{name}' takes no settings; remove its `kwargs`.")
        return func
    try:
        return func(**kwargs)
    except TypeError as e:
        raise InputError(
            f"The built-in reward '{name}' needs settings ({e}): in a recipe give them under `kwargs:`; in Python "
            f"call grpo.rewards.{attr}(...) and pass the function it returns."
        ) from e


def check_reward_funcs(
    reward_funcs, reward_processing_classes=None, reward_weights=None, keywords: Collection[str] | None = None
) -> tuple[list, list]:
    """Every check of the rewards given to the trainer that needs no weights, so that a misspelt name, a bad
    signature or a miscounted `reward_weights` fails before any model loads: every string is checked
    (`reward_kind`) before any is resolved, built-ins and `module:function` are resolved (an import, no weights),
    each function's signature is checked (`check_reward_signature`), and against the `keywords` it will be called
    with when they are known (`check_reward_keywords`), and `reward_processing_classes` and `reward_weights` must
    have one entry per reward. Returns (the rewards, reward models named by path or hub id still as strings; the
    tokenizers given, aligned with them)."""
    reward_funcs = reward_funcs if isinstance(reward_funcs, list) else [reward_funcs]
    if not reward_funcs:
        raise ValueError("reward_funcs is empty; pass at least one reward function or reward model.")
    kinds = [reward_kind(f) if isinstance(f, str) else None for f in reward_funcs]
    reward_funcs = [resolve_reward_name(f) if k in ("builtin", "function") else f for f, k in zip(reward_funcs, kinds)]
    for f in reward_funcs:
        if isinstance(f, PreTrainedModel):
            check_reward_model(f, reward_name(f))
            if is_process_reward(f):
                raise TypeError(
                    f"Reward model '{reward_name(f)}' is marked @process_reward, but a reward model scores whole "
                    "completions. Wrap it in a @process_reward function that splits the completion into steps, "
                    "scores them and returns StepRewards."
                )
        elif callable(f):
            check_reward_signature(f)
        elif not isinstance(f, str):
            raise TypeError(f"A reward function must be callable or a reward model, got {type(f).__name__}.")
    check_reward_keywords(reward_funcs, keywords)
    given = reward_processing_classes
    if given is None:
        given = [None] * len(reward_funcs)
    elif not isinstance(given, list):
        given = [given]
    if len(given) != len(reward_funcs):
        raise ValueError(
            f"reward_processing_classes has {len(given)} entries for {len(reward_funcs)} reward "
            "functions; align them (None for plain functions)."
        )
    if reward_weights is not None and len(reward_weights) != len(reward_funcs):
        raise ValueError(
            f"reward_weights has {len(reward_weights)} entries but there are {len(reward_funcs)} reward functions "
            f"({[reward_name(f) for f in reward_funcs]}); give one weight per function."
        )
    return reward_funcs, given


def load_reward_funcs(
    reward_funcs, reward_processing_classes=None, reward_weights=None, trust_remote_code: bool = False, keywords=None
) -> tuple[list, list]:
    """Check the rewards given to the trainer (`check_reward_funcs`, with the `keywords` they will be called with
    when known), then load the reward models named by path or hub id (`resolve_reward_name`) and the tokenizers of
    reward models given without one. Returns (reward functions and models, tokenizers aligned with them)."""
    reward_funcs, given = check_reward_funcs(reward_funcs, reward_processing_classes, reward_weights, keywords)
    reward_funcs = [
        resolve_reward_name(f, trust_remote_code=trust_remote_code) if isinstance(f, str) else f for f in reward_funcs
    ]
    tokenizers = []
    for func, tokenizer in zip(reward_funcs, given):
        if isinstance(func, PreTrainedModel) and tokenizer is None:
            path = func.config._name_or_path
            if not path:
                raise ValueError(
                    f"Reward model '{reward_name(func)}' was built in code and has no path to load a tokenizer "
                    "from; pass its tokenizer in `reward_processing_classes`."
                )
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if tokenizer is not None and tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if isinstance(func, PreTrainedModel) and func.config.pad_token_id is None:
            func.config.pad_token_id = tokenizer.pad_token_id
        tokenizers.append(tokenizer)
    return reward_funcs, tokenizers


def missing_arguments(func, keywords: Collection[str]) -> list[str]:
    """The parameters of reward function `func` that need a value (no default, not `*args` or `**kwargs`) and are not
    among `keywords`, the names it will be called with (`grpo.rewards.scoring.reward_keywords`): its first call
    would fail with a TypeError. [] for a reward model, a name not resolved yet, or a signature that cannot be
    read."""
    if isinstance(func, str | PreTrainedModel) or not callable(func):
        return []
    try:
        params = inspect.signature(func).parameters.values()
    except (TypeError, ValueError):
        return []
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in named and p.default is p.empty and p.name not in keywords]


def stand_in_column(name: str, columns: Collection[str]) -> str | None:
    """The column most likely meant by a reward parameter `name` that no column has: the closest name, else the only
    column, else None (the prompt is not a candidate: it arrives as `prompts`)."""
    columns = [c for c in columns if c not in RESERVED_COLUMNS and c != "prompt"]
    close = difflib.get_close_matches(name, columns, n=1, cutoff=0.6)
    return close[0] if close else columns[0] if len(columns) == 1 else None


def check_reward_keywords(reward_funcs, keywords: Collection[str] | None) -> None:
    """Refuse a reward function with a parameter the trainer will not pass (a column the data set lacks, a
    misspelt `completions`), before any weight loads; `keywords`: `grpo.rewards.scoring.reward_keywords`, None
    when they are known only at the first round (offline data, agent and rollout functions)."""
    if keywords is None:
        return
    for func in reward_funcs:
        missing = missing_arguments(func, keywords)
        if not missing:
            continue
        columns = sorted(k for k in keywords if k not in RESERVED_COLUMNS and k != "environments")
        standard = difflib.get_close_matches(missing[0], [*RESERVED_COLUMNS, "environments"], n=1, cutoff=0.8)
        source = stand_in_column(missing[0], [c for c in columns if c not in missing])
        if standard:
            fix = f"Did you mean `{standard[0]}`? Rename the parameter."
        else:
            fix = (
                f"Rename a column of the data set to it (dataset.rename_column({source or '<column>'!r}, "
                f"{missing[0]!r})), or give the parameter a default."
            )
        raise InputError(
            f"Reward function '{reward_name(func)}' takes `{'`, `'.join(missing)}`, which the trainer does not pass: "
            f"it passes {', '.join(RESERVED_COLUMNS)} and the data set's columns but `prompt` "
            f"({', '.join(columns) or 'none'}){', and environments' if 'environments' in keywords else ''}. {fix}"
        )


def check_reward_signature(func: Callable) -> None:
    """Refuse a reward function that cannot receive its arguments: they are all passed by keyword
    (`grpo.rewards.runner`), so a positional-only parameter without a default is never filled, and a function with no
    keyword parameter and no `**kwargs` (e.g. only `*args`) receives nothing. A signature that cannot be read (some
    built-in callables) is not checked."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return
    params = signature.parameters.values()
    positional = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional:
        problem = f"so its positional-only parameter(s) {positional} would never be given"
    elif not any(p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params):
        problem = "and it takes none (no named parameter, no **kwargs)"
    else:
        return
    name = reward_name(func)
    raise InputError(
        f"Reward function '{name}{signature}' cannot receive its arguments: reward functions are called with keyword "
        f"arguments only, {problem}. Supported signatures: def {name}(prompts, completions, **kwargs) -> "
        f"list[float | None], or async def the same; the keywords are {', '.join(RESERVED_COLUMNS)} and every other "
        "dataset column (name those you use, **kwargs takes the rest)."
    )
