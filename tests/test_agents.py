"""Multi-turn episodes with tools (grpo/generation/episodes.py): token-exact rollouts, masks checked token by token,
the loss over the policy's tokens only, budgets, errors, metrics and a TRL-style environment class trained unchanged.
The scripted policy and its tools are in tests/helpers/agents.py."""

import json
import os
import warnings

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError
from grpo.generation import Completions
from grpo.generation.episodes import CHATML_TOOLS_TEMPLATE
from grpo.objective.logprobs import completion_logprobs
from grpo.testing import save_tiny_model, tiny_model, tiny_tokenizer
from tests.helpers.agents import (
    AGENT,
    ONE_CALL,
    SCRIPT,
    WRONG,
    ScriptedTurns,
    add,
    call,
    chat_prompts,
    multiply,
    reward_25,
    talkative_add_trainer,
    tool_tokenizer,
    turn_starts,
)
from tests.helpers.naive import naive_group_advantages, naive_policy_loss
from tests.helpers.scripted import capture_batches

G = 4


def config(tmp_path, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        max_completion_length=1000,
        max_prompt_length=None,
        num_generations=G,
        per_device_train_batch_size=G,
        max_steps=1,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        loss_type="grpo",
    )
    return GRPOConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    # A context of 4,096 positions: episode prompts with the byte-level tools' schemas run to 1,500 tokens, which a
    # model of 1,024 positions is refused for (GRPOTrainer checks that prompts fit the model's context).
    save_tiny_model(path, max_position_embeddings=4096)
    tool_tokenizer().save_pretrained(path)
    return str(path)


def make_trainer(tmp_path, model_path, scripts=(SCRIPT,), tools=(add, multiply), **overrides):
    tokenizer = tool_tokenizer()
    trainer = GRPOTrainer(
        model_path,
        reward_25,
        args=config(tmp_path, **overrides),
        train_dataset=chat_prompts(2),
        processing_class=tokenizer,
        tools=list(tools),
    )
    trainer.generation = ScriptedTurns(tokenizer, scripts)
    return trainer


def test_an_episode_is_the_sampled_tokens_and_the_rendered_tool_answers(tmp_path, model_path):
    trainer = make_trainer(tmp_path, model_path)
    rollout, columns = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    tokenizer = trainer.processing_class
    messages = rollout.completions[0]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert [m["content"] for m in messages[1::2]] == ["5", "25"]
    assert messages[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 3}}
    # Token by token: the whole row is the chat template's rendering of the conversation ...
    row = torch.cat([rollout.prompt_ids[0][rollout.prompt_mask[0].bool()], rollout.completion_ids[0]])
    row = row[torch.cat([rollout.prompt_mask[0], rollout.completion_mask[0]]).bool()]
    conversation = rollout.prompts[0] + [{"role": m["role"], "content": m["content"]} for m in messages]
    schemas = [t.schema for t in trainer.toolbox.tools.values()]
    rendered = tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False)
    assert tokenizer.decode(row) + "\n" == rendered  # the template's newline after the last turn's EOS is not sampled
    # ... and the policy's tokens are exactly the sampled turns, in order; the rest is context.
    ids, sampled = rollout.completion_ids[0], rollout.sampled_mask[0].bool()
    turns = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in SCRIPT]
    assert ids[sampled].tolist() == [t for turn in turns for t in turn]
    assert tokenizer.decode(ids[~sampled & rollout.completion_mask[0].bool()]).count("<tool_response>") == 2
    assert torch.equal(rollout.loss_mask, rollout.sampled_mask)
    assert rollout.episode_stats == {
        "episodes": G,
        "turns": 3 * G,
        "tool_calls": 2 * G,
        "tool_errors": 0,
        "tool_timeouts": 0,
        "parse_failures": 0,
        "budget_cuts": 0,
        "unknown_tools": 0,
    }
    assert columns["environments"] == [None] * G


