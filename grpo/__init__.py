"""GRPO: Group Relative Policy Optimization for language models, on top of `transformers.Trainer`."""

from grpo.config import GRPOConfig
from grpo.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
__version__ = "0.1.0"
