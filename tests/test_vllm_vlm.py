"""Images through vLLM's CPU build (docs/vlm.md#vllm-with-images): the tiny Qwen2-VL-shaped model built in code,
saved with its processor, on a real `grpo vllm-serve` and in a colocated engine; one trainer step on images with
each. Runs in the vLLM environment: `make test-vllm`."""

import importlib.util
import types

import pytest
import torch

pytest.importorskip("vllm", reason="needs vLLM: run `make test-vllm`")

from grpo import GRPOConfig, GRPOTrainer  # noqa: E402
from grpo.data.vision import (  # noqa: E402
    encode_vision_prompts,
    image_prompts,
    open_rows,
    placeholder_token_ids,
    vision_batch,
)
from grpo.generation import cut_at_eos  # noqa: E402
from grpo.generation.vllm.colocate import VLLMColocateGeneration  # noqa: E402
from grpo.generation.vllm.images import encode_rows  # noqa: E402
from grpo.testing import squares_image, tiny_vlm  # noqa: E402
from tests.helpers.net import free_port  # noqa: E402
from tests.helpers.vllm_server import start_server, stop_server  # noqa: E402
from tests.helpers.vlm import squares_dataset  # noqa: E402

pytestmark = pytest.mark.vllm

KEY = "test-api-key-vlm-7d2e"
TOKENS = 8
PROMPT = [{"role": "user", "content": "How many squares?"}]
ONE_PROCESS = types.SimpleNamespace(process_index=0, local_process_index=0, num_processes=1)


@pytest.fixture(scope="module", autouse=True)
def cpu_engine_settings():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        patch.setenv("GRPO_VLLM_API_KEY", KEY)
        yield


# vLLM's Qwen2-VL module imports transformers' torchvision image processor (`smart_resize`), and vLLM's CPU build
# here has no torchvision: the registry's torchvision wheels are CUDA builds, which fail on the CPU torch
# ("operator torchvision::nms does not exist"), so the Makefile removes them (docs/vlm.md#vllm-with-images).
NO_TORCHVISION = (
    "vLLM 0.32's Qwen2-VL module imports transformers.models.qwen2_vl.image_processing_qwen2_vl, which needs "
    "torchvision (ModuleNotFoundError: No module named 'torchvision'); this vLLM environment has none"
)
KINDS = [
    pytest.param(
        "qwen2_vl",
        marks=pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason=NO_TORCHVISION),
    ),
    "idefics3",
]


@pytest.fixture(scope="module", params=KINDS)
def vlm(request, tmp_path_factory):
    """(model, processor, path, kind): a tiny vision-language model of each kind and its processor, saved together
    for vLLM to load."""
    model, processor = tiny_vlm(kind=request.param)
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model, processor, path, request.param


def _prompts(processor, images):
    """The trainer's expanded prompt ids and the `ImagePrompts` vLLM gets, one row per image."""
    rows = open_rows([[image] for image in images])
    expanded, _ = encode_vision_prompts([PROMPT] * len(rows), rows, processor, None)
    return expanded, image_prompts([PROMPT] * len(rows), rows, processor)


def _transformers_greedy(model, processor, image):
    """`model.generate`'s greedy completion for PROMPT with `image`, placeholders suppressed as the trainer does."""
    ids, vision = encode_vision_prompts([PROMPT], open_rows([[image]]), processor, None)
    input_ids = torch.tensor(ids)
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=TOKENS,
            do_sample=False,
            suppress_tokens=placeholder_token_ids(model.config),
            **vision_batch(vision, input_ids.shape[1], 0),
        )
    return _cut(out[0, input_ids.shape[1] :].tolist(), processor)


def _cut(ids, processor):
    """`ids` up to its first EOS, as the trainer cuts every completion (vLLM stops there, `generate` pads on)."""
    return cut_at_eos([ids], [processor.tokenizer.eos_token_id], TOKENS)[0][0]


def _colocated(model, processor, temperature):
    backend = VLLMColocateGeneration(
        ONE_PROCESS,
        eos_token_ids=[processor.tokenizer.eos_token_id],
        max_completion_length=TOKENS,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        engine_kwargs={"max_model_len": 256},
        processor=processor,
    )
    backend.sync_weights(model, version=0)
    return backend


