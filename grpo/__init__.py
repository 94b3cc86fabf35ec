"""GRPO: Group Relative Policy Optimization for language models, on top of `transformers.Trainer`.

Every public name loads its module on first use: `import grpo` (and `grpo --help`, `grpo --version`) loads no torch
or transformers, and building a config (a recipe check, `grpo train --help`) loads no trainer, generation backend or
reward runner.
"""

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what type checkers and the API docs read; at run time, `__getattr__` below
    from grpo.config import GRPOConfig
    from grpo.generation.rollout_function import generate_rollout_completions
    from grpo.objective.reference import ReferenceResetCallback
    from grpo.rewards.process import StepRewards, process_reward
    from grpo.rewards.turns import turn_reward
    from grpo.training.trainer import GRPOTrainer

# public name -> the module that defines it, imported when the name is first read
_LAZY = {
    "GRPOConfig": "grpo.config",
    "GRPOTrainer": "grpo.training.trainer",
    "ReferenceResetCallback": "grpo.objective.reference",
    "StepRewards": "grpo.rewards.process",
    "generate_rollout_completions": "grpo.generation.rollout_function",
    "process_reward": "grpo.rewards.process",
    "turn_reward": "grpo.rewards.turns",
}

__all__ = [
    "GRPOConfig",
    "GRPOTrainer",
    "ReferenceResetCallback",
    "StepRewards",
    "generate_rollout_completions",
    "process_reward",
    "turn_reward",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value  # read once: later reads do not come here
        return value
    raise AttributeError(f"module 'grpo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
