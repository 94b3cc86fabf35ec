"""The loss and advantage variants inside the trainer: GSPO, clip-higher and two-sided clipping, top-entropy tokens,
process rewards and dynamic sampling. The math itself is proven in tests/test_loss.py; these tests check that each
switch reaches it and changes what it should (the loss the trainer computes equals the naive objective with that
variant's knobs, and not the default's; the advantages are the naive mixed ones; dynamic sampling trains exactly the
groups it keeps), and the batch-layout properties docs/method.md requires."""

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer, StepRewards, process_reward
from grpo.testing import tiny_model, tiny_tokenizer
from tests.helpers.compare import assert_same_update
from tests.helpers.naive import naive_decoupled_advantages, naive_mixed_advantages, naive_policy_loss
from tests.helpers.scripted import (
    TINY,
    ScriptedGeneration,
    capture_batches,
    half_flat_dataset,
    half_flat_reward,
    len_as_final_step,
    reward_len,
    sgd_step_update,
    use_sampler,
)

# ---- What each loss variant changes: the loss ----

# Each variant as GRPOConfig settings and as the knobs of the naive objective (tests/helpers/naive.py) they mean;
# a knob left out keeps its default: a token-level ratio, epsilon 0.2 on both sides, no delta cap, every token trained.
DEFAULT_KNOBS = dict(level="token", eps_high=0.2, delta=None, top_entropy_quantile=1.0, off_policy_threshold=None)
VARIANTS = {
    "gspo": (dict(importance_sampling_level="sequence"), dict(level="sequence")),
    "clip-higher": (dict(epsilon_high=0.28), dict(eps_high=0.28)),
    "two-sided": (dict(delta=1.5), dict(delta=1.5)),
    "top-entropy": (dict(top_entropy_quantile=0.5), dict(top_entropy_quantile=0.5)),
    # pi_old is the behaviour policy here (no sampler log-probs): rows whose mean log(pi_old / pi_theta) is above 0
    # and whose advantage is negative lose their policy term.
    "off-policy-mask": (dict(off_policy_mask_threshold=0.0), dict(off_policy_threshold=0.0)),
    "together": (
        dict(importance_sampling_level="sequence", epsilon_high=0.28, delta=2.0, top_entropy_quantile=0.5),
        dict(level="sequence", eps_high=0.28, delta=2.0, top_entropy_quantile=0.5),
    ),
}
BETA = 0.04


def log_ratios(rows, columns):
    """log(pi_theta / pi_old) of each token: ratios from 0.55 to 4.5, a spread in every row, so that clipping on
    either side, the delta cap and the sequence-level ratio all change the loss (as a stale sampler or stored
    completions would)."""
    return torch.tensor([[-0.6 + 0.3 * ((t + 2 * i) % 8) for t in range(columns)] for i in range(rows)])


def loss_taken(output_dir, **config):
    """(record, trainer) of one optimizer step on one scripted group whose pi_old log-probs are the policy's minus
    `log_ratios`. The record holds the tensors the loss took, with the log-probs and entropies from a forward pass of
    our own at the same weights, and the loss the trainer computed."""
    tokenizer = tiny_tokenizer()
    args = GRPOConfig(
        output_dir=str(output_dir), **{**TINY, "max_steps": 1, "beta": BETA, "loss_type": "dapo", **config}
    )
    dataset = Dataset.from_dict({"prompt": ["Question 0: count to three."]})
    trainer = GRPOTrainer(
        tiny_model(tokenizer), reward_len, args=args, train_dataset=dataset, processing_class=tokenizer
    )
    use_sampler(trainer, ScriptedGeneration(args.num_generations, args.max_completion_length))
    records, compute_loss = [], trainer.compute_loss

    def record(model, inputs, **kwargs):
        with torch.no_grad():
            logps, entropy = trainer.logprobs(model, inputs, with_entropy=True)
        inputs.old_logps = logps - log_ratios(*logps.shape)  # as stored behaviour log-probs are given
        loss = compute_loss(model, inputs, **kwargs)
        tensors = dict(logps=logps, entropy=entropy, old=inputs.old_logps, ref=inputs.ref_logps)
        records.append({**tensors, "advantages": inputs.advantages, "mask": inputs.loss_mask.bool()})
        records[-1]["loss"] = loss.item()
        return loss

    trainer.compute_loss = record
    trainer.train()
    (taken,) = records
    return taken, trainer


