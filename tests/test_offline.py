"""Training from scored rollouts (grpo/data/offline.py, docs/offline.md): grouping, validation, the loss against a
naive computation, training direction, export and read-back, and 1 vs 2 processes."""

import json
import random
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError
from grpo.data.offline import OfflineGroups, load_scored_rollouts, prompt_key
from grpo.objective.advantages import group_advantages, group_reward_stats, grouped_advantages, mixed_advantages
from grpo.testing import tiny_model, tiny_tokenizer
from tests.helpers.compare import assert_same_update
from tests.helpers.naive import naive_grouped_advantages, naive_policy_loss
from tests.helpers.net import launch_two_processes
from tests.helpers.scripted import TINY, ScriptedGeneration, capture_batches, reward_len

ROOT = Path(__file__).resolve().parent.parent


def scored_rows(num_prompts=4, sizes=(2, 3)):
    """One row per completion: prompt i has sizes[i % len(sizes)] completions, the longer ones rewarded more."""
    rows = []
    for i in range(num_prompts):
        for j in range(sizes[i % len(sizes)]):
            rows.append({"prompt": f"Question {i}: count.", "completion": "ab" * (j + 1), "reward": float(j)})
    return rows


def config(tmp_path, **overrides):
    settings = dict(TINY, num_generations=2, per_device_train_batch_size=4, max_steps=1, shuffle_dataset=False)
    return GRPOConfig(output_dir=str(tmp_path / "out"), **{**settings, **overrides})


def trainer_for(tmp_path, data, reward_funcs=None, **overrides):
    tokenizer = tiny_tokenizer()
    dataset = data if isinstance(data, Dataset) else Dataset.from_list(data)
    args = config(tmp_path, **overrides)
    return GRPOTrainer(
        tiny_model(tokenizer), reward_funcs, args=args, train_dataset=dataset, processing_class=tokenizer
    )


def group_contents(groups: OfflineGroups) -> list:
    """Each group as (prompt key, sorted (completion, reward) pairs), in the groups' order."""
    out = []
    for g in range(len(groups)):
        item = groups[g]
        pairs = sorted((json.dumps(row["completion"]), row["reward"]) for row in item["rows"])
        out.append((prompt_key(item["prompt"]), pairs))
    return out


# ---- Advantages of groups of different sizes ----


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grouped_advantages_match_naive(scale):
    torch.manual_seed(1)
    sizes = [3, 1, 4, 2, 5]
    rewards = torch.randn(sum(sizes))
    rewards[4] = float("nan")  # an unscored row
    rewards[9:11] = 2.0  # a flat group
    expected = naive_grouped_advantages(rewards.tolist(), sizes, scale)
    assert grouped_advantages(rewards, sizes, scale).tolist() == pytest.approx(expected, abs=1e-6)
    with_baseline = naive_grouped_advantages(rewards.tolist(), sizes, scale, baseline=0.5)
    assert grouped_advantages(rewards, sizes, scale, baseline=0.5).tolist() == pytest.approx(with_baseline, abs=1e-6)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_grouped_advantages_equal_group_advantages_for_equal_sizes(scale):
    rewards = torch.randn(12)
    assert torch.equal(grouped_advantages(rewards, [4, 4, 4], scale), group_advantages(rewards, 4, scale))
    stats, ragged = group_reward_stats(rewards, 4), group_reward_stats(rewards, [4, 4, 4])
    assert all(torch.equal(stats[k], ragged[k]) for k in stats)
    steps = torch.full((12, 2, 5), float("nan"))
    steps[:, 0, 3] = torch.randn(12)
    weights = torch.tensor([0.5, 1.0])
    assert torch.equal(
        mixed_advantages(rewards, steps, weights, 4, scale), mixed_advantages(rewards, steps, weights, [4] * 3, scale)
    )


def test_grouped_advantages_hand_worked():
    # Group [1, 3, 5]: mean 3, std 2 -> -1, 0, 1 (eps aside); group [2, 7]: mean 4.5, std 3.536 -> -/+0.7071;
    # a lone row with baseline 0.5: 0.7 - 0.5 = 0.2.
    adv = grouped_advantages(torch.tensor([1.0, 3.0, 5.0, 2.0, 7.0, 0.7]), [3, 2, 1], baseline=0.5)
    assert adv.tolist() == pytest.approx([-1.0, 0.0, 1.0, -0.7071, 0.7071, 0.2], abs=1e-4)


# ---- Grouping and validation ----


def test_shuffled_rows_give_the_same_groups(tmp_path):
    rows = scored_rows(num_prompts=6, sizes=(2, 3, 4))
    shuffled = list(rows)
    random.Random(0).shuffle(shuffled)
    args = config(tmp_path)
    a = OfflineGroups(Dataset.from_list(rows), args, reward_funcs_given=False)
    b = OfflineGroups(Dataset.from_list(shuffled), args, reward_funcs_given=False)
    assert len(a) == 6 and [len(a[g]["rows"]) for g in range(6)] == [2, 3, 4, 2, 3, 4]
    assert group_contents(a) == group_contents(b)


