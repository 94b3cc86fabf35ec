"""Reward functions for the worker-process tests. They live in a module of their own, importing nothing heavy, because
a spawned worker process imports the module of every function it runs."""

import os
import time


def worker_pid(completions):
    return [float(os.getpid())] * len(completions)


def sleeps_on_long_completions(completions):
    if any(len(c) > 2 for c in completions):
        time.sleep(60)
    return [1.0] * len(completions)


def fails_on_row_1(prompts, completions):
    if "p1" in prompts:
        raise KeyError("p1")
    return [1.0] * len(completions)


def exits_on_row_1(prompts, completions):
    if "p1" in prompts:
        raise SystemExit(0)
    return [1.0] * len(completions)


def interrupted_on_row_1(prompts, completions):
    if "p1" in prompts:
        raise KeyboardInterrupt
    return [1.0] * len(completions)


def edits_its_arguments(prompts, completions, answer):
    """Edits every argument in place, at every level: a careless (or hostile) reward function."""
    for rows in (prompts, completions, answer):
        for row in rows:
            row.append({"role": "assistant", "content": "hacked"}) if isinstance(row, list) else row.update(x=1)
    for message in completions[0]:
        message["content"] = "hacked"
    completions.append([])
    prompts.clear()
    return [0.0] * len(answer)


def untouched(prompts, completions, answer):
    """1.0 for a row that reached this function as the test built it, 0.0 for one another function edited."""
    same_size = len(prompts) == len(completions) == len(answer)
    return [
        float(same_size and len(c) == 1 and c[0]["content"] != "hacked" and len(p) == 1 and list(a) == ["value"])
        for p, c, a in zip(prompts, completions, answer)
    ] + [0.0] * (len(answer) - min(len(prompts), len(completions), len(answer)))
