"""Activations that do not grow with the whole sequence (grpo/objective/activation_memory.py): the tiled MLP
(`tiled_mlp_tokens`) gives the plain MLP's log-probs and gradients in float64, with gradient checkpointing off,
reentrant and non-reentrant, under a LoRA adapter on the MLP and through a whole training step, while a layer's MLP
keeps only its input for backward and never runs on more than a chunk of tokens; `activation_offloading` copies the
saved activations out and back without changing a gradient (on a CPU here by asking for it; the trainer makes it a
logged no-op there)."""

import logging
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.objective.activation_memory import HostOffload, TiledForward, decoder_mlps, tile_mlps
from grpo.objective.logprobs import completion_logprobs
from grpo.testing import tiny_model
from tests.helpers.compare import assert_close_to_scale, assert_same_update, updates
from tests.helpers.fsdp_update import STEPS, trained
from tests.helpers.net import TWO_CPU_PROCESSES, launch_two_processes
from tests.helpers.scripted import TINY, ScriptedGeneration, reward_len
from tests.helpers.tiled_update import CASES

# 5 tokens per chunk: it divides none of the widths below, so every MLP call ends on a short chunk.
TOKENS = 5
# How each run checkpoints the decoder layers: not at all, torch's reentrant and non-reentrant implementations.
CHECKPOINTING = {"off": None, "reentrant": True, "non_reentrant": False}


def _batch(pad_id):
    """Two groups of two rows (repeated prompts), left-padded prompts, right-padded ragged completions: 4 x 13
    tokens, 41 of them real."""
    generator = torch.Generator().manual_seed(0)
    prompt_ids = torch.randint(3, 250, (4, 4), generator=generator)
    prompt_ids[1], prompt_ids[3] = prompt_ids[0], prompt_ids[2]
    prompt_ids[2:, 0] = pad_id
    completion_ids = torch.randint(3, 250, (4, 9), generator=generator)
    completion_mask = torch.ones_like(completion_ids)
    for row, length in enumerate((9, 6, 2, 7)):
        completion_ids[row, length:], completion_mask[row, length:] = pad_id, 0
    return prompt_ids, (prompt_ids != pad_id).long(), completion_ids, completion_mask


def _model(tokenizer, tokens=None, checkpointing=None, lora=False):
    model = tiny_model(tokenizer, seed=1).double()
    if lora:
        peft = pytest.importorskip("peft", reason="the peft extra is not installed")
        config = peft.LoraConfig(r=4, target_modules=["gate_proj", "up_proj", "down_proj"], init_lora_weights=False)
        model = peft.get_peft_model(model, config)  # B is random too (init_lora_weights=False): every grad non-zero
    model.train()
    if checkpointing is not None:
        model.activation_checkpointing_enable({"use_reentrant": checkpointing})
        if lora:
            model.enable_input_require_grads()  # the reentrant implementation needs an input that requires grad
    tile_mlps(model, tokens)
    return model


def _rows_per_call(model):
    """A list that receives the rows (tokens) of every call of each layer's gate projection, forward and
    recomputation alike."""
    calls = []
    for mlp in decoder_mlps(model).values():
        mlp.gate_proj.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[:-1].numel()))
    return calls


def _loss_and_grads(model, batch, shared_prompt=True):
    """Log-probs and entropies of `batch`, and every trainable parameter's gradient of a loss that weighs each
    token differently (so a gradient routed to the wrong rows shows)."""
    logps, entropy = completion_logprobs(model, *batch, with_entropy=True, share_prompt=shared_prompt)
    weights = torch.linspace(-1.0, 2.0, logps.numel(), dtype=logps.dtype, device=logps.device).view(logps.shape)
    ((logps * weights).sum() + entropy.sum()).backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    return logps.detach(), entropy.detach(), grads


def _assert_same(got, want):
    assert_close_to_scale(got[0], want[0], "log-probs")
    assert_close_to_scale(got[1], want[1], "entropies")
    assert sorted(got[2]) == sorted(want[2])
    for name, grad in want[2].items():
        assert grad.abs().max() > 0, name  # every parameter takes part: an equality of zeros would prove nothing
        assert_close_to_scale(got[2][name], grad, name)


