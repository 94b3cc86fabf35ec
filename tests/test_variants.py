"""The loss and advantage variants inside the trainer: GSPO, clip-higher and two-sided clipping, top-entropy tokens,
process rewards and dynamic sampling. The math itself is proven in tests/test_loss.py; these tests check the wiring
and the batch-layout properties docs/method.md requires."""

import math

import pytest

from grpo import GRPOConfig, GRPOTrainer, StepRewards, process_reward
from tests.compare import assert_same_update
from tests.scripted import (
    TINY,
    capture_batches,
    half_flat_dataset,
    half_flat_reward,
    len_as_final_step,
    reward_len,
    sgd_step_update,
)


def test_variants_train_and_log(tmp_path, tiny_model_path, prompt_dataset):
    # GSPO ratio, clip-higher, two-sided clipping and top-entropy tokens together, with replayed batches so that
    # the ratio moves away from 1.
    args = GRPOConfig(
        output_dir=str(tmp_path),
        **{**TINY, "max_steps": 2, "num_iterations": 2, "learning_rate": 1e-2, "beta": 0.04},
        importance_sampling_level="sequence",
        epsilon_high=0.28,
        delta=2.0,
        top_entropy_quantile=0.5,
    )
    trainer = GRPOTrainer(tiny_model_path, reward_len, args=args, train_dataset=prompt_dataset)
    trainer.train()
    logs = trainer.state.log_history[0]
    for key in ("loss", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert math.isfinite(logs[key]), key


def test_process_reward_per_token_advantages_reach_the_loss(tmp_path, tiny_model_path, prompt_dataset):
    # A process function and an outcome function with weights: advantages become (B, T), trimmed with the
    # completions, and zero after each row's last step.
    @process_reward
    def first_and_last(completions, completion_ids):
        return [
            StepRewards([float(len(ids) % 3), 1.0], token_ends=[0, len(ids) - 1])
            if len(ids) > 1
            else StepRewards([0.0], token_ends=[0])
            for ids in completion_ids
        ]

    args = GRPOConfig(output_dir=str(tmp_path), **{**TINY, "max_steps": 2}, reward_weights=[1.0, 0.5])
    trainer = GRPOTrainer(tiny_model_path, [first_and_last, reward_len], args=args, train_dataset=prompt_dataset)
    captured = capture_batches(trainer)
    trainer.train()
    assert trainer.reward_names == ["reward_len", "first_and_last"]  # outcome functions first
    for batch in captured:
        assert batch["advantages"].shape == batch["completion_ids"].shape
        assert (batch["advantages"][batch["completion_mask"] == 0] == 0).all()
    logs = trainer.state.log_history[0]
    assert "rewards/first_and_last/mean" in logs and "rewards/reward_len/mean" in logs


@pytest.mark.parametrize("loss_type", ["grpo", pytest.param("dapo", marks=pytest.mark.slow)])
def test_outcome_reward_as_a_single_final_step_gives_the_same_update(tmp_path, loss_type):
    outcome, _ = sgd_step_update(tmp_path / "outcome", loss_type=loss_type, gradient_accumulation_steps=2)
    process, trainer = sgd_step_update(
        tmp_path / "process", reward_funcs=len_as_final_step, loss_type=loss_type, gradient_accumulation_steps=2
    )
    assert trainer.rewards.process_funcs and not trainer.reward_funcs
    assert sum(d.abs().sum() for d in outcome.values()) > 0
    assert_same_update(process, outcome, dict(trainer.model.named_parameters()), what=loss_type)


def test_dynamic_sampling_keeps_the_batch_full_of_groups_with_spread(tmp_path):
    # 2 prompts per generation round (8 rows, G = 4), half of all prompts flat: the first round of every step holds
    # one flat group (shuffle off, consecutive prompts), which must be replaced from extra rounds.
    update, trainer = sgd_step_update(
        tmp_path,
        reward_funcs=half_flat_reward,
        dataset=half_flat_dataset(),
        gradient_accumulation_steps=2,
        dynamic_sampling=True,
        max_steps=3,
    )
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["dynamic_sampling/dropped_groups"] >= 1 for h in logs)
    assert all(h["dynamic_sampling/zero_std_groups_kept"] == 0 for h in logs)
    assert sum(d.abs().sum() for d in update.values()) > 0


