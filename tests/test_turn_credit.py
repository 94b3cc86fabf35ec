"""Turn-level credit (grpo/objective/advantages.py `turn_credit_advantages`, grpo/rewards/turns.py): each policy
turn's tokens get the episode's advantage plus the turn's advantage within its group. Checked against a naive loop
in float64, on numbers worked out by hand, by its properties, and end to end on a scripted multi-turn agent whose
per-token advantages, as the loss received them, are recomputed here from the episodes' turns."""

import math
import random

import pytest
import torch

from grpo import GRPOConfig, GRPOTrainer, turn_reward
from grpo.objective.advantages import turn_credit_advantages, turn_group_advantages, turn_returns
from grpo.rewards.scoring import score_rewards
from grpo.testing import save_tiny_model
from tests.helpers.agents import ONE_CALL, SCRIPT, WRONG, ScriptedTurns, add, chat_prompts, reward_25, tool_tokenizer
from tests.helpers.naive import naive_group_advantages
from tests.helpers.scripted import capture_batches

G = 4


def naive_turn_credit(outcome, scores, weights, turn_index, num_generations, scheme, coef, scale_rewards, eps=1e-4):
    """One token at a time. `outcome`: B episode advantages; `scores[i][n][k]`: turn function k's score of turn n of
    row i (None: none; rows have their own numbers of turns); `turn_index[i]`: each token's turn, -1 off turns."""
    combined = []  # combined[i][n]: the weighted sum over the functions that scored turn n, None if none did
    for row in scores:
        combined.append([])
        for turn in row:
            given = [w * s for w, s in zip(weights, turn) if s is not None]
            combined[-1].append(sum(given) if given else None)
    values = []
    for row in combined:
        if scheme == "mt_grpo":
            values.append(list(row))
            continue
        values.append([])
        for n in range(len(row)):
            later = [v for v in row[n:] if v is not None]
            values[-1].append(sum(later) if later else None)
    turn_adv = [[0.0] * len(row) for row in values]
    most = max(len(row) for row in values)
    for n in range(most):
        column = [row[n] for row in values if n < len(row) and row[n] is not None]
        batch_std = 0.0
        if len(column) > 1:
            m = sum(column) / len(column)
            batch_std = math.sqrt(sum((v - m) ** 2 for v in column) / (len(column) - 1))
        for start in range(0, len(values), num_generations):
            group = [i for i in range(start, start + num_generations) if n < len(values[i])]
            given = [values[i][n] for i in group if values[i][n] is not None]
            if len(given) <= 1 or max(given) == min(given):
                continue
            mean = sum(given) / len(given)
            std = math.sqrt(sum((v - mean) ** 2 for v in given) / (len(given) - 1))
            divisor = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale_rewards]
            for i in group:
                if values[i][n] is not None:
                    turn_adv[i][n] = (values[i][n] - mean) / divisor
    out = []
    for i, tokens in enumerate(turn_index):
        out.append([outcome[i] + (coef * turn_adv[i][n] if n >= 0 else 0.0) for n in tokens])
    return out


def as_tensors(scores, turn_index, num_funcs):
    """The naive layout as `turn_credit_advantages` takes it: (B, K, N) NaN-padded scores, (B, T) turn index."""
    rows, most, width = len(scores), max(len(r) for r in scores), max(len(t) for t in turn_index)
    dense = torch.full((rows, num_funcs, most), math.nan, dtype=torch.float64)
    for i, row in enumerate(scores):
        for n, turn in enumerate(row):
            for k, s in enumerate(turn):
                if s is not None:
                    dense[i, k, n] = s
    index = torch.full((rows, width), -1, dtype=torch.long)
    for i, tokens in enumerate(turn_index):
        index[i, : len(tokens)] = torch.tensor(tokens)
    return dense, index


