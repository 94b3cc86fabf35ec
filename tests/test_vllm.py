"""A real `grpo vllm-serve` (vLLM's CPU build) on a tiny model, with the trainer on the other side.

Runs in the vLLM environment: `make test-vllm` (it builds `.venv-vllm`). Each server takes about 15 s to start, so
one server serves the whole module, except the tests that need their own (two engines; killed mid-run). Every server
requires the test's API key (the module's server by --api-key, the others through GRPO_VLLM_API_KEY), and
GRPO_VLLM_API_KEY carries it to every client here, the trainers' included.
"""

import copy
import json
import os
import re
import signal
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainerCallback

pytest.importorskip("vllm", reason="needs vLLM: run `make test-vllm`")

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo.generation.policy_weights import checkpoint_tensors  # noqa: E402
from grpo.generation.vllm.client import VLLMClient, VLLMServerError  # noqa: E402
from grpo.testing import save_tiny_model  # noqa: E402
from tests.helpers.agents import talkative_add_trainer, talkative_agent_trainer  # noqa: E402
from tests.helpers.net import free_port, launch_two_processes  # noqa: E402
from tests.helpers.vllm_server import start_server, stop_server  # noqa: E402

pytestmark = pytest.mark.vllm

G = 4  # completions per prompt
KEY = "test-api-key-5c1f0e9a"


@pytest.fixture(scope="module", autouse=True)
def api_key_in_the_environment():
    """The trainer's side: every client in this module, and the two-process run's (it inherits the environment),
    sends this key. A server without a key ignores it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRPO_VLLM_API_KEY", KEY)
        yield


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory, api_key_in_the_environment):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    process, client = start_server(model_path, port, log_path, KEY, "--api-key", KEY)
    yield port, client
    stop_server(process)


def _config(tmp_path, port, **overrides):
    settings = dict(
        output_dir=str(tmp_path / "out"),
        use_vllm=True,
        vllm_server_port=port,
        vllm_group_port=free_port(),
        vllm_server_timeout=60,
        per_device_train_batch_size=8,
        num_generations=G,
        max_completion_length=12,
        max_steps=1,
        # A large step so that one update visibly changes the greedy completion of the tiny random model.
        learning_rate=0.05,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
    )
    return GRPOConfig(**{**settings, **overrides})


def _dataset():
    return Dataset.from_dict({"prompt": ["hello there", "count to three", "abc", "xyz"] * 4})


def _reward(prompts, completions, **kwargs):
    # Rewards letters, so that groups have a spread and the step moves the weights.
    return [sum(ch.isalpha() for ch in c) / 10 for c in completions]


PROMPT = [71, 68, 75, 75, 78]  # five byte tokens


def _server_greedy(client, prompt=PROMPT, tokens=10):
    reply = client.generate([prompt], n=1, max_tokens=tokens, temperature=0.0, logprobs=False)
    return reply["completion_ids"][0]


def _trainer_greedy(model, prompt=PROMPT, tokens=10):
    model.eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()[:tokens]


def test_generate_returns_n_completions_per_prompt_with_logprobs(server):
    _, client = server
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    reply = client.generate(prompts, n=G, max_tokens=6, seed=3, temperature=1.0)
    assert len(reply["completion_ids"]) == len(prompts) * G
    assert all(1 <= len(ids) <= 6 for ids in reply["completion_ids"])
    assert [len(lp) for lp in reply["logprobs"]] == [len(ids) for ids in reply["completion_ids"]]
    assert all(lp <= 0 for row in reply["logprobs"] for lp in row)
    # The G samples of a prompt differ (each gets its own seed), and the same request gives the same samples.
    first = [tuple(ids) for ids in reply["completion_ids"][:G]]
    assert len(set(first)) > 1
    again = client.generate(prompts, n=G, max_tokens=6, seed=3, temperature=1.0)
    assert again["completion_ids"] == reply["completion_ids"]


def _raw_request(port, path, payload=None, key=None):
    """(status, JSON answer) of one request, with `key` as its bearer key or no Authorization header."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = None if payload is None else json.dumps(payload).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_keyed_server_refuses_every_request_without_the_key(server):
    port, _ = server
    group_port = free_port()
    requests = [
        ("/health", None),
        ("/generate", {"prompts": [[1, 2]], "n": 1}),
        ("/init_communicator", {"port": group_port, "timeout": 5, "token": "0" * 64}),
        ("/update_weights", {"version": 99}),
        ("/reset_prefix_cache", {}),
        ("/close_communicator", {}),
        ("/openapi.json", None),
    ]
    for path, payload in requests:
        for key in (None, "not-the-key"):
            status, answer = _raw_request(port, path, payload, key)
            assert status == 401 and "Authorization: Bearer <key>" in answer["detail"], (path, key, answer)
    # The refused /init_communicator opened no weight-sync store: nothing listens on its port.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", group_port), timeout=2).close()
    # With the key the same requests go through (the trainer tests below sync weights through this server).
    status, answer = _raw_request(port, "/generate", {"prompts": [[1, 2]], "n": 1, "max_tokens": 2}, KEY)
    assert status == 200 and len(answer["completion_ids"]) == 1
    status, answer = _raw_request(port, "/update_weights", {"version": 99}, KEY)
    assert status == 409  # past the key check; no group is open yet
    # The trainer's client without the key says what to set.
    with pytest.raises(
        VLLMServerError, match="requires an API key and got no API key.*Set the environment variable GRPO_VLLM_API_KEY"
    ):
        VLLMClient(port=port, api_key="").generate([[1, 2]], n=1)


