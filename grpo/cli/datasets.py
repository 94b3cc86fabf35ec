"""Prompt data sets for recipes: local files, hub data sets and offline reasoning-gym tasks, shaped into a `prompt`
column (plus whatever columns the rewards read).

    train, held_out = load_prompt_datasets(DatasetSection(reasoning_gym="basic_arithmetic", size=500, eval_size=50))

Shaping happens in this order: rename columns (`columns`, `prompt_column`), format `prompt_template` with the row's
columns, then wrap as chat messages (`chat`, `system_prompt`).
"""

from __future__ import annotations

from pathlib import Path

from grpo.cli.recipe import LOCAL_SUFFIXES, DatasetSection, RecipeError


def _load_source(section: DatasetSection, split: str, size: int | None, seed: int):
    import datasets

    # For the command line's process only (grpo check, grpo train): loading and shaping a few hundred rows is
    # quick, and datasets' "Map:" and "Generating split" bars came above the plan, the run's bars and one-line errors.
    datasets.disable_progress_bars()

    if section.reasoning_gym is not None:
        from grpo.rewards import reasoning_gym_dataset

        try:
            return reasoning_gym_dataset(section.reasoning_gym, size=size or 1000, seed=seed, **section.task_config)
        except (KeyError, ValueError) as e:
            raise RecipeError(
                f"reasoning-gym could not make task '{section.reasoning_gym}' with {section.task_config}: {e}"
            ) from e
    path = Path(section.path)
    suffix = "".join(path.suffixes[-1:]).lower()
    if suffix in LOCAL_SUFFIXES:
        if not path.is_file():
            raise RecipeError(
                f"Data file {section.path!r} not found (relative paths start from the working directory)."
            )
        data = datasets.load_dataset(LOCAL_SUFFIXES[suffix], data_files={split: str(path)}, split=split)
    else:
        # A hub data set (or a local folder in a format `load_dataset` understands).
        data = datasets.load_dataset(section.path, section.name, split=split)
    return data.select(range(min(size, len(data)))) if size is not None else data


def _shape(data, section: DatasetSection):
    mapping = dict(section.columns)
    if section.prompt_column != "prompt":
        mapping.setdefault(section.prompt_column, "prompt")
    missing = [c for c in mapping if c not in data.column_names]
    if missing:
        raise RecipeError(
            f"Column(s) {missing} named in the dataset section's column mapping are not in the data, whose columns "
            f"are {data.column_names}."
        )
    if "prompt" in mapping.values() and "prompt" in data.column_names and mapping.get("prompt") != "prompt":
        data = data.rename_column("prompt", "original_prompt")
    for source, target in mapping.items():
        if source != target:
            data = data.rename_column(source, target)
    if "prompt" not in data.column_names:
        raise RecipeError(
            f"The data has no 'prompt' column (columns: {data.column_names}). Name the prompt column with "
            "`dataset.prompt_column: <column>` or rename it with `dataset.columns: {<column>: prompt}`."
        )
    template, system = section.prompt_template, section.system_prompt
    chat = section.chat or section.system_prompt or section.examples
    examples = _example_messages(section.examples)

    def shape(row):
        prompt = row["prompt"]
        if template is not None:
            if not isinstance(prompt, str):
                raise RecipeError("prompt_template applies to string prompts; this data's prompts are chat messages.")
            try:
                prompt = template.format(**row)
            except KeyError as e:
                raise RecipeError(f"prompt_template names column {e}, which the data does not have.") from e
        if chat and isinstance(prompt, str):
            prompt = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": prompt}
            ]
        if examples:  # after a leading system message, before the conversation
            head = 1 if prompt and prompt[0]["role"] == "system" else 0
            prompt = prompt[:head] + examples + prompt[head:]
        return {"prompt": prompt}

    if template is not None or chat:
        data = data.map(shape)
    return data


def _example_messages(examples: list) -> list[dict[str, str]]:
    """The `dataset.examples` messages, checked: each a {role, content} mapping of a user, assistant or tool turn."""
    checked = []
    for index, message in enumerate(examples):
        where = f"dataset.examples[{index}]"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise RecipeError(f"{where} must be a mapping with exactly the keys role and content, got {message!r}.")
        if message["role"] not in ("user", "assistant", "tool"):
            raise RecipeError(
                f"{where}.role is {message['role']!r}; worked examples are user, assistant or tool turns (the system "
                "prompt is `dataset.system_prompt`)."
            )
        if not isinstance(message["content"], str):
            raise RecipeError(f"{where}.content must be a string, got {message['content']!r}. Quote it in the YAML.")
        checked.append({"role": message["role"], "content": message["content"]})
    if checked and checked[-1]["role"] != "assistant":
        raise RecipeError(
            f"dataset.examples ends with a {checked[-1]['role']} turn, which the row's question would follow "
            "unanswered. End the examples with the assistant's turn."
        )
    return checked


def load_prompt_datasets(section: DatasetSection):
    """(train, held-out or None) for a recipe's dataset section."""
    if section.eval_split is not None and section.eval_size:
        raise RecipeError("Give the held-out prompts as `eval_split` or `eval_size`, not both.")
    if section.reasoning_gym is not None and section.eval_split is not None:
        raise RecipeError("reasoning-gym tasks have no splits; use `eval_size` for held-out prompts.")
    size = section.size
    if section.eval_size and size is not None:
        size += section.eval_size
    data = _load_source(section, section.split, size, section.seed)
    held_out = None
    if section.eval_size:
        if section.eval_size >= len(data):
            raise RecipeError(f"eval_size={section.eval_size} leaves no training rows out of {len(data)}.")
        # Generated rows are already random; a file is shuffled first so the held-out rows are not its tail.
        if section.reasoning_gym is None:
            data = data.shuffle(seed=section.seed)
        held_out = data.select(range(len(data) - section.eval_size, len(data)))
        data = data.select(range(len(data) - section.eval_size))
    elif section.eval_split is not None:
        held_out = _load_source(section, section.eval_split, None, section.seed)
    return _shape(data, section), (_shape(held_out, section) if held_out is not None else None)