def random_episodes(rng, rows, num_funcs):
    """Rows of 1-4 turns whose scores come from a small set (ties and Nones are common), and token turn indices with
    tool answers (-1) between the turns."""
    scores, turn_index = [], []
    for _ in range(rows):
        turns = rng.randint(1, 4)
        scores.append([[rng.choice([0.0, 0.5, 1.0, 2.0, None]) for _ in range(num_funcs)] for _ in range(turns)])
        tokens = []
        for n in range(turns):
            tokens += [n] * rng.randint(1, 4) + ([-1] * rng.randint(1, 3) if n < turns - 1 else [])
        turn_index.append(tokens)
    return scores, turn_index


@pytest.mark.parametrize("scheme", ["mt_grpo", "reward_to_go"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_turn_credit_equals_the_naive_loop_in_float64(scheme, scale_rewards):
    rng = random.Random(0)
    for trial in range(20):
        scores, turn_index = random_episodes(rng, G * 3, num_funcs=2)
        weights = [1.0, rng.choice([0.5, 2.0])]
        outcome = [rng.uniform(-1, 1) for _ in scores]
        coef = rng.choice([0.3, 1.0])
        expected = naive_turn_credit(outcome, scores, weights, turn_index, G, scheme, coef, scale_rewards)
        dense, index = as_tensors(scores, turn_index, 2)
        got = turn_credit_advantages(
            torch.tensor(outcome, dtype=torch.float64),
            dense,
            torch.tensor(weights, dtype=torch.float64),
            index,
            G,
            scheme,
            coef,
            scale_rewards,
        )
        assert got.dtype == torch.float64
        for i, tokens in enumerate(turn_index):
            assert got[i, : len(tokens)].tolist() == pytest.approx(expected[i], rel=1e-12, abs=1e-12), (trial, i)


def test_hand_worked_two_turn_episodes():
    """Two episodes, two turns, scale_rewards="none", coef 0.5. Turn scores: row 0 [1, 0], row 1 [0, 1]; episode
    advantages A = [0.5, -0.5]. Tokens: row 0 is turn 0 (2 tokens), a tool answer, turn 1 (1 token); row 1 the same.
      mt_grpo:      turn 0 scores 1, 0 -> mean 0.5 -> Â = +0.5, -0.5; turn 1 scores 0, 1 -> Â = -0.5, +0.5
                    row 0: 0.5 + 0.5 * 0.5 = 0.75 on turn 0, 0.5 on the tool answer, 0.5 - 0.25 = 0.25 on turn 1
                    row 1: -0.5 - 0.25 = -0.75, -0.5, -0.5 + 0.25 = -0.25
      reward_to_go: returns row 0 [1 + 0, 0] = [1, 0], row 1 [0 + 1, 1] = [1, 1]: turn 0 ties -> Â = 0;
                    turn 1 returns 0, 1 -> Â = -0.5, +0.5
                    row 0: 0.5, 0.5, 0.5 - 0.25 = 0.25; row 1: -0.5, -0.5, -0.5 + 0.25 = -0.25"""
    outcome = torch.tensor([0.5, -0.5], dtype=torch.float64)
    scores = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]], dtype=torch.float64)  # (B=2, K=1, N=2)
    index = torch.tensor([[0, 0, -1, 1], [0, 0, -1, 1]])
    one = torch.ones(1, dtype=torch.float64)
    mt = turn_credit_advantages(outcome, scores, one, index, 2, "mt_grpo", 0.5, "none")
    assert mt.tolist() == [[0.75, 0.75, 0.5, 0.25], [-0.75, -0.75, -0.5, -0.25]]
    to_go = turn_credit_advantages(outcome, scores, one, index, 2, "reward_to_go", 0.5, "none")
    assert to_go.tolist() == [[0.5, 0.5, 0.5, 0.25], [-0.5, -0.5, -0.5, -0.25]]
    # Group scaling: three episodes whose turn 0 scored 0, 1, 2 (mean 1, std 1) -> Â = (r - 1) / (1 + 1e-4).
    three = turn_group_advantages(torch.tensor([[0.0], [1.0], [2.0]], dtype=torch.float64), 3)
    assert three[:, 0].tolist() == pytest.approx([-1 / 1.0001, 0.0, 1 / 1.0001], rel=1e-12)
    assert turn_returns(torch.tensor([[1.0, math.nan, 2.0], [math.nan, 3.0, math.nan]])).tolist()[0] == [3, 2, 2]


