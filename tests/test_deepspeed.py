"""DeepSpeed ZeRO-2 and ZeRO-3 on two CPU processes over gloo against one process (docs/distributed.md).

DeepSpeed's CPU accelerator (DS_ACCELERATOR=cpu) runs its collectives over torch's gloo group; the first launch on a
machine JIT-compiles its shared-memory all-reduce op (ninja and a C++ compiler, 1-4 min, cached in
~/.cache/torch_extensions). accelerate 1.15 does not start DeepSpeed on a CPU by itself:
tests/helpers/deepspeed_update.py patches the same routing decision as tests/helpers/fsdp_update.py."""

from pathlib import Path

import pytest
import torch

from grpo.testing import save_tiny_model, save_tiny_reward_model, tiny_model
from tests.helpers.compare import assert_same_update, updates
from tests.helpers.fsdp_update import LOSS_TYPES, STEPS, trained
from tests.helpers.net import launch_two_processes
from tests.helpers.scripted import reward_len

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install 'grpo[deepspeed]'")

ROOT = Path(__file__).resolve().parent.parent
DS_ENV = {"ACCELERATE_TORCH_DEVICE": "cpu", "ACCELERATE_USE_CPU": None, "DS_ACCELERATOR": "cpu"}


def launch(stage, out_file, *extra):
    """Run tests/helpers/deepspeed_update.py on 2 processes under ZeRO stage `stage`'s config; its results."""
    config = ROOT / "tests" / "configs" / f"accelerate_cpu_zero{stage}.yaml"
    launch_two_processes(
        ROOT / "tests" / "helpers" / "deepspeed_update.py", out_file, *extra, config=config, env=DS_ENV
    )
    return torch.load(out_file, weights_only=False)


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def zero(request, tmp_path_factory):
    """(ZeRO stage, the results of tests/helpers/deepspeed_update.py on 2 processes under that stage's config,
    where they were written). The script also trains the tiny model and a reward model from folders, written here
    first."""
    stage = request.param
    out_file = tmp_path_factory.mktemp(f"zero{stage}") / "two.pt"
    save_tiny_model(f"{out_file}.model")
    save_tiny_reward_model(f"{out_file}.rm")
    return stage, {**launch(stage, out_file), "out_file": str(out_file)}


