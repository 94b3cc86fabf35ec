"""The trainer's side of vLLM generation, without vLLM: the weight transport between two processes and its token
handshake, the client's errors and API key, the server's access checks (as plain functions), how the backend groups
prompts, checkpoint names with PEFT, and the importance-sampling correction. The real server is tested in
tests/test_vllm.py (`make test-vllm`)."""

import contextlib
import copy
import io
import multiprocessing
import socket
import time
import warnings

import pytest
import torch
from accelerate import Accelerator

from grpo.generation.policy_weights import checkpoint_tensors
from grpo.generation.vllm.client import VLLMClient, VLLMServerError
from grpo.generation.vllm.serve import (
    add_arguments,
    authorized,
    choose_api_key,
    exposure_warning,
    generated_key_message,
    is_loopback,
    resolve_api_key,
)
from grpo.generation.vllm.server_backend import VLLMGeneration
from grpo.generation.vllm.server_key import key_file, remove_key_file
from grpo.generation.vllm.weight_sync import (
    check_token,
    open_group,
    open_store,
    receive_weights,
    send_token,
    send_weights,
)
from grpo.testing import tiny_model, tiny_tokenizer
from tests.helpers.losses import loss_with
from tests.helpers.net import free_port, stand_in_server

TOKEN = bytes(range(32))
# Seconds each side waits for the other: the spawned receiver imports torch and grpo before it connects, which on a
# loaded 2-core machine has taken more than 30 s. Only a failing test waits this long.
WAIT = 180


def _weights():
    torch.manual_seed(0)
    return [
        ("a.weight", torch.randn(64, 32)),
        ("a.bias", torch.randn(64)),
        ("b.weight", torch.randn(3, 5).to(torch.bfloat16)),
        ("c.scale", torch.tensor(2.5)),
        ("d.ids", torch.arange(7)),
    ]


def _receiver(ports, queue):
    """The server's side: a group on each port, kept only if rank 0 sends TOKEN; then the weights it sends."""
    for port in ports:
        group = open_group("127.0.0.1", port, 1, 2, "gloo", WAIT)
        try:
            check_token(group, TOKEN, torch.device("cpu"))
        except PermissionError as e:
            queue.put(e)
            continue
        # As bytes: a tensor put on a queue is shared through a file descriptor, which dies with this process.
        buffer = io.BytesIO()
        torch.save([(name, tensor.clone()) for name, tensor in receive_weights(group, torch.device("cpu"))], buffer)
        queue.put(buffer.getvalue())


def test_weights_cross_processes_in_buckets_unchanged_from_the_rank_0_with_the_token():
    ports = [free_port(), free_port()]
    context = multiprocessing.get_context("spawn")  # one process for both groups: each start costs seconds
    queue = context.Queue()
    receiver = context.Process(target=_receiver, args=(ports, queue))
    receiver.start()
    # First a stranger who reached the store's port: it does not know the token, and is refused before any weights.
    stranger = open_group("127.0.0.1", ports[0], 0, 2, "gloo", WAIT)
    send_token(stranger, bytes(32), torch.device("cpu"))
    refused = queue.get(timeout=2 * WAIT)
    assert isinstance(refused, PermissionError) and "handshake failed" in str(refused)

    group = open_group("127.0.0.1", ports[1], 0, 2, "gloo", WAIT)
    send_token(group, TOKEN, torch.device("cpu"))
    # 4 KiB buckets: a.weight (8 KiB) is a bucket of its own, the four small tensors share the second.
    buckets, sent = send_weights(group, iter(_weights()), 4096, torch.device("cpu"))
    received = torch.load(io.BytesIO(queue.get(timeout=2 * WAIT)), weights_only=True)
    receiver.join(timeout=WAIT)
    assert [name for name, _ in received] == [name for name, _ in _weights()]
    for (_, got), (_, want) in zip(received, _weights()):
        assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    assert buckets == 2 and sent == sum(t.numel() * t.element_size() for _, t in _weights())