@pytest.mark.parametrize("scheme", ["mt_grpo", "reward_to_go"])
def test_equal_turn_scores_in_a_group_leave_the_episode_advantage(scheme):
    """A turn scored alike by every episode of its group carries no information about that turn: its tokens get the
    episode's advantage exactly. One different score, and they no longer do (the property can fail)."""
    rng = random.Random(1)
    if scheme == "mt_grpo":  # rows of 1-4 turns, every turn scored 1
        _, turn_index = random_episodes(rng, G * 2, num_funcs=1)
        dense, index = as_tensors([[[1.0]] * (max(t) + 1) for t in turn_index], turn_index, 1)
    else:  # returns tie only when the rows have as many turns: three each, every turn scored 1
        index = torch.tensor([[0, 0, -1, 1, -1, 2]] * (G * 2))
        dense = torch.ones(G * 2, 1, 3, dtype=torch.float64)
    outcome = torch.tensor([rng.uniform(-1, 1) for _ in range(G * 2)], dtype=torch.float64)
    one = torch.ones(1, dtype=torch.float64)
    got = turn_credit_advantages(outcome, dense, one, index, G, scheme, 1.0, "group")
    assert torch.equal(got, outcome.unsqueeze(1).expand_as(got))
    dense[0, 0, 0] = 0.0  # one episode's first turn scored differently
    broken = turn_credit_advantages(outcome, dense, one, index, G, scheme, 1.0, "group")
    assert not torch.equal(broken, outcome.unsqueeze(1).expand_as(broken))


def test_a_process_reward_advantage_gets_the_turn_term_added():
    """(B, T) advantages (process rewards) keep their per-token values; the turn term is added on top."""
    base = torch.tensor([[0.1, 0.2, 0.3], [-0.1, -0.2, -0.3]], dtype=torch.float64)
    scores = torch.tensor([[[1.0]], [[0.0]]], dtype=torch.float64)
    index = torch.tensor([[0, -1, 0], [0, 0, -1]])
    got = turn_credit_advantages(base, scores, torch.ones(1, dtype=torch.float64), index, 2, "mt_grpo", 1.0, "none")
    assert got.flatten().tolist() == pytest.approx([0.6, 0.2, 0.8, -0.6, -0.7, -0.3], rel=1e-12)
    with pytest.raises(ValueError, match="differ"):
        turn_credit_advantages(base[:, :2], scores, torch.ones(1), index, 2)


# ---- Scoring: what turn functions return ----


def messages(turns):
    """An episode's completion with `turns` assistant messages and tool answers between them."""
    out = []
    for n in range(turns):
        out.append({"role": "assistant", "content": f"turn {n}"})
        if n < turns - 1:
            out.append({"role": "tool", "name": "add", "content": "5"})
    return out


def score(turn_funcs, completions):
    return score_rewards(
        [],
        [],
        [],
        turn_funcs,
        prompts=[[{"role": "user", "content": "?"}]] * len(completions),
        completions=completions,
        completion_ids=[[1, 2]] * len(completions),
        columns={},
    )


def test_turn_scores_are_laid_out_per_turn_and_checked():
    @turn_reward
    def per_turn(completions, **kwargs):
        return [
            [float(n) if n else None for n in range(sum(m["role"] == "assistant" for m in c))] for c in completions
        ]

    with pytest.warns(UserWarning, match=r"row\(s\) \[1\] of this batch"):  # row 0 has turn scores: not warned of
        scored = score([per_turn], [messages(3), messages(1)])
    assert scored.turn_rewards.shape == (2, 1, 3)
    assert [[None if math.isnan(v) else v for v in row] for row in scored.turn_rewards[:, 0].tolist()] == [
        [None, 1.0, 2.0],
        [None, None, None],
    ]

    @turn_reward
    def one_short(completions, **kwargs):
        return [[1.0] * (sum(m["role"] == "assistant" for m in c) - (i == 1)) for i, c in enumerate(completions)]

    with pytest.raises(ValueError, match=r"'one_short' returned 2 scores for row 1, whose episode has 3 policy turns"):
        score([one_short], [messages(2), messages(3)])

    @turn_reward
    def a_number(completions, **kwargs):
        return [1.0] * len(completions)

    with pytest.raises(TypeError, match=r"'a_number' returned 1.0 for row 0.*drop the @turn_reward mark"):
        score([a_number], [messages(2)])


