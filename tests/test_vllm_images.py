"""Images through the vLLM backends without vLLM (docs/vlm.md#vllm-with-images): how an image travels in a
/generate request (PNG, base64, with limits), how the server's request is cut among its engines, how the server
backend sends one image list per group and the colocated one builds its multimodal requests, and that
`sample_rollout` hands such a backend the images themselves. The real engine is in tests/test_vllm_vlm.py."""

import base64
import io
import sys

import pytest
from accelerate import Accelerator
from PIL import Image

from grpo.data import InputError
from grpo.data.vision import ImagePrompts, check_vision_run, open_rows
from grpo.generation import Completions, sample_rollout
from grpo.generation.policy_weights import checkpoint_tensors
from grpo.generation.vllm import images as vllm_images
from grpo.generation.vllm.images import (
    ImageRequestError,
    decode_image,
    decode_rows,
    encode_image,
    encode_rows,
    multimodal_request,
    placeholder_bias,
)
from grpo.generation.vllm.serve import _generate_jobs, _request_images
from grpo.generation.vllm.server_backend import VLLMGeneration
from grpo.testing import squares_image, tiny_vlm
from tests.test_vllm_colocate_unit import FakeLLM, fake_vllm  # noqa: F401 (a fixture)
from tests.test_vllm_colocate_unit import _backend as colocate_backend


def test_an_image_crosses_as_png_with_its_pixels_unchanged():
    image = squares_image(2, size=40, seed=3)
    back = decode_image(encode_image(image))
    assert back.mode == "RGB" and back.size == image.size and back.tobytes() == image.convert("RGB").tobytes()
    # Any mode goes as RGB, what the trainer's processor was given (grpo/data/vision.py `open_rows`).
    rgba = Image.new("RGBA", (5, 3), (10, 20, 30, 40))
    assert decode_image(encode_image(rgba)).tobytes() == rgba.convert("RGB").tobytes()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_a_bad_or_oversized_image_is_refused_naming_it(monkeypatch):
    with pytest.raises(ImageRequestError, match="image 0 of prompt 1 is not base64"):
        decode_rows([[encode_image(squares_image(1))], ["not base64!"]])
    jpeg = io.BytesIO()
    squares_image(1).save(jpeg, format="JPEG")
    with pytest.raises(ImageRequestError, match="is not a PNG image"):
        decode_image(_b64(jpeg.getvalue()))
    png = encode_image(squares_image(1, size=64))
    with pytest.raises(ImageRequestError, match="is a broken PNG image"):
        decode_image(_b64(base64.b64decode(png)[:-40]))
    # The pixel count is read from the header, before anything is decompressed.
    monkeypatch.setattr(vllm_images, "MAX_IMAGE_PIXELS", 63 * 64)
    with pytest.raises(ImageRequestError, match="is 64 x 64 pixels, more than the 4032"):
        decode_image(png)
    with pytest.raises(ImageRequestError, match="make the images smaller"):
        encode_image(squares_image(1, size=64))  # the trainer refuses it before sending
    monkeypatch.setattr(vllm_images, "MAX_IMAGE_BASE64_CHARS", len(png) - 1)
    with pytest.raises(ImageRequestError, match=f"is {len(png)} base64 characters"):
        decode_image(png)
    monkeypatch.setattr(vllm_images, "MAX_IMAGES_PER_PROMPT", 1)
    with pytest.raises(ImageRequestError, match="prompt 0 has 2 images, more than 1"):
        decode_rows([["x", "y"]])


def test_an_image_shared_by_rows_is_encoded_once():
    a, b = squares_image(1), squares_image(2)
    rows = encode_rows([[a, b], [a, b], [b]])
    assert rows[0] == rows[1] and rows[0][0] is rows[1][0] and rows[2] == [rows[0][1]]


def test_the_server_decodes_each_prompts_images_or_refuses_with_the_status():
    png = encode_image(squares_image(1))
    assert _request_images([[1]], None, multimodal=False) == (None, None)
    images, refusal = _request_images([[1], [2]], [[png], [png, png]], multimodal=True)
    assert refusal is None and [len(row) for row in images] == [1, 2] and images[1][0].size == (64, 64)
    assert _request_images([[1]], [[png]], multimodal=False)[1][0] == 409
    assert _request_images([[1], [2]], [[png]], multimodal=True)[1] == (
        422,
        "images: 1 image lists for 2 prompts (one list per prompt)",
    )
    status, detail = _request_images([[1]], [["%%"]], multimodal=True)[1]
    assert status == 422 and "image 0 of prompt 0 is not base64" in detail


