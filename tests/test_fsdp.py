"""FSDP2 (torch `fully_shard`) on two CPU processes over gloo against one process (docs/distributed.md).

accelerate 1.15 does not run FSDP on CPU by itself (`test_accelerate_alone_drops_fsdp_on_cpu`): tests/fsdp_update.py
patches its device routing and then runs the unpatched trainer, `fully_shard` and the gathers."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fsdp_update import LOSS_TYPES, trained
from tests.net import free_port

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "accelerate_cpu_fsdp2.yaml"
SHARDED = ("DistributedType.FSDP", "DTensor", 2)  # what a sharded 2-process run reports (`ran`)


def ran(info):
    """(distributed type, class of the policy's parameters, process count) of a run of tests/fsdp_update.py."""
    return info["distributed_type"], info["param_class"], info["world_size"]


def launch(out_file, *extra, **env):
    """Run tests/fsdp_update.py on 2 processes with `env` added (a value of None removes the variable)."""
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(CONFIG),
        "--main_process_port",
        str(free_port()),
        str(ROOT / "tests" / "fsdp_update.py"),
        str(out_file),
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env}
    env = {key: value for key, value in env.items() if value is not None}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out_file, weights_only=False)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """The results of tests/fsdp_update.py on 2 processes (one launch for every test here)."""
    # ACCELERATE_USE_CPU must stay unset: with it the CPU is routed to MULTI_CPU before the patch can act.
    env = {"ACCELERATE_TORCH_DEVICE": "cpu", "ACCELERATE_USE_CPU": None}
    return launch(tmp_path_factory.mktemp("fsdp2") / "two.pt", **env)


@pytest.mark.distributed
def test_accelerate_alone_drops_fsdp_on_cpu(tmp_path):
    """The reason for the patch: with the FSDP2 config and ACCELERATE_USE_CPU=1, accelerate runs DDP over gloo
    (MULTI_CPU) and ignores the FSDP section. When this fails, accelerate shards on CPU and the patch can go."""
    assert launch(tmp_path / "kind.pt", "--unpatched", ACCELERATE_USE_CPU="1") == "DistributedType.MULTI_CPU"


@pytest.mark.distributed
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_fsdp2_matches_one_process(fsdp2, tmp_path, loss_type):
    """3 SGD steps with a reference model (beta 0.04): 2 FSDP2 processes x 4 rows = 1 process x 8 rows."""
    params, info = fsdp2[loss_type]
    # Really sharded: the policy's parameters are DTensors. The reference is prepared with evaluation_mode=True,
    # which accelerate does not shard: it stays whole on every process.
    assert ran(info) == SHARDED
    assert info["ref_param_class"] == "Parameter"
    reference, trainer = trained(tmp_path, 8, loss_type=loss_type)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert info["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-6)
    assert max(float((p - params[n]).abs().max()) for n, p in reference.items()) > 0  # the runs moved apart from 0
    for name, value in reference.items():
        torch.testing.assert_close(params[name], value, rtol=0, atol=1e-5, msg=f"{loss_type} {name}")


@pytest.mark.distributed
def test_fsdp2_checkpoint_tensors_are_whole(fsdp2):
    """The vLLM weight export gathers FSDP2 shards: the same names and tensors as the unwrapped model."""
    result = fsdp2["checkpoint_tensors"]
    assert result["class"] == "DTensor" and result["rows"] < result["plain"]["model.embed_tokens.weight"].shape[0]
    assert list(result["sharded"]) == list(result["plain"])
    for name, tensor in result["plain"].items():
        assert type(result["sharded"][name]) is torch.Tensor
        torch.testing.assert_close(result["sharded"][name], tensor, rtol=0, atol=0, msg=name)


@pytest.mark.distributed
def test_fsdp2_trains_with_model_generate(fsdp2):
    """Two steps that sample with the sharded policy's own `model.generate` (no scripted completions)."""
    info = fsdp2["generate"]
    assert ran(info) == SHARDED
    assert len(info["losses"]) == 2 and all(torch.isfinite(torch.tensor(info["losses"])))


@pytest.mark.distributed
def test_fsdp2_generate_stops_unevenly(fsdp2):
    """Process 0 stops after 2 new tokens, process 1 after 6: the sharded forward passes stay in step (the next
    collective gives 1 + 2 on both)."""
    assert fsdp2["uneven_generate"] == [(2, 3.0), (6, 3.0)]
