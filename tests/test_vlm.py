"""Vision-language models (docs/vlm.md): images beside chat prompts, through the processor, `model.generate` and the
log-prob passes, on tiny Idefics3- (SmolVLM-) and Qwen2-VL-shaped models built in code."""

import json

import pytest
import torch
from datasets import Dataset

from grpo import GRPOConfig, GRPOTrainer
from grpo.data import InputError, pad
from grpo.data.vision import encode_vision_prompts, vision_batch, with_image_blocks
from grpo.generation import TransformersGeneration
from grpo.objective.logprobs import completion_logprobs
from grpo.rollout import MicroBatch
from grpo.testing import VLM_KINDS, squares_image, tiny_model, tiny_tokenizer, tiny_vlm
from tests.helpers.scripted import TINY
from tests.helpers.vlm import ScriptedVisionGeneration, squares_dataset


@pytest.fixture(autouse=True)
def _run_in_tmp_path(tmp_path, monkeypatch):
    """Each test runs in its own temporary folder: the trainers' placeholder output_dir ("unused-vlm", which building
    a trainer may create) lands there, not in the repository."""
    monkeypatch.chdir(tmp_path)


PROMPTS = [[{"role": "user", "content": "How many squares?"}], [{"role": "user", "content": "Count them, please."}]]


