"""GRPO: Group Relative Policy Optimization for language models, on top of `transformers.Trainer`."""

from grpo.config import GRPOConfig
from grpo.objective.reference import ReferenceResetCallback
from grpo.rewards.process import StepRewards, process_reward
from grpo.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "ReferenceResetCallback", "StepRewards", "process_reward"]
__version__ = "0.1.0"
