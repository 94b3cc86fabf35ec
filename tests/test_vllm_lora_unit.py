"""Adapter-only weight sync to `grpo vllm-serve --enable-lora`, without vLLM: which mode a sync takes, the adapters
vLLM cannot serve (and the error that says so), the adapter's tensors and config as the trainer sends them, and the
adapter directory the server writes. The real server is tested in tests/test_vllm.py (`make test-vllm`)."""

import argparse
import json
import re
import stat

import pytest
import torch
from accelerate import Accelerator

from grpo.generation.policy_weights import adapter_tensors, checkpoint_tensors
from grpo.generation.vllm import lora_sync
from grpo.generation.vllm.serve import add_arguments, lora_engine_kwargs
from grpo.generation.vllm.server_backend import VLLMGeneration
from grpo.testing import tiny_model

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "gate_proj"]


def _lora_model(**config):
    settings = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(tiny_model(), peft.LoraConfig(**{**settings, **config}))
    torch.manual_seed(1)
    with torch.no_grad():  # LoRA's B starts at zero; give the adapter an effect
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5)
    return model


def test_the_adapter_goes_alone_only_to_a_lora_server():
    assert lora_sync.sync_mode(True, {"lora": True, "max_lora_rank": 16}) == "adapter"
    assert lora_sync.sync_mode(True, {"lora": False}) == "merged"
    assert lora_sync.sync_mode(True, {}) == "merged"  # a server from before --enable-lora existed
    assert lora_sync.sync_mode(False, {"lora": True}) == "merged"


def test_a_plain_lora_adapter_has_no_problems():
    assert lora_sync.adapter_problems(peft.LoraConfig(r=16, target_modules=TARGETS), 16) == []
    rslora = peft.LoraConfig(r=8, target_modules=TARGETS, use_rslora=True, init_lora_weights="gaussian")
    assert lora_sync.adapter_problems(rslora, 8) == []


@pytest.mark.parametrize(
    "config, expected",
    [
        (dict(r=32), r"its rank 32 is above the server.s --max-lora-rank 16 \(restart it with --max-lora-rank 32\)"),
        (dict(r=8, rank_pattern={"q_proj": 40}), "its rank 40 is above .* --max-lora-rank 64"),
        (dict(r=1024), "no --max-lora-rank holds it"),
        (dict(modules_to_save=["lm_head"]), r"modules_to_save=\['lm_head'\]"),
        (dict(use_dora=True), "DoRA"),
        (dict(bias="all"), "bias='all'"),
        (dict(init_lora_weights="pissa"), "init_lora_weights='pissa' changed the base weights"),
        (dict(layer_replication=[(0, 1)]), "layer_replication"),
    ],
)
def test_what_vllm_cannot_serve_is_named(config, expected):
    lora = peft.LoraConfig(**{"r": 4, "target_modules": TARGETS, **config})
    (problem,) = lora_sync.adapter_problems(lora, 16)
    assert re.search(expected, problem), problem


def test_other_peft_types_and_several_active_adapters_are_refused():
    ia3 = peft.IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"])
    assert lora_sync.adapter_problems(ia3, 16) == ["its PEFT type is IA3; vLLM serves LoRA adapters only"]
    lora = peft.LoraConfig(r=4, target_modules=TARGETS)
    (problem,) = lora_sync.adapter_problems(lora, 16, ["a", "b"])
    assert "2 adapters are active" in problem
    message = lora_sync.adapter_error([problem], "http://host:8000")
    assert "http://host:8000" in message and "restart the server without --enable-lora" in message


def test_the_config_is_peft_json():
    model = _lora_model(use_rslora=True)
    config = lora_sync.adapter_config(model.peft_config["default"])
    assert json.loads(json.dumps(config)) == config
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["use_rslora"] is True
    assert sorted(config["target_modules"]) == sorted(TARGETS)


def test_adapter_tensors_are_the_adapter_alone_under_peft_names():
    model = _lora_model()
    sent = dict(adapter_tensors(model))
    saved = peft.get_peft_model_state_dict(model)
    assert sent.keys() == saved.keys()
    assert all(".lora_A.weight" in name or ".lora_B.weight" in name for name in sent)
    assert len(sent) == 2 * len(TARGETS) * model.config.num_hidden_layers
    for name, tensor in sent.items():
        assert torch.equal(tensor, saved[name])
    adapter_bytes = sum(t.numel() * t.element_size() for t in sent.values())
    merged_bytes = sum(t.numel() * t.element_size() for _, t in checkpoint_tensors(model))
    assert adapter_bytes < merged_bytes / 10


