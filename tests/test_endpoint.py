"""Any agent through the trainer's OpenAI-compatible endpoint (grpo/generation/endpoint.py, agent_function.py,
call_chains.py): the key and loopback, token-exact chains checked token by token, a re-encoding drift, failures that
are scored and never end the run, batching across episodes, and training with the real `model.generate`."""

import json
import logging
import threading
import urllib.error
import urllib.request

import pytest
import torch
from transformers.utils import get_json_schema

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError
from grpo.generation import Completions
from grpo.generation.endpoint import ChatEndpoint
from grpo.generation.settings import SamplingSettings
from grpo.testing import save_tiny_model
from tests.helpers.agents import SCRIPT, WRONG, ScriptedTurns, add, chat_prompts, multiply, reward_25, tool_tokenizer

G = 4
TOOLS = {"add": add, "multiply": multiply}
SCHEMAS = [get_json_schema(f) for f in TOOLS.values()]


def post(endpoint, body, path="/chat/completions", key=None):
    """POST `body` as JSON with the episode's key (or `key`); the decoded answer, or urllib's HTTPError."""
    request = urllib.request.Request(
        endpoint.base_url + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {endpoint.api_key if key is None else key}"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def calculator_agent(row, endpoint):
    """A plain HTTP agent loop: ask, run the tools the answer calls, send their results back, until an answer
    calls nothing."""
    messages = list(row["prompt"])
    for _ in range(5):
        message = post(endpoint, {"model": endpoint.model, "messages": messages, "tools": SCHEMAS})["choices"][0]
        message = message["message"]
        messages.append(message)
        if not message.get("tool_calls"):
            return {"answer": message["content"]}
        for call in message["tool_calls"]:
            result = TOOLS[call["function"]["name"]](**json.loads(call["function"]["arguments"]))
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": str(result)})
    return {"answer": None}


def openai_agent(row, endpoint):
    """The same loop with an unchanged `openai` client."""
    client = endpoint.client()
    messages = list(row["prompt"])
    for _ in range(5):
        message = client.chat.completions.create(model=endpoint.model, messages=messages, tools=SCHEMAS)
        message = message.choices[0].message
        messages.append(message.model_dump())
        if not message.tool_calls:
            return {"answer": message.content}
        for call in message.tool_calls:
            result = TOOLS[call.function.name](**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(result)})
    return {"answer": None}


def answer_25(completions, answer, **kwargs):
    return [float(a is not None and "25" in a) for a in answer]


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
    save_tiny_model(path, max_position_embeddings=4096)  # prompts with the tools' schemas in bytes run long
    tool_tokenizer().save_pretrained(path)
    return str(path)


def make_trainer(tmp_path, model_path, agent=calculator_agent, scripts=(SCRIPT,), reward=answer_25, **overrides):
    tokenizer = tool_tokenizer()
    trainer = GRPOTrainer(
        model_path,
        reward,
        args=config(tmp_path, **overrides),
        train_dataset=chat_prompts(2),
        processing_class=tokenizer,
        agent_func=agent,
    )
    if scripts is not None:
        trainer.generation = ScriptedTurns(tokenizer, scripts)
    trainer.agent.batch_window = 3600.0  # batches form only when every running episode waits: no timing in tests
    return trainer


def sample(trainer, rows=None):
    return trainer.sample_round(rows or [trainer.train_dataset[0]] * G, trainer.generation)


class Answers:
    """The endpoint's queue, answering each request at once with an empty 200."""

    def __init__(self):
        self.calls = []

    def __call__(self, call):
        self.calls.append(call)
        call.answer(200, {"ok": True})