def first_round(kind, dataset=None, **config):
    """A trainer on a tiny VLM of `kind` and its first round's first micro-batch (scripted completions)."""
    model, processor = tiny_vlm(kind=kind)
    args = GRPOConfig(output_dir="unused-vlm", **{**TINY, "max_steps": 1, **config})
    dataset = dataset if dataset is not None else squares_dataset(8)
    trainer = GRPOTrainer(model, lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=dataset, processing_class=processor)  # fmt: skip
    trainer.generation = ScriptedVisionGeneration(args.num_generations, args.max_completion_length)
    rows = [dataset[i // args.num_generations] for i in range(args.per_device_train_batch_size)]
    return trainer, trainer._prepare_inputs(rows), rows


def plain_forward_logprobs(model, processor, rows, micro_batch):
    """The reference: the processor's own batch of the rows' prompts and images (left-padded), the completions after
    them, one forward with full logits, log-softmax at the completion tokens. No code of grpo's vision path."""
    texts = [
        processor.apply_chat_template(with_image_blocks(row["prompt"], 1), tokenize=False, add_generation_prompt=True)
        for row in rows
    ]
    images = [[row["image"]] for row in rows]
    batch = processor(text=texts, images=images, return_tensors="pt", padding=True, padding_side="left")
    prompt_ids, prompt_mask = batch.pop("input_ids"), batch.pop("attention_mask")
    assert torch.equal(prompt_ids, micro_batch.prompt_ids)  # the trainer's prompt tokens are the processor's
    completion_ids, completion_mask = micro_batch.completion_ids, micro_batch.completion_mask
    mask = torch.cat([prompt_mask, completion_mask], 1)
    inputs = {"input_ids": torch.cat([prompt_ids, completion_ids], 1), "attention_mask": mask}
    for name, value in batch.items():  # per-token vision fields cover the completion too (0: not an image token)
        inputs[name] = torch.cat([value, value.new_zeros(completion_ids.shape)], 1) if value.dim() == 2 and \
            value.shape == prompt_ids.shape else value  # fmt: skip
    if not hasattr(model.model, "get_rope_index"):  # 1-D positions counted over real tokens, as `generate` does
        inputs["position_ids"] = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(**inputs).logits[:, prompt_ids.shape[1] - 1 : -1].double()
    return logits.log_softmax(-1).gather(-1, completion_ids[..., None])[..., 0] * completion_mask


@pytest.mark.parametrize("kind", VLM_KINDS)
def test_training_logprobs_equal_a_plain_forward_with_the_images(kind):
    trainer, micro_batch, rows = first_round(kind)
    assert micro_batch.vision is not None and len(micro_batch.vision) == micro_batch.num_rows
    with torch.no_grad():
        logps, _ = trainer.logprobs(trainer.model, micro_batch)
        expected = plain_forward_logprobs(trainer.model, trainer.processing_class, rows, micro_batch)
    # float32 forward passes of a different layout (chunked projection vs full logits): rounding of order 1e-6.
    torch.testing.assert_close(logps.double(), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", VLM_KINDS)
def test_logprobs_are_those_generate_sampled_from(kind):
    """Greedy `generate` on left-padded prompts of different lengths, with images: the training path's log-probs
    equal the log-softmax of the logits `generate` chose each token from, so positions (Qwen2-VL's 3-D ones too)
    and image features are the same in sampling and training."""
    model, processor = tiny_vlm(kind=kind)
    images = [[squares_image(1, seed=1)], [squares_image(3, seed=2, size=48)]]
    ids, vision = encode_vision_prompts(PROMPTS, images, processor, None)
    assert len(ids[0]) != len(ids[1])  # the shorter prompt is left-padded
    prompt_ids, prompt_mask = pad(ids, processor.tokenizer.pad_token_id, "left")
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        **vision_batch(vision, prompt_ids.shape[1], 0),
        max_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
    )
    completion_ids = out.sequences[:, prompt_ids.shape[1] :]
    sampled = torch.stack(out.logits, 1).double().log_softmax(-1).gather(-1, completion_ids[..., None])[..., 0]
    with torch.no_grad():
        logps, _ = completion_logprobs(
            model, prompt_ids, prompt_mask, completion_ids, torch.ones_like(completion_ids), vision=vision
        )
    torch.testing.assert_close(logps.double(), sampled, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", VLM_KINDS)
def test_the_images_reach_generation_and_every_logprob_pass(kind):
    """Two data sets that differ only in their images: the policy's (training), old and reference log-probs of the
    same completions differ, and `model.generate` is given the images. A path that dropped the images would give
    equal log-probs."""
    flipped = squares_dataset(8).to_list()
    for i, row in enumerate(flipped):
        row["image"] = squares_image(5 - int(row["answer"]), seed=100 + i, colour="blue")
    results = []
    for dataset in (squares_dataset(8), Dataset.from_list(flipped)):
        # num_iterations=2 and GA=2 with steps_per_generation=1: the second micro-batch needs a no-grad old pass.
        trainer, micro_batch, rows = first_round(kind, dataset, beta=0.04, steps_per_generation=2)
        with torch.no_grad():
            logps, _ = trainer.logprobs(trainer.model, micro_batch)
        second = trainer._buffer[1]
        assert second.old_logps is not None and micro_batch.ref_logps is not None
        results.append((logps, second.old_logps, micro_batch.ref_logps))
        sampler = TransformersGeneration(max_completion_length=2, pad_token_id=0, eos_token_ids=trainer.eos_token_ids)
        calls = []

        def recorded(_calls=calls, _generate=trainer.model.generate, **kwargs):
            _calls.append(kwargs)
            return _generate(**kwargs)

        trainer.model.generate = recorded
        sampler.generate(trainer.model, micro_batch.prompt_ids.tolist(), micro_batch.vision)
        given = vision_batch(micro_batch.vision, micro_batch.prompt_ids.shape[1], 0)
        assert torch.equal(calls[0]["pixel_values"], given["pixel_values"])
    for a, b in zip(*results):
        assert (a - b).abs().max() > 1e-3


def test_a_completion_never_holds_an_image_placeholder():
    """A policy that would sample the image token at every step (its head row made huge) still completes without
    one: the token is suppressed in generation, since the log-prob passes would look for its image."""
    model, processor = tiny_vlm(kind="idefics3")
    image_token = model.config.image_token_id
    with torch.no_grad():
        model.lm_head.weight[image_token] = 50 * model.lm_head.weight.abs().max()
    ids, vision = encode_vision_prompts(PROMPTS, [[squares_image(1)], [squares_image(2)]], processor, None)
    sampler = TransformersGeneration(max_completion_length=6, pad_token_id=0, eos_token_ids=[2])
    completions = sampler.generate(model, ids, vision=vision).ids
    assert all(image_token not in row for row in completions)


def test_images_column_and_checkpointed_micro_batches(tmp_path):
    """An `images` column (a list per row) works like `image`, and a micro-batch's vision inputs survive a checkpoint
    (weights_only loading)."""
    trainer, micro_batch, rows = first_round("qwen2_vl", squares_dataset(8, column="images"))
    assert set(micro_batch.vision[0]) >= {"pixel_values", "image_grid_thw"}
    torch.save(micro_batch.state_dict(), tmp_path / "mb.pt")
    loaded = MicroBatch.from_state_dict(torch.load(tmp_path / "mb.pt", weights_only=True))
    with torch.no_grad():
        torch.testing.assert_close(
            trainer.logprobs(trainer.model, loaded)[0], trainer.logprobs(trainer.model, micro_batch)[0]
        )


def test_vision_batch_pads_rows_with_fewer_images():
    """Per-row image tensors (Idefics3's (1, N, C, H, W)) of rows with fewer images get all-zero images, which the
    model skips; per-token fields are left-padded like the prompt and extended over the completion."""
    rows = [
        {"pixel_values": torch.ones(1, 2, 3, 4, 4), "token_type_ids": torch.tensor([1, 1])},
        {"pixel_values": torch.ones(1, 1, 3, 4, 4), "token_type_ids": torch.tensor([0, 1, 1])},
    ]
    batch = vision_batch(rows, prompt_width=3, completion_width=2)
    assert batch["pixel_values"].shape == (2, 2, 3, 4, 4)
    assert batch["pixel_values"][1, 1].abs().sum() == 0 and batch["pixel_values"][1, 0].abs().sum() > 0
    assert batch["token_type_ids"].tolist() == [[0, 1, 1, 0, 0], [0, 1, 1, 0, 0]]


def test_lora_goes_on_the_language_model_only_by_default():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    args = dict(output_dir="unused-vlm", **{**TINY, "max_steps": 1})
    adapted = {}
    for train_vision_tower in (False, True):
        model, processor = tiny_vlm(kind="qwen2_vl")
        trainer = GRPOTrainer(
            model,
            lambda completions, **kw: [0.0] * len(completions),
            args=GRPOConfig(**args, train_vision_tower=train_vision_tower),
            train_dataset=squares_dataset(8),
            processing_class=processor,
            peft_config=config,
        )
        names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
        adapted[train_vision_tower] = names
        assert all("lora_" in n for n in names)
    assert adapted[False] and not any(".visual." in n for n in adapted[False])
    assert any(".language_model." in n for n in adapted[False])
    assert any(".visual." in n for n in adapted[True])
    assert config.exclude_modules is None  # the user's config is not changed


def test_full_fine_tuning_freezes_the_vision_tower_unless_asked():
    for train_vision_tower, frozen in ((False, True), (True, False)):
        model, processor = tiny_vlm(kind="idefics3")
        trainer = GRPOTrainer(
            model,
            lambda completions, **kw: [0.0] * len(completions),
            args=GRPOConfig(output_dir="unused-vlm", train_vision_tower=train_vision_tower, **TINY),
            train_dataset=squares_dataset(8),
            processing_class=processor,
        )
        vision = [p.requires_grad for n, p in trainer.model.named_parameters() if "vision_model" in n]
        text = [p.requires_grad for n, p in trainer.model.named_parameters() if "text_model" in n]
        assert vision and all(text) and (not any(vision)) == frozen


@pytest.mark.parametrize(
    "settings, tokenizer, message",
    [
        (dict(padding_free=True), False, "padding_free=True"),
        (dict(async_generation=True), False, "async_generation"),
        (dict(use_transformers_continuous_batching=True), False, "use_transformers_continuous_batching"),
        ({}, True, "processing_class is a tokenizer"),
    ],
)
def test_what_a_run_with_images_refuses_at_construction(settings, tokenizer, message):
    model, processor = tiny_vlm(kind="idefics3")
    with pytest.raises(InputError, match=message):
        GRPOTrainer(
            model,
            lambda completions, **kw: [0.0] * len(completions),
            args=GRPOConfig(output_dir="unused-vlm", **{**TINY, **settings}),
            train_dataset=squares_dataset(8),
            processing_class=processor.tokenizer if tokenizer else processor,
        )


def test_prompts_with_images_are_never_cut():
    _, processor = tiny_vlm(kind="idefics3")
    with pytest.raises(InputError, match="never cut"):
        encode_vision_prompts(PROMPTS[:1], [[squares_image(1)]], processor, max_prompt_length=8)


def test_a_text_model_is_untouched_by_the_vision_path(prompt_dataset):
    """No image column: no vision inputs, and padding-free / shared-prompt stay as they were."""
    tokenizer = tiny_tokenizer()
    args = GRPOConfig(output_dir="unused-vlm", **TINY)
    trainer = GRPOTrainer(tiny_model(tokenizer), lambda completions, **kw: [0.0] * len(completions), args=args,
                          train_dataset=prompt_dataset, processing_class=tokenizer)  # fmt: skip
    assert not trainer.vision and trainer.tokenizer is tokenizer


@pytest.mark.slow
@pytest.mark.parametrize("kind", VLM_KINDS)
def test_trains_with_images_end_to_end(tmp_path, kind):
    """Two optimizer steps with `model.generate`, a replayed round (num_iterations=2) and the KL term: the weights
    move and the loss, KL and gradient norm are finite."""
    model, processor = tiny_vlm(kind=kind)
    args = GRPOConfig(output_dir=str(tmp_path), **{**TINY, "max_steps": 2, "num_iterations": 2, "beta": 0.04})
    trainer = GRPOTrainer(model, lambda completions, **kw: [float(len(c[0]["content"])) for c in completions],
                          args=args, train_dataset=squares_dataset(8), processing_class=processor)  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved
    for logged in trainer.state.log_history[:2]:
        assert all(torch.isfinite(torch.tensor(logged[name])) for name in ("loss", "kl", "grad_norm"))


def logging_run(tmp_path, dataset, **config):
    """One scripted step of a tiny Qwen2-VL-shaped model with the completions log on; the trainer after it."""
    model, processor = tiny_vlm(kind="qwen2_vl")
    settings = {**TINY, "max_steps": 1, "log_completions": True, "shuffle_dataset": False, **config}
    args = GRPOConfig(output_dir=str(tmp_path), **settings)
    trainer = GRPOTrainer(model, lambda completions, **kw: [float(len(c[0]["content"])) for c in completions],
                          args=args, train_dataset=dataset, processing_class=processor)  # fmt: skip
    trainer.generation = ScriptedVisionGeneration(args.num_generations, args.max_completion_length)
    trainer.train()
    return trainer


def test_log_multimodal_saves_each_prompt_image_once(tmp_path, capsys):
    """`log_multimodal` (on by default): every completions.jsonl record lists its prompt's image by a path under
    output_dir, whose PNG holds the row's pixels; the G completions of a prompt share one file; the table marks the
    prompt. Rows given as paths and as PIL images of equal pixels share a file too."""
    from PIL import Image

    from grpo.training.logged_images import encode_rows

    dataset = squares_dataset(8, column="images")
    logging_run(tmp_path, dataset)
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 4  # one prompt x G = 4 completions
    assert all(r["images"] == records[0]["images"] and len(r["images"]) == 1 for r in records)
    row = next(i for i in range(len(dataset)) if dataset[i]["prompt"] == records[0]["prompt"])
    saved = Image.open(tmp_path / records[0]["images"][0])
    assert list(saved.convert("RGB").getdata()) == list(dataset[row]["images"][0].convert("RGB").getdata())
    assert len(list((tmp_path / "completions_images").iterdir())) == 1  # no partial files left either
    assert "[1 image] " in capsys.readouterr().out

    image = squares_image(3, seed=7)
    image.save(tmp_path / "three.png")
    names, blobs = encode_rows([[image], [str(tmp_path / "three.png")], [squares_image(2, seed=7)], None])
    assert names[0] == names[1] != names[2] and names[3] == [] and len(blobs) == 2


def test_log_multimodal_off_logs_text_only(tmp_path):
    logging_run(tmp_path, squares_dataset(8), log_multimodal=False)
    records = [json.loads(line) for line in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert records and all("images" not in r for r in records)
    assert not (tmp_path / "completions_images").exists()


def test_the_hub_push_sends_each_logged_image_once(tmp_path, monkeypatch):
    """With log_completions_hub_repo, a push sends completions.jsonl and the image files no earlier push sent."""
    from concurrent.futures import Future

    from grpo.training import hub_log

    pushed = []

    def upload(repo_id, token, files, step):
        pushed.append(sorted(files))
        done = Future()
        done.set_result(None)
        return done

    monkeypatch.setattr(hub_log, "create_repository", lambda *a: "url")
    monkeypatch.setattr(hub_log, "upload", upload)
    logging_run(tmp_path, squares_dataset(8), max_steps=2, log_completions_hub_repo="me/c", hub_token="hf_abc")
    first, second = pushed
    assert first[0] == "completions.jsonl" and len(first) == 2 and first[1].startswith("completions_images/")
    assert second[0] == "completions.jsonl" and first[1] not in second  # the second step's prompt: its own image
    assert len(second) == 2