def test_a_colocated_engine_generates_from_the_image_as_model_generate_does(vlm):
    model, processor, _, _ = vlm
    images = [squares_image(1, seed=0), squares_image(4, seed=5, colour="blue")]
    expanded, sent = _prompts(processor, images)
    backend = _colocated(model, processor, temperature=0.0)
    greedy = backend.generate(model, expanded, images=sent)
    # vLLM expanded the placeholders as the trainer's processor did (checked inside), took the synced weights and
    # the image: its greedy completions are model.generate's.
    assert [_cut(ids, processor) for ids in greedy.ids] == [_transformers_greedy(model, processor, i) for i in images]
    # The image changes what vLLM computes: the same seed and prompt, another image, other log-probs.
    backend.sampling["temperature"] = 1.0
    torch.manual_seed(3)
    first = backend.generate(model, expanded, images=sent)
    assert first.logprobs[0] != first.logprobs[1] or first.ids[0] != first.ids[1]
    torch.manual_seed(3)
    assert backend.generate(model, expanded, images=sent).logprobs == first.logprobs
    banned = set(placeholder_token_ids(model.config))
    assert not banned & {token for row in first.ids for token in row}


@pytest.fixture(scope="module")
def server(vlm, tmp_path_factory):
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "server.log"
    process, client = start_server(vlm[2], port, log_path, KEY, max_model_len=512, timeout=240)
    yield port, client
    stop_server(process)


def test_the_server_generates_from_the_image(vlm, server):
    model, processor, _, _ = vlm
    _, client = server
    assert client.info["multimodal"] is True
    images = [squares_image(1, seed=0), squares_image(4, seed=5, colour="blue")]
    expanded, sent = _prompts(processor, images)
    png = encode_rows(sent.images)
    reply = client.generate(sent.prompt_ids, n=1, images=png, max_tokens=TOKENS, temperature=0.0, logprobs=False)
    assert reply["prompt_ids"] == expanded  # vLLM expanded the one placeholder per image as the trainer's processor
    greedy = [_cut(ids, processor) for ids in reply["completion_ids"]]
    assert greedy == [_transformers_greedy(model, processor, image) for image in images]
    sampled = client.generate(sent.prompt_ids, n=2, images=png, max_tokens=TOKENS, seed=4, temperature=1.0)
    again = client.generate(sent.prompt_ids, n=2, images=png, max_tokens=TOKENS, seed=4, temperature=1.0)
    assert again["logprobs"] == sampled["logprobs"]  # same images, same seed: the same samples
    # The second prompt's samples (another image) get other log-probs than the first's with the same seeds.
    swapped = client.generate(sent.prompt_ids, n=2, images=png[::-1], max_tokens=TOKENS, seed=4, temperature=1.0)
    assert swapped["logprobs"] != sampled["logprobs"]


def _trainer(model, processor, tmp_path, **settings):
    args = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        use_vllm=True,
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=TOKENS,
        max_prompt_length=None,
        max_steps=1,
        learning_rate=0.05,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        **settings,
    )
    reward = lambda completions, **kw: [float(len(c[0]["content"])) for c in completions]  # noqa: E731
    return GRPOTrainer(model, reward, args=args, train_dataset=squares_dataset(8), processing_class=processor)


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_one_training_step_on_images_with_vllm(vlm, server, tmp_path, mode):
    _, processor, _, kind = vlm
    model, _ = tiny_vlm(kind=kind)  # a fresh copy: the step moves its weights
    settings = {"vllm_mode": "colocate", "vllm_max_model_length": 256}
    if mode == "server":
        settings = {"vllm_server_port": server[0], "vllm_group_port": free_port(), "vllm_server_timeout": 60}
    trainer = _trainer(model, processor, tmp_path, **settings)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.generation.synced_version == 0  # the round was sampled by vLLM, on the synced weights
    moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert moved
    (logs,) = [h for h in trainer.state.log_history if "loss" in h]
    assert torch.isfinite(torch.tensor(logs["loss"]))
    # The engine's log-probs are the trainer's, up to the placeholder tokens vLLM may not sample (their
    # probability under the random model, a few in a thousand, is renormalised away).
    assert abs(logs["sampling/importance_sampling_ratio/mean"] - 1) < 0.01
    assert logs["sampling/sampling_logp_difference/max"] < 0.01  # 0.004 measured with the tiny Idefics3 model
