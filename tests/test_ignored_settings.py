"""Settings a run would have ignored without a word (issue 50), refused or warned about when the trainer is built:
`scale_rewards` under GDPO, reward weights that are all 0, and a `code_execution` wall time that `reward_timeout`
cuts short. (SAPO's and VESPO's knobs under another loss type: tests/test_config.py.) Rows of the fault matrix in
docs/reliability.md."""

import warnings

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer
from grpo.objective.advantages import mixed_advantages
from grpo.rewards.builtin import code_execution
from tests.helpers.scripted import TINY, len_as_final_step, reward_len

# No such model: a refusal that comes before any weight loads is the error raised, not the missing model's.
NO_MODEL = "/nonexistent/grpo-test-model"
GDPO = dict(aggregation="normalize_then_sum")  # mixed_advantages' keyword


def parity(completions):
    return [float(len(c) % 2) for c in completions]


def build(tmp_path, model, rewards, dataset, **settings):
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**TINY, "max_steps": 1, **settings})
    return GRPOTrainer(model, rewards, args=args, train_dataset=dataset)


# ---- scale_rewards under GDPO ----


@pytest.mark.parametrize("scale_rewards, shown", [("batch", "'batch'"), (False, "'none'")])
def test_scale_rewards_gdpo_ignores_is_refused_before_any_weight_loads(tmp_path, prompt_dataset, scale_rewards, shown):
    # TRL 1.16 reads scale_rewards only in its sum_then_normalize branch; here it trained on, ignored, without a word.
    gdpo = dict(multi_objective_aggregation="normalize_then_sum", scale_rewards=scale_rewards)
    with pytest.raises(ValueError, match=rf"scale_rewards={shown} does nothing under multi_objective_aggregation="):
        build(tmp_path, NO_MODEL, [reward_len, parity], prompt_dataset, **gdpo)
    with pytest.raises(ValueError, match="Leave scale_rewards at 'group', or set multi_objective_aggregation="):
        build(tmp_path, NO_MODEL, [reward_len, parity], prompt_dataset, **gdpo)


def test_scale_rewards_under_gdpo_is_taken_where_process_rewards_read_it(tmp_path, tiny_model_path, prompt_dataset):
    # Process rewards' per-token advantages are scaled by scale_rewards under either aggregation.
    gdpo = dict(multi_objective_aggregation="normalize_then_sum", scale_rewards="none")
    trainer = build(tmp_path, tiny_model_path, [reward_len, len_as_final_step], prompt_dataset, **gdpo)
    assert trainer.args.scale_rewards == "none"


def test_gdpo_outcome_advantages_ignore_scale_rewards_and_process_ones_do_not():
    # What the refusal rests on, on the advantage functions themselves: without process rewards GDPO's advantages
    # are the same for every scale_rewards; with a process reward they differ.
    generator = torch.Generator().manual_seed(0)
    per_func = (torch.rand(8, 2, generator=generator, dtype=torch.float64) * 5, torch.tensor([1.0, 0.5]))
    steps = torch.rand(8, 1, 3, generator=generator, dtype=torch.float64) * 7
    outcome = {
        scale: mixed_advantages(
            torch.zeros(8), torch.zeros(8, 0, 3), torch.zeros(0), 4, scale, **GDPO, per_func=per_func
        )
        for scale in ("group", "batch", "none")
    }
    assert torch.equal(outcome["group"], outcome["batch"]) and torch.equal(outcome["group"], outcome["none"])
    process = {
        scale: mixed_advantages(torch.zeros(8), steps, torch.ones(1), 4, scale, **GDPO, per_func=per_func)
        for scale in ("group", "none")
    }
    assert not torch.allclose(process["group"], process["none"])


# ---- Reward weights that are all 0 ----


@pytest.mark.parametrize("aggregation", ["normalize_then_sum", "sum_then_normalize"])
def test_reward_weights_all_zero_are_refused_before_any_weight_loads(tmp_path, prompt_dataset, aggregation):
    # Every advantage is 0 under either aggregation: the run used to train nothing, exit 0 and warn of nothing.
    settings = dict(multi_objective_aggregation=aggregation, reward_weights=[0.0, 0.0])
    with pytest.raises(ValueError, match=r"All reward_weights are 0 \(reward_len: 0, parity: 0\): .* every advantage"):
        build(tmp_path, NO_MODEL, [reward_len, parity], prompt_dataset, **settings)


def test_one_non_zero_weight_is_enough(tmp_path, tiny_model_path, prompt_dataset):
    settings = dict(multi_objective_aggregation="normalize_then_sum", reward_weights=[0.0, 1.0])
    trainer = build(tmp_path, tiny_model_path, [reward_len, parity], prompt_dataset, **settings)
    assert trainer.rewards.outcome_weights.tolist() == [0.0, 1.0]


# ---- A code_execution wall time that reward_timeout cuts short ----


def timeout_warnings(tmp_path, tiny_model_path, prompt_dataset, wall, reward_timeout):
    reward = code_execution(wall_seconds=wall, isolation="process")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        build(tmp_path, tiny_model_path, [reward], prompt_dataset, reward_timeout=reward_timeout)
    return [str(w.message) for w in caught if "reward_timeout" in str(w.message)]


def test_a_code_execution_wall_time_reward_timeout_cuts_short_warns(tmp_path, tiny_model_path, prompt_dataset):
    # As the python tool's wall time against tool_timeout (issue 53): one row whose code runs to its limit would
    # time out the whole call and fail all its rows, not only its own.
    said = timeout_warnings(tmp_path, tiny_model_path, prompt_dataset, wall=10.0, reward_timeout=5.0)
    assert len(said) == 1, said
    assert "'code_execution' runs each row's code for up to 10.0 s" in said[0]
    assert "reward_timeout=5.0 s ends the whole call first" in said[0] and "wall_seconds below 5.0 s" in said[0]


@pytest.mark.parametrize("reward_timeout", [None, 30.0])
def test_a_reward_timeout_that_leaves_the_wall_time_is_quiet(
    tmp_path, tiny_model_path, prompt_dataset, reward_timeout
):
    assert timeout_warnings(tmp_path, tiny_model_path, prompt_dataset, 10.0, reward_timeout) == []
