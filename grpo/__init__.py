"""GRPO: Group Relative Policy Optimization for language models, on top of `transformers.Trainer`."""

from grpo.config import GRPOConfig
from grpo.process import StepRewards, process_reward
from grpo.reference import ReferenceResetCallback
from grpo.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer", "ReferenceResetCallback", "StepRewards", "process_reward"]
__version__ = "0.1.0"
