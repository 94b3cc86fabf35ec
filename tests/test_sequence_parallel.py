"""Sequence parallelism through DeepSpeed's Ulysses attention (docs/distributed.md, "Sequence parallelism").

The distributed tier launches two CPU processes over gloo as one sequence-parallel group (sp_size 2) under ZeRO-2
and under ZeRO-3 (tests/helpers/sequence_parallel_update.py): each process runs half of every sequence, and their update must equal
one process's on the same rows, without sequence parallelism, within float32 rounding (tests/helpers/compare.py).
The fast tests check the layout's arithmetic and the settings refused at construction."""

from pathlib import Path

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig

from grpo import GRPOConfig
from grpo.objective.sequence_parallel import SequenceShards, check_model, gradient_factor
from grpo.testing import tiny_model
from tests.helpers.compare import assert_same_update, updates

ROOT = Path(__file__).resolve().parent.parent
DS_ENV = {"ACCELERATE_TORCH_DEVICE": "cpu", "ACCELERATE_USE_CPU": None, "DS_ACCELERATOR": "cpu"}


class Group:
    """What `SequenceShards` reads of a `SequenceParallel`: the group's size and this process's rank in it."""

    def __init__(self, size, rank):
        self.size, self.rank = size, rank


def batch():
    """3 rows: prompts of 3, 1 and 2 tokens (left-padded, pad 0), completions of 4, 2 and 1 tokens (right-padded)."""
    prompt_ids = torch.tensor([[11, 12, 13], [0, 0, 21], [0, 31, 32]])
    completion_ids = torch.tensor([[14, 15, 16, 17], [22, 23, 0, 0], [33, 0, 0, 0]])
    return prompt_ids, (prompt_ids != 0).long(), completion_ids, (completion_ids != 0).long()


@pytest.mark.parametrize("size", [2, 3])
def test_shards_hold_each_row_whole_and_predict_each_token_once(size):
    """Joined over the group, the shards are every row's real tokens from column 0 (prompt, then completion), padded
    to a multiple of the group size, positions 0.. on; every completion token is predicted by exactly one process,
    at the column before it, which holds the token before it."""
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch()
    shards = [SequenceShards(*batch(), Group(size, rank)) for rank in range(size)]
    ids = torch.cat([s.input_ids for s in shards], dim=1)
    positions = torch.cat([s.position_ids for s in shards], dim=1)
    assert ids.shape[1] % size == 0 and ids.shape[1] >= 3 + 4
    for row in range(3):
        tokens = [t for t in prompt_ids[row].tolist() + completion_ids[row].tolist() if t != 0]
        assert ids[row, : len(tokens)].tolist() == tokens
        assert positions[row].tolist() == list(range(ids.shape[1]))
    owners = torch.stack([s.completion_mask for s in shards]).long()  # (size, B, T)
    assert torch.equal(owners.sum(0), completion_mask)  # each completion token once
    width = shards[0].input_ids.shape[1]
    for rank, s in enumerate(shards):
        rows, columns = s.predicting // width, s.predicting % width + rank * width
        assert torch.equal(ids[rows, columns + 1], completion_ids[s.completion_mask])  # column j predicts j + 1
        # The token before each predicted one: the prompt's last for token 0, else the completion's previous.
        assert ids[rows, columns].tolist() == [
            prompt_ids[i, -1].item() if t == 0 else completion_ids[i, t - 1].item()
            for i, t in s.completion_mask.nonzero().tolist()
        ]


def test_shards_pad_to_a_multiple_of_the_group_and_of_pad_to_multiple_of():
    shards = SequenceShards(*batch(), Group(2, 1), multiple_of=8)
    assert shards.input_ids.shape == (3, 8) and shards.position_ids[0, 0] == 8  # L = 16: 3 + 4 up to 2 x 8


def sp_config(tmp_path, **settings):
    return GRPOConfig(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", num_generations=2, per_device_train_batch_size=2,
        **settings,
    )  # fmt: skip


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(parallelism_config=ParallelismConfig(cp_size=2)), "does not run torch's context parallelism"),
        (dict(parallelism_config=ParallelismConfig(sp_size=2), padding_free=True), "padding_free=True with sp_size"),
        (dict(parallelism_config=ParallelismConfig(sp_size=2), top_entropy_quantile=0.2), "top_entropy_quantile"),
        (dict(parallelism_config=ParallelismConfig(sp_size=2)), "must divide the number of processes"),
    ],
)
def test_config_refuses_what_sequence_parallelism_cannot_run(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        sp_config(tmp_path, **settings)


def test_config_reads_the_accelerate_launch_variables(tmp_path, monkeypatch):
    """`accelerate launch` passes a config's parallelism_config section as variables; sp_size 2 on this one process
    is refused, the same variables with sp_size 1 are not."""
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    with pytest.raises(ValueError, match="must divide the number of processes"):
        sp_config(tmp_path)
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "1")
    assert sp_config(tmp_path).sequence_parallel_size == 1