def test_each_engine_gets_its_prompts_images():
    jobs = _generate_jobs([[1], [2], [3]], seed=10, n=2, num_engines=2, sampling={}, images=[["a"], ["b"], ["c"]])
    assert [(job["prompts"], job["images"], job["seeds"]) for job in jobs] == [
        ([[1], [2]], [["a"], ["b"]], [10, 12]),
        ([[3]], [["c"]], [14]),
    ]
    assert "images" not in _generate_jobs([[1]], seed=None, n=1, num_engines=1, sampling={})[0]


def test_a_multimodal_request_and_the_placeholder_bias():
    assert multimodal_request([1, 2], None) == {"prompt_token_ids": [1, 2]}
    assert multimodal_request([1, 2], []) == {"prompt_token_ids": [1, 2]}
    image = squares_image(1)
    assert multimodal_request([1], [image]) == {"prompt_token_ids": [1], "multi_modal_data": {"image": [image]}}
    assert placeholder_bias([7, 9]) == {7: -100.0, 9: -100.0} and placeholder_bias([]) is None


class _RecordingClient:
    """The HTTP client's stand-in: records each /generate and answers [prompt length, sample index]; a prompt with
    images comes back "expanded" by `expand` (each token 9 becomes 9, 9)."""

    base_url = "http://stub"

    def __init__(self, multimodal=True, expand=lambda ids: [t for token in ids for t in [token] * (1 + (token == 9))]):
        self.calls = []
        self.info = {"model": "tiny-vlm", "multimodal": multimodal}
        self.expand = expand

    def wait_until_ready(self):
        return self.info

    def generate(self, prompts, n, images=None, **sampling):
        self.calls.append((prompts, n, images))
        ids = [[len(p), k] for p in prompts for k in range(n)]
        reply = {"completion_ids": ids, "logprobs": [[-1.0, -1.0] for _ in ids], "weights_version": None}
        return reply if images is None else {**reply, "prompt_ids": [self.expand(p) for p in prompts]}


def _server_backend(client, G=2):
    sampling = dict(max_completion_length=4, temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)
    return VLLMGeneration(Accelerator(), client=client, num_generations=G, bucket_bytes=1 << 20, **sampling)


def test_the_server_backend_sends_one_image_list_per_group_with_unexpanded_prompts():
    client = _RecordingClient()
    a, b = squares_image(1), squares_image(3)
    rows = open_rows([[a], [a], [b], [b]])  # the G copies of a row share their images
    expanded = [[5, 9, 9, 6]] * 4  # the trainer's processor's ids; vLLM gets one placeholder (9) per image
    out = _server_backend(client).generate(None, expanded, images=ImagePrompts([[5, 9, 6]] * 4, rows))
    ((prompts, n, sent),) = client.calls
    # Equal prompts with other images are another group: two prompts, each with its own image.
    assert prompts == [[5, 9, 6], [5, 9, 6]] and n == 2
    assert [[decode_image(text).tobytes() for text in row] for row in sent] == [[a.tobytes()], [b.tobytes()]]
    assert out.ids == [[3, 0], [3, 1], [3, 0], [3, 1]]
    # Text rows send no image field (a server of any version takes them).
    _server_backend(client).generate(None, [[5], [5]])
    assert client.calls[-1][2] is None


def test_the_server_backend_refuses_what_would_train_on_another_prompt():
    a, b = squares_image(1), squares_image(3)
    with pytest.raises(ValueError, match="prompt rows with their images do not come as groups of 2"):
        _server_backend(_RecordingClient()).generate(
            None, [[5]] * 4, images=ImagePrompts([[5]] * 4, [[a], [b], [a], [a]])
        )
    with pytest.raises(RuntimeError, match="serves 'tiny-vlm', which takes no images"):
        _server_backend(_RecordingClient(multimodal=False)).generate(
            None, [[5]] * 2, images=ImagePrompts([[5]] * 2, [[a], [a]])
        )
    adapters = _server_backend(_RecordingClient())
    adapters.mode = "adapter"  # the server was started with --enable-lora
    with pytest.raises(RuntimeError, match="was started with --enable-lora: syncing a vision-language model's LoRA"):
        adapters.generate(None, [[5]] * 2, images=ImagePrompts([[5]] * 2, [[a], [a]]))
    # The server's processor expanded the image into another number of tokens than the trainer's.
    client = _RecordingClient(expand=lambda ids: [t for token in ids for t in [token] * (1 + 2 * (token == 9))])
    with pytest.raises(ValueError, match="prompt 0 into a prompt of 5 tokens, where the trainer's processor made 4"):
        _server_backend(client).generate(None, [[5, 9, 9, 6]] * 2, images=ImagePrompts([[5, 9, 6]] * 2, [[a], [a]]))