def test_a_re_encoding_drift_cannot_reach_the_training_tokens(tmp_path, model_path):
    """The policy samples a byte that is not valid UTF-8 alone: decoded, it becomes U+FFFD, which encodes to three
    other bytes. The training row still holds the sampled byte, and the next turn is conditioned on it."""
    trainer = make_trainer(tmp_path, model_path)
    tokenizer = trainer.processing_class
    lone = tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(tokenizer("é")["input_ids"])[:1])
    assert tokenizer(tokenizer.decode(lone), add_special_tokens=False)["input_ids"] != lone  # it would drift

    class Drifting(ScriptedTurns):
        def generate(self, model, prompt_ids):
            out = super().generate(model, prompt_ids)
            return Completions([lone + ids if ids[0] == tokenizer("<")["input_ids"][0] else ids for ids in out.ids])

    trainer.generation = Drifting(tokenizer)
    rollout, _ = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    sampled = rollout.completion_ids[0][rollout.sampled_mask[0].bool()].tolist()
    assert sampled[: len(lone)] == lone
    second_turn_context = trainer.generation.calls[1][0]
    assert second_turn_context[len(rollout.prompt_ids[0][rollout.prompt_mask[0].bool()]) :][: len(lone)] == lone


def test_the_loss_is_the_naive_objective_over_policy_tokens_only(tmp_path):
    """Half of each group calls the tools and answers right, half answers wrong at once. With `dapo` (one mean over
    every loss token of the batch) both the loss and its gradient depend on which tokens count: the logged loss and
    the SGD update equal, in float64, the objective built token by token over the sampled tokens alone, and differ
    from the same objective with the tool answers counted. (On-policy `grpo` with zero-mean advantages would log 0
    whatever the mask.)"""
    tokenizer = tool_tokenizer()
    model = tiny_model(tokenizer).double()  # float64: the update is compared to a naive gradient within rounding
    initial = tiny_model(tokenizer).double()
    initial.load_state_dict(model.state_dict())
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**AGENT, "loss_type": "dapo", "beta": 0.0})
    trainer = GRPOTrainer(
        model, reward_25, args=args, train_dataset=chat_prompts(4), processing_class=tokenizer, tools=[add, multiply]
    )
    trainer.generation = ScriptedTurns(tokenizer, (SCRIPT, WRONG))
    batches = capture_batches(trainer)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    (batch,) = batches
    assert (batch.loss_mask.sum(1) < batch.completion_mask.sum(1)).any()  # some rows have tool answers
    rewards = [float("25" in tokenizer.decode(row)) for row in batch.completion_ids]
    advantages = torch.tensor(naive_group_advantages(rewards, G), dtype=torch.float64)
    assert torch.allclose(batch.advantages.double(), advantages, atol=1e-6) and advantages.abs().sum() > 0
    advantages = batch.advantages.double()  # the trainer's float32 numbers: what is compared below is the mask

    def naive(mask):
        """The naive loss over the tokens of `mask` and the SGD update it gives, from the initial weights."""
        initial.zero_grad()
        logps, _ = completion_logprobs(
            initial, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
        )
        loss = naive_policy_loss(logps, logps.detach(), None, advantages, mask, "dapo", 0.0, 0.2, 0.2)
        loss.backward()
        return loss.item(), {n: -AGENT["learning_rate"] * p.grad for n, p in initial.named_parameters()}

    policy = policy_tokens_mask(batch.completion_ids, tokenizer)  # found from the script, not from the trainer's mask
    assert torch.equal(batch.loss_mask, policy)
    expected_loss, expected_update = naive(policy)
    assert trainer.state.log_history[0]["loss"] == pytest.approx(expected_loss, rel=1e-6)
    update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    scale = max(u.abs().max() for u in expected_update.values())
    assert scale > 0 and all(
        torch.allclose(update[n], u, rtol=0, atol=1e-9 * scale) for n, u in expected_update.items()
    )
    # Not vacuous: with the tool answers counted, the loss and the update are others.
    with_tools_loss, with_tools_update = naive(batch.completion_mask)
    assert with_tools_loss != pytest.approx(expected_loss, rel=1e-3)
    assert max((with_tools_update[n] - u).abs().max() for n, u in expected_update.items()) > 1e-3 * scale
    logged = trainer.state.log_history[0]
    assert logged["tools/call_frequency"] == pytest.approx(1.0)  # 2 calls in half the episodes, 0 in the others
    assert logged["tools/turns"] == pytest.approx(2.0)
    policy_tokens = [sum(len(tokenizer(t)["input_ids"]) + 1 for t in s) for s in (SCRIPT, WRONG)]
    assert logged["completions/mean_length"] == pytest.approx(sum(policy_tokens) / 2)  # tool answers not counted


