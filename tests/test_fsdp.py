"""FSDP2 (torch `fully_shard`) on two CPU processes over gloo against one process (docs/distributed.md).

accelerate 1.15 does not run FSDP on CPU by itself (`test_accelerate_alone_drops_fsdp_on_cpu`):
tests/helpers/fsdp_update.py patches its device routing and then runs the unpatched trainer, `fully_shard` and the
gathers."""

from pathlib import Path

import pytest
import torch

from grpo.objective.logprobs import completion_logprobs
from grpo.testing import tiny_model
from tests.helpers.compare import assert_close_to_scale, assert_same_update, updates
from tests.helpers.fsdp_update import (
    HEADS,
    LAYOUTS,
    LOSS_TYPES,
    STEPS,
    head_variant,
    logprob_batch,
    logprob_loss,
    trained,
)
from tests.helpers.net import launch_two_processes

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "tests" / "configs" / "accelerate_cpu_fsdp2.yaml"
SHARDED = ("DistributedType.FSDP", "DTensor", 2)  # what a sharded 2-process run reports (`ran`)


# ACCELERATE_USE_CPU must stay unset: with it the CPU is routed to MULTI_CPU before the patch can act.
FSDP2_ENV = {"ACCELERATE_TORCH_DEVICE": "cpu", "ACCELERATE_USE_CPU": None}


def ran(info):
    """(distributed type, class of the policy's parameters, process count) of a run of tests/helpers/fsdp_update.py."""
    return info["distributed_type"], info["param_class"], info["world_size"]


def launch(out_file, *extra, **env):
    """Run tests/helpers/fsdp_update.py on 2 processes with `env` added (a value of None removes the variable)."""
    launch_two_processes(ROOT / "tests" / "helpers" / "fsdp_update.py", out_file, *extra, config=CONFIG, env=env)
    return torch.load(out_file, weights_only=False)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory):
    """The results of tests/helpers/fsdp_update.py on 2 processes (one launch for every test here)."""
    out_file = tmp_path_factory.mktemp("fsdp2") / "two.pt"
    return {**launch(out_file, **FSDP2_ENV), "out_file": str(out_file)}


@pytest.mark.distributed
def test_accelerate_alone_drops_fsdp_on_cpu(tmp_path):
    """The reason for the patch: with the FSDP2 config and ACCELERATE_USE_CPU=1, accelerate runs DDP over gloo
    (MULTI_CPU) and ignores the FSDP section. When this fails, accelerate shards on CPU and the patch can go."""
    assert launch(tmp_path / "kind.pt", "--unpatched", ACCELERATE_USE_CPU="1") == "DistributedType.MULTI_CPU"


@pytest.mark.distributed
@pytest.mark.parametrize("name", [*LOSS_TYPES, "lora"])
def test_fsdp2_matches_one_process(fsdp2, tmp_path, name):
    """3 SGD steps with the KL term on (beta 0.04): 2 FSDP2 processes x 4 rows = 1 process x 8 rows. `name`: a loss
    type with a frozen reference model, or "lora" (the default loss with a LoRA adapter, the reference its base)."""
    params, info = fsdp2[name]
    # Really sharded: the policy's parameters are DTensors, and the log-probs take the chunked path with the output
    # projection as FSDP2 gathered it for the forward (never the full-logits fallback). The reference is prepared
    # with evaluation_mode=True, which accelerate does not shard: it stays whole on every process.
    assert ran(info) == SHARDED and info["head_sharded"] and info["steps_run"] == 3
    assert info["calls"].get("whole", 0) > 0 and "full_logits" not in info["calls"]
    assert info["ref_param_class"] == (None if name == "lora" else "Parameter")
    # Each group's prompt is computed once in every pass of the sharded run; the reference run computes it per row.
    assert info["shared_passes"] > 0
    config = dict(lora=True) if name == "lora" else dict(loss_type=name)
    reference, trainer = trained(tmp_path, 8, share_prompt=False, **config)
    initial = trainer.initial
    assert any(not torch.equal(value, initial[key]) for key, value in reference.items())  # the steps moved weights
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert info["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-6)
    expected = updates(reference, initial)
    assert_same_update(updates(params, initial), expected, reference, steps=STEPS, what=name)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", HEADS)
def test_fsdp2_chunked_logprobs_match_one_process(fsdp2, kind, layout):
    """completion_logprobs on each process's batch under FSDP2 takes the chunked path and equals it on 1 unsharded
    process: the log-probs and entropies per process, and the gradients, which FSDP2 averages over the processes,
    equal the mean of the two batches' gradients. The full-logits fallback, forced, gives the same. `kind`: the
    head's own weight, tied to the embedding, with a bias. `layout`: accelerate's wrapping, whose root module keeps
    the projection gathered from the forward to the backward (used as it is), or the projection sharded as a unit
    of its own (a DTensor after the forward: gathered once per call, its gradient reduce-scattered to the shards)."""
    model = head_variant(kind)
    expected = []
    for rank in range(2):
        batch = logprob_batch(rank)
        logps, entropy = completion_logprobs(model, *batch, temperature=0.7, with_entropy=True)
        (logprob_loss(logps, batch[3]) / 2).backward()
        expected.append((logps.detach(), entropy))
    tensors = 1 + (kind == "bias")  # the weight, and the bias
    for path in ("chunked", "full_logits"):
        everyone, grads, calls = fsdp2["logprobs"][kind, layout, path]
        chunked = {"whole" if layout == "accelerate" else "gathered": tensors}
        assert calls == (chunked if path == "chunked" else {"full_logits": 1})
        for (logps, entropy), (want_logps, want_entropy) in zip(everyone, expected):
            assert_close_to_scale(logps, want_logps, f"{kind} {path}")
            assert_close_to_scale(entropy, want_entropy, f"{kind} {path}")
        assert list(grads) == [name for name, _ in model.named_parameters()]
        for name, param in model.named_parameters():
            assert param.grad.abs().sum() > 0, name
            assert_close_to_scale(grads[name], param.grad, f"{kind} {path} {name}")


@pytest.mark.distributed
def test_fsdp2_trains_a_model_loaded_from_a_folder(fsdp2):
    """The dapo run again with the model given as a folder, the way users pass one: the same sharded run, losses and
    parameters as the model built in code."""
    params, info = fsdp2["from_path"]
    expected, expected_info = fsdp2["dapo"]
    assert ran(info) == SHARDED and info["steps_run"] == 3
    assert info["losses"] == pytest.approx(expected_info["losses"], rel=1e-6)
    initial = dict(tiny_model().named_parameters())  # the folder holds the tiny model as built in code
    assert_same_update(updates(params, initial), updates(expected, initial), expected, steps=STEPS, what="from path")


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


@pytest.mark.distributed
def test_fsdp2_resumes_from_a_checkpoint(fsdp2, tmp_path):
    """3 Adam steps saved every step; a second launch resumed from checkpoint-2 (sharded weights and optimizer
    state) takes the one step left and ends with the same parameters."""
    saved, info = fsdp2["saved"]
    assert ran(info) == SHARDED and info["steps_run"] == 3
    output_dir = fsdp2["out_file"] + ".c"  # where tests/helpers/fsdp_update.py saved it
    resumed, resumed_info = launch(tmp_path / "resumed.pt", "--resume", output_dir, **FSDP2_ENV)["resumed"]
    assert ran(resumed_info) == SHARDED and resumed_info["steps_run"] == 1
    assert resumed_info["losses"] == pytest.approx(info["losses"], rel=1e-5)
    for key, value in saved.items():  # the same last step on the same machine: rounding explains no difference
        assert torch.equal(resumed[key], value), key