# ---- The trainer ----


class ArithmeticEnv:
    """An environment whose tools are methods and which scores each turn: a turn that calls `add` earns 1, one that
    calls anything else 0; the last turn (the answer) is left to the outcome reward (None)."""

    def reset(self, **kwargs):
        self.called = []

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        self.called.append("add")
        return a + b

    def multiply(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first integer
            b: the second integer
        """
        self.called.append("multiply")
        return a * b

    def get_turn_rewards(self):
        return [float(name == "add") for name in self.called] + [None]


@turn_reward
def calls_a_tool(completions, **kwargs):
    """1 for each assistant turn that calls a tool, 0 for one that does not."""
    return [[float("tool_calls" in m) for m in c if m["role"] == "assistant"] for c in completions]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    save_tiny_model(path, max_position_embeddings=4096)  # episode prompts with the tools' schemas: ~1,500 tokens
    tool_tokenizer().save_pretrained(path)
    return str(path)


def agent_trainer(tmp_path, model_path, **overrides):
    """One prompt's group of 4 episodes per step, rows taking SCRIPT (3 turns: add, multiply, answer), ONE_CALL (2:
    multiply, answer), WRONG (1: a wrong answer) and SCRIPT again."""
    tokenizer = tool_tokenizer()
    settings = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_completion_length=1000,
        max_prompt_length=None,
        num_generations=G,
        per_device_train_batch_size=G,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        loss_type="grpo",
        reward_weights=[1.0, 2.0, 1.0],  # reward_25, calls_a_tool, ArithmeticEnv_turns
    )
    trainer = GRPOTrainer(
        model_path,
        [reward_25, calls_a_tool],
        args=GRPOConfig(**{**settings, **overrides}),
        train_dataset=chat_prompts(2),
        processing_class=tokenizer,
        environment_factory=ArithmeticEnv,
    )
    trainer.generation = ScriptedTurns(tokenizer, (SCRIPT, ONE_CALL, WRONG))
    return trainer


def policy_turns_of(loss_mask_row):
    """Each loss token's turn, read back from the mask: the policy's turns are its runs of 1s, in order."""
    turns, n, previous = [], -1, 0
    for m in loss_mask_row.tolist():
        if m and not previous:
            n += 1
        turns.append(n if m else -1)
        previous = m
    return turns


@pytest.mark.parametrize("scheme", ["mt_grpo", "reward_to_go"])
def test_the_loss_receives_each_turns_advantage(tmp_path, model_path, scheme):
    trainer = agent_trainer(tmp_path, model_path, turn_advantage=scheme, turn_advantage_coef=0.5)
    assert trainer.reward_names == ["reward_25", "calls_a_tool", "ArithmeticEnv_turns"]
    batches = capture_batches(trainer)
    trainer.train()
    assert len(batches) == 2
    for batch in batches:
        rows = batch.completion_ids.shape[0]
        texts = [
            trainer.processing_class.decode(row[m.bool()]) for row, m in zip(batch.completion_ids, batch.loss_mask)
        ]
        # The scripted turns, and the scores the environment (weight 1) and calls_a_tool (weight 2) give them.
        script = [SCRIPT if "add" in t else ONE_CALL if "multiply" in t else WRONG for t in texts]
        environment = {id(SCRIPT): [1.0, 0.0, None], id(ONE_CALL): [0.0, None], id(WRONG): [None]}
        tool_calls = {id(SCRIPT): [1.0, 1.0, 0.0], id(ONE_CALL): [1.0, 0.0], id(WRONG): [0.0]}
        scores = [[[2 * c, e] for c, e in zip(tool_calls[id(s)], environment[id(s)])] for s in script]
        outcome = naive_group_advantages([float("25" in s[-1]) for s in script], G)
        turn_index = [policy_turns_of(m) for m in batch.loss_mask]
        assert [max(t) + 1 for t in turn_index] == [len(s) for s in script]
        expected = naive_turn_credit(outcome, scores, [1.0, 1.0], turn_index, G, scheme, 0.5, "group")
        assert batch.advantages.shape == batch.completion_ids.shape
        loss_tokens = batch.loss_mask.bool()
        for i in range(rows):
            got = batch.advantages[i][loss_tokens[i]].tolist()
            assert got == pytest.approx([a for a, n in zip(expected[i], turn_index[i]) if n >= 0], abs=1e-5)
        # Not one advantage per episode: a three-turn episode's turns get different ones.
        first = next(i for i, s in enumerate(script) if s is SCRIPT)
        per_turn = {n: batch.advantages[first, torch.tensor(turn_index[first]) == n].unique() for n in range(3)}
        assert all(len(v) == 1 for v in per_turn.values())
        assert len({round(v.item(), 6) for v in per_turn.values()}) > 1
    logged = trainer.state.log_history[0]
    assert logged["rewards/ArithmeticEnv_turns/mean"] == pytest.approx((1 + 0 + 1) / 3)  # per row: sum over turns


def test_the_episodes_record_each_tokens_turn(tmp_path, model_path):
    trainer = agent_trainer(tmp_path, model_path, turn_advantage="mt_grpo")
    rollout, _ = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    on_turns = rollout.turn_index >= 0
    assert torch.equal(on_turns, rollout.sampled_mask.bool())  # policy tokens, and only they, have a turn
    assert rollout.turn_index[0][on_turns[0]].unique().tolist() == [0, 1, 2]  # SCRIPT: three turns, in order
    assert (rollout.turn_index[0][on_turns[0]].diff() >= 0).all()
    assert policy_turns_of(rollout.sampled_mask[0]) == rollout.turn_index[0].tolist()


def test_turn_credit_misuse_fails_at_construction(tmp_path, model_path):
    tokenizer = tool_tokenizer()
    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=G)
    data = chat_prompts(2)
    with pytest.raises(ValueError, match="no tools or environment_factory"):
        GRPOTrainer(model_path, reward_25, args=GRPOConfig(**base, turn_advantage="mt_grpo"), train_dataset=data)
    with pytest.raises(ValueError, match="needs a score per turn"):
        GRPOTrainer(
            model_path,
            reward_25,
            args=GRPOConfig(**base, turn_advantage="mt_grpo"),
            train_dataset=data,
            processing_class=tokenizer,
            tools=[add],
        )
    with pytest.raises(ValueError, match=r"\['calls_a_tool'\] score each turn .* but turn_advantage=None"):
        GRPOTrainer(
            model_path,
            [reward_25, calls_a_tool],
            args=GRPOConfig(**base),
            train_dataset=data,
            processing_class=tokenizer,
            environment_factory=ArithmeticEnv,
        )
    # Off by default: an environment's get_turn_rewards is not even called.
    trainer = GRPOTrainer(
        model_path,
        reward_25,
        args=GRPOConfig(**base),
        train_dataset=data,
        processing_class=tokenizer,
        environment_factory=ArithmeticEnv,
    )
    assert trainer.reward_names == ["reward_25"]
    with pytest.raises(ValueError, match="turn_advantage='mt' is not one of"):
        GRPOConfig(**base, turn_advantage="mt")
    with pytest.raises(ValueError, match="turn_advantage_coef=0.5 weighs turn-level credit, which is off"):
        GRPOConfig(**base, turn_advantage_coef=0.5)