def policy_tokens_mask(completion_ids, tokenizer):
    """(B, T) 1 on the tokens the scripted policy wrote (SCRIPT's turns in rows with tool answers, WRONG's in the
    others), found in order in each row; 0 on tool answers and padding."""
    mask = torch.zeros_like(completion_ids)
    for row, ids in enumerate(completion_ids.tolist()):
        script = SCRIPT if "<tool_response>" in tokenizer.decode(ids) else WRONG
        at = 0
        for text in script:
            turn = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            at = next(i for i in range(at, len(ids)) if ids[i : i + len(turn)] == turn)
            mask[row, at : at + len(turn)] = 1
            at += len(turn)
    return mask


def test_turn_limit_and_token_budget(tmp_path, model_path):
    trainer = make_trainer(tmp_path, model_path, max_tool_calling_iterations=1)
    rollout, _ = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    assert [m["role"] for m in rollout.completions[0]] == ["assistant", "tool", "assistant"]  # the 2nd call never runs
    assert rollout.episode_stats["tool_calls"] == G and rollout.episode_stats["turns"] == 2 * G

    first = len(trainer.processing_class(SCRIPT[0])["input_ids"]) + 1
    trainer = make_trainer(tmp_path, model_path, max_completion_length=first + 5)  # no room for the tool answer
    rollout, _ = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    assert [m["role"] for m in rollout.completions[0]] == ["assistant"]
    assert rollout.completion_mask.sum(1).tolist() == [first] * G and not rollout.is_truncated.any()
    assert rollout.episode_stats["budget_cuts"] == G

    trainer = make_trainer(tmp_path, model_path, max_completion_length=first - 3)  # the first turn itself is cut
    rollout, _ = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    assert rollout.is_truncated.all() and rollout.completion_mask.sum(1).tolist() == [first - 3] * G


def test_each_turn_asks_for_no_more_than_the_budget_left(tmp_path, model_path):
    """Turn k asks the backend for at most max_completion_length minus what the episode already holds (the most left
    among the rows going), not for a whole max_completion_length each time. Rows follow SCRIPT or ONE_CALL, so the
    episodes going at the third turn are the SCRIPT ones."""
    trainer = make_trainer(tmp_path, model_path, scripts=(SCRIPT, ONE_CALL), max_completion_length=300)
    rollout, _ = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    starts = [turn_starts(rollout, row) for row in range(G)]
    assert sorted(map(len, starts)) == [2, 2, 3, 3]
    expected = [max(300 - s[k] for s in starts if len(s) > k) for k in range(3)]
    assert trainer.generation.limits == expected
    assert expected[0] == 300 and expected[2] < expected[1] < 300


def test_model_generate_is_asked_for_the_budget_left(tmp_path):
    """The same through the default backend, `model.generate` with the KV cache carried between turns: the random
    talkative model writes turns of a few tokens, every one read as a call, so episodes run three turns."""
    trainer = talkative_add_trainer(
        tmp_path, config(tmp_path, max_completion_length=200, max_tool_calling_iterations=2)
    )
    asked, generate = [], trainer.model.generate

    def recording(*args, generation_config, **kwargs):
        out = generate(*args, generation_config=generation_config, **kwargs)
        asked.append((generation_config.max_new_tokens, out.sequences.shape[1] - kwargs["input_ids"].shape[1]))
        return out

    trainer.model.generate = recording
    rollout, _ = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    starts = [turn_starts(rollout, row) for row in range(G)]
    assert max(map(len, starts)) == 3
    expected = [max(200 - s[k] for s in starts if len(s) > k) for k in range(3)]
    assert [limit for limit, _ in asked] == expected and expected[2] < expected[1] < expected[0] == 200
    assert all(new <= limit for limit, new in asked)


def fails(a: int) -> int:
    """Always fails.

    Args:
        a: anything
    """
    raise RuntimeError(f"no luck with {a}")


