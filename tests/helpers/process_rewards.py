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
