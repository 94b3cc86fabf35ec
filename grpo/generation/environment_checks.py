"""The checks on an `environment_factory` and what it makes, each failure one message naming the factory and the fix.

- `make_environment(factory, name, number)` calls the factory for its `number`-th object; a factory that is not
  callable (an object passed where its class was meant) is refused, and an exception of the factory is re-raised
  as an `EnvironmentFactoryError` naming the factory and the object's number, the original chained;
- `check_new_object(environment, made, label)` refuses an object the factory already gave (one shared object for
  every call would let the episodes of a round play on one state);
- `checked_observation(environment, value)` refuses what `reset` returned unless it is None or a string (TRL's
  contract: a string is appended to the prompt);
- `check_environment_rows(toolbox, train_dataset, eval_dataset)`, with a dict of factories, checks when the trainer
  is built that every row has an `environment` column naming one of them (a stream is not read ahead).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from grpo.data import InputError, is_stream

PROTOCOL = "docs/agents.md#environments"


class EnvironmentFactoryError(RuntimeError):
    """An environment factory raised, or it or its objects break the protocol; the message names the factory (and the
    object) and the fix. A factory's own exception is the cause."""


def factory_label(factory: object, name: str | None) -> str:
    """How messages name a factory: `environment_factory` (or `environment_factory['name']` in a dict) and what it is.

    >>> factory_label(dict, "maze")
    "environment_factory['maze'] (dict)"
    """
    key = "environment_factory" if name is None else f"environment_factory[{name!r}]"
    what = getattr(factory, "__qualname__", None) or f"a {type(factory).__name__}"
    return f"{key} ({what})"


def ordinal(number: int) -> str:
    """`number` as an English ordinal.

    >>> [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21)]
    ['1st', '2nd', '3rd', '4th', '11th', '12th', '13th', '21st']
    """
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def check_factory(factory: object, name: str | None) -> None:
    """Refuse a factory that cannot be called: most often an environment object passed where its class was meant."""
    if callable(factory):
        return
    key = "environment_factory" if name is None else f"environment_factory[{name!r}]"
    kind = type(factory).__name__
    fix = f"pass {kind}" if callable(getattr(factory, "reset", None)) else f"pass a factory of {kind} objects"
    raise EnvironmentFactoryError(
        f"{key} must be a class or a zero-argument callable returning a new environment; got an instance of {kind}: "
        f"{fix} (each episode running at once needs an object of its own, {PROTOCOL})."
    )


def make_environment(factory: Callable[[], object], name: str | None, number: int) -> object:
    """The factory's `number`-th object (counted from 1 over its pool's life); its exception, re-raised naming it."""
    check_factory(factory, name)
    try:
        return factory()
    except Exception as error:
        raise EnvironmentFactoryError(
            f"{factory_label(factory, name)} raised {type(error).__name__} making its {ordinal(number)} object: "
            f"{error}. The objects it made before are closed with the run. A factory is called with no arguments "
            "whenever a round needs one more object than its pool holds: fix the factory (or what it connects to)."
        ) from error


def check_new_object(environment: object, made: Iterable[object], label: str) -> None:
    """Refuse `environment` when it is one of `made` (the objects the factory gave before, not yet closed)."""
    if any(environment is other for other in made):
        raise EnvironmentFactoryError(
            f"{label} returned an object already in use ({type(environment).__name__} at "
            f"{id(environment):#x}): the episodes that run at once would share one state. Return a new object from "
            "each call (pass the class itself, or `lambda: MyEnv(...)`), not one made beforehand."
        )


def checked_observation(environment: object, value: Any) -> str | None:
    """`reset`'s return value when it keeps the protocol (None, or a string appended to the prompt); else refused."""
    if value is None or isinstance(value, str):
        return value
    kind = type(environment).__name__
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    hint = (
        " To start an episode from a conversation, put its messages in the row's `prompt` column instead."
        if isinstance(value, list | tuple)
        else f" Return str(...) of it, e.g. {str(value)[:40]!r}."
    )
    raise EnvironmentFactoryError(
        f"{kind}.reset returned {shown} (type {type(value).__name__}), but the reset of environment_factory's objects "
        f"must return None or a string, which is appended to the prompt's last message ({PROTOCOL}).{hint}"
    )


def unknown_environment(value: object, names: Iterable[str], where: str) -> str:
    """The message for a row whose `environment` value `value` is none of `names`, with the closest name if any."""
    names = sorted(map(str, names))
    close = difflib.get_close_matches(str(value), names, n=1, cutoff=0.6)
    guess = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"{where} has environment={value!r}, which is not one of the names given to environment_factory "
        f"({names}).{guess} Fix the row's `environment` column, or add that name to environment_factory."
    )


def check_environment_rows(toolbox, train_dataset, eval_dataset) -> None:
    """With a dict of factories (`toolbox.routed`), every row of the training and evaluation sets (each set of a dict
    of them) has an `environment` column naming one of the factories. Streams are not read ahead (the first round
    that meets a bad row says so)."""
    if toolbox is None or not toolbox.routed:
        return
    names = set(toolbox.factories)
    datasets = {"train_dataset": train_dataset}
    if isinstance(eval_dataset, Mapping):
        datasets.update({f"eval_dataset[{key!r}]": data for key, data in eval_dataset.items()})
    else:
        datasets["eval_dataset"] = eval_dataset
    for label, dataset in datasets.items():
        if dataset is None or is_stream(dataset) or not len(dataset):
            continue
        values = environment_column(dataset, label, names)
        for row, value in enumerate(values):
            if value not in names:
                raise InputError(unknown_environment(value, names, f"{label} row {row}"))


def environment_column(dataset, label: str, names: set[str]) -> list:
    """The `environment` value of each row of a sized data set; a missing column is refused naming the fix."""
    columns = getattr(dataset, "column_names", None)
    if columns is not None:
        present = "environment" in columns
    else:
        present = all(isinstance(row, Mapping) and "environment" in row for row in dataset)
    if not present:
        raise InputError(
            f"environment_factory is a dict ({sorted(names)}), so each row picks its environment by name in an "
            f"`environment` column, but {label} has none. Add that column (dataset.add_column('environment', [...])), "
            "or pass a single factory."
        )
    if columns is not None:
        return list(dataset.select_columns(["environment"]).with_format(None)["environment"])
    return [row["environment"] for row in dataset]