def test_tool_errors_and_parse_failures_are_answered_and_counted(tmp_path, model_path):
    script = [call("fails", a=1), "<tool_call>\n{not json\n</tool_call>", call("nope", a=1), "done"]
    trainer = make_trainer(tmp_path, model_path, scripts=(script,), tools=(fails,))
    rollout, _ = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    answers = [m["content"] for m in rollout.completions[0] if m["role"] == "tool"]
    assert answers[0].startswith("Error:") and "no luck with 1" in answers[0]
    assert len(answers) == 3 and all(a.startswith("Error") for a in answers)
    stats = rollout.episode_stats
    assert (stats["tool_errors"], stats["parse_failures"], stats["turns"]) == (G, 2 * G, 4 * G)

    trainer = make_trainer(tmp_path, model_path, scripts=(script,), tools=(fails,), tool_errors="raise")
    with pytest.raises(Exception, match="fails"):
        trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)


def file_name(x: int) -> str:
    """Name a file whose name is not UTF-8.

    Args:
        x: anything
    """
    return os.fsdecode(b"report-\xff.txt")  # a lone surrogate, which no tokenizer encodes


def test_what_the_policy_writes_and_what_a_tool_answers_cannot_end_the_run(tmp_path, model_path):
    """Issue 50, end to end: a call nested 1,100 `[` deep (Python's JSON parser raised RecursionError) is a counted
    malformed call, answered; a tool answer holding a lone surrogate (tokenization raised TypeError) is shown with
    U+FFFD and the tool named; the episode goes on to its last turn."""
    script = ["<tool_call>" + "[" * 1100 + "</tool_call>", call("file_name", x=1), "done"]
    # A budget for the 1,100-token first turn (byte tokens) and the turns after it.
    trainer = make_trainer(tmp_path, model_path, scripts=(script,), tools=(file_name,), max_completion_length=1400)
    with pytest.warns(UserWarning, match="'file_name' answered text holding lone surrogates"):
        rollout, _ = trainer.sample_round([trainer.train_dataset[0]] * G, trainer.generation)
    answers = [m["content"] for m in rollout.completions[0] if m["role"] == "tool"]
    assert answers[0].startswith("Error: the tool call nests deeper than") and answers[1] == "report-\ufffd.txt"
    assert rollout.completions[0][-1]["content"] == "done"
    stats = rollout.episode_stats
    assert (stats["parse_failures"], stats["tool_calls"], stats["turns"]) == (G, G, 3 * G)


def test_a_template_that_drops_tool_answers_is_refused_at_construction(tmp_path, model_path):
    """A template that renders `tools` but not `role: tool` messages trained silently without the tool answers: the
    policy never saw what its calls returned, while the metrics counted them answered (issue 50). One that fails on
    a tool message (e.g. wanting a `tool_call_id`) failed at the first tool turn."""
    head = "{% elif message['role'] == 'tool' %}"
    start = CHATML_TOOLS_TEMPLATE.index(head)
    tool_branch = CHATML_TOOLS_TEMPLATE[start : CHATML_TOOLS_TEMPLATE.index("{% else %}", start)]
    for body, words in [
        ("", "renders the tools but not the tool answers"),
        ("{{ raise_exception('tool messages need a tool_call_id') }}", "fails on a tool answer.*tool_call_id"),
    ]:
        tokenizer = tool_tokenizer()
        tokenizer.chat_template = CHATML_TOOLS_TEMPLATE.replace(tool_branch, head + body)
        with pytest.raises(InputError, match=f"{words}.*CHATML_TOOLS_TEMPLATE"):
            GRPOTrainer(
                model_path,
                reward_25,
                args=config(tmp_path),
                train_dataset=chat_prompts(2),
                processing_class=tokenizer,
                tools=[add],
            )


def test_misuse_fails_at_construction(tmp_path, model_path):
    plain = tiny_tokenizer()  # its template ignores `tools`
    with pytest.raises(InputError, match="does not render the tools"):
        GRPOTrainer(
            model_path,
            reward_25,
            args=config(tmp_path),
            train_dataset=chat_prompts(2),
            processing_class=plain,
            tools=[add],
        )

    def undocumented(a: int) -> int:
        return a

    with pytest.raises(ValueError, match="undocumented"):
        GRPOTrainer(model_path, reward_25, args=config(tmp_path), train_dataset=chat_prompts(2), tools=[undocumented])
    with pytest.raises(ValueError, match="tool_errors"):
        config(tmp_path, tool_errors="ignore")