def test_the_weight_sync_store_listens_on_its_host_only():
    port = free_port()
    store = open_store("127.0.0.1", port, 2, is_master=True, timeout=10)  # noqa: F841 (it listens while alive)
    socket.create_connection(("127.0.0.1", port), timeout=5).close()
    # 127.0.0.2 is this machine too (Linux routes 127/8 to loopback): a TCPStore left to itself listens on every
    # address and would accept this connection.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", port), timeout=5).close()


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    """A home folder of the test's own: a key file a real server left in the user's would change what clients send."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("GRPO_VLLM_API_KEY", raising=False)


def test_a_server_that_dies_mid_run_is_named_as_gone_not_as_never_reached():
    """It used to say "No vLLM server answered ... within 0 s" after the run had talked to it for hours."""
    with stand_in_server() as (url, _):
        client = VLLMClient(url, timeout=5)
        client.wait_until_ready()
    # The stand-in is shut down: the port now refuses, as after the server's process died.
    with pytest.raises(VLLMServerError) as caught:
        client.request("/close_communicator", {}, retry=False)
    message = str(caught.value)
    assert message.startswith(f"The vLLM server at {url} stopped answering during /close_communicator (")
    assert "has most likely died" in message and "resume" in message and "within 0 s" not in message
    # A server never reached is still told apart: start one.
    fresh = VLLMClient(url, timeout=0.5)
    with pytest.raises(VLLMServerError, match="No vLLM server answered at .* Start one with `grpo vllm-serve"):
        fresh.request("/close_communicator", {}, retry=False)


def test_the_client_sends_the_api_key_as_a_bearer_header(monkeypatch):
    monkeypatch.setenv("GRPO_VLLM_API_KEY", "key-from-env")
    with stand_in_server() as (url, seen):
        VLLMClient(url).wait_until_ready()
        VLLMClient(url, api_key="key-from-argument").generate([[1, 2]], n=2)
        VLLMClient(url, api_key="").reset_prefix_cache()  # "" sends none, whatever the environment says
        monkeypatch.delenv("GRPO_VLLM_API_KEY")
        VLLMClient(url).request("/close_communicator", {})
    assert [r["headers"].get("authorization") for r in seen] == [
        "Bearer key-from-env",
        "Bearer key-from-argument",
        None,
        None,
    ]
    assert "key-from-argument" not in repr(VLLMClient(url, api_key="key-from-argument"))


def test_a_401_becomes_an_error_that_names_the_environment_variable():
    with stand_in_server(401, {"detail": "no API key was sent"}) as (url, seen):
        with pytest.raises(VLLMServerError, match=r"requires an API key and got no API key.*GRPO_VLLM_API_KEY"):
            VLLMClient(url, api_key="", timeout=30).wait_until_ready()
        assert len(seen) == 1  # a refusal is final: no retrying for the timeout
        with pytest.raises(VLLMServerError, match=r"refused the API key this client sent.*GRPO_VLLM_API_KEY"):
            VLLMClient(url, api_key="wrong").generate([[1]], n=1)
    assert len(seen) == 2


def test_server_access_checks():
    # The key: --api-key wins over the environment variable; empty means none.
    assert resolve_api_key("flag", {"GRPO_VLLM_API_KEY": "env"}) == "flag"
    assert resolve_api_key(None, {"GRPO_VLLM_API_KEY": "env"}) == "env"
    assert resolve_api_key(None, {"GRPO_VLLM_API_KEY": ""}) is None and resolve_api_key(None, {}) is None
    # The header: "Bearer <key>" (the scheme in any case), nothing else.
    assert authorized("Bearer s3cret", "s3cret") and authorized("bearer s3cret", "s3cret")
    for header in (None, "", "s3cret", "Bearer", "Bearer s3cre", "Bearer s3cret2", "Basic s3cret"):
        assert not authorized(header, "s3cret"), header
    # Loopback only by default; a warning for any other address without a key.
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m"])
    assert args.host == "127.0.0.1" and args.api_key is None and not args.insecure_no_key
    assert all(is_loopback(h) for h in ("127.0.0.1", "127.0.1.1", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "node-a"))
    assert exposure_warning("127.0.0.1", "key") is None and exposure_warning("0.0.0.0", "key") is None
    warning = exposure_warning("0.0.0.0", None)
    assert "anyone who can reach this port" in warning and "GRPO_VLLM_API_KEY" in warning
    # Without a key (--insecure-no-key), loopback is no shelter from the machine's other users: that is said too.
    assert "every user and process of this machine" in exposure_warning("127.0.0.1", None)


def test_a_server_given_no_key_makes_one_that_only_its_user_can_read_and_its_trainer_finds(monkeypatch):
    # A loopback port is open to every user of the machine: with no key given, the server makes one and writes it
    # where only its user can read it, and a client of that user connecting to a loopback address sends it.
    with stand_in_server() as (url, seen):
        port = int(url.rsplit(":", 1)[1])
        early = VLLMClient(url)  # made before the server wrote its key, as a trainer started beside it is
        key, made = choose_api_key(None, False, port, environ={})
        assert made and len(key) >= 32 and key in generated_key_message(port, key)
        path = key_file(port)
        assert path.read_text() == key and path.stat().st_mode & 0o777 == 0o600
        assert path.parent.stat().st_mode & 0o777 == 0o700
        early.wait_until_ready()  # no key given, none in the environment: the file's, read when it asks
        VLLMClient(f"http://localhost:{port}").wait_until_ready()
        monkeypatch.setenv("GRPO_VLLM_API_KEY", "key-from-env")
        VLLMClient(url).wait_until_ready()  # the variable wins over the file
    assert [r["headers"].get("authorization") for r in seen] == [f"Bearer {key}"] * 2 + ["Bearer key-from-env"]
    monkeypatch.delenv("GRPO_VLLM_API_KEY")
    # A server elsewhere never gets this machine's key files.
    assert "Authorization" not in VLLMClient(f"http://10.0.0.5:{port}").headers
    # A second server on the port replaces a stale file, and the first one's cleanup leaves the second one's key.
    second, _ = choose_api_key(None, False, port, environ={})
    remove_key_file(port, key)
    assert second != key and path.read_text() == second
    remove_key_file(port, second)
    assert not path.exists()


def test_a_server_runs_without_a_key_only_when_told_so_by_name(tmp_path):
    port = free_port()
    assert choose_api_key("flag", False, port, environ={}) == ("flag", False)
    assert choose_api_key(None, False, port, environ={"GRPO_VLLM_API_KEY": "env"}) == ("env", False)
    assert choose_api_key(None, True, port, environ={}) == (None, False)
    assert not key_file(port).exists()  # a key given, or none asked for: no file
    with pytest.raises(SystemExit, match="--insecure-no-key contradicts the API key given"):
        choose_api_key("flag", True, port, environ={})


def test_no_server_gives_an_error_naming_host_port_and_command(monkeypatch):
    port = free_port()  # nothing listens there
    client = VLLMClient(host="127.0.0.1", port=port, timeout=1.0)
    sleeps, sleep = [], time.sleep
    monkeypatch.setattr(time, "sleep", lambda seconds: sleeps.append(seconds) or sleep(seconds))
    start = time.monotonic()
    with pytest.raises(VLLMServerError) as error:
        client.wait_until_ready()
    message = str(error.value)
    assert f"http://127.0.0.1:{port}" in message and f"port {port}" in message
    assert f"grpo vllm-serve --model <the policy's model> --host 127.0.0.1 --port {port}" in message
    # Retried with backoff for the timeout, then gave up: it kept trying for the timeout at least, and its own waits
    # add up to no more (how long a connection attempt takes is the machine's: no bound on the wall time above).
    assert time.monotonic() - start >= 1.0 and sum(sleeps) <= 1.0


@contextlib.contextmanager
def _silent_server():
    """A socket on 127.0.0.1 that accepts every connection (the kernel does, from its backlog) and never answers."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


