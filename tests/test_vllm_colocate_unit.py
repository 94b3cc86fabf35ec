"""`vllm_mode="colocate"` without vLLM: its config fields, the missing-vLLM error, and the backend's bookkeeping
(requests per run of equal rows, seeds, sleep and wake, engine settings) against a stand-in `vllm` module. The real
engine is tested in tests/test_vllm_colocate.py (`make test-vllm`)."""

import json
import os
import random
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo import GRPOConfig
from grpo.generation import make_generation_backend
from grpo.generation.base import SamplingRNG, equal_runs
from grpo.generation.vllm.colocate import EnvironmentChanges, VLLMColocateGeneration
from grpo.testing import tiny_model, tiny_tokenizer

ONE_PROCESS = types.SimpleNamespace(process_index=0, local_process_index=0, num_processes=1)
TWO_PROCESSES = types.SimpleNamespace(process_index=1, local_process_index=1, num_processes=2)


def _config(tmp_path, **kwargs):
    return GRPOConfig(output_dir=str(tmp_path), report_to=[], use_vllm=True, **kwargs)


def test_colocate_fields_default_to_trls(tmp_path):
    args = _config(tmp_path, vllm_mode="colocate")
    assert args.vllm_gpu_memory_utilization == 0.3
    assert args.vllm_tensor_parallel_size == 1
    assert args.vllm_enable_sleep_mode is False
    assert args.vllm_max_model_length is None


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"vllm_mode": "colo"}, ValueError, r"not one of \('server', 'colocate'\)"),
        ({"vllm_gpu_memory_utilization": 0.0}, ValueError, r"must be in \(0, 1\]"),
        ({"vllm_gpu_memory_utilization": 1.5}, ValueError, r"must be in \(0, 1\]"),
        ({"vllm_tensor_parallel_size": 2}, ValueError, "one engine per process is built; server mode for more"),
        ({"vllm_max_model_length": 0}, ValueError, "must be >= 1"),
        ({"vllm_max_model_length": 512.0}, TypeError, "must be an integer"),
        ({"vllm_enable_sleep_mode": "true"}, TypeError, "must be True or False"),
    ],
)
def test_bad_colocate_fields(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        _config(tmp_path, **{"vllm_mode": "colocate", **kwargs})


def test_without_vllm_the_backend_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(ImportError, match=r"pip install vllm.*make install-vllm"):
        make_generation_backend(_config(tmp_path, vllm_mode="colocate"), ONE_PROCESS, tiny_tokenizer(), [1])


def test_equal_runs():
    a, b = [1, 2], [3]
    assert equal_runs([a, a, a, b, b, a]) == [(a, 3), (b, 2), (a, 1)]
    assert equal_runs([]) == []


class FakeLLM:
    """Records what the backend asks of `vllm.LLM`; answers each request with n samples [seed + i]."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.calls = []
        torch.manual_seed(0)  # vLLM seeds the process's generators with its `seed`
        random.seed(0)
        np.random.seed(0)
        torch.set_num_threads(1)

    def generate(self, requests, params, use_tqdm):
        self.calls.append("generate")
        self.requests = list(zip(requests, params))
        samples = types.SimpleNamespace
        outputs = []
        for p in params:
            rows = [[p.seed + i] for i in range(p.n)]
            outputs.append(
                samples(outputs=[samples(token_ids=r, logprobs=[{r[0]: samples(logprob=-0.5)}]) for r in rows])
            )
        return outputs

    def collective_rpc(self, method, args=()):
        self.calls.append("load")
        worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(reload_weights=self._reload))
        method(worker, *args)

    def _reload(self, weights_iterator):
        self.loaded = dict(weights_iterator)

    def reset_prefix_cache(self):
        self.calls.append("reset")

    def sleep(self, level):
        self.calls.append(f"sleep{level}")

    def wake_up(self):
        self.calls.append("wake")


@pytest.fixture
def fake_vllm(monkeypatch):
    platform = types.SimpleNamespace(is_sleep_mode_available=lambda: True, is_cpu=lambda: True, device_type="cpu")
    module = types.ModuleType("vllm")
    module.LLM = FakeLLM
    module.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = platform
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "VLLM_ENABLE_V1_MULTIPROCESSING"):
        # Unset now and after the test (the backend sets them): setenv first makes monkeypatch restore the original.
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return platform


def _backend(accelerator=ONE_PROCESS, **kwargs):
    sampling = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)
    return VLLMColocateGeneration(accelerator, eos_token_ids=[2], max_completion_length=8, **{**sampling, **kwargs})


def test_each_run_of_equal_rows_is_one_request_with_its_own_seeds(fake_vllm):
    backend, model = _backend(), tiny_model()
    backend.sync_weights(model, version=0)
    a, b = [5, 6], [7]
    torch.manual_seed(123)
    seed = int(torch.randint(2**31 - 1, ()))
    torch.manual_seed(123)
    out = backend.generate(model, [a, a, a, b, a])
    # Requests a x 3, b x 1, a x 1; row r is drawn with seed + r, so no two rows share a seed.
    assert [(req["prompt_token_ids"], p.n, p.seed - seed) for req, p in backend.llm.requests] == [
        (a, 3, 0),
        (b, 1, 3),
        (a, 1, 4),
    ]
    assert out.ids == [[seed + r] for r in range(5)]
    assert out.logprobs == [[-0.5]] * 5
    params = backend.llm.requests[0][1]
    assert params.stop_token_ids == [2] and params.max_tokens == 8 and params.logprobs == 0


def test_request_seeds_come_from_the_trainers_sampling_stream(fake_vllm):
    # They came from torch's default generator, which a reward calling torch.manual_seed(0) reset before every round,
    # so every round sent the same seed and drew the same completions.
    backend, model = _backend(rng=SamplingRNG(seed=5)), tiny_model()
    backend.sync_weights(model, version=0)
    seeds = []
    for _ in range(2):
        torch.manual_seed(0)  # what such a reward does between two rounds
        backend.generate(model, [[1]])
        seeds.append(backend.llm.requests[-1][1].seed)
    expected = SamplingRNG(seed=5)
    assert seeds == [expected.request_seed(), expected.request_seed()] and seeds[0] != seeds[1]


def test_weights_load_once_per_version_and_sleep_wraps_generation(fake_vllm):
    backend, model = _backend(enable_sleep_mode=True), tiny_model()
    with pytest.raises(RuntimeError, match="sync_weights before generate"):
        backend.generate(model, [[1]])
    backend.sync_weights(model, version=0)
    assert set(backend.llm.loaded) == {name for name, _ in model.named_parameters()}
    backend.generate(model, [[1]])
    backend.sync_weights(model, version=0)  # same version: nothing to load
    backend.generate(model, [[1]])
    backend.sync_weights(model, version=1)
    backend.generate(model, [[1]])
    assert backend.llm.calls == [
        "load", "reset", "generate", "sleep1",
        "wake", "reset", "generate", "sleep1",
        "wake", "reset", "load", "reset", "generate", "sleep1",
    ]  # fmt: skip


def test_sleep_mode_where_vllm_has_none_is_an_error(fake_vllm):
    fake_vllm.is_sleep_mode_available = lambda: False
    with pytest.raises(ValueError, match="vllm_enable_sleep_mode=True, but vLLM has no sleep mode on this platform"):
        _backend(enable_sleep_mode=True).sync_weights(tiny_model(), version=0)


def test_the_engine_is_built_from_the_policy_config_in_this_process(fake_vllm):
    backend, model = _backend(TWO_PROCESSES), tiny_model()
    torch.manual_seed(7)
    random.seed(7)
    expected = (torch.rand(()), random.random())
    torch.manual_seed(7)
    random.seed(7)
    threads = torch.get_num_threads()
    llm = backend.engine(model)
    # The trainer's random streams and threads are as they were, whatever vLLM did to them.
    assert (torch.rand(()), random.random()) == expected
    assert torch.get_num_threads() == threads
    settings = llm.kwargs
    config = json.loads((Path(settings["model"]) / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["hidden_size"] == model.config.hidden_size
    assert settings["load_format"] == "dummy" and settings["dtype"] == "float32"
    assert settings["logprobs_mode"] == "processed_logprobs" and settings["enforce_eager"] is True
    # Two processes: vLLM joins the trainer's process group (external launcher), and its engine core stays here.
    assert settings["distributed_executor_backend"] == "external_launcher"
    assert os.environ["RANK"] == "1" and os.environ["WORLD_SIZE"] == "2"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_environment_changes_are_put_back_as_they_were(monkeypatch):
    names = ("GRPO_TEST_SET", "GRPO_TEST_UNSET", "GRPO_TEST_KEPT")
    for name in names:  # restored by monkeypatch after the test, whatever it leaves
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("GRPO_TEST_SET", "before")
    monkeypatch.setenv("GRPO_TEST_KEPT", "launcher")
    changes = EnvironmentChanges()
    changes.set("GRPO_TEST_SET", "engine")
    changes.set("GRPO_TEST_SET", "again")  # a second change: the value before the first is what comes back
    changes.set_default("GRPO_TEST_UNSET", "engine")
    changes.set_default("GRPO_TEST_KEPT", "engine")  # a value the process has stays
    assert [os.environ.get(name) for name in names] == ["again", "engine", "launcher"]
    changes.restore()
    assert [os.environ.get(name) for name in names] == ["before", None, "launcher"]
    assert "GRPO_TEST_UNSET" not in os.environ


def test_closing_the_engine_puts_the_process_back(fake_vllm, monkeypatch):
    # Every variable the engine set goes back at close: VLLM_ENABLE_V1_MULTIPROCESSING to the user's value, RANK and
    # WORLD_SIZE unset as they were, a launcher's LOCAL_RANK untouched throughout.
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("LOCAL_RANK", "7")
    backend = _backend(TWO_PROCESSES)
    backend.engine(tiny_model())
    config_dir = Path(backend.llm.kwargs["model"])
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and os.environ["RANK"] == "1"
    assert os.environ["LOCAL_RANK"] == "7" and os.environ["WORLD_SIZE"] == "2"
    backend.close()
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1" and os.environ["LOCAL_RANK"] == "7"
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ
    assert backend.llm is None and not config_dir.exists()


def test_a_failed_engine_build_leaves_no_variable_behind(fake_vllm):
    fake_vllm.is_sleep_mode_available = lambda: False
    with pytest.raises(ValueError, match="no sleep mode"):
        _backend(TWO_PROCESSES, enable_sleep_mode=True).engine(tiny_model())
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ


@pytest.fixture(params=[False, True])
def colocate_args(request, tmp_path):
    """A colocate config with trust_remote_code off and on, built before `fake_vllm` replaces `find_spec`."""
    return _config(tmp_path, vllm_mode="colocate", trust_remote_code=request.param)


def test_trust_remote_code_reaches_the_engine(colocate_args, fake_vllm):
    backend = make_generation_backend(colocate_args, ONE_PROCESS, tiny_tokenizer(), [1])
    assert backend.engine(tiny_model()).kwargs["trust_remote_code"] is colocate_args.trust_remote_code


def test_model_impl_and_the_regex_reach_the_engine(fake_vllm, monkeypatch):
    # vllm_model_impl is an engine setting; a regex makes the engine load the tokenizer (saved beside the config) and
    # puts vLLM's structured-outputs constraint in every request.
    outputs = types.ModuleType("vllm.sampling_params")
    outputs.StructuredOutputsParams = lambda **kw: ("constraint", kw)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", outputs)
    model, tokenizer = tiny_model(), tiny_tokenizer()
    plain = _backend(model_impl="transformers")
    plain.sync_weights(model, version=0)
    assert plain.llm.kwargs["model_impl"] == "transformers" and plain.llm.kwargs["skip_tokenizer_init"] is True
    backend = _backend(structured_outputs_regex="(yes|no)", tokenizer=tokenizer)
    backend.sync_weights(model, version=0)
    settings = backend.llm.kwargs
    assert settings["model_impl"] == "vllm" and settings["skip_tokenizer_init"] is False
    assert (Path(settings["model"]) / "tokenizer.json").exists()
    backend.generate(model, [[5, 6], [5, 6]])
    assert backend.llm.requests[0][1].structured_outputs == ("constraint", {"regex": "(yes|no)"})
    with pytest.raises(ValueError, match="needs the tokenizer"):
        _backend(structured_outputs_regex="(yes|no)")