def naive_loss(record, level, eps_high, delta, top_entropy_quantile, off_policy_threshold):
    """The dapo loss of the recorded micro-batch built token by token in float64 with these knobs."""
    mask, entropy = record["mask"], record["entropy"]
    policy_mask = None
    if top_entropy_quantile < 1:  # the top fraction of the loss tokens by entropy (one micro-batch, one process)
        policy_mask = entropy >= torch.quantile(entropy[mask], 1 - top_entropy_quantile)
    logps, old, ref, advantages = (record[k].double() for k in ("logps", "old", "ref", "advantages"))
    knobs = dict(
        level=level,
        delta=delta,
        policy_mask=policy_mask,
        bias_correction_kl=True,
        off_policy_threshold=off_policy_threshold,
    )
    return naive_policy_loss(logps, old, ref, advantages, mask, "dapo", BETA, 0.2, eps_high, **knobs).item()


@pytest.mark.parametrize("variant", VARIANTS.values(), ids=VARIANTS.keys())
def test_each_variant_gives_the_loss_of_the_naive_objective_with_its_knobs(tmp_path, variant):
    config, knobs = variant
    record, trainer = loss_taken(tmp_path, **config)
    want = naive_loss(record, **{**DEFAULT_KNOBS, **knobs})
    # The loss averages at most 32 token terms, each at most max|A| x max ratio in size (the KL term is 0: the
    # reference is the policy at step 1); each float32 operation rounds by eps, and 32 eps bounds the sum's error.
    ratio = torch.exp(log_ratios(*record["logps"].shape))
    scale = record["advantages"].abs().max().item() * ratio[record["mask"]].max().item()
    bound = 32 * torch.finfo(torch.float32).eps * scale
    assert record["loss"] == pytest.approx(want, abs=bound)
    # The default knobs give another loss on the same tensors, far outside that bound: the check above fails when
    # the setting is ignored.
    assert abs(naive_loss(record, **DEFAULT_KNOBS) - want) > 100 * bound
    logs = trainer.state.log_history[0]
    for key in ("loss", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert key in logs, key


# Each loss type beyond PPO's clip with the four aggregations, as GRPOConfig settings and the naive objective's
# arguments; the knobs are off their defaults so that a knob the trainer does not pass on fails the check.
LOSS_TYPES = {
    "cispo": (dict(epsilon_high=1.5), dict(eps_high=1.5)),
    "sapo": (dict(sapo_temperature_pos=1.3, sapo_temperature_neg=2.1), dict(sapo=(1.3, 2.1))),
    "luspo": (dict(importance_sampling_level="sequence"), dict(level="sequence")),
    "vespo": (
        dict(vespo_k_pos=1.3, vespo_lambda_pos=2.7, vespo_k_neg=3.3, vespo_lambda_neg=1.7),
        dict(vespo=(1.3, 2.7, 3.3, 1.7)),
    ),
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_each_loss_type_gives_the_loss_of_the_naive_objective(tmp_path, loss_type):
    config, knobs = LOSS_TYPES[loss_type]
    record, trainer = loss_taken(tmp_path, loss_type=loss_type, **config)
    logps, old, ref, advantages = (record[k].double() for k in ("logps", "old", "ref", "advantages"))
    mask = record["mask"]

    def naive(name, **kwargs):
        settings = dict(bias_correction_kl=True, max_len=TINY["max_completion_length"], **kwargs)
        return naive_policy_loss(logps, old, ref, advantages, mask, name, BETA, 0.2, **settings).item()

    want = naive(loss_type, **{"eps_high": 0.2, **knobs})
    # At most 32 token terms, each at most max|A| x max ratio in size, times (1 + max|logp|) for cispo and vespo,
    # which weigh logp itself, and 8 for luspo's sum over a row (the KL term is 0 at step 1); each float32
    # operation rounds by eps, and 32 eps per term bounds the error.
    ratio = torch.exp(log_ratios(*logps.shape))[mask].max().item()
    logp_factor = 1 + logps[mask].abs().max().item() if loss_type in ("cispo", "vespo") else 1
    scale = advantages.abs().max().item() * ratio * logp_factor * (8 if loss_type == "luspo" else 1)
    bound = 32 * torch.finfo(torch.float32).eps * scale
    assert record["loss"] == pytest.approx(want, abs=bound)
    # The same tensors under PPO's clip with the same aggregation, and under this loss type with default knobs, give
    # other losses: the check above fails when the loss type or its knobs do not reach the trainer's loss.
    clipped = {"cispo": "dapo", "sapo": "grpo", "luspo": "grpo", "vespo": "dapo"}[loss_type]
    assert abs(naive(clipped, eps_high=0.2, level=knobs.get("level", "token")) - want) > 10 * bound
    if loss_type != "luspo":  # luspo has no knob of its own
        default = naive(loss_type, eps_high=1.2 if loss_type == "cispo" else 0.2)
        assert abs(default - want) > 10 * bound
    logs = trainer.state.log_history[0]
    own = {"cispo": "cispo_clip_ratio", "vespo": "vespo/phi_seq_mean"}.get(loss_type, "loss")
    assert own in logs and "entropy" in logs


def test_bias_corrected_kl_changes_the_gradient_once_the_policy_has_left_the_reference(tmp_path):
    """use_bias_correction_kl reaches the loss. At step 1 the policy is the reference (k3 = 0, and on-policy the
    ratio is 1), so both settings make the same update, bit for bit; from step 2 on, k3 > 0 and the corrected
    gradient, d logp * log(pi / ref) instead of d logp * (1 - ref / pi), moves the weights elsewhere."""
    settings = dict(beta=0.5, learning_rate=0.5)  # a large KL weight, so that its gradient dominates step 2
    first = [sgd_step_update(tmp_path / f"1-{c}", use_bias_correction_kl=c, **settings)[0] for c in (False, True)]
    assert all(torch.equal(first[0][n], first[1][n]) for n in first[0])
    both = [
        sgd_step_update(tmp_path / f"2-{c}", use_bias_correction_kl=c, max_steps=2, **settings) for c in (False, True)
    ]
    (plain, trainer), (corrected, _) = both
    params = dict(trainer.model.named_parameters())
    with pytest.raises(AssertionError, match="max difference"):
        assert_same_update(corrected, plain, params, steps=2, what="use_bias_correction_kl")


# ---- Process rewards and dynamic sampling: what reaches the loss ----


def test_gdpo_normalises_each_reward_function_before_the_sum(tmp_path, tiny_model_path, prompt_dataset):
    """multi_objective_aggregation='normalize_then_sum' reaches the advantages: each function's rewards normalised
    in its group, weighted, summed and normalised over the batch (the naive GDPO loop), which the default sum of the
    rewards does not give on the same rewards."""
    scored = []  # (length, parity) rewards of each round

    def length(completions):
        scored.append([[float(len(c)), float(len(c) % 2)] for c in completions])
        return [row[0] for row in scored[-1]]

    def parity(completions):
        return [float(len(c) % 2) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path),
        **{**TINY, "max_steps": 2},
        reward_weights=[1.0, 3.0],
        multi_objective_aggregation="normalize_then_sum",
    )
    trainer = GRPOTrainer(tiny_model_path, [length, parity], args=args, train_dataset=prompt_dataset)
    captured = capture_batches(trainer)
    trainer.train()
    assert len(captured) == len(scored) == 2
    changed = 0.0
    for batch, rewards in zip(captured, scored):
        expected = naive_decoupled_advantages(rewards, [1.0, 3.0], [args.num_generations])
        assert batch.advantages.tolist() == pytest.approx(expected, abs=1e-5)
        summed = naive_mixed_advantages([r[0] + 3 * r[1] for r in rewards], [], [], 1, args.num_generations)
        changed = max(changed, *(abs(a - b[0]) for a, b in zip(expected, summed)))
    assert changed > 0.1  # the default aggregation gives other advantages: the check above fails if GDPO is ignored


def test_process_reward_per_token_advantages_reach_the_loss(tmp_path, tiny_model_path, prompt_dataset):
    # A process function and an outcome function with weights: advantages become (B, T), trimmed with the
    # completions: the outcome advantage on every token plus 0.5 x the process function's token advantages, which
    # are zero after each row's last step (docs/method.md, "Process supervision"). The weights follow the order of
    # reward_funcs; the outcome's, 2.0, scales rewards that group normalisation then divides by their spread.
    @process_reward
    def first_and_last(completions, completion_ids):
        return [
            StepRewards([float(len(ids) % 3), 1.0], token_ends=[0, len(ids) - 1])
            if len(ids) > 1
            else StepRewards([0.0], token_ends=[0])
            for ids in completion_ids
        ]

    scored = []  # the outcome rewards of each round

    def reward_len(prompts, completions):  # scripted.reward_len, recording what it returns
        scored.append([float(len(completion)) for completion in completions])
        return scored[-1]

    args = GRPOConfig(output_dir=str(tmp_path), **{**TINY, "max_steps": 2}, reward_weights=[0.5, 2.0])
    trainer = GRPOTrainer(tiny_model_path, [first_and_last, reward_len], args=args, train_dataset=prompt_dataset)
    captured = capture_batches(trainer)
    trainer.train()
    assert trainer.reward_names == ["reward_len", "first_and_last"]  # outcome functions first
    assert len(captured) == len(scored) == 2  # a round of one group per step
    for batch, rewards in zip(captured, scored):
        assert batch.advantages.shape == batch.completion_ids.shape
        assert (batch.advantages[batch.completion_mask == 0] == 0).all()
        steps = [[(n % 3, 0), (1.0, n - 1)] if n > 1 else [(0.0, 0)] for n in batch.completion_mask.sum(1).tolist()]
        width, outcome = batch.completion_ids.shape[1], [2.0 * r for r in rewards]
        expected = naive_mixed_advantages(outcome, [steps], [0.5], width, args.num_generations)
        assert batch.advantages.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]
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


