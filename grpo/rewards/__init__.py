"""The rewards stage: completions in, one reward per row and function out (docs/rewards.md).

    from grpo.rewards import accuracy, format_reward, soft_overlong_punishment, code_execution, reasoning_gym

The modules, by job:
  - builtin.py: the built-in reward functions and their helpers, re-exported here;
  - names.py: what the user passed, checked and resolved (`BUILTIN_REWARDS`, reward strings, signatures, weights);
  - runner.py: calling the functions (sync, async, threads, worker processes, timeouts, retries, `reward_errors`);
  - scoring.py: `RewardSet` and `score_rewards` (every function and reward model on a batch), `combine_rewards`;
  - process.py: process (step) rewards, `StepRewards` and `@process_reward`;
  - turns.py: turn rewards of multi-turn episodes (`@turn_reward`, environments' `get_turn_rewards`);
  - environments.py: an environment's `get_reward` as a reward function;
  - stored.py: offline training's stored reward as a reward function (`StoredReward`, `offline_rewards`);
  - sandbox/: running untrusted code against test cases (the verdict computed outside it) or tests, imported only
    when `code_execution` is built;
  - code_tool.py: `python_tool`, a tool for multi-turn episodes that runs the model's code in that sandbox.

Importing this package loads the built-ins and the tool's factory only: no runner, no sandbox (so `GRPOConfig`,
which imports the two tuples below, stays light).
"""

from grpo.data import completion_text
from grpo.rewards.builtin import (
    THINK_ANSWER,
    accuracy,
    answers_match,
    code_execution,
    extract_answer,
    extract_code,
    format_reward,
    last_boxed,
    reasoning_gym,
    reasoning_gym_dataset,
    soft_overlong_punishment,
)
from grpo.rewards.code_tool import python_tool

# How reward functions may be called (`GRPOConfig.reward_errors`, `reward_worker_type`; grpo/rewards/runner.py).
REWARD_ERRORS = ("raise", "skip")
REWARD_WORKER_TYPES = ("thread", "process")

__all__ = [
    "REWARD_ERRORS",
    "REWARD_WORKER_TYPES",
    "THINK_ANSWER",
    "accuracy",
    "answers_match",
    "code_execution",
    "completion_text",
    "extract_answer",
    "extract_code",
    "format_reward",
    "last_boxed",
    "python_tool",
    "reasoning_gym",
    "reasoning_gym_dataset",
    "soft_overlong_punishment",
]