@pytest.mark.distributed
@pytest.mark.parametrize("name", [*LOSS_TYPES, "lora"])
def test_zero_matches_one_process(zero, tmp_path, name):
    """3 SGD steps with the KL term on (beta 0.04): 2 DeepSpeed processes x 4 rows = 1 process x 8 rows, under
    ZeRO-2 (gradients and optimizer state partitioned) and ZeRO-3 (parameters too). `name`: a loss type with a
    frozen reference model, or "lora" (the default loss with a LoRA adapter, the reference its base)."""
    stage, results = zero
    params, info = results[name]
    assert info["distributed_type"] == "DistributedType.DEEPSPEED" and info["zero_stage"] == stage
    assert info["world_size"] == 2 and info["steps_run"] == 3
    # ZeRO-3 partitions the policy's output projection (its log-probs then build the full logits); ZeRO-2 keeps it
    # whole (the chunked path), and so does a separate reference model under both.
    assert info["head_sharded"] == (stage == 3)
    assert ("full_logits" in info["calls"]) == (stage == 3)
    assert info["calls"].get("whole", 0) > 0 or (name == "lora" and stage == 3)
    assert info["ref_param_class"] == (None if name == "lora" else "Parameter")
    # Each group's prompt is computed once in every pass of the sharded run; the reference run computes it per row.
    assert info["shared_passes"] > 0
    config = dict(lora=True) if name == "lora" else dict(loss_type=name)
    reference, trainer = trained(tmp_path, 8, share_prompt=False, **config)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert info["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-6)
    assert sorted(params) == sorted(reference)
    expected = updates(reference, trainer.initial)
    assert_same_update(updates(params, trainer.initial), expected, reference, steps=STEPS, what=f"ZeRO-{stage} {name}")
    if name == "lora":  # the adapter trained (B starts at zero)
        assert any(".lora_B." in key and value.abs().sum() > 0 for key, value in params.items())


@pytest.mark.distributed
def test_zero_trains_a_model_loaded_from_a_folder(zero):
    """The dapo run again with the model given as a folder, the way users pass one: under ZeRO-3 `from_pretrained`
    partitions the weights as it loads them and the reference is loaded from the folder (a partitioned model
    cannot be copied); under ZeRO-2 it is a copy. Same losses and parameters as the model built in code."""
    stage, results = zero
    params, info = results["from_path"]
    expected, expected_info = results["dapo"]
    assert info["ref_partitioned"] == (stage == 3) and info["steps_run"] == 3
    assert info["losses"] == pytest.approx(expected_info["losses"], rel=1e-6)
    initial = dict(tiny_model().named_parameters())  # the folder holds the tiny model as built in code
    update, expected_update = updates(params, initial), updates(expected, initial)
    assert_same_update(update, expected_update, expected, steps=STEPS, what=f"ZeRO-{stage} from path")


@pytest.mark.distributed
def test_zero_scores_with_a_reward_model_loaded_from_a_folder(zero, tmp_path):
    """A reward model given as a folder (with a reward function beside it): under ZeRO-3 partitioned as it loads
    and run by an engine of its own; the logged rewards, losses and parameters equal 1 process's with 8 rows."""
    stage, results = zero
    params, info = results["reward_model"]
    assert info["rm_partitioned"] == (stage == 3) and info["steps_run"] == 3
    folder = results["out_file"]
    expected, trainer = trained(tmp_path, 8, model=f"{folder}.model", rewards=[f"{folder}.rm", reward_len])
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert info["rewards"] == pytest.approx([entry["reward"] for entry in logged], rel=1e-5)
    assert info["losses"] == pytest.approx([entry["loss"] for entry in logged], rel=1e-4, abs=1e-6)
    update = updates(params, trainer.initial)
    assert_same_update(update, updates(expected, trainer.initial), expected, steps=STEPS, what=f"ZeRO-{stage}")


@pytest.mark.distributed
def test_zero_generate_gathers_weights(zero):
    """2 steps that sample with the policy's own `model.generate`, with ds3_gather_for_generation on and off: under
    ZeRO-3 the weights are whole while sampling only with the gather (ZeRO-2 never partitions them); the draws, the
    losses and the parameters after are the same either way."""
    stage, results = zero
    gathered_params, gathered_info, gathered_calls = results["generate", True]
    partitioned_params, partitioned_info, partitioned_calls = results["generate", False]
    assert gathered_info["steps_run"] == partitioned_info["steps_run"] == 2
    assert len(gathered_calls) == len(partitioned_calls) == 2  # one round per step, on this process
    assert all(whole for whole, _ in gathered_calls)
    assert all(whole for whole, _ in partitioned_calls) == (stage == 2)
    assert [ids for _, ids in gathered_calls] == [ids for _, ids in partitioned_calls]
    assert gathered_info["losses"] == pytest.approx(partitioned_info["losses"], rel=1e-6, abs=1e-8)
    initial = dict(tiny_model().named_parameters())
    expected = updates(gathered_params, initial)
    assert_same_update(updates(partitioned_params, initial), expected, gathered_params, steps=2, what="partitioned")


@pytest.mark.distributed
@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "partitioned"])
def test_zero_generate_stops_unevenly(zero, gather):
    """Process 0 stops after 2 new tokens, process 1 after 6; a collective right after agrees on both. Partitioned,
    each decoding step gathers the weights, so process 0 keeps joining process 1's steps."""
    _, results = zero
    assert results["uneven", gather] == [(2, 3.0), (6, 3.0)]


@pytest.mark.distributed
def test_zero_resumes_from_a_checkpoint(zero, tmp_path):
    """3 Adam steps saved every step; a second launch resumed from checkpoint-2 (DeepSpeed's partitioned weights and
    optimizer state, and this trainer's own state) takes the one step left and ends with the same parameters."""
    stage, results = zero
    saved, info = results["saved"]
    assert info["steps_run"] == 3
    output_dir = results["out_file"] + ".c"  # where tests/helpers/deepspeed_update.py saved it
    resumed, resumed_info = launch(stage, tmp_path / "resumed.pt", "--resume", output_dir)["resumed"]
    assert resumed_info["steps_run"] == 1 and resumed_info["distributed_type"] == "DistributedType.DEEPSPEED"
    assert resumed_info["losses"] == pytest.approx(info["losses"], rel=1e-5)
    assert sorted(resumed) == sorted(saved)
    for key, value in saved.items():  # the same last step on the same machine: rounding explains no difference
        assert torch.equal(resumed[key], value), f"ZeRO-{stage} {key}"