def test_dynamic_sampling_keeps_the_batch_full_of_groups_with_spread(tmp_path, tokenizer):
    # 2 prompts per generation round (8 rows, G = 4), half of all prompts flat: the first round of every step holds
    # one flat group (shuffle off, consecutive prompts), which must be replaced from extra rounds.
    captured = []
    update, trainer = sgd_step_update(
        tmp_path / "dynamic",
        reward_funcs=half_flat_reward,
        dataset=half_flat_dataset(),
        captured=captured,
        gradient_accumulation_steps=2,
        dynamic_sampling=True,
        max_steps=3,
    )
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(h["dynamic_sampling/dropped_groups"] >= 1 for h in logs)
    assert all(h["dynamic_sampling/zero_std_groups_kept"] == 0 for h in logs)
    assert sum(d.abs().sum() for d in update.values()) > 0
    # What dynamic sampling changes is which groups train, and nothing else: none of the groups it kept is flat, and
    # a run without it on exactly those prompts, in that order, gives the same update.
    kept = [tokenizer.decode(b.prompt_ids[0][b.prompt_mask[0].bool()]) for b in captured]  # a group per micro-batch
    flat = {row["prompt"] for row in half_flat_dataset() if row["flat"]}
    assert len(kept) == 6 and not flat & set(kept)
    dataset = Dataset.from_dict({"prompt": kept, "flat": [False] * len(kept)})
    reference, _ = sgd_step_update(
        tmp_path / "kept", reward_funcs=half_flat_reward, dataset=dataset, gradient_accumulation_steps=2, max_steps=3
    )
    assert_same_update(update, reference, dict(trainer.model.named_parameters()), steps=3, what="kept groups")


def test_dynamic_sampling_no_zero_variance_group_reaches_the_loss(tmp_path, tokenizer):
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
        assert batch.prompt_ids.shape[0] == args.per_device_train_batch_size  # ... the batch size is kept ...
        groups = batch.advantages.view(-1, args.num_generations)
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
    # its threshold is taken per micro-step; tests/test_distributed.py checks it across processes.) What each variant
    # changes in the loss is checked above; this is the one step of each, cut into micro-batches three ways.
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