def test_the_endpoint_binds_to_loopback_and_refuses_requests_without_the_key():
    answers = Answers()
    server = ChatEndpoint(answers, SamplingSettings(max_completion_length=8))
    try:
        assert server.server.server_address[0] == "127.0.0.1" and server.base_url.startswith("http://127.0.0.1:")
        server.open_episodes(["e1"])
        live = server.endpoint("e1")
        body = {"messages": [{"role": "user", "content": "hi"}]}
        for key in ("", "nonsense", f"{server.run_key}x-e1", f"{server.run_key}-e2", "wrong-e1"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                post(live, body, key=key)
            assert refused.value.code == 401
        assert answers.calls == []  # nothing unauthenticated reaches the round
        models = urllib.request.Request(live.base_url + "/models", headers={"Authorization": f"Bearer {live.api_key}"})
        with urllib.request.urlopen(models) as response:
            assert json.loads(response.read())["data"][0]["id"] == live.model
        assert post(live, body) == {"ok": True} and answers.calls[0].episode == "e1"
        for bad, field in (
            ({"messages": "hi"}, "messages"),
            ({**body, "stop": ["x"]}, "stop"),
            ({**body, "temperature": 0.3}, "temperature"),
            ({**body, "tool_choice": "required"}, "tool_choice"),
            ({**body, "logit_bias": {"1": 2}}, "logit_bias"),
        ):
            with pytest.raises(urllib.error.HTTPError) as refused:
                post(live, bad)
            assert refused.value.code == 400
            assert json.loads(refused.value.read())["error"]["param"] == field
        server.close_episodes(["e1"])
        with pytest.raises(urllib.error.HTTPError) as refused:
            post(live, body)
        assert refused.value.code == 401  # an episode's key lasts as long as its episode
    finally:
        server.close()


@pytest.mark.parametrize("agent", [calculator_agent, openai_agent])
def test_an_agent_s_calls_merge_into_the_sampled_tokens_and_rendered_context(tmp_path, model_path, agent):
    if agent is openai_agent:
        pytest.importorskip("openai")
    trainer = make_trainer(tmp_path, model_path, agent)
    rollout, columns = sample(trainer)
    tokenizer = trainer.processing_class
    messages = rollout.completions[0]
    assert [m["role"] for m in messages] == ["assistant", "tool", "assistant", "tool", "assistant"]
    assert columns["answer"] == ["The answer is 25."] * G and columns["agent_error"] == [None] * G
    # Token by token: the row is the chat template's rendering of the whole conversation ...
    row = torch.cat([rollout.prompt_ids[0][rollout.prompt_mask[0].bool()], rollout.completion_ids[0]])
    row = row[torch.cat([rollout.prompt_mask[0], rollout.completion_mask[0]]).bool()]
    conversation = rollout.prompts[0] + [{"role": m["role"], "content": m["content"] or ""} for m in messages]
    for message, text in zip(conversation[1::2][:2], SCRIPT):  # the assistant turns as the policy wrote them
        message["content"] = text
    rendered = tokenizer.apply_chat_template(conversation, tools=SCHEMAS, tokenize=False)
    assert tokenizer.decode(row) + "\n" == rendered  # the template's newline after the last EOS is not sampled
    # ... the policy's tokens are exactly the sampled answers, in order, and the rest (tool answers) is context.
    ids, sampled = rollout.completion_ids[0], rollout.sampled_mask[0].bool()
    turns = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in SCRIPT]
    assert ids[sampled].tolist() == [t for turn in turns for t in turn]
    assert tokenizer.decode(ids[~sampled & rollout.completion_mask[0].bool()]).count("<tool_response>") == 2
    assert torch.equal(rollout.loss_mask, rollout.sampled_mask)
    stats = rollout.episode_stats
    assert (stats["turns"], stats["tool_calls"], stats["dropped_calls"], stats["agent_failures"]) == (
        3 * G,
        2 * G,
        0,
        0,
    )