def test_malformed_requests_get_a_4xx_with_the_reason(server):
    _, client = server
    with pytest.raises(VLLMServerError, match="answered 422.*prompts"):
        client.request("/generate", {"prompts": [], "n": 2})
    with pytest.raises(VLLMServerError, match="answered 422.*extra_forbidden"):
        client.request("/generate", {"prompts": [[1, 2]], "nn": 2})
    with pytest.raises(VLLMServerError, match="answered 400.*out of vocabulary"):
        client.request("/generate", {"prompts": [[10**7]], "n": 1})
    # The engine is still fine afterwards.
    assert len(client.generate([[1, 2, 3]], n=2, max_tokens=2)["completion_ids"]) == 2


def test_after_a_step_and_a_sync_the_server_generates_like_the_trainer(server, model_path, tokenizer, tmp_path):
    port, client = server
    trainer = GRPOTrainer(
        str(model_path), _reward, args=_config(tmp_path, port), train_dataset=_dataset(), processing_class=tokenizer
    )
    # The trainer reaches the keyed server with the key from GRPO_VLLM_API_KEY alone.
    assert trainer.generation.client.headers["Authorization"] == f"Bearer {KEY}"
    policy = trainer.accelerator.unwrap_model(trainer.model)
    trainer.generation.sync_weights(policy, version=0)
    before = _server_greedy(client)
    assert before == _trainer_greedy(policy)

    trainer.train()
    trainer.generation.sync_weights(policy, version=trainer.state.global_step)
    after = _server_greedy(client)
    assert after == _trainer_greedy(policy)  # the server holds the trained weights
    assert after != before  # and they really moved
    assert trainer.generation.last_sync["buckets"] >= 1

    # The engine's log-probs of the sampled tokens match the trainer's (both float32): ratio ~ 1.
    logs = trainer.state.log_history[0]
    assert logs["sampling/sampling_logp_difference/max"] < 1e-3
    assert abs(logs["sampling/importance_sampling_ratio/mean"] - 1) < 1e-3


def test_weights_sync_in_many_small_buckets(server, model_path, tokenizer, tmp_path):
    port, client = server
    # Buckets of 32 KiB split the tiny model's layers across buckets; the engine must still load every tensor.
    args = _config(tmp_path, port, vllm_sync_bucket_mb=1 / 32)
    trainer = GRPOTrainer(str(model_path), _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    policy = trainer.accelerator.unwrap_model(trainer.model)
    with torch.no_grad():
        for param in policy.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    trainer.generation.sync_weights(policy, version=7)
    assert trainer.generation.last_sync["buckets"] > 5
    assert _server_greedy(client) == _trainer_greedy(policy)


def test_lora_weights_are_merged_before_the_sync(server, model_path, tokenizer, tmp_path):
    peft = pytest.importorskip("peft")
    port, client = server
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora)
    with torch.no_grad():  # LoRA's B starts at zero; give the adapters a visible effect
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    trainer = GRPOTrainer(
        model, _reward, args=_config(tmp_path, port), train_dataset=_dataset(), processing_class=tokenizer
    )
    policy = trainer.accelerator.unwrap_model(trainer.model)
    trainer.generation.sync_weights(policy, version=11)
    assert _server_greedy(client) == _trainer_greedy(policy)
    merged = policy.merge_and_unload()  # the same weights, merged by PEFT itself
    assert _server_greedy(client) == _trainer_greedy(merged)