def test_dynamic_sampling_no_zero_variance_group_reaches_the_loss(tmp_path, tokenizer):
    from grpo.testing import tiny_model
    from tests.scripted import ScriptedGeneration

    args = GRPOConfig(
        output_dir=str(tmp_path),
        **{**TINY, "max_steps": 3, "gradient_accumulation_steps": 2, "shuffle_dataset": False},
        dynamic_sampling=True,
    )
    trainer = GRPOTrainer(
        tiny_model(tokenizer),
        half_flat_reward,
        args=args,
        train_dataset=half_flat_dataset(),
        processing_class=tokenizer,
    )
    trainer.generation = ScriptedGeneration(args.num_generations, args.max_completion_length)
    seen_flat = []

    def spy(completions, flat):
        seen_flat.extend(flat)
        return half_flat_reward(completions, flat)

    trainer.rewards.outcome_funcs = [spy]
    captured = capture_batches(trainer)
    trainer.train()
    assert True in seen_flat  # flat groups were generated ...
    assert len(captured) == 6
    for batch in captured:
        assert batch["prompt_ids"].shape[0] == args.per_device_train_batch_size  # ... the batch size is kept ...
        groups = batch["advantages"].view(-1, args.num_generations)
        assert (groups != 0).any(dim=1).all()  # ... and none reaches the loss


def test_dynamic_sampling_cap_keeps_zero_variance_groups_when_nothing_else_comes(tmp_path, tokenizer):
    def constant(completions):
        return [1.0] * len(completions)

    update, trainer = sgd_step_update(
        tmp_path,
        reward_funcs=constant,
        gradient_accumulation_steps=2,
        dynamic_sampling=True,
        max_dynamic_sampling_rounds=2,
    )
    logs = trainer.state.log_history[0]
    assert logs["dynamic_sampling/extra_rounds"] == 2
    assert logs["dynamic_sampling/zero_std_groups_kept"] == 2  # both groups of the batch
    assert logs["dynamic_sampling/dropped_groups"] == 4  # the two extra rounds' groups
    assert all((d == 0).all() for d in update.values())  # zero advantages everywhere: no update


# ---- slow: the same update across batch layouts, for every variant ----


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize(
    "variant",
    [
        {"mask_truncated_completions": True},
        {"importance_sampling_level": "sequence", "beta": 0.04},
        {"num_iterations": 2, "beta": 0.04},
        {"reward_funcs": len_as_final_step, "beta": 0.04},
    ],
    ids=["mask-truncated", "gspo", "num-iterations", "process-reward"],
)
def test_variants_give_the_same_update_for_any_accumulation(tmp_path, loss_type, variant):
    # per_device x accumulation = 8 rows in every layout. (top_entropy_quantile is not layout-invariant by design:
    # its threshold is taken per micro-step; tests/test_distributed.py checks it across processes.)
    reference, trainer = sgd_step_update(
        tmp_path / "ref", loss_type=loss_type, per_device_train_batch_size=8, gradient_accumulation_steps=1, **variant
    )
    params = dict(trainer.model.named_parameters())
    assert sum(d.abs().sum() for d in reference.values()) > 0
    for per_device, accumulation in [(4, 2), (2, 4)]:
        update, _ = sgd_step_update(
            tmp_path / f"{per_device}",
            loss_type=loss_type,
            per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accumulation,
            **variant,
        )
        assert_same_update(update, reference, params, what=f"{loss_type} {per_device}x{accumulation}")