def test_per_prompt_lists_give_the_same_groups(tmp_path):
    rows = scored_rows(num_prompts=4)
    by_prompt = {}
    for row in rows:
        entry = by_prompt.setdefault(row["prompt"], {"prompt": row["prompt"], "completions": [], "reward": []})
        entry["completions"].append(row["completion"])
        entry["reward"].append(row["reward"])
    args = config(tmp_path)
    flat = OfflineGroups(Dataset.from_list(rows), args, reward_funcs_given=False)
    lists = OfflineGroups(Dataset.from_list(list(by_prompt.values())), args, reward_funcs_given=False)
    assert lists.form == "lists" and group_contents(flat) == group_contents(lists)


def test_single_completion_is_an_error_unless_a_baseline_is_set(tmp_path):
    rows = scored_rows(num_prompts=4) + [{"prompt": "Alone", "completion": "x", "reward": 2.0}]
    with pytest.raises(InputError, match=r"1 prompt\(s\) have a single scored completion.*offline_baseline"):
        trainer_for(tmp_path, rows)
    trainer = trainer_for(tmp_path, rows, offline_baseline=0.5, max_steps=1)
    assert len(trainer.train_dataset) == 5
    batches = capture_batches(trainer)
    # The lone group sorts first ("Alone" < "Question"); one round = 2 groups: "Alone" and "Question 0".
    trainer.train()
    assert batches[0].advantages[0].item() == pytest.approx(2.0 - 0.5)


@pytest.mark.parametrize(
    "change, problem",
    [
        (lambda rows: [{k: v for k, v in r.items() if k != "reward"} for r in rows], r"no 'reward' column"),
        (lambda rows: [r | {"reward": "high"} for r in rows], r"the reward in 'reward' is 'high'"),
        (lambda rows: [r | {"completion": {"text": "x"}} for r in rows], r"neither a string nor an assistant message"),
    ],
)
def test_bad_offline_data_fails_at_construction(tmp_path, change, problem):
    with pytest.raises(InputError, match=problem):
        trainer_for(tmp_path, change(scored_rows()))


def test_settings_offline_training_does_not_take(tmp_path, prompt_dataset):
    with pytest.raises(InputError, match="offline_logprobs_column='behaviour'"):
        trainer_for(tmp_path, scored_rows(), offline_logprobs_column="behaviour")
    with pytest.raises(InputError, match="dynamic_sampling=True"):
        trainer_for(tmp_path, scored_rows(), dynamic_sampling=True)
    with pytest.raises(InputError, match="eval_dataset is not supported"):
        tokenizer = tiny_tokenizer()
        GRPOTrainer(
            tiny_model(tokenizer),
            args=config(tmp_path),
            train_dataset=Dataset.from_list(scored_rows()),
            eval_dataset=prompt_dataset,
            processing_class=tokenizer,
        )
    with pytest.raises(InputError, match="online training needs at least one reward function"):
        trainer_for(tmp_path, prompt_dataset)


def test_misaligned_per_prompt_lists(tmp_path):
    data = [{"prompt": "q", "completions": ["a", "b"], "reward": [1.0]}]
    with pytest.raises(InputError, match=r"row 0: 'reward' must be a list with one reward per completion \(2\)"):
        trainer_for(tmp_path, data)


# ---- The rollout and the loss ----


def test_rollout_tokens_rewards_and_functions(tmp_path):
    """Completions tokenized without special tokens plus EOS; the stored reward first, a reward function added with
    its weight (reward_weights without an entry for the stored reward: it gets 1)."""
    trainer = trainer_for(tmp_path, scored_rows(), reward_funcs=reward_len, reward_weights=[0.5])
    assert trainer.reward_names == ["reward", "reward_len"]
    inputs = [trainer.train_dataset[0], trainer.train_dataset[1]]
    rollout, columns = trainer.sample_round(inputs, trainer.generation)
    tokenizer = trainer.processing_class
    assert rollout.completion_lists()[0] == tokenizer("ab", add_special_tokens=False)["input_ids"] + [258]
    assert rollout.group_sizes == [2, 3] and not rollout.is_truncated.any()
    scored = trainer.rounds.score_round(rollout, columns, None, trainer.state)
    combined = trainer.rewards.columns(scored.rewards_per_func, scored.step_rewards)[1]
    lengths = torch.tensor([len(c) for c in rollout.completions], dtype=torch.float32)
    assert combined.tolist() == pytest.approx((torch.tensor([0.0, 1, 0, 1, 2]) + 0.5 * lengths).tolist())