def test_a_server_that_accepts_and_never_answers_cannot_hang_the_client(caplog):
    with _silent_server() as url:
        client = VLLMClient(url, timeout=3.0, request_timeout=1.0)
        client.progress_every = 0.5  # seconds: short enough that a 3 s wait shows the progress lines
        start = time.monotonic()
        with caplog.at_level("WARNING", logger="grpo.generation.vllm.client"):
            with pytest.raises(VLLMServerError) as error:
                client.wait_until_ready()
        # A bound against a hang only (today's client waits forever): the wait is 3 s.
        assert time.monotonic() - start < 30
        message = str(error.value)
        assert f"The vLLM server at {url} accepted the connection but did not answer /health within" in message
        assert "(vllm_server_timeout)" in message and "\n" not in message
        progress = [r.getMessage() for r in caplog.records if "Waiting for the vLLM server" in r.getMessage()]
        assert progress and all(url in line and "giving up in" in line for line in progress)
        # A request the server took (a generation round) fails once `request_timeout` has passed, naming it.
        start = time.monotonic()
        with pytest.raises(VLLMServerError, match=r"did not answer /generate within .*\(vllm_request_timeout\)"):
            client.generate([[1, 2]], n=2)
        assert time.monotonic() - start < 30


def test_an_answer_that_is_not_json_names_the_server_and_what_it_sent():
    page = "<!DOCTYPE html>\n<html><body>\n  <h1>Welcome to nginx!</h1>\n</body></html>"
    with stand_in_server(body=page.encode(), content_type="text/html") as (url, _):
        with pytest.raises(VLLMServerError) as error:
            VLLMClient(url, api_key="", timeout=5).wait_until_ready()
    message = str(error.value)
    assert f"The server at {url} answered /health with something that is not JSON (text/html:" in message
    assert "<h1>Welcome to nginx!</h1>" in message and "\n" not in message
    assert "vllm_server_base_url" in message
    with stand_in_server(502, body=page.encode(), content_type="text/html") as (url, _):
        with pytest.raises(VLLMServerError, match=r"/generate answered 502: <!DOCTYPE html> <html>"):
            VLLMClient(url, api_key="", timeout=5).generate([[1]], n=1)