@pytest.fixture
def lora_server(model_path, tmp_path):
    # Stopped after its test: a third engine kept alive beside the later tests' own servers starves them on CPU.
    port = free_port()
    log_path = tmp_path / "lora-server.log"
    process, client = start_server(model_path, port, log_path, KEY, "--enable-lora", "--max-lora-rank", "8")
    yield port, client
    stop_server(process)


def _lora_model(model_path, seed):
    peft = pytest.importorskip("peft")
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, lora)
    torch.manual_seed(seed)
    with torch.no_grad():  # LoRA's B starts at zero; give the adapter a visible effect
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model


def test_a_lora_server_gets_the_adapter_alone_and_generates_with_it(
    lora_server, server, model_path, tokenizer, tmp_path
):
    port, client = lora_server
    assert client.info["lora"] is True and client.info["max_lora_rank"] == 8
    base_greedy = _server_greedy(client)  # no adapter yet: the base model
    trainer = GRPOTrainer(
        _lora_model(model_path, seed=1),
        _reward,
        args=_config(tmp_path, port),
        train_dataset=_dataset(),
        processing_class=tokenizer,
    )
    policy = trainer.accelerator.unwrap_model(trainer.model)
    with policy.disable_adapter():
        assert _trainer_greedy(policy) == base_greedy
    adapter = [p for name, p in policy.named_parameters() if ".lora_" in name]
    trainer.generation.sync_weights(policy, version=0)
    sync = trainer.generation.last_sync
    # Only the adapter went over the wire: its 12 tensors (3 modules x 2 layers x A, B), in float32.
    assert sync["mode"] == "adapter" and sync["tensors"] == len(adapter) == 12
    assert sync["bytes"] == sum(p.numel() * 4 for p in adapter)
    assert sync["bytes"] < sum(p.numel() * 4 for _, p in checkpoint_tensors(policy)) / 20
    # The server generates with the adapter: like the trainer's PEFT model, and not like the base model.
    with_adapter = _server_greedy(client)
    assert with_adapter == _trainer_greedy(policy) and with_adapter != base_greedy

    # Another adapter under the next version replaces it (a new LoRA id: no stale adapter from vLLM's cache).
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    trainer.generation.sync_weights(policy, version=1)
    assert _server_greedy(client) == _trainer_greedy(policy) != with_adapter

    # A training step, then its sync: the engine's log-probs match the trainer's (ratio ~ 1).
    trainer.generation.synced_version = None
    trainer.train()
    trainer.generation.sync_weights(policy, version=trainer.state.global_step + 10)
    assert _server_greedy(client) == _trainer_greedy(policy)
    logs = trainer.state.log_history[0]
    assert logs["sampling/sampling_logp_difference/max"] < 1e-3

    # Merged weights (a policy that is not a PEFT model) replace the base weights and drop the adapter.
    merged = copy.deepcopy(policy).merge_and_unload()
    pusher = VLLMClient(port=port, group_port=free_port(), timeout=60)
    pusher.wait_until_ready()
    pusher.update_weights(checkpoint_tensors(merged), version=99, bucket_bytes=1 << 20)
    assert _server_greedy(client) == _trainer_greedy(merged) == _trainer_greedy(policy)

    # A server started without --enable-lora refuses an adapter before any weights move.
    _, plain = server
    with pytest.raises(VLLMServerError, match="answered 409.*started without --enable-lora"):
        plain.request("/update_weights", {"version": 1, "adapter": {"peft_type": "LORA"}})