def _naive_logps(model, batch):
    """Per-token log-probs of the completion tokens, one row at a time from a plain forward pass of the unpadded
    prompt + completion (log_softmax over the vocabulary at each position, the completion's next token picked)."""
    rows = []
    for i in range(batch.prompt_ids.shape[0]):
        prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
        completion = batch.completion_ids[i][batch.completion_mask[i].bool()]
        ids = torch.cat([prompt, completion])[None]
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # positions predicting the completion
        logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, completion[:, None])[:, 0]
        width = batch.completion_ids.shape[1]
        rows.append(torch.cat([logps, logps.new_zeros(width - len(logps))]))
    return torch.stack(rows)


def test_offline_loss_equals_naive_computation(tmp_path):
    """One micro-batch of stored completions with behaviour log-probs: the trainer's loss equals the clipped
    objective built token by token from a plain forward pass, the naive group advantages and the stored behaviour
    log-probs as pi_old, with the KL to the (identical, untrained) reference."""
    tokenizer = tiny_tokenizer()
    rows = scored_rows(num_prompts=2, sizes=(2, 3))
    for row in rows:
        n = len(tokenizer(row["completion"], add_special_tokens=False)["input_ids"]) + 1
        row["behaviour"] = [-5.5 + 0.3 * t for t in range(n)]  # some tokens clip, some do not
    trainer = trainer_for(
        tmp_path, rows, offline_logprobs_column="behaviour", beta=0.04, loss_type="dapo", per_device_train_batch_size=4
    )
    batches = capture_batches(trainer)
    trainer.train()
    batch = batches[0]
    naive_adv = naive_grouped_advantages([r["reward"] for r in rows], [2, 3])
    assert batch.advantages.tolist() == pytest.approx(naive_adv, abs=1e-6)
    old = torch.zeros_like(batch.old_logps)
    for i, row in enumerate(rows):
        old[i, : len(row["behaviour"])] = torch.tensor(row["behaviour"])
    assert torch.equal(batch.old_logps, old)
    # Recompute at the weights the loss saw: undo the step by reloading the initial model.
    fresh = tiny_model(tokenizer)
    logps = _naive_logps(fresh, batch)
    mask = batch.completion_mask
    expected = naive_policy_loss(
        logps, old, logps.detach(), torch.tensor(naive_adv), mask, "dapo", 0.04, 0.2, 0.2, bias_correction_kl=True
    )
    assert trainer.state.log_history[0]["loss"] == pytest.approx(expected.item(), rel=1e-4)


def test_conversational_file(tmp_path):
    """Chat prompts and assistant-message completions (as one message or a list of one): the prompt is rendered with
    the chat template, the completion is the message's text followed by EOS (<|im_end|>)."""
    rows = []
    for i in range(2):
        prompt = [{"role": "user", "content": f"What is {i} + 1?"}]
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": str(i + 1)}], "reward": 1.0})
        rows.append({"prompt": prompt, "completion": [{"role": "assistant", "content": "no idea"}], "reward": 0.0})
    trainer = trainer_for(tmp_path, rows)
    rollout, _ = trainer.sample_round([trainer.train_dataset[0]], trainer.generation)
    tokenizer = trainer.processing_class
    rendered = tokenizer.apply_chat_template(rollout.prompts[0], tokenize=False, add_generation_prompt=True)
    assert tokenizer.decode(rollout.prompt_ids[0][rollout.prompt_mask[0].bool()]) == rendered
    assert tokenizer.decode(rollout.completion_lists()[0]) == "1<|im_end|>"
    assert rollout.completions[0] == [{"role": "assistant", "content": "1"}]
    trainer.train()
    assert trainer.state.global_step == 1


def completion_logps(trainer, rows):
    """Mean per-token log-prob of each stored completion under the trainer's current model."""
    groups = [trainer.train_dataset[g] for g in range(len(trainer.train_dataset))]
    rollout, _ = trainer.generation.rollout(groups, trainer.processing_class, trainer.eos_token_ids)
    with torch.no_grad():
        logps, _ = trainer.logprobs(trainer.model, rollout)
    mask = rollout.completion_mask
    means = (logps * mask).sum(1) / mask.sum(1)
    rewards = [row["reward"] for group in groups for row in group["rows"]]
    return means, torch.tensor(rewards)