class IncrementEnv:
    """The environment of TRL's documentation (an episode's counter, its `increment` tool and `get_reward`), as a
    TRL user writes it."""

    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.target = kwargs["target"]
        return f" Reach {self.target}."

    def increment(self, step: int) -> int:
        """Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter == self.target)


def test_a_trl_style_environment_trains_unchanged(tmp_path, model_path):
    tokenizer = tool_tokenizer()
    data = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": f"row={i} Count."}] for i in range(2)], "target": [3, 5]}
    )
    seen = {}

    def sees_the_environments(prompts, completions, environments, **kwargs):
        seen["environments"], seen["completions"] = environments, completions
        return [0.0] * len(completions)

    script = [call("increment", step=3), "Done."]
    trainer = GRPOTrainer(
        model_path,
        sees_the_environments,
        args=config(tmp_path),
        train_dataset=data,
        processing_class=tokenizer,
        environment_factory=IncrementEnv,
    )
    trainer.generation = ScriptedTurns(tokenizer, [script])
    assert trainer.reward_names == ["sees_the_environments", "IncrementEnv"]
    trainer.train()
    environments = seen["environments"]
    assert len({id(e) for e in environments}) == G  # one object per episode
    assert all(e.counter == 3 for e in environments)
    assert "Reach" in trainer.processing_class.decode(trainer.generation.calls[0][0])  # reset's text in the prompt
    logged = trainer.state.log_history[0]
    row_targets = {e.target for e in environments}
    assert logged["rewards/IncrementEnv/mean"] == pytest.approx(float(row_targets == {3}))
    assert seen["completions"][0][1] == {"role": "tool", "name": "increment", "content": "3"}


class CodingEnv:
    """TRL's multiple-environments example, coding half: reset self-samples the task and returns the prompt."""

    def reset(self, **kwargs) -> str:
        self.n = 6
        self.ran = []
        return f"Compute the {self.n}th Fibonacci number."

    def run_code(self, code: str) -> str:
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        self.ran.append(code)
        return "8"  # a stand-in: the test's policy only ever asks for fib(6)


class GameEnv:
    """The game half: a `move` tool whose state is the position reached."""

    def reset(self, **kwargs) -> str:
        self.position = 0
        return "Reach the goal tile."

    def move(self, action: str) -> str:
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        self.position += 1 if action == "right" else 0
        return "goal" if self.position == 1 else "empty"


def test_trl_multiple_environments_example_trains_unchanged(tmp_path, model_path):
    """TRL's documented mix of tasks: a dict of factories, a data set whose `environment` column routes each row,
    prompts that come from reset, a reward function that branches on the environment's type, and
    each episode offered only its own environment's tool."""
    tokenizer = tool_tokenizer()
    seen = {}

    def reward_func(completions, environments, **kwargs):
        seen["environments"], seen["completions"] = environments, completions
        return [float(bool(e.ran)) if isinstance(e, CodingEnv) else float(e.position == 1) for e in environments]

    coding, game = [call("run_code", code="print(8)"), "It is 8."], [call("move", action="right"), "Reached."]
    trainer = GRPOTrainer(
        model_path,
        reward_func,
        args=config(tmp_path, per_device_train_batch_size=2 * G, shuffle_dataset=False),
        # TRL's rows hold only `environment`; here a `prompt` column is required (empty: reset's string is the prompt).
        train_dataset=Dataset.from_dict(
            {"environment": ["coding", "game"], "prompt": [[{"role": "user", "content": ""}]] * 2}
        ),
        processing_class=tokenizer,
        environment_factory={"coding": CodingEnv, "game": GameEnv},
    )
    trainer.generation = ScriptedTurns(tokenizer, [coding] * G + [game] * G)
    trainer.train()
    environments = seen["environments"]
    assert [type(e) for e in environments] == [CodingEnv] * G + [GameEnv] * G
    assert all(e.ran == ["print(8)"] for e in environments[:G]) and all(e.position == 1 for e in environments[G:])
    assert seen["completions"][0][1]["content"] == "8" and seen["completions"][G][1]["content"] == "goal"
    # The prompt is reset's string, and each episode saw only its own environment's tool.
    first_coding, first_game = (tokenizer.decode(trainer.generation.calls[0][r]) for r in (0, G))
    assert "Fibonacci" in first_coding and '"run_code"' in first_coding and '"move"' not in first_coding
    assert "goal tile" in first_game and '"move"' in first_game and '"run_code"' not in first_game
    assert trainer.state.log_history[0]["reward"] == 1.0