def test_two_engines_share_the_prompts_and_both_receive_the_weights(model_path, tmp_path):
    port = free_port()
    process, client = start_server(model_path, port, tmp_path / "server.log", KEY, "--data-parallel-size", "2")
    try:
        assert client.info["weight_sync_world_size"] == 3  # the trainer and one worker per engine
        # Prompt i's samples use seeds 9 + 2i whichever engine runs it: the third prompt (engine 1 here) gives the
        # same samples alone with seed 13 (engine 0).
        prompts = [[5, 6, 7], [8, 9], [10, 11, 12]]
        together = client.generate(prompts, n=2, max_tokens=5, seed=9)["completion_ids"]
        alone = client.generate(prompts[2:], n=2, max_tokens=5, seed=13)["completion_ids"]
        assert len(together) == 6 and together[4:] == alone
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
        client.group_port = free_port()  # not the default port, which another process may hold
        client.update_weights(checkpoint_tensors(model), version=1, bucket_bytes=1 << 16)
        # Three copies of the prompt: engine 0 gets two, engine 1 one; all answer with the new weights.
        reply = client.generate([PROMPT] * 3, n=1, max_tokens=10, temperature=0.0, logprobs=False)
        assert reply["completion_ids"] == [_trainer_greedy(model)] * 3
        assert reply["weights_version"] == 1
    finally:
        stop_server(process)


def test_two_trainer_processes_share_one_server(server, model_path, tmp_path):
    port, _ = server
    out = tmp_path / "result.json"
    script = Path(__file__).parent / "helpers" / "vllm_two_processes.py"
    launch_two_processes(script, model_path, port, free_port(), out)
    outcome = json.loads(out.read_text())
    assert outcome["world_size"] == 2
    assert outcome["server_greedy"] == outcome["trainer_greedy"]
    # Each process scored the engine's samples of its own prompts: a row handed to the wrong process would be
    # scored under another prompt, and its trainer log-probs would be far from the engine's.
    steps = [h for h in outcome["log_history"] if "sampling/sampling_logp_difference/max" in h]
    assert len(steps) == 2 and all(h["sampling/sampling_logp_difference/max"] < 1e-3 for h in steps)


def test_async_generation_on_the_server(server, model_path, tokenizer, tmp_path):
    """Round k+1 sampled on the server while round k trains: one step behind after the first round, the server's
    log-probs are the behaviour policy (so they now differ from pi_old), and the final sync still reaches it."""
    port, client = server
    args = _config(tmp_path, port, max_steps=3, async_generation=True, max_staleness=1)
    trainer = GRPOTrainer(str(model_path), _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "async/staleness" in h]
    assert [h["async/staleness"] for h in logs] == [0, 1, 1]
    assert all(h["async/dropped_rows"] == 0 for h in logs)
    differences = [h["sampling/sampling_logp_difference/max"] for h in logs]
    assert differences[0] < 1e-3 < max(differences[1:])  # on-policy first, then one optimizer step behind
    policy = trainer.accelerator.unwrap_model(trainer.model)
    trainer.generation.sync_weights(policy, version=trainer.state.global_step)
    trainer.generation.wait_for_load()  # with one process the engine loads in a thread of its own
    assert _server_greedy(client) == _trainer_greedy(policy)


def test_two_trainer_processes_generate_asynchronously_on_one_server(server, model_path, tmp_path):
    """Each process's producer sends its own rows (no collective call off the main thread); weights are pushed
    with every process's engine lock held, so no generation sees half-loaded weights."""
    port, _ = server
    out = tmp_path / "result.json"
    script = Path(__file__).parent / "helpers" / "vllm_two_processes.py"
    launch_two_processes(script, model_path, port, free_port(), out, "async")
    outcome = json.loads(out.read_text())
    assert outcome["world_size"] == 2
    assert outcome["server_greedy"] == outcome["trainer_greedy"]
    logs = [h for h in outcome["log_history"] if "async/staleness" in h]
    assert [h["async/staleness"] for h in logs] == [0, 1]


class _KillServer(TrainerCallback):
    def __init__(self, process):
        self.process = process

    def on_step_end(self, args, state, control, **kwargs):
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def test_a_server_killed_mid_run_gives_a_clear_error(model_path, tokenizer, tmp_path):
    port = free_port()
    process, _ = start_server(model_path, port, tmp_path / "server.log", KEY)
    try:
        args = _config(tmp_path, port, max_steps=3, vllm_server_timeout=3)
        trainer = GRPOTrainer(
            str(model_path), _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer
        )
        trainer.add_callback(_KillServer(process))
        start = time.monotonic()
        # Killed after it answered: named as a server that died (restart it, resume), never as one not reached.
        died = rf"vLLM server at http://127.0.0.1:{port} stopped answering during .*most likely died.*grpo vllm-serve"
        with pytest.raises(VLLMServerError, match=died):
            trainer.train()
        assert time.monotonic() - start < 60  # an error within the timeout, not a hang
        assert trainer.state.global_step == 1
    finally:
        stop_server(process)