def test_the_config_passes_the_request_timeout_to_the_client(monkeypatch):
    import grpo.generation.vllm.server_backend as server_backend
    from grpo import GRPOConfig
    from grpo.generation import make_generation_backend

    args = GRPOConfig(output_dir="/tmp/x", use_vllm=True, vllm_request_timeout=7.5, report_to=[])
    monkeypatch.setattr(server_backend, "VLLMGeneration", lambda accelerator, client, **kwargs: client)
    client = make_generation_backend(args, Accelerator(), tiny_tokenizer(), eos_token_ids=[1])
    assert client.request_timeout == 7.5 and client.timeout == args.vllm_server_timeout


def test_base_url_wins_over_host_and_port():
    client = VLLMClient(base_url="http://10.1.2.3:9000/", host="ignored", port=1)
    assert (client.base_url, client.host, client.port) == ("http://10.1.2.3:9000", "10.1.2.3", 9000)


class _RecordingClient:
    """Stands in for the HTTP client only, to see what the backend asks for; the engine is in tests/test_vllm.py."""

    base_url = "http://stub"

    def __init__(self):
        self.calls = []

    def wait_until_ready(self):
        return {}

    def generate(self, prompts, n, **sampling):
        self.calls.append((prompts, n, sampling))
        ids = [[len(p), k] for p in prompts for k in range(n)]
        return {"completion_ids": ids, "logprobs": [[-1.0, -2.0] for _ in ids], "weights_version": None}


def _backend(client, G=3, **kwargs):
    return VLLMGeneration(
        Accelerator(),
        client=client,
        num_generations=G,
        max_completion_length=8,
        temperature=0.7,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        bucket_bytes=1 << 20,
        **kwargs,
    )


def test_each_prompt_is_sent_once_with_n_equal_to_the_group_size():
    client = _RecordingClient()
    backend = _backend(client)
    rows = [[1, 2]] * 3 + [[4, 5, 6]] * 3
    out = backend.generate(None, rows)
    ((prompts, n, sampling),) = client.calls
    assert prompts == [[1, 2], [4, 5, 6]] and n == 3
    assert sampling["max_tokens"] == 8 and sampling["temperature"] == 0.7 and sampling["min_p"] == 0.0
    assert out.ids == [[2, 0], [2, 1], [2, 2], [3, 0], [3, 1], [3, 2]]
    assert out.logprobs == [[-1.0, -2.0]] * 6
    backend.generate(None, rows)
    assert client.calls[0][2]["seed"] != client.calls[1][2]["seed"]  # fresh samples every round
    # The seeds come from torch's generator, whose state checkpoints save: restoring it repeats them (exact resume).
    torch.manual_seed(11)
    backend.generate(None, rows)
    torch.manual_seed(11)
    backend.generate(None, rows)
    assert client.calls[2][2]["seed"] == client.calls[3][2]["seed"]


