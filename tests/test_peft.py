"""GRPO with a LoRA adapter (`GRPOTrainer(peft_config=...)`, a PeftModel as `model`, the recipe's `peft:` section).

What trains (only the adapter), the reference (the same network with the adapter disabled, equal to the original
model), the KL at the first step, generation with the adapter, gradient checkpointing, the saved adapter, and the
recipe section. Exact resume with LoRA is a scenario of tests/test_resume.py; two processes against one, a case of
tests/helpers/distributed_update.py."""

import json

import pytest
import torch
import yaml

from grpo import GRPOConfig, GRPOTrainer
from grpo.cli.recipe import RecipeError, load_recipe
from grpo.data import InputError
from grpo.objective.logprobs import completion_logprobs
from grpo.testing import tiny_model
from tests.helpers.compare import assert_close_to_scale, assert_same_update
from tests.helpers.distributed_update import lora_config, lora_step_update
from tests.helpers.scripted import TINY, capture_batches, reward_len
from tests.test_cli import run_grpo, write_tiny_recipe

peft = pytest.importorskip("peft", reason="the PEFT tests need `pip install peft`")


def make_trainer(tmp_path, tokenizer, dataset, model=None, peft_config=None, **config):
    # lr 1e-2 with Adam: every step moves each adapter weight by about 1e-2, far above float32 noise.
    settings = {**dict(learning_rate=1e-2, beta=0.04, max_steps=2), **config}
    args = GRPOConfig(output_dir=str(tmp_path / "out"), **{**TINY, **settings})
    model = model if model is not None else tiny_model(tokenizer)
    return GRPOTrainer(
        model, reward_len, args=args, train_dataset=dataset, processing_class=tokenizer, peft_config=peft_config
    )


def base_name(peft_name):
    """`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` -> `model.layers.0.self_attn.q_proj.weight`:
    the name of a wrapped base weight in the original model."""
    return peft_name.removeprefix("base_model.model.").replace(".base_layer", "")


def adapter_params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_lora_trains_only_the_adapter_and_leaves_the_base_bit_identical(tmp_path, tokenizer, prompt_dataset):
    original = tiny_model(tokenizer)  # the same seed as the trainer's model: an untouched copy of the base
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, peft_config=lora_config())
    named = dict(trainer.model.named_parameters())
    trainable = sorted(n for n, p in named.items() if p.requires_grad)
    # every linear layer but the output head gets an A and a B: 2 layers x 7 projections x 2
    assert len(trainable) == 28 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    start = adapter_params(trainer.model)
    assert all(v.abs().sum() == 0 for n, v in start.items() if "lora_B" in n)  # LoRA's B starts at 0

    trainer.train()

    base = original.state_dict()
    frozen = [n for n in named if "lora_" not in n]
    assert len(frozen) == len(base)
    for name in frozen:
        assert torch.equal(named[name].detach(), base[base_name(name)]), name
    end = adapter_params(trainer.model)
    for name in trainable:
        assert not torch.equal(end[name], start[name]), f"{name} did not train"


def test_kl_is_zero_at_the_first_step_and_positive_once_the_adapter_moved(tmp_path, tokenizer, prompt_dataset):
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, peft_config=lora_config(), max_steps=3)
    trainer.train()
    kl = [entry["kl"] for entry in trainer.state.log_history if "loss" in entry]
    # Step 1: B = 0, so the adapter adds exactly 0.0 and the policy is the reference to the last bit.
    assert kl[0] == 0.0
    assert kl[1] > 0 and kl[2] > 0


def test_reference_logprobs_are_the_original_models_while_the_adapter_is_not_zero(tmp_path, tokenizer, prompt_dataset):
    original = tiny_model(tokenizer).eval()
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, peft_config=lora_config(), max_steps=3)
    assert trainer.ref_model is None  # no second copy of the network
    batches = capture_batches(trainer)
    trainer.train()
    batch = batches[-1]  # step 3: the reference was computed after two updates of the adapter

    def logps(model):
        with torch.no_grad():
            out, _ = completion_logprobs(
                model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask
            )
        return out[batch.completion_mask.bool()]

    expected = logps(original)
    assert_close_to_scale(batch.ref_logps[batch.completion_mask.bool()], expected, "reference log-probs")
    # Not vacuous: with the adapter on, the same tokens have clearly different log-probs.
    assert (logps(trainer.model.eval()) - expected).abs().max() > 1e-3