def test_multi_turn_episodes_on_the_server(server, tmp_path):
    """Episodes of three policy turns and two tool answers sampled on the server: the engine's log-probs of the
    policy's tokens, conditioned on the whole conversation so far, equal the trainer's over the same row, so the
    ids the trainer trains on are the ids the engine sampled and conditioned on."""
    port, _ = server
    args = _config(tmp_path, port, max_completion_length=240, max_prompt_length=None, max_tool_calling_iterations=2)
    trainer = talkative_add_trainer(tmp_path, args)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["tools/turns"] == 3 and logs["tools/call_frequency"] == 2
    assert logs["sampling/sampling_logp_difference/max"] < 1e-3


def test_agent_func_episodes_on_the_server(server, tmp_path):
    """An agent program's two calls per episode (tests/helpers/agents.py `again_agent`), served by the trainer's
    endpoint from the server's samples: one trained sequence each, whose sampled tokens are the engine's."""
    port, _ = server
    args = _config(tmp_path, port, max_completion_length=64, max_prompt_length=None)
    trainer = talkative_agent_trainer(tmp_path, args)
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["tools/turns"] == 2 and logs["tools/sequences"] == 1 and logs["tools/agent_failures"] == 0
    assert logs["sampling/sampling_logp_difference/max"] < 1e-3


def test_a_regex_constrains_every_completion_on_the_server(server, model_path, tokenizer, tmp_path):
    # The tiny random model never writes this on its own; under vLLM's structured outputs every completion matches
    # it, and the engine ends each with EOS once the pattern is complete.
    port, client = server
    assert client.info["model_impl"] == "vllm"  # the server's default, GRPOConfig's vllm_model_impl default
    pattern, seen = "(yes|no)[0-9]{2}", []

    def record(prompts, completions, **kwargs):
        seen.extend(completions)
        return [float(c.startswith("yes")) for c in completions]

    with pytest.warns(UserWarning, match="importance-sampling correction then weights"):
        args = _config(tmp_path, port, vllm_structured_outputs_regex=pattern)
    trainer = GRPOTrainer(str(model_path), record, args=args, train_dataset=_dataset(), processing_class=tokenizer)
    trainer.train()
    assert len(seen) == 8 and all(re.fullmatch(pattern, c) for c in seen), seen
    # The engine reports the constrained distribution's log-probs (the mask is applied before sampling), the trainer
    # the unconstrained policy's: the correction's weights pi_old / pi_sampler fall far below 1 (the warning above).
    assert trainer.state.log_history[0]["sampling/importance_sampling_ratio/mean"] < 0.5


def test_a_server_running_the_transformers_implementation(model_path, tokenizer, tmp_path):
    # `--model-impl transformers` reaches the engine (vLLM runs the transformers modeling code); a trainer whose
    # vllm_model_impl matches syncs and samples the policy's greedy completion, one that does not is stopped.
    port = free_port()
    process, client = start_server(model_path, port, tmp_path / "server.log", KEY, "--model-impl", "transformers")
    try:
        assert client.info["model_impl"] == "transformers"
        args = _config(tmp_path, port, vllm_model_impl="transformers")
        trainer = GRPOTrainer(
            str(model_path), _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer
        )
        policy = trainer.accelerator.unwrap_model(trainer.model)
        trainer.generation.sync_weights(policy, version=0)
        assert _server_greedy(client) == _trainer_greedy(policy)
        args = _config(tmp_path, port)  # vllm_model_impl="vllm", the default
        trainer = GRPOTrainer(
            str(model_path), _reward, args=args, train_dataset=_dataset(), processing_class=tokenizer
        )
        with pytest.raises(ValueError, match="runs --model-impl transformers, but vllm_model_impl='vllm'"):
            trainer.generation.sync_weights(policy, version=0)
    finally:
        stop_server(process)