def test_rows_that_are_not_whole_groups_are_refused():
    with pytest.raises(ValueError, match="groups of 3 equal consecutive rows"):
        _backend(_RecordingClient()).generate(None, [[1], [1], [2]])


def test_a_server_with_other_weights_is_detected():
    backend = _backend(_RecordingClient())
    backend.synced_version = 4  # the trainer pushed step 4; the stub answers "weights as loaded from disk"
    with pytest.raises(VLLMServerError, match="not the trainer's step 4: it was restarted"):
        backend.generate(None, [[1]] * 3)


def test_checkpoint_names_and_merged_lora_weights():
    peft = pytest.importorskip("peft")
    model = tiny_model()
    plain = dict(checkpoint_tensors(model))
    assert plain.keys() == dict(model.named_parameters()).keys()
    lora = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    wrapped = peft.get_peft_model(tiny_model(), lora)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_()
    synced = dict(checkpoint_tensors(wrapped))
    assert synced.keys() == plain.keys()  # the base model's names: no lora_, base_layer or modules_to_save
    merged = copy.deepcopy(wrapped).merge_and_unload().state_dict()  # PEFT's own merge, on a copy
    for name, tensor in synced.items():
        torch.testing.assert_close(tensor, merged[name])
    # The adapters are not merged into the model itself.
    assert any("lora_A" in name for name, _ in wrapped.named_parameters())


def test_sampling_weights_scale_each_tokens_loss_and_gradient():
    torch.manual_seed(0)
    logps = torch.randn(2, 4, requires_grad=True)
    advantages, mask = torch.tensor([1.0, -0.5]), torch.ones(2, 4)
    weights = torch.tensor([[1.0, 2.0, 0.5, 0.0], [1.5, 1.0, 1.0, 2.0]])
    loss, _ = loss_with(logps, None, None, advantages, mask, loss_type="dapo", sampling_weights=weights)
    loss.backward()
    # On-policy the ratio is 1 with gradient d logp, so dL/dlogp_it = -A_i w_it / (tokens = 8).
    torch.testing.assert_close(logps.grad, -advantages[:, None] * weights / 8)


def test_config_refuses_what_the_server_cannot_do():
    from grpo import GRPOConfig

    with pytest.raises(ValueError, match=r"vllm_mode='remote' is not one of \('server', 'colocate'\)"):
        GRPOConfig(output_dir="/tmp/x", use_vllm=True, vllm_mode="remote", report_to=[])
    with pytest.raises(ValueError, match="which the vLLM server does not take"):
        GRPOConfig(output_dir="/tmp/x", use_vllm=True, generation_kwargs={"typical_p": 0.9}, report_to=[])
    with pytest.raises(ValueError, match="vllm_importance_sampling_mode"):
        GRPOConfig(output_dir="/tmp/x", vllm_importance_sampling_mode="token", report_to=[])


def test_generate_jobs_keep_each_prompts_seed_wherever_it_runs():
    from grpo.generation.vllm.serve import _generate_jobs

    jobs = _generate_jobs([[1], [2], [3]], seed=10, n=4, num_engines=2, sampling={"n": 4})
    assert [job["prompts"] for job in jobs] == [[[1], [2]], [[3]]]
    assert [job["seeds"] for job in jobs] == [[10, 14], [18]]  # prompt i: seed + i * n, on any engine
    assert all(job["n"] == 4 for job in jobs)
    # More engines than prompts: the idle engines get no job; no seed: vLLM's own.
    jobs = _generate_jobs([[1]], seed=None, n=2, num_engines=3, sampling={})
    assert jobs == [{"prompts": [[1]], "seeds": [None]}]