def test_offline_training_raises_the_higher_reward_completions(tmp_path):
    """A few steps on a fixed file: within every group, the mean log-prob of the higher-reward completion rises
    relative to the lower-reward one."""
    rows = []
    for i in range(4):
        rows.append({"prompt": f"Question {i}: yes or no?", "completion": "yes yes", "reward": 1.0})
        rows.append({"prompt": f"Question {i}: yes or no?", "completion": "no no no", "reward": 0.0})
    trainer = trainer_for(tmp_path, rows, max_steps=8, learning_rate=3e-3, shuffle_dataset=True)
    before, rewards = completion_logps(trainer, rows)
    trainer.train()
    after, _ = completion_logps(trainer, rows)
    gap_before = before[rewards == 1].mean() - before[rewards == 0].mean()
    gap_after = after[rewards == 1].mean() - after[rewards == 0].mean()
    assert gap_after > gap_before + 0.5, (gap_before, gap_after)
    per_group = (after - before).view(-1, 2)  # (groups, [high, low]) in the groups' order
    assert (per_group[:, 0] > per_group[:, 1]).all()


# ---- Export and read-back ----


def test_save_rollouts_then_train_offline_on_them(tmp_path):
    """An online run with save_rollouts writes rollouts.jsonl; load_scored_rollouts reads it; offline training
    accepts it as it is (the exported `rewards` and `step` columns ride along)."""
    tokenizer = tiny_tokenizer()
    prompts = Dataset.from_dict({"prompt": [f"Question {i}: count." for i in range(8)]})
    args = GRPOConfig(output_dir=str(tmp_path / "online"), **{**TINY, "max_steps": 2, "save_rollouts": True})
    online = GRPOTrainer(
        tiny_model(tokenizer), reward_len, args=args, train_dataset=prompts, processing_class=tokenizer
    )
    online.generation = ScriptedGeneration(args.num_generations, args.max_completion_length)
    online.train()
    path = tmp_path / "online" / "rollouts.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 2 * args.generation_batch_size
    first = records[0]
    assert set(first) == {"prompt", "completion", "reward", "rewards", "truncated", "step"}
    assert first["reward"] == first["rewards"]["reward_len"] == float(len(first["completion"]))
    assert [r["step"] for r in records] == [0] * 4 + [1] * 4
    assert sum(r["truncated"] for r in records) == 2  # the scripted last copy of each group never ends
    data = load_scored_rollouts(path)
    # The scripted tokens are random bytes, which decode to replacement characters and re-tokenize longer.
    offline = trainer_for(tmp_path, data, max_steps=1, max_completion_length=64)
    assert len(offline.train_dataset) == 2
    group = offline.train_dataset[0]
    rollout, _ = offline.sample_round([group], offline.generation)
    assert rollout.is_truncated.tolist() == [row["truncated"] for row in group["rows"]] and rollout.is_truncated.any()
    ends = [ids[-1] for ids in rollout.completion_lists()]
    assert [end == 258 for end in ends] == [not row["truncated"] for row in group["rows"]]  # EOS only when finished
    offline.train()


def test_offline_recipe_loads_a_rollouts_file(tmp_path, monkeypatch):
    from grpo.cli.datasets import load_prompt_datasets
    from grpo.cli.recipe import load_recipe

    monkeypatch.chdir(tmp_path)
    Path("rollouts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in scored_rows()))
    recipe = load_recipe(ROOT / "examples" / "recipes" / "offline.yaml", ["--dataset.path", "rollouts.jsonl"])
    train, held_out = load_prompt_datasets(recipe.dataset)
    assert held_out is None and {"prompt", "completion", "reward"} <= set(train.column_names)
    assert recipe.rewards == [] and recipe.grpo_config().num_generations == 8


# ---- Resume and processes ----


@pytest.mark.slow
def test_offline_resume_matches_an_uninterrupted_run(tmp_path):
    rows = scored_rows(num_prompts=8)
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2, shuffle_dataset=True, learning_rate=1e-2)
    settings["lr_scheduler_type"] = "constant"  # the same schedule for the 2-step and the 4-step run
    whole = trainer_for(tmp_path / "a", rows, **settings)
    whole.train()
    first = trainer_for(tmp_path / "b", rows, **{**settings, "max_steps": 2})
    first.train()
    resumed = trainer_for(tmp_path / "b", rows, **settings)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "out" / "checkpoint-2"))
    for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)
    assert [h["loss"] for h in whole.state.log_history[2:4]] == [h["loss"] for h in resumed.state.log_history[:2]]


@pytest.mark.distributed
def test_two_processes_match_one(tmp_path):
    """The same file on 2 CPU processes (each holding whole groups of different sizes) gives the update and loss
    of 1 process (loss_type dapo, whose normaliser counts the tokens of all processes)."""
    out_file = tmp_path / "two.pt"
    launch_two_processes(ROOT / "tests" / "helpers" / "offline_update.py", out_file)
    from tests.helpers.offline_update import offline_update

    update, world_size, loss, _ = torch.load(out_file)
    assert world_size == 2
    reference, _, reference_loss, params = offline_update(str(tmp_path / "one"))
    assert sum(d.abs().sum() for d in reference.values()) > 0
    assert loss == pytest.approx(reference_loss, rel=1e-4, abs=1e-6)
    assert_same_update(update, reference, params, what="2 processes")