def test_the_written_adapter_is_private_and_loads_in_peft(tmp_path):
    model = _lora_model()
    config = lora_sync.adapter_config(model.peft_config["default"])
    directory = lora_sync.write_adapter(tmp_path / "adapter-1", adapter_tensors(model), config)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert sorted(p.name for p in directory.iterdir()) == [lora_sync.CONFIG_FILE, lora_sync.WEIGHTS_FILE]
    # PEFT loads the directory over a fresh base model and computes what the trainer's model computes.
    loaded = peft.PeftModel.from_pretrained(tiny_model(), directory)
    ids = torch.tensor([[5, 6, 7, 8]])
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
        assert not torch.allclose(tiny_model()(ids).logits, model(ids).logits)  # the adapter matters
    with pytest.raises(FileExistsError):  # a sync's directory is always new
        lora_sync.write_adapter(directory, adapter_tensors(model), config)
    with pytest.raises(ValueError, match="not a LoRA adapter config"):
        lora_sync.write_adapter(tmp_path / "other", adapter_tensors(model), {"peft_type": "IA3"})
    with pytest.raises(ValueError, match="no adapter tensors"):
        lora_sync.write_adapter(tmp_path / "empty", [], config)


class _SyncClient:
    """Stands in for the HTTP client: a server with `info`, recording what each sync would send."""

    base_url = "http://stub"

    def __init__(self, info):
        self.info = info
        self.updates = []

    def wait_until_ready(self):
        return self.info

    def update_weights(self, tensors, version, bucket_bytes, adapter_config=None):
        tensors = list(tensors)
        self.updates.append((dict(tensors), version, adapter_config))
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        return {"buckets": 1, "tensors": len(tensors), "bytes": nbytes, "seconds": 0.0}


def _backend(client):
    return VLLMGeneration(
        Accelerator(),
        client=client,
        num_generations=2,
        max_completion_length=8,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        bucket_bytes=1 << 20,
    )


def test_a_lora_server_gets_the_adapter_and_its_config(caplog):
    model = _lora_model()
    backend = _backend(_SyncClient({"lora": True, "max_lora_rank": 16}))
    with caplog.at_level("INFO", logger="grpo.generation.vllm.server_backend"):
        backend.sync_weights(model, version=0)
        backend.sync_weights(model, version=1)
    assert [r.getMessage() for r in caplog.records].count(
        "vLLM weight sync: the LoRA adapter alone (the server was started with --enable-lora)"
    ) == 1  # logged once, at the first sync
    (tensors, version, config), _ = backend.client.updates
    assert version == 0 and tensors.keys() == peft.get_peft_model_state_dict(model).keys()
    assert config["peft_type"] == "LORA" and config["r"] == 4
    assert backend.last_sync["mode"] == "adapter" and backend.last_sync["tensors"] == len(tensors)


def test_without_lora_on_the_server_a_peft_model_sends_merged_weights():
    model = _lora_model()
    backend = _backend(_SyncClient({"lora": False}))
    backend.sync_weights(model, version=0)
    ((tensors, _, config),) = backend.client.updates
    assert config is None and tensors.keys() == dict(tiny_model().named_parameters()).keys()
    assert backend.last_sync["mode"] == "merged"


def test_an_adapter_the_server_cannot_take_fails_at_the_first_sync():
    backend = _backend(_SyncClient({"lora": True, "max_lora_rank": 8}))
    with pytest.raises(ValueError, match=r"rank 16 is above the server's --max-lora-rank 8 .*--max-lora-rank 16.*"
                       "restart the server without --enable-lora"):  # fmt: skip
        backend.sync_weights(_lora_model(r=16), version=0)
    assert backend.client.updates == [] and backend.synced_version is None


def test_the_server_flags():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "m"])
    assert not args.enable_lora and lora_engine_kwargs(args.enable_lora, args.max_lora_rank) == {}
    args = parser.parse_args(["--model", "m", "--enable-lora", "--max-lora-rank", "64"])
    assert lora_engine_kwargs(args.enable_lora, args.max_lora_rank) == {
        "enable_lora": True,
        "max_lora_rank": 64,
        "max_loras": 1,
    }
    with pytest.raises(SystemExit):  # vLLM takes only its listed ranks
        parser.parse_args(["--model", "m", "--enable-lora", "--max-lora-rank", "20"])
