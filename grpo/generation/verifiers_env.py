"""`verifiers` environments trained as they are: `GRPOTrainer(model, args=args, **from_verifiers(env))`
(docs/agents.md "verifiers environments").

A `verifiers` environment (`vf.SingleTurnEnv`, `vf.MultiTurnEnv`, `vf.ToolEnv`, ..., from the classic API of the
`verifiers` package, 0.1 to 0.3; 0.4 removed it) runs its own rollout loop against an OpenAI-style client, so it
trains through the trainer's endpoint (agent_function.py) with no change to its code. `from_verifiers` returns
  1. `agent_func`: for each row, `env.rollout(row, client, model, env.sampling_args)` with a verifiers chat-completions
     client on the episode's endpoint, then the rubric's `score_rollout` on the state; it returns the rollout's
     `vf_reward` (the rubric's weighted total), `vf_metrics` (each rubric function's score) and `vf_state` (the
     verifiers `State` itself) for the reward functions. A rollout whose state holds an error is a failed episode;
  2. `reward_funcs`: the rubric's total as one reward named after the environment, or with `per_function=True` one
     reward per rubric function, named as the rubric names it (`rewards/<name>/mean`); their weights are then
     `rubric_weights(env)`, for `GRPOConfig(reward_weights=...)`;
  3. `train_dataset` (and `eval_dataset`): the environment's own data set, formatted by verifiers (its `prompt`
     column of chat messages, `answer`, `info`, `example_id`, `task`), when it has one.

Rubrics with group-level reward functions are refused: an episode here is scored alone, as it ends.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from grpo.data import InputError

STATE_COLUMNS = ("vf_reward", "vf_metrics", "vf_state")


def import_verifiers():
    """The `verifiers` module, or an InputError saying how to install it."""
    try:
        import verifiers
    except ImportError as error:
        raise InputError(
            f"verifiers environments need the `verifiers` package ({error}); install it: pip install 'verifiers<0.4'."
        ) from error
    if not hasattr(verifiers, "Environment"):
        raise InputError(
            f"verifiers {getattr(verifiers, '__version__', '?')} has no classic environments (vf.Environment): "
            "verifiers 0.4 replaced them with verifiers.v1. Install verifiers<0.4."
        )
    return verifiers


def check_environment(env) -> None:
    """Refuse what cannot train here: an object that is no verifiers environment, or a rubric with group rewards."""
    vf = import_verifiers()
    if not isinstance(env, vf.Environment):
        raise InputError(
            f"from_verifiers needs a verifiers environment (a vf.Environment such as vf.SingleTurnEnv), got a "
            f"{type(env).__name__}. Load one with vf.load_environment(name) or its module's load_environment()."
        )
    if env.rubric.has_group_rewards:
        raise InputError(
            f"The rubric of {type(env).__name__} has group-level reward functions, which score the G rollouts of a "
            "prompt together; the trainer scores each episode as it ends. Use per-rollout reward functions."
        )


def rubric_names(env) -> list[str]:
    """The rubric's function names, in its order (the names `vf_metrics` holds)."""
    return list(env.rubric._get_reward_func_names())


def rubric_weights(env) -> list[float]:
    """The rubric's weights, in the order of `from_verifiers(env, per_function=True)`'s reward functions."""
    return [float(w) for w in env.rubric._get_reward_weights()]


def verifiers_agent(env) -> Callable:
    """The `agent_func` that runs `env`'s rollout for a row against the episode's endpoint (module docstring, 1)."""
    vf = import_verifiers()

    async def agent_func(row, endpoint):
        openai_client = endpoint.async_client()
        try:
            client = vf.OpenAIChatCompletionsClient(openai_client)
            state = await env.rollout(row, client, endpoint.model, dict(env.sampling_args))
            if state.get("error") is not None:
                raise RuntimeError(f"the verifiers rollout failed: {error_chain(state['error'])}")
            await env.rubric.score_rollout(state)
            await env.rubric.cleanup(state)
        finally:
            await openai_client.close()
        return {"vf_reward": float(state["reward"]), "vf_metrics": dict(state["metrics"]), "vf_state": state}

    agent_func.__name__ = f"verifiers_{_env_name(env)}"
    return agent_func


def total_reward(env) -> Callable:
    """One reward: the rubric's weighted total, named after the environment."""

    def reward(prompts, completions, vf_reward, **kwargs):
        return list(vf_reward)

    reward.__name__ = _env_name(env)
    return reward


def function_reward(name: str) -> Callable:
    """The score of the rubric function `name`, as a reward function of that name."""

    def reward(prompts, completions, vf_metrics, **kwargs):
        return [None if metrics is None else float(metrics[name]) for metrics in vf_metrics]

    reward.__name__ = name
    return reward


def from_verifiers(env, per_function: bool = False) -> dict:
    """What `GRPOTrainer` takes to train the verifiers environment `env`: `agent_func`, `reward_funcs` and, when the
    environment has them, `train_dataset` and `eval_dataset` (module docstring). With `per_function=True` there is
    one reward per rubric function: pass `GRPOConfig(reward_weights=rubric_weights(env))` to weigh them as the rubric
    does (its metrics have weight 0).

        trainer = GRPOTrainer(model, args=GRPOConfig(...), **from_verifiers(vf.load_environment("my-env")))
    """
    check_environment(env)
    rewards = [function_reward(n) for n in rubric_names(env)] if per_function else [total_reward(env)]
    out = {"agent_func": verifiers_agent(env), "reward_funcs": rewards}
    if getattr(env, "dataset_source", None) is not None or getattr(env, "dataset", None) is not None:
        out["train_dataset"] = env.get_dataset()
    if getattr(env, "eval_dataset_source", None) is not None or getattr(env, "eval_dataset", None) is not None:
        out["eval_dataset"] = env.get_eval_dataset()
    return out


def load_verifiers(spec: str, **env_args):
    """The environment `spec` names: "module:attr" (a `load_environment`-style function, called with `env_args`, or an
    environment object), or an installed environment's id for `vf.load_environment`."""
    vf = import_verifiers()
    if ":" not in spec:
        return vf.load_environment(spec, **env_args)
    module_name, _, attr = spec.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as error:
        raise InputError(f"verifiers: {spec!r} cannot be imported ({error}). Name it as module:function.") from error
    env = target(**env_args) if callable(target) and not isinstance(target, vf.Environment) else target
    check_environment(env)
    return env


def error_chain(error: BaseException) -> str:
    """An error and its causes, outermost first (verifiers wraps the client's error in its own)."""
    parts = []
    while error is not None and len(parts) < 5:
        parts.append(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
        error = error.__cause__ or error.__context__
    return " <- ".join(parts)


def _env_name(env) -> str:
    name = (getattr(env, "env_id", "") or type(env).__name__).replace("-", "_")
    return name if name.isidentifier() else "verifiers"