def test_model_checks():
    """sdpa with 2 heads and 1 key/value head splits over 2 processes; eager attention, a router loss and a group
    that does not divide the heads are refused."""
    check_model(tiny_model(attn_implementation="sdpa"), 2, 0.0)
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        check_model(tiny_model(attn_implementation="eager"), 2, 0.0)
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        check_model(tiny_model(attn_implementation="sdpa"), 2, 0.01)
    with pytest.raises(ValueError, match="must divide the model's 2 attention heads"):
        check_model(tiny_model(attn_implementation="sdpa"), 4, 0.0)


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2", "zero3"])
def launched(request, tmp_path_factory):
    """(ZeRO stage, every process's results of tests/helpers/sequence_parallel_update.py on 2 processes, sp_size 2,
    under that stage)."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install 'grpo[deepspeed]'")
    from tests.helpers.net import launch_two_processes

    out_file = tmp_path_factory.mktemp(f"ulysses_zero{request.param}") / "two.pt"
    config = ROOT / "tests" / "configs" / f"accelerate_cpu_ulysses_zero{request.param}.yaml"
    helper = ROOT / "tests" / "helpers" / "sequence_parallel_update.py"
    launch_two_processes(helper, out_file, config=config, env=DS_ENV)
    return request.param, torch.load(out_file, weights_only=False)


def run_names():
    try:
        from tests.helpers.sequence_parallel_update import RUNS
    except ImportError:  # no DeepSpeed: the tests below skip
        return ["grpo"]
    return list(RUNS)


@pytest.mark.distributed
@pytest.mark.parametrize("name", run_names())
def test_two_processes_splitting_each_sequence_match_one(launched, tmp_path, name):
    """3 plain-SGD steps with the KL term on: the group of 2 processes, each running half of every sequence (the
    reference's passes and pi_old's too), ends with the parameters of 1 process on the same rows, under ZeRO-2 and
    ZeRO-3 (whose reduce-scatter divides the gradients by every process, not by the data-parallel groups)."""
    from tests.helpers.fsdp_update import trained
    from tests.helpers.sequence_parallel_update import RUNS

    stage, (results, other_results) = launched
    (params, info), (_, other) = results[name], other_results[name]
    assert info["distributed_type"] == "DistributedType.DEEPSPEED" and info["sp_world_size"] == 2
    assert info["zero_stage"] == stage
    assert info["world_size"] == 2 and info["steps_run"] == 3
    seen, other_seen = info["seen"], other["seen"]
    assert seen["rows"] == other_seen["rows"]  # both processes trained the same micro-batches
    config = dict(RUNS[name])
    per_device = config.pop("per_device_train_batch_size")
    assert all(len(prompts) == per_device for prompts, _ in seen["rows"])
    # Each pass ran half of each row on each process: widths L / 2, the second half's positions from L / 2.
    for (width, full, first, _, _), (other_width, _, other_first, _, _) in zip(seen["shards"], other_seen["shards"]):
        assert width == other_width and 2 * width >= full > 2 * (width - 1) and (first, other_first) == (0, width)
    # Both processes predicted some completion tokens, and together each once.
    assert sum(s[3] for s in seen["shards"]) > 0 and sum(s[3] for s in other_seen["shards"]) > 0
    assert all(a[3] + b[3] == a[4] for a, b in zip(seen["shards"], other_seen["shards"]))
    assert len(seen["ulysses"]) > 0 and set(seen["ulysses"]) == {2}  # DeepSpeed's all-to-all over the group
    # One Ulysses call per layer (2) and pass, and with gradient checkpointing again in each training backward.
    assert (len(seen["ulysses"]) > 2 * len(seen["shards"])) == (name == "checkpointed")
    assert set(info["kv_groups"]) == {2}  # the model's own grouping, as Ulysses found it
    reference, trainer = trained(tmp_path, per_device, share_prompt=False, **config)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert info["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-6)
    assert sorted(params) == sorted(reference)
    expected = updates(reference, trainer.initial)
    assert sum(u.abs().sum() for u in expected.values()) > 0
    what = f"sp_size 2, ZeRO-{stage}, {name}"
    assert_same_update(updates(params, trainer.initial), expected, reference, steps=3, what=what)


@pytest.mark.distributed
def test_sampling_runs_whole_sequences(launched):
    """2 steps that sample with the policy's own `model.generate` between sequence-parallel passes: sampling calls
    the plain attention (no Ulysses call beyond the log-prob passes'), and the model's attention layers keep their
    own key/value grouping after the passes."""
    info = launched[1][0]["generate"]
    assert info["steps_run"] == 2 and all(torch.isfinite(torch.tensor(info["losses"])))
    layers = 2
    passes = len(info["seen"]["shards"])
    assert passes > 0 and len(info["seen"]["ulysses"]) == passes * layers
    assert set(info["kv_groups"]) == {2}


def test_gradient_factor_makes_up_for_how_each_zero_stage_divides():
    """ZeRO-0/1/2 divide the sum of every process's gradient by the data-parallel groups: 1; ZeRO-3's reduce-scatter
    by every process: sp_size; ZeRO-3 without reduce-scatter (bucket-dependent divisors) is refused."""
    assert gradient_factor({"zero_optimization": {"stage": 2}}, 4) == 1
    assert gradient_factor({}, 4) == 1
    assert gradient_factor({"zero_optimization": {"stage": 3}}, 4) == 4
    with pytest.raises(ValueError, match="reduce_scatter: false"):
        gradient_factor({"zero_optimization": {"stage": 3, "reduce_scatter": False}}, 2)


def test_example_config_has_the_tested_section():
    """examples/accelerate_configs/deepspeed_ulysses.yaml sets the parallelism_config section the distributed tests
    launch with, under DeepSpeed."""
    from accelerate.commands.config.config_args import load_config_from_file

    example = load_config_from_file(str(ROOT / "examples" / "accelerate_configs" / "deepspeed_ulysses.yaml"))
    tested = load_config_from_file(str(ROOT / "tests" / "configs" / "accelerate_cpu_ulysses_zero2.yaml"))
    assert example.distributed_type.value == "DEEPSPEED"
    assert example.parallelism_config == tested.parallelism_config
    assert example.parallelism_config["parallelism_config_sp_size"] == 2