def test_concurrent_episodes_are_batched_into_one_backend_call_per_turn(tmp_path, model_path):
    trainer = make_trainer(tmp_path, model_path, scripts=(SCRIPT, WRONG))
    sample(trainer)
    # Two episodes answer at once (WRONG), two call the tools twice: 4 rows, then the 2 still running, twice.
    assert [len(call) for call in trainer.generation.calls] == [G, G // 2, G // 2]


def test_a_re_encoding_drift_cannot_reach_the_training_tokens(tmp_path, model_path):
    """The policy samples a byte that is not valid UTF-8 alone: decoded into the answer's text it is U+FFFD, which
    encodes to three other bytes. The agent sends that text back, yet the trained row and the next call's context
    hold the sampled byte."""
    trainer = make_trainer(tmp_path, model_path)
    tokenizer = trainer.processing_class
    lone = tokenizer.convert_tokens_to_ids(tokenizer.convert_ids_to_tokens(tokenizer("é")["input_ids"])[:1])
    assert tokenizer(tokenizer.decode(lone), add_special_tokens=False)["input_ids"] != lone  # it would drift

    class Drifting(ScriptedTurns):
        def generate(self, model, prompt_ids):
            out = super().generate(model, prompt_ids)
            return Completions([lone + ids if ids[0] == tokenizer("<")["input_ids"][0] else ids for ids in out.ids])

    trainer.generation = Drifting(tokenizer)
    rollout, _ = sample(trainer)
    sampled = rollout.completion_ids[0][rollout.sampled_mask[0].bool()].tolist()
    assert sampled[: len(lone)] == lone
    prompt = rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist()
    second_call_context = trainer.generation.calls[1][0]
    assert second_call_context[: len(prompt)] == prompt  # extended, not rendered again from the text
    assert second_call_context[len(prompt) :][: len(lone)] == lone
    assert rollout.episode_stats["dropped_calls"] == 0


def flaky_agent(row, endpoint):
    """Rows 0-3 of a round behave; row 4 raises, row 5 hangs, row 6 sends a malformed request, row 7 returns a
    string instead of a dict."""
    kind = row["prompt"][0]["content"].split()[0]
    if kind == "row=1":
        index = int(row["copy"])
        if index == 0:
            raise RuntimeError("the agent broke")
        if index == 1:
            threading.Event().wait()  # forever: past agent_timeout
        if index == 2:
            post(endpoint, {"messages": "not a list"})
        if index == 3:
            return "a string"
    return calculator_agent(row, endpoint)


def test_failing_hanging_and_malformed_agents_are_scored_failures(tmp_path, model_path, caplog):
    trainer = make_trainer(tmp_path, model_path, flaky_agent, agent_timeout=2.0, agent_failure_reward=-1.0)
    rows = [{**trainer.train_dataset[r], "copy": i} for r in (0, 1) for i in range(G)]
    with caplog.at_level(logging.WARNING, logger="grpo.generation.agent_function"):
        rollout, columns = sample(trainer, rows)
    errors = columns["agent_error"]
    assert errors[:G] == [None] * G
    assert "RuntimeError: the agent broke" in errors[4] and "TimeoutError" in errors[5]
    assert "HTTPError" in errors[6] and "TypeError" in errors[7]
    logged = [r.getMessage() for r in caplog.records]
    for copy, what in ((0, "the agent broke"), (1, "agent_timeout"), (2, "HTTP Error 400"), (3, "returned a str")):
        assert any(f"'copy': {copy}" in line and "row=1" in line and what in line for line in logged), what
    scores = trainer.rounds.local_scores(rollout, columns, None, trainer.state)
    assert scores.rewards[:G, 0].tolist() == [1.0] * G and scores.rewards[G:, 0].tolist() == [-1.0] * G
    assert rollout.episode_stats["agent_failures"] == 3 and rollout.episode_stats["agent_timeouts"] == 1
    assert rollout.loss_mask[G:].sum() == 0  # a failure before any call trains nothing
    trainer.train()  # and the run goes on
    assert trainer.state.global_step == 1


def test_agent_func_misuse_is_refused_when_the_trainer_is_built(tmp_path, model_path):
    def build(agent, **kwargs):
        GRPOTrainer(
            model_path,
            reward_25,
            args=config(tmp_path),
            train_dataset=chat_prompts(2),
            processing_class=tool_tokenizer(),
            agent_func=agent,
            **kwargs,
        )

    with pytest.raises(InputError, match="tools="):
        build(calculator_agent, tools=[add])
    with pytest.raises(InputError, match="must be a function"):
        build("calculator_agent")
    with pytest.raises(InputError, match="two positional arguments"):
        build(lambda row: None)


def chatty_agent(row, endpoint):
    """Two answers of a few tokens, the second after a new user turn, with log-probs asked for."""
    messages, answers = list(row["prompt"]), []
    for _ in range(2):
        reply = post(endpoint, {"messages": messages, "max_tokens": 6, "logprobs": True})
        answers.append(reply)
        messages += [reply["choices"][0]["message"], {"role": "user", "content": "Again."}]
    return {"answer": answers[-1]["choices"][0]["message"]["content"], "replies": answers}


def test_model_generate_serves_episodes_that_train_two_steps(tmp_path, model_path):
    def length(completions, **kwargs):  # a spread for random answers: their characters' code points, summed
        return [float(sum(map(ord, c[-1]["content"] or ""))) for c in completions]

    trainer = make_trainer(
        tmp_path,
        model_path,
        chatty_agent,
        scripts=None,
        reward=length,
        max_steps=2,
        max_completion_length=64,
        num_generations=2,
        per_device_train_batch_size=2,
    )
    tokenizer = trainer.processing_class
    rollout, columns = sample(trainer, [trainer.train_dataset[0]] * 2)
    eos = tokenizer.eos_token_id
    for row, replies in enumerate(columns["replies"]):
        ids = rollout.completion_ids[row][rollout.completion_mask[row].bool()].tolist()
        sampled = rollout.sampled_mask[row][rollout.completion_mask[row].bool()].tolist()
        # The trained row, token by token: answer 1 (sampled), its EOS if it was cut, the user turn (context), answer 2.
        first = sum(sampled[: sampled.index(0)]) if 0 in sampled else len(ids)
        assert [len(r["choices"][0]["logprobs"]["content"]) for r in replies] == [first, sum(sampled) - first]
        assert all(r["usage"]["completion_tokens"] == len(r["choices"][0]["logprobs"]["content"]) for r in replies)
        user_turn = trainer.agent.context_tokens([{"role": "user", "content": "Again."}])
        cut = [eos] if replies[0]["choices"][0]["finish_reason"] == "length" else []
        assert ids[first : first + len(cut) + len(user_turn)] == cut + user_turn
        assert sampled == [1] * first + [0] * (len(cut) + len(user_turn)) + [1] * (
            len(ids) - first - len(cut) - len(user_turn)
        )
        assert all(
            isinstance(t["logprob"], float) and t["logprob"] <= 0
            for r in replies
            for t in r["choices"][0]["logprobs"]["content"]
        )
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 2
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def summarising_agent(row, endpoint):
    """One call, then a call on a rewritten history (a summary), which extends nothing: a new chain."""
    first = post(endpoint, {"messages": list(row["prompt"]), "tools": SCHEMAS})["choices"][0]["message"]
    summary = [{"role": "user", "content": f"So far you said: {first['tool_calls'][0]['function']['name']}. Go on."}]
    post(endpoint, {"messages": summary, "tools": SCHEMAS})
    return None


def test_a_rewritten_history_starts_a_new_chain_and_every_chain_is_trained(tmp_path, model_path):
    trainer = make_trainer(tmp_path, model_path, summarising_agent, reward=reward_25)
    rollout, columns = sample(trainer)
    assert rollout.prompts[0][0]["content"] == "So far you said: add. Go on."  # the latest of two equal chains
    second = trainer.generation.calls[1][0]
    assert second == rollout.prompt_ids[0][rollout.prompt_mask[0].bool()].tolist()  # rendered afresh, not extended
    first = trainer.generation.calls[0][0]  # the first call's chain: its prompt and its sampled answer
    assert [len(extras) for extras in rollout.extra_sequences] == [1] * G
    extra = rollout.extra_sequences[0][0]
    assert extra["prompt_ids"] == first and extra["sampled"] == [1] * len(extra["completion_ids"])
    stats = rollout.episode_stats
    assert (stats["sequences"], stats["dropped_calls"], stats["turns"]) == (2 * G, 0, 2 * G)
    assert columns["agent_error"] == [None] * G


def test_the_extra_sequences_train_as_rows_of_their_own_with_their_episodes_advantage(tmp_path, model_path):
    """Every episode summarises (two chains): the round's rows are the G episodes' latest chains, then their first
    chains, each with the advantage of the episode it came from."""

    def said_25(completions, **kwargs):  # the latest chain ends with a call: its content is None
        return [float("25" in (c[-1]["content"] or "")) for c in completions]

    trainer = make_trainer(tmp_path, model_path, summarising_agent, reward=said_25)
    rollout, columns = sample(trainer)
    scores = trainer.rounds.local_scores(rollout, columns, "train", trainer.state)
    scores = scores._replace(rewards=torch.tensor([[1.0], [0.0], [0.0], [0.5]]))
    scored = trainer.rounds.score_round(rollout, columns, "train", trainer.state, scores)
    prepared = trainer.rounds.prepare(scored, "train", trainer.round_context())
    assert prepared.num_rows == 2 * G and prepared.extra_sequences is None
    assert (
        prepared.advantages[:G].sign().tolist() == [1.0, -1.0, -1.0, 1.0]
        and prepared.advantages[0] > prepared.advantages[3]
    )
    assert torch.equal(prepared.advantages[G:], prepared.advantages[:G])  # each episode's extra chain, in order
    for row, extra in enumerate(rollout.extra_sequences):
        mask = prepared.completion_mask[G + row].bool()
        assert prepared.completion_ids[G + row][mask].tolist() == extra[0]["completion_ids"]
        assert prepared.prompt_ids[G + row][prepared.prompt_mask[G + row].bool()].tolist() == extra[0]["prompt_ids"]
    assert torch.equal(prepared.loss_mask[G:], prepared.sampled_mask[G:])
    micro_batches = trainer.rounds.micro_batches(prepared, "train")
    assert sum(mb.num_rows for mb in micro_batches) == 2 * G
    trainer.train()  # a step over the episodes and their extra chains
    assert trainer.state.global_step == 1


def test_async_generation_serves_the_endpoint_from_the_producer_thread(tmp_path, model_path):
    """With async_generation, rounds are made in the producer thread on the policy's copy: the endpoint is served
    from there, and training goes on (the real model.generate, 2 steps)."""
    trainer = make_trainer(
        tmp_path, model_path, scripts=None, async_generation=True, max_steps=2, max_completion_length=48
    )
    trainer.train()
    assert trainer.state.global_step == 2
    logged = [h for h in trainer.state.log_history if "tools/turns" in h]
    assert len(logged) == 2 and all(h["tools/turns"] >= 1 and h["tools/agent_failures"] == 0 for h in logged)