def test_peft_model_as_model_trains_like_peft_config(tmp_path, tokenizer, prompt_dataset):
    # tiny_model seeds itself, so LoRA's A is drawn from the same RNG state in both; each trainer is built right
    # before it trains because Trainer.__init__ seeds the RNG that sampling then uses.
    by_config = make_trainer(tmp_path / "a", tokenizer, prompt_dataset, peft_config=lora_config())
    by_config.train()
    wrapped = peft.get_peft_model(tiny_model(tokenizer), lora_config())
    by_model = make_trainer(tmp_path / "b", tokenizer, prompt_dataset, model=wrapped)
    assert by_model.ref_model is None
    by_model.train()
    a, b = adapter_params(by_config.model), adapter_params(by_model.model)
    assert a.keys() == b.keys() and len(a) == 28
    for name in a:
        assert torch.equal(a[name], b[name]), name
    logs = [[e for e in t.state.log_history if "loss" in e] for t in (by_config, by_model)]
    assert [(e["loss"], e["reward"], e["kl"]) for e in logs[0]] == [(e["loss"], e["reward"], e["kl"]) for e in logs[1]]
    assert logs[0][-1]["kl"] > 0  # the adapter moved: the comparison is not between two untrained models


def test_peft_config_errors(tmp_path, tokenizer, prompt_dataset):
    wrapped = peft.get_peft_model(tiny_model(tokenizer), lora_config())
    with pytest.raises(InputError, match="already a PeftModel"):
        make_trainer(tmp_path, tokenizer, prompt_dataset, model=wrapped, peft_config=lora_config())
    with pytest.raises(InputError, match=r"peft_config must be a peft.PeftConfig .* got dict"):
        make_trainer(tmp_path, tokenizer, prompt_dataset, peft_config={"r": 8})


@pytest.mark.parametrize(
    "checkpointing",
    [
        dict(gradient_checkpointing=True),  # the TRL-style name (an alias in transformers 5); non-reentrant
        dict(activation_checkpointing=True, activation_checkpointing_kwargs={"use_reentrant": True}),
    ],
)
def test_gradient_checkpointing_gives_the_same_lora_update(tmp_path, checkpointing):
    """With activation checkpointing on, the frozen embeddings still pass gradients to the adapter, and the update
    equals the one without checkpointing. Even the reentrant kind works with no help from us: transformers'
    `activation_checkpointing_enable` calls `enable_input_require_grads()` itself for input-ids models."""
    plain, trainer = lora_step_update(tmp_path / "plain", per_device_train_batch_size=8)
    params = dict(trainer.model.named_parameters())
    checkpointed, trainer = lora_step_update(tmp_path / "gc", per_device_train_batch_size=8, **checkpointing)
    assert trainer.model.base_model.model.model.gradient_checkpointing  # it really was on
    moved = [n for n, d in checkpointed.items() if d.abs().sum() > 0]
    # One step from B = 0: only B gets a gradient (dL/dA = B^T (...) = 0); all 14 of them must move.
    assert len(moved) == 14 and all(".lora_B." in n for n in moved)
    assert_same_update(checkpointed, plain, params, what="checkpointed")


def test_generation_samples_with_the_adapter(tmp_path, tokenizer, prompt_dataset):
    original = tiny_model(tokenizer)
    trainer = make_trainer(tmp_path, tokenizer, prompt_dataset, peft_config=lora_config(), max_steps=3)
    trainer.train()
    policy = trainer.accelerator.unwrap_model(trainer.model)
    trainer.generation.generation_config.do_sample = False  # greedy: the argmax token at every position
    prompts = [tokenizer(f"Question {i}: count to three.")["input_ids"] for i in range(8)]

    def greedy(model):
        return trainer.generation.generate(model, prompts).ids

    with policy.disable_adapter():
        without_adapter = greedy(policy)
    # The adapter switched off reproduces the original model token for token, so any difference below comes from
    # the adapter and nothing else.
    assert without_adapter == greedy(original)
    with_adapter = greedy(policy)
    assert with_adapter != without_adapter
    assert sum(a != b for a, b in zip(with_adapter, without_adapter)) >= 4  # most rows, not one near-tie