@pytest.mark.parametrize("checkpointing", list(CHECKPOINTING))
@pytest.mark.parametrize("shared_prompt", [True, False], ids=["grouped", "padded"])
def test_tiled_mlp_equals_the_plain_mlp(tokenizer, checkpointing, shared_prompt):
    """Log-probs, entropies and every parameter's gradient equal the plain model's, in float64 (to 32 eps of each
    tensor's scale: tests/helpers/compare.py), whether the layers are checkpointed or not; and the MLP really ran in
    chunks: no call of a gate projection on more than TOKENS rows, several per layer and pass."""
    batch = _batch(tokenizer.pad_token_id)
    reentrant = CHECKPOINTING[checkpointing]
    want = _loss_and_grads(_model(tokenizer, checkpointing=reentrant), batch, shared_prompt)
    tiled = _model(tokenizer, TOKENS, checkpointing=reentrant)
    calls = _rows_per_call(tiled)
    got = _loss_and_grads(tiled, batch, shared_prompt)
    _assert_same(got, want)
    assert max(calls) == TOKENS and len(calls) > 4 * len(decoder_mlps(tiled))


@pytest.mark.parametrize("checkpointing", list(CHECKPOINTING))
def test_tiled_mlp_under_lora_on_its_projections(tokenizer, checkpointing):
    """A LoRA adapter on gate, up and down projections (its A and B both random): the adapter weights get the plain
    model's gradients through the tiled MLP; the frozen base weights none."""
    batch = _batch(tokenizer.pad_token_id)
    reentrant = CHECKPOINTING[checkpointing]
    want = _loss_and_grads(_model(tokenizer, checkpointing=reentrant, lora=True), batch)
    tiled = _model(tokenizer, TOKENS, checkpointing=reentrant, lora=True)
    got = _loss_and_grads(tiled, batch)
    assert any(".mlp.gate_proj.lora_B." in name for name in got[2])
    _assert_same(got, want)
    assert all(p.grad is None for p in tiled.parameters() if not p.requires_grad)


def _saved_bytes_in_mlps(model, batch):
    """Bytes of the distinct tensors saved for backward while an MLP's forward runs, over all layers, in one
    training pass without checkpointing."""
    inside, saved = [False], {}

    def pack(tensor):
        if inside[0] and not isinstance(tensor, torch.nn.Parameter):
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    for mlp in decoder_mlps(model).values():
        mlp.register_forward_pre_hook(lambda module, args: inside.__setitem__(0, True))
        mlp.register_forward_hook(lambda module, args, out: inside.__setitem__(0, False))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logps, _ = completion_logprobs(model, *batch, share_prompt=False)
    logps.sum().backward()
    return sum(saved.values())


def test_a_tiled_mlp_saves_only_its_input(tokenizer):
    """The plain MLP saves, per layer, its input and four (N, I) tensors (gate, act(gate), up, their product), N the
    tokens of the pass; the tiled one saves its input alone: (N, H) per layer, 4 I / H + 1 = 9 times less here."""
    batch = _batch(tokenizer.pad_token_id)
    plain, tiled = _model(tokenizer), _model(tokenizer, TOKENS)
    layers, config = len(decoder_mlps(plain)), plain.config
    tokens = batch[0].shape[0] * (batch[0].shape[1] + batch[2].shape[1])  # the padded forward: B x (P + T)
    row = 8  # bytes of a float64
    assert _saved_bytes_in_mlps(tiled, batch) == layers * tokens * config.hidden_size * row
    assert _saved_bytes_in_mlps(plain, batch) >= layers * tokens * (4 * config.intermediate_size) * row