class _ExpandingLLM(FakeLLM):
    """The colocated tests' `vllm.LLM` stand-in, whose outputs also carry the prompt as "expanded" (token 9 doubled)."""

    def generate(self, requests, params, use_tqdm):
        outputs = super().generate(requests, params, use_tqdm)
        for request, output in zip(requests, outputs):
            output.prompt_token_ids = [
                t for token in request["prompt_token_ids"] for t in [token] * (1 + (token == 9))
            ]
        return outputs


def test_the_colocated_engine_gets_each_runs_images_and_never_samples_placeholders(fake_vllm, monkeypatch):  # noqa: F811
    monkeypatch.setattr(sys.modules["vllm"], "LLM", _ExpandingLLM)
    model, processor = tiny_vlm(kind="qwen2_vl")
    backend = colocate_backend(processor=processor)
    backend.sync_weights(model, version=0)
    a, b = squares_image(1), squares_image(2)
    rows = open_rows([[a], [a], [a], [b]])
    out = backend.generate(model, [[5, 9, 9, 6]] * 4, images=ImagePrompts([[5, 9, 6]] * 4, rows))
    requests = backend.llm.requests
    assert [
        (request["prompt_token_ids"], request["multi_modal_data"]["image"], params.n) for request, params in requests
    ] == [
        ([5, 9, 6], [rows[0][0]], 3),
        ([5, 9, 6], [rows[3][0]], 1),
    ]
    config = model.config
    banned = {config.image_token_id, config.video_token_id, config.vision_start_token_id, config.vision_end_token_id}
    assert all(set(params.logit_bias) == banned for _, params in requests)
    assert len(out.ids) == 4
    # The engine was built with the processor beside the config, and loads its tokenizer (vLLM runs the processor).
    assert backend.llm.kwargs["skip_tokenizer_init"] is False
    with pytest.raises(ValueError, match="The colocated vLLM engine expanded the image placeholders of prompt 0"):
        backend.generate(model, [[5, 9, 6]], images=ImagePrompts([[5, 9, 6]], rows[:1]))
    backend.generate(model, [[5, 6]] * 2)
    assert all("multi_modal_data" not in request and not hasattr(params, "logit_bias")
               for request, params in backend.llm.requests)  # fmt: skip


class _ImageBackend:
    """A backend that takes images (as the vLLM ones do): records what `sample_rollout` hands it."""

    takes_images = True

    def generate(self, model, prompt_ids, images=None):
        self.prompt_ids, self.images = prompt_ids, images
        return Completions([[1, 2]] * len(prompt_ids))


def test_sample_rollout_gives_a_vllm_backend_the_images_and_keeps_the_vision_inputs():
    from grpo import GRPOConfig
    from tests.helpers.vlm import squares_dataset

    _, processor = tiny_vlm(kind="qwen2_vl")
    data = squares_dataset(2)
    row0, row1 = data[0], data[1]
    inputs = [row0, row0, row1, row1]
    args = GRPOConfig(output_dir="unused", per_device_train_batch_size=4, num_generations=2, max_completion_length=4)
    backend = _ImageBackend()
    rollout, _ = sample_rollout(inputs, backend, None, processor, [2], args)
    sent = backend.images.images
    assert sent[0][0] is sent[1][0] and sent[2][0] is not sent[0][0]  # a group's rows share their images
    assert sent[0][0].tobytes() == row0["image"].convert("RGB").tobytes()
    # vLLM gets each prompt with one placeholder per image: what the processor expands into the trainer's ids.
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    for unexpanded, expanded in zip(backend.images.prompt_ids, backend.prompt_ids):
        assert unexpanded.count(pad) == 1 and expanded.count(pad) > 1
        assert [t for t in expanded if t != pad] == [t for t in unexpanded if t != pad]
    assert rollout.vision is not None and "pixel_values" in rollout.vision[0]  # the log-prob passes still get them


def test_a_run_with_images_takes_use_vllm_but_not_async_generation():
    class Args:
        use_vllm, async_generation, use_transformers_continuous_batching, padding_free = True, False, False, None

    _, processor = tiny_vlm(kind="qwen2_vl")
    check_vision_run(Args(), processor, True, None, None)
    Args.async_generation = True
    with pytest.raises(InputError, match="images are not supported with async_generation yet"):
        check_vision_run(Args(), processor, True, None, None)


def test_a_qwen2_vl_policy_syncs_under_the_names_vllms_loader_maps():
    """transformers 5 names Qwen2-VL's modules model.language_model.* and model.visual.*; vLLM 0.32's
    Qwen2VLForConditionalGeneration maps exactly these prefixes (and lm_head.) onto its own modules."""
    model, _ = tiny_vlm(kind="qwen2_vl")
    names = [name for name, _ in checkpoint_tensors(model)]
    prefixes = ("model.language_model.", "model.visual.", "lm_head.")
    assert names and all(name.startswith(prefixes) for name in names)
    assert {prefix for prefix in prefixes for name in names if name.startswith(prefix)} == set(prefixes)