def test_checkpoints_and_save_model_write_the_adapter_only(tmp_path, tokenizer, prompt_dataset):
    trainer = make_trainer(
        tmp_path,
        tokenizer,
        prompt_dataset,
        peft_config=lora_config(),
        max_steps=1,
        save_strategy="steps",
        save_steps=1,
    )
    trainer.train()
    checkpoint = tmp_path / "out" / "checkpoint-1"
    assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "adapter_config.json").is_file()
    assert not (checkpoint / "model.safetensors").exists()
    trainer.save_model(str(tmp_path / "final"))
    assert (tmp_path / "final" / "adapter_model.safetensors").is_file()
    assert not (tmp_path / "final" / "model.safetensors").exists()
    loaded = peft.PeftModel.from_pretrained(tiny_model(tokenizer), str(tmp_path / "final"))
    saved = {n.replace(".default", ""): p for n, p in loaded.named_parameters() if "lora_" in n}
    trained = {n.replace(".default", ""): p for n, p in trainer.model.named_parameters() if "lora_" in n}
    assert saved.keys() == trained.keys()
    for name in saved:
        assert torch.equal(saved[name], trained[name]), name


# ---- The recipe's `peft:` section ----


def test_recipe_peft_section_builds_a_lora_config(tmp_path):
    recipe = load_recipe("examples/recipes/demo_lora.yaml")
    config = recipe.peft_config()
    assert isinstance(config, peft.LoraConfig)
    assert (config.r, config.lora_alpha, config.target_modules, config.lora_dropout) == (16, 32, "all-linear", 0.0)
    assert load_recipe("examples/recipes/demo.yaml").peft_config() is None  # no section: full fine-tuning
    # Overrides reach the section, add one, or remove it.
    assert load_recipe("examples/recipes/demo_lora.yaml", ["--peft.r", "4"]).peft_config().r == 4
    assert load_recipe("examples/recipes/demo.yaml", ["--peft.r", "8"]).peft_config().r == 8
    assert load_recipe("examples/recipes/demo_lora.yaml", ["--peft", "null"]).peft_config() is None
    listed = load_recipe("examples/recipes/demo.yaml", ["--peft", "{target_modules: [q_proj, v_proj]}"])
    assert listed.peft_config().target_modules == {"q_proj", "v_proj"}


@pytest.mark.parametrize(
    "override, message",
    [
        (["--peft.lora_alpah", "16"], "Unknown key 'lora_alpah' in the 'peft' section. Did you mean 'lora_alpha'?"),
        (["--peft", "{rank: 8}"], "Unknown key 'rank' in the 'peft' section"),
        (["--peft", "8"], "'peft' must be a mapping"),
        (["--peft.r", "sixteen"], "peft.r: 'sixteen' (str) is not of type int"),
        (["--peft.r", "0"], "peft.r must be a positive rank"),
        (["--peft.lora_dropout", "1.5"], r"peft.lora_dropout must be in \[0, 1\)"),
        (["--peft.bias", "some"], "peft.bias must be 'none', 'all' or 'lora_only'"),
    ],
)
def test_recipe_peft_section_errors(override, message):
    with pytest.raises(RecipeError, match=message.replace("(str)", r"\(str\)")):
        load_recipe("examples/recipes/demo.yaml", override)


@pytest.mark.slow
def test_grpo_train_with_a_lora_recipe_saves_the_adapter(tmp_path, tiny_model_path, tokenizer):
    write_tiny_recipe(tmp_path, tiny_model_path)
    recipe = yaml.safe_load((tmp_path / "tiny.yaml").read_text())
    recipe["peft"] = {"r": 4, "lora_alpha": 8, "target_modules": "all-linear"}
    recipe["learning_rate"] = 1e-2  # two steps must visibly move the adapter
    (tmp_path / "tiny.yaml").write_text(yaml.safe_dump(recipe))
    result = run_grpo("train", "tiny.yaml", "--max_steps", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "out"
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    loaded = peft.PeftModel.from_pretrained(tiny_model(tokenizer), str(out))
    lora_b = [p for n, p in loaded.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 14 and all(p.abs().sum() > 0 for p in lora_b)  # trained, saved, loaded back