def _trainer(tmp_path, model, tokenizer, **config):
    settings = dict(max_steps=1, optim="sgd", learning_rate=0.5, max_grad_norm=0.0, shuffle_dataset=False, beta=0.04)
    args = GRPOConfig(output_dir=str(tmp_path), **{**TINY, **settings, **config})
    dataset = Dataset.from_dict({"prompt": [f"Question {i}: count to three." for i in range(8)]})
    trainer = GRPOTrainer(model, reward_len, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.generation = ScriptedGeneration(args.num_generations, args.max_completion_length)
    return trainer


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_one_training_step_equals_the_plain_trainers(tmp_path, tokenizer, checkpointing):
    """One plain-SGD step (KL term on, so the reference pass runs through tiled MLPs too) from the same float64
    weights on the same scripted completions: the tiled trainer's update equals the plain trainer's."""
    updates = {}
    for name, tokens in (("plain", None), ("tiled", 3)):
        model = tiny_model(tokenizer, seed=1).double()
        trainer = _trainer(
            tmp_path / name, model, tokenizer, tiled_mlp_tokens=tokens, activation_checkpointing=checkpointing
        )
        calls = _rows_per_call(trainer.model)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        updates[name] = {n: p.detach() - before[n] for n, p in trainer.model.named_parameters()}
        assert max(calls) <= 3 if tokens else max(calls) > 3
    assert_same_update(updates["tiled"], updates["plain"], before, what="tiled MLP")
    assert all(u.abs().max() > 0 for n, u in updates["plain"].items() if ".mlp." in n)


def test_dropout_in_the_mlp_draws_the_same_masks_in_the_recomputation():
    """With dropout on (disable_dropout=False), the backward's recomputation of each chunk replays the forward's
    random state: the gradients are those of the function the forward computed, i.e. of the MLP run on the same
    chunks in the same order from the same seed (without the replay, other masks give other gradients)."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 6)).double()
    x = torch.randn(2, 11, 6, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, 11, 6, dtype=torch.float64)

    def grads(output):
        (output * weights).sum().backward()
        found = [x.grad.clone()] + [p.grad.clone() for p in mlp.parameters()]
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        return found

    torch.manual_seed(1)
    want = grads(torch.cat([mlp(rows[None]) for rows in x.reshape(-1, 6).split(TOKENS)], 1).view(2, 11, 6))
    torch.manual_seed(1)
    got = grads(TiledForward(mlp, mlp.forward, TOKENS)(x))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("tokens", [0, -4, 2.5, "64", True])
def test_bad_chunk_lengths_are_refused_by_the_config(tmp_path, tokens):
    with pytest.raises((TypeError, ValueError), match="tiled_mlp_tokens"):
        GRPOConfig(output_dir=str(tmp_path), use_cpu=True, tiled_mlp_tokens=tokens)
    with pytest.raises(ValueError, match="tiled_mlp_tokens"):
        tile_mlps(torch.nn.Linear(2, 2), tokens)


def test_a_model_without_decoder_mlps_is_refused(tokenizer):
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    with pytest.raises(ValueError, match=r"tiled_mlp_tokens=16 found no MLP to tile in Sequential.*=None"):
        tile_mlps(model, 16)


def test_a_mixture_of_experts_model_is_refused_when_the_trainer_is_built(tmp_path, tokenizer):
    from tests.test_router_aux import tiny_moe

    with pytest.raises(ValueError, match=r"model.layers.0.mlp is a Mixture-of-Experts block .*tiled_mlp_tokens=None"):
        _trainer(tmp_path, tiny_moe(tokenizer), tokenizer, tiled_mlp_tokens=16)


def test_an_mlp_that_takes_more_than_the_hidden_states_is_refused(tokenizer):
    class GatedMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64)

        def forward(self, hidden_states, gate):
            return self.proj(hidden_states) * gate

    model = tiny_model(tokenizer)
    model.model.layers[1].mlp = GatedMLP()
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.forward \(GatedMLP\) takes \['hidden_states', 'gate'\]"):
        tile_mlps(model, 16)


def test_tiling_is_undone_and_not_nested(tokenizer):
    """Tiling twice replaces the chunk length (no tiled forward inside another); None restores the plain forward."""
    model = tiny_model(tokenizer)
    plain = {name: mlp.forward for name, mlp in decoder_mlps(model).items()}
    assert tile_mlps(model, 8) == tile_mlps(model, 4) == 2
    for mlp in decoder_mlps(model).values():
        assert mlp.forward.tokens == 4 and mlp.forward.inner == plain_forward(mlp)
    tile_mlps(model, None)
    assert {name: mlp.forward for name, mlp in decoder_mlps(model).items()} == plain


def plain_forward(mlp):
    return type(mlp).forward.__get__(mlp)


# ---- activation_offloading ----


class RecordedOffload(HostOffload):
    """`HostOffload` that keeps the storage address of every tensor it copied out."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.copied = set()

    def pack(self, tensor):
        packed = super().pack(tensor)
        if packed is not tensor:
            self.copied.add(tensor.untyped_storage().data_ptr())
        return packed


@pytest.mark.parametrize("checkpointing", list(CHECKPOINTING))
def test_offloaded_activations_leave_every_gradient_as_it_was(tokenizer, checkpointing):
    """`HostOffload` asked to copy CPU tensors (a GPU's path, run here): each saved activation goes out to a host
    copy and comes back; log-probs and gradients are unchanged, tiled or not; no parameter was copied."""
    batch = _batch(tokenizer.pad_token_id)
    reentrant = CHECKPOINTING[checkpointing]
    want = _loss_and_grads(_model(tokenizer, checkpointing=reentrant), batch)
    for tokens in (None, TOKENS):
        model = _model(tokenizer, tokens, checkpointing=reentrant)
        offload = RecordedOffload(model, min_bytes=0, devices=("cpu",))
        with offload:
            got = _loss_and_grads(model, batch)
        _assert_same(got, want)
        assert offload.offloaded_bytes > 0 and offload.copied
        assert not offload.copied & {p.untyped_storage().data_ptr() for p in model.parameters()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("checkpointing", list(CHECKPOINTING))
def test_offloading_on_a_gpu_copies_to_pinned_memory_and_back(tokenizer, checkpointing):
    """The GPU path as the trainer runs it (default `devices`, pinned host buffers, copies that do not block): the
    same log-probs and gradients as without offloading, in float64 on the GPU, with activations really copied."""
    batch = [t.cuda() for t in _batch(tokenizer.pad_token_id)]
    reentrant = CHECKPOINTING[checkpointing]
    want = _loss_and_grads(_model(tokenizer, TOKENS, checkpointing=reentrant).cuda(), batch)
    model = _model(tokenizer, TOKENS, checkpointing=reentrant).cuda()
    offload = RecordedOffload(model, min_bytes=0)
    with offload:
        got = _loss_and_grads(model, batch)
    _assert_same(got, want)
    assert offload.offloaded_bytes > 0 and offload.copied


def test_offloading_is_a_logged_no_op_on_a_cpu(tmp_path, tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="grpo.objective.activation_memory"):
        trainer = _trainer(tmp_path, tiny_model(tokenizer), tokenizer, activation_offloading=True)
    assert trainer.accelerator.device.type == "cpu"
    assert trainer.logprobs.autocast == trainer.accelerator.autocast  # nothing around the passes
    lines = [r.getMessage() for r in caplog.records if "activation_offloading" in r.getMessage()]
    assert lines == [
        "activation_offloading=True does nothing on a cpu device: the tensors saved for backward are in "
        "host memory already."
    ]


# ---- Two processes: DDP, FSDP2, DeepSpeed ZeRO-3 (tests/helpers/tiled_update.py) ----

CONFIGS = Path(__file__).resolve().parent / "configs"
# name -> (accelerate config, the helper's extra arguments, environment, the distributed type that must have run)
LAUNCHES = {
    "ddp": (TWO_CPU_PROCESSES, (), {}, "MULTI_CPU"),
    "fsdp2": (CONFIGS / "accelerate_cpu_fsdp2.yaml", ("--route",), {"ACCELERATE_TORCH_DEVICE": "cpu"}, "FSDP"),
    "zero3": (
        CONFIGS / "accelerate_cpu_zero3.yaml",
        ("--route",),
        {"ACCELERATE_TORCH_DEVICE": "cpu", "DS_ACCELERATOR": "cpu"},
        "DEEPSPEED",
    ),
}


@pytest.fixture(scope="module", params=list(LAUNCHES))
def launched(request, tmp_path_factory):
    """(launch name, what tests/helpers/tiled_update.py saved on 2 processes under it)."""
    name = request.param
    if name == "zero3":
        pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install 'grpo[deepspeed]'")
    config, extra, env, _ = LAUNCHES[name]
    out_file = tmp_path_factory.mktemp(name) / "two.pt"
    script = Path(__file__).resolve().parent / "helpers" / "tiled_update.py"
    launch_two_processes(
        script, out_file, *extra, config=config, env={"ACCELERATE_USE_CPU": None, **env} if extra else env
    )
    return name, torch.load(out_file, weights_only=False)


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(CASES))
def test_tiled_mlp_on_two_processes_matches_the_plain_mlp_on_one(launched, tmp_path, case):
    """3 SGD steps on 2 processes x 4 rows with every MLP tiled (3 tokens a chunk) = 1 process x 8 rows with plain
    MLPs, under DDP (gradients all-reduced once per step: the tiled MLP returns each weight's gradient once), FSDP2
    (the weights gathered for the backward's recomputation) and ZeRO-3 (each chunk's gradient added through
    DeepSpeed's hooks, reduced after the last): the full model, checkpointed, and a LoRA adapter."""
    name, results = launched
    params, info = results[case]
    assert info["distributed_type"] == f"DistributedType.{LAUNCHES[name][3]}"
    assert info["world_size"] == 2 and info["steps_run"] == STEPS and info["tiled"] and all(info["tiled"])
    # 2 layers x (3 steps + the no-grad passes run no backward) at least; ZeRO-3's through its partitioned path only.
    kind = "partitioned" if name == "zero3" else "returned"
    assert info["backwards"].get(kind, 0) >= 2 * STEPS and set(info["backwards"]) == {kind}
    config = dict(CASES[case])
    lora = config.pop("lora", False)
    reference, trainer = trained(tmp_path, 8, share_prompt=False, lora=lora, **config)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert info["losses"] == pytest.approx(losses, rel=1e-4, abs=1e-6)
    expected = updates(reference, trainer.initial)
    assert_same_update(updates(params, trainer.initial), expected, reference, steps=STEPS, what=f"{name} {case}")