def test_string_prompts_with_tools_fail_at_construction(tmp_path, model_path):
    with pytest.raises(InputError, match="Tools need conversational prompts"):
        GRPOTrainer(
            model_path,
            reward_25,
            args=config(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": ["What is 2 + 3?"] * 2}),
            processing_class=tool_tokenizer(),
            tools=[add],
        )


def test_the_completions_table_shows_the_tool_turns(tmp_path, model_path, capsys):
    trainer = make_trainer(tmp_path, model_path, log_completions=True, num_completions_to_print=1)
    trainer.train()
    table = capsys.readouterr().out
    assert "add: 5" in table and "multiply: 25" in table  # the tools' answers, by tool name
    logged = [json.loads(line) for line in open(tmp_path / "out" / "completions.jsonl")]
    assert [m["role"] for m in logged[0]["completion"]] == ["assistant", "tool", "assistant", "tool", "assistant"]


def test_async_generation_runs_the_episodes_in_the_producer(tmp_path, model_path):
    tokenizer = tool_tokenizer()
    args = config(tmp_path, async_generation=True, max_staleness=0, max_steps=2)
    trainer = GRPOTrainer(
        model_path,
        reward_25,
        args=args,
        train_dataset=chat_prompts(2),
        processing_class=tokenizer,
        tools=[add, multiply],
    )
    scripted = ScriptedTurns(tokenizer, (SCRIPT, WRONG))
    trainer.generation.backend = scripted  # the sampler inside the shared engine
    trainer.train()
    assert [h["tools/turns"] for h in trainer.state.log_history[:2]] == [2.0, 2.0]  # 3 turns and 1, per group
    assert len(scripted.calls) == 2 * 3  # two rounds of three turns, all in the producer thread


def test_a_long_episode_prompt_loses_whole_turns_keeps_the_tool_schemas_and_is_counted(tmp_path, model_path):
    """With max_prompt_length set, an episode's conversation loses its oldest whole turns; the system turn that
    carries the tools' schemas and the last turn stay, and the cut is counted in prompts/turns_cut. One whose schemas
    and last turn alone are too long is refused, naming the schemas."""
    tokenizer = tool_tokenizer()
    question = {"role": "user", "content": "What is 2 + 3, then times 5?"}
    shot = [{"role": "user", "content": "x" * 1500 + " An example."}, {"role": "assistant", "content": "25"}]
    data = Dataset.from_dict({"prompt": [[*shot, question]] * 2})
    trainer = GRPOTrainer(
        model_path,
        reward_25,
        args=config(tmp_path, max_prompt_length=1500),  # the byte-level system turn with two schemas: ~1,000 tokens
        train_dataset=data,
        processing_class=tokenizer,
        tools=[add, multiply],
    )
    trainer.generation = ScriptedTurns(tokenizer, [SCRIPT])
    trainer.train()
    first_context = tokenizer.decode(trainer.generation.calls[0][0])
    assert first_context.startswith("<|im_start|>system\nYou can call functions.")  # the schemas survived
    assert '"name": "multiply"' in first_context and "x" * 10 not in first_context  # the example turn went whole
    assert first_context.endswith("then times 5?<|im_end|>\n<|im_start|>assistant\n")
    logged = trainer.state.log_history[0]
    assert logged["prompts/truncated"] == 1.0 and logged["prompts/turns_cut"] == 1.0
    # Without the schemas (as the trainer reads the rows when built) it fits; with them, its one turn does not.
    alone = Dataset.from_dict({"prompt": [[{"role": "user", "content": "y" * 800 + " What is 2 + 3?"}]] * 2})
    trainer = GRPOTrainer(
        model_path,
        reward_25,
        args=config(tmp_path, max_prompt_length=1500),
        train_dataset=alone,
        processing_class=tokenizer,
        tools=[add, multiply],
    )
    with pytest.raises(InputError, match=r"last turn alone are \d+ tokens \(with the tools' schemas\)"):
        trainer.sample_round([alone[0]] * 4, trainer.generation)


@pytest.mark.parametrize("weights", [[2.0], [2.0, 3.0]], ids=["trl-one-per-function", "one-per-reward"])
def test_reward_weights_count_the_functions_given_as_in_trl(tmp_path, model_path, weights):
    """TRL's convention: one weight per reward function given, each environment's get_reward weighing 1; a list with
    an entry for the environment reward too is taken as written."""
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": "Count."}]] * 2, "target": [3, 3]})

    def one(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    trainer = GRPOTrainer(
        model_path,
        one,
        args=config(tmp_path, reward_weights=weights),
        train_dataset=data,
        processing_class=tool_tokenizer(),
        environment_factory=IncrementEnv,
    )
    trainer.generation = ScriptedTurns(trainer.processing_class, [[call("increment", step=3), "Done."]])
    assert trainer.reward_names == ["one", "IncrementEnv"]
    trainer.train()
    # Both rewards are 1 on every row (the counter reaches the target): the reward is the sum of the weights.
    assert trainer.state.log_history[0]["reward"] == pytest.approx(sum(weights) + (1.0 if len(weights) == 1 else 0.0))


def test_two_names_for_one_environment_class_score_its_episodes_once(tmp_path, model_path):
    """A dict environment_factory mapping two names to the same class: one `IncrementEnv` reward (TRL dedupes the
    class), so a reward of 1 is logged as 1, not as 2 under `IncrementEnv` and `IncrementEnv_2`."""
    data = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": "Count."}]] * 2, "target": [3, 3], "environment": ["a", "b"]}
    )
    trainer = GRPOTrainer(
        model_path,
        None,
        args=config(tmp_path, reward_weights=None),
        train_dataset=data,
        processing_class=tool_tokenizer(),
        environment_factory={"a": IncrementEnv, "b": IncrementEnv},
    )
    trainer.generation = ScriptedTurns(trainer.processing_class, [[call("increment", step=3), "Done."]])
    assert trainer.reward_names == ["IncrementEnv"]
    trainer.train()
    assert trainer.state.log_history[0]["reward"] == pytest.approx(1.0)


def test_tools_that_are_not_a_list_are_refused_naming_the_fix(tmp_path, model_path):
    """`tools=multiply` failed with "'function' object is not iterable" (issue 50)."""
    for tools, words in [(multiply, r"tools=multiply is a single function.*tools=\[multiply\]"), ("add", "list of")]:
        with pytest.raises(ValueError, match=words):
            GRPOTrainer(
                model_path,
                reward_25,
                args=config(tmp_path),
                train_dataset=chat_prompts(2),
                processing_class=tool_tokenizer(),
                tools=tools,
            )


def test_tool_settings_without_tools_are_warned_about_and_defaults_are_not(tmp_path, model_path, recwarn):
    """max_tool_calling_iterations and tool_timeout did nothing without tools, without a word (issue 50)."""
    build = dict(reward_funcs=reward_25, train_dataset=chat_prompts(2), processing_class=tool_tokenizer())
    GRPOTrainer(model_path, args=config(tmp_path), **build)
    assert not [w for w in recwarn if "no tools" in str(w.message)]
    with pytest.warns(UserWarning, match=r"max_tool_calling_iterations=3, tool_timeout=5\.0 set, but this run has no"):
        GRPOTrainer(model_path, args=config(tmp_path, max_tool_calling_iterations=3, tool_timeout=5.0), **build)


def test_resuming_with_other_tools_warns_naming_them(tmp_path, model_path):
    """A resume from a checkpoint of a run with other tools was silent (issue 50): the checkpoint records the tool
    set (names and schema digests) and the resume names what was added, removed or described otherwise."""
    first = make_trainer(tmp_path, model_path, tools=(add, multiply), save_strategy="steps", save_steps=1)
    first.train()

    def add_numbers(a: float, b: float) -> float:  # `add` again, described otherwise
        """Add two numbers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    add_numbers.__name__ = "add"
    changed = make_trainer(tmp_path, model_path, tools=(add_numbers, fails), max_steps=2)
    with pytest.warns(
        UserWarning,
        match=r"other tools .*\(added \['fails'\]; removed \['multiply'\]; described "
        r"otherwise \['add'\]\).*Pass the same tools",
    ):
        changed.train(resume_from_checkpoint=True)

    same = make_trainer(tmp_path, model_path, tools=(add, multiply), max_steps=2, save_strategy="steps", save_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    assert not [w for w in caught if "other tools" in str(w.message)]