def test_adapter_refusal():
    from grpo.generation.vllm.serve import _adapter_refusal

    assert _adapter_refusal(None, lora_enabled=False) is None
    assert _adapter_refusal({"peft_type": "LORA"}, lora_enabled=True) is None
    status, detail = _adapter_refusal({"peft_type": "LORA"}, lora_enabled=False)
    assert status == 409 and "--enable-lora" in detail
    assert _adapter_refusal({"peft_type": "IA3"}, lora_enabled=True)[0] == 422


def test_an_evaluation_batch_is_sent_with_n_equal_to_num_generations_eval():
    client = _RecordingClient()
    backend = _backend(client)  # G = 3 in training
    backend.num_generations_eval = 2
    backend.generate(None, [[1]] * 3 + [[2]] * 3)  # a training round
    backend.generate(None, [[1]] * 2 + [[2]] * 2)  # an evaluation batch
    assert [(prompts, n) for prompts, n, _ in client.calls] == [([[1], [2]], 3), ([[1], [2]], 2)]
    with pytest.raises(ValueError, match="groups of 3 or 2 equal consecutive rows"):
        backend.generate(None, [[1], [2]])


def test_the_structured_outputs_regex_goes_with_every_request_and_only_when_set():
    client = _RecordingClient()
    _backend(client, structured_outputs_regex="(yes|no)").generate(None, [[1]] * 3)
    _backend(client).generate(None, [[1]] * 3)
    assert client.calls[0][2]["structured_outputs_regex"] == "(yes|no)"
    assert "structured_outputs_regex" not in client.calls[1][2]  # a server without the field takes the request


def test_a_server_running_another_model_implementation_is_refused_at_the_first_sync():
    client = _RecordingClient()
    model = tiny_model()
    client.info = {"lora": False, "model_impl": "transformers"}
    with pytest.raises(ValueError, match="runs --model-impl transformers, but vllm_model_impl='vllm'"):
        _backend(client, model_impl="vllm")._choose_mode(model)
    assert _backend(client, model_impl="transformers")._choose_mode(model) == "merged"
    client.info = {"lora": False}  # a server from before --model-impl existed reports none: not checked
    assert _backend(client, model_impl="vllm")._choose_mode(model) == "merged"


def test_the_server_takes_a_model_implementation_and_requests_take_a_regex():
    import argparse

    from grpo.generation.vllm.serve import _request_models

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--model", "m"]).model_impl == "vllm"  # TRL's default, GRPOConfig's too
    assert parser.parse_args(["--model", "m", "--model-impl", "transformers"]).model_impl == "transformers"
    GenerateRequest = _request_models()[0]
    request = GenerateRequest(prompts=[[1]], structured_outputs_regex="[0-9]+")
    assert request.model_dump()["structured_outputs_regex"] == "[0-9]+"
    assert GenerateRequest(prompts=[[1]]).model_dump()["structured_outputs_regex"] is None


def test_config_checks_the_vllm_engine_fields():
    from grpo import GRPOConfig

    def config(**kwargs):
        return GRPOConfig(output_dir="/tmp/x", report_to=[], **kwargs)

    assert config().vllm_model_impl == "vllm" and config().vllm_structured_outputs_regex is None
    # The engine's log-probs are the constrained distribution's: the correction would weight by pi_theta / that.
    with pytest.warns(UserWarning, match="importance-sampling correction then weights each token"):
        config(use_vllm=True, vllm_structured_outputs_regex=r"\d+")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = config(use_vllm=True, vllm_structured_outputs_regex=r"\d+", vllm_importance_sampling_correction=False)
    assert args.vllm_structured_outputs_regex == r"\d+"
    with pytest.raises(ValueError, match="vllm_model_impl='native' is not one of"):
        config(vllm_model_impl="native")
    with pytest.raises(ValueError, match="changes the transformers model class in place"):
        config(use_vllm=True, vllm_mode="colocate", vllm_model_impl="transformers")
    assert config(use_vllm=True, vllm_model_impl="transformers").vllm_model_impl == "transformers"  # server mode
    with pytest.raises(ValueError, match="use_vllm=False: only a vLLM engine"):
        config(vllm_structured_outputs_regex="yes|no")
    with pytest.raises(ValueError, match="is not a valid regular expression"):
        config(use_vllm=True, vllm_structured_outputs_regex="(yes|no")
