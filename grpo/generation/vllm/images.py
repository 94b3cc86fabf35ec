"""Images in vLLM requests (docs/vlm.md#vllm-with-images): what the trainer sends with a prompt that has images, and
what a vLLM engine is given for it.

vLLM takes the original images beside the prompt's token ids (`multi_modal_data={"image": [PIL images]}`) and runs
the model's processor on them itself, expanding each image's placeholder in the token prompt into the image's
feature tokens. It does so also when they are expanded already (it would then expand the first one again), so it is
given the prompt with one placeholder per image (grpo/data/vision.py `image_prompts`); the prompt it expanded comes
back and must equal the trainer's, which the log-prob passes use (`check_expanded`). Between the trainer and `grpo vllm-serve` an image travels as PNG bytes,
base64 in the JSON request: lossless, so the engine sees the pixels the trainer's processor saw, and decoded on the
server with size limits checked before any pixel is decompressed (`decode_image`). Nothing received is unpickled.

The rows of a group (the G copies of one prompt) share one image list: a request sends it once, with its prompt.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Sequence
from typing import Any

# Limits on what a server accepts in one /generate request: an encoded image (as base64 text), its pixels (checked
# from the PNG header, before decompressing) and the images of one prompt. A trainer's image past them is refused
# before it is sent, with the same words.
MAX_IMAGE_BASE64_CHARS = 32 * 2**20
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGES_PER_PROMPT = 64


class ImageRequestError(ValueError):
    """An image in a request is malformed or too large."""


def encode_image(image) -> str:
    """`image` (a PIL image) as base64 PNG text, in RGB (what the trainer's processor was given)."""
    image = image.convert("RGB") if image.mode != "RGB" else image
    _check_pixels(image.size, "an image of this prompt")
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    text = base64.b64encode(buffer.getvalue()).decode("ascii")
    if len(text) > MAX_IMAGE_BASE64_CHARS:
        raise ImageRequestError(
            f"an image of {image.size[0]} x {image.size[1]} pixels is {len(text)} characters as base64 PNG, more than "
            f"the {MAX_IMAGE_BASE64_CHARS} a vLLM server takes: make the images smaller"
        )
    return text


def encode_rows(images: Sequence[Sequence[Any]]) -> list[list[str]]:
    """Each row's images encoded (`encode_image`); an image object shared by several rows (the G copies of a row)
    is encoded once."""
    done: dict[int, str] = {}
    out = []
    for row in images:
        if len(row) > MAX_IMAGES_PER_PROMPT:
            raise ImageRequestError(
                f"a prompt has {len(row)} images, more than the {MAX_IMAGES_PER_PROMPT} a vLLM server takes per prompt"
            )
        for image in row:
            if id(image) not in done:
                done[id(image)] = encode_image(image)
        out.append([done[id(image)] for image in row])
    return out


def decode_image(text: str, where: str = "an image"):
    """The RGB PIL image of base64 PNG `text` (`encode_image`), or ImageRequestError naming `where` and the
    problem: too long, not base64, not a PNG, or more pixels than MAX_IMAGE_PIXELS (read from the header, before
    anything is decompressed)."""
    from PIL import Image, UnidentifiedImageError

    if len(text) > MAX_IMAGE_BASE64_CHARS:
        raise ImageRequestError(f"{where} is {len(text)} base64 characters, more than {MAX_IMAGE_BASE64_CHARS}")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ImageRequestError(f"{where} is not base64 ({e})") from None
    try:
        image = Image.open(io.BytesIO(data), formats=["PNG"])
    except (UnidentifiedImageError, OSError) as e:
        raise ImageRequestError(f"{where} is not a PNG image ({e})") from None
    _check_pixels(image.size, where)
    try:
        image.load()
    except (OSError, ValueError) as e:  # truncated data, a bad chunk
        raise ImageRequestError(f"{where} is a broken PNG image ({e})") from None
    return image.convert("RGB") if image.mode != "RGB" else image


def decode_rows(rows: Sequence[Sequence[str]]) -> list[list]:
    """Each prompt's images decoded (`decode_image`); ImageRequestError names the first bad one."""
    out = []
    for i, row in enumerate(rows):
        if len(row) > MAX_IMAGES_PER_PROMPT:
            raise ImageRequestError(f"prompt {i} has {len(row)} images, more than {MAX_IMAGES_PER_PROMPT}")
        out.append([decode_image(text, f"image {j} of prompt {i}") for j, text in enumerate(row)])
    return out


def _check_pixels(size: tuple[int, int], where: str) -> None:
    width, height = size
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageRequestError(
            f"{where} is {width} x {height} pixels, more than the {MAX_IMAGE_PIXELS} a vLLM server takes: make the "
            "images smaller"
        )


def multimodal_request(prompt_ids: list[int], images: Sequence | None) -> dict:
    """One vLLM prompt: its token ids and, when it has images, `multi_modal_data` with them."""
    if not images:
        return {"prompt_token_ids": prompt_ids}
    return {"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": list(images)}}


def placeholder_bias(token_ids: Sequence[int]) -> dict[int, float] | None:
    """vLLM's `logit_bias` that keeps the image placeholder tokens `token_ids` out of a completion (the model would
    look for an image's features at each of them, as `model.generate` avoids with `suppress_tokens`); vLLM takes
    biases down to -100, which leaves such a token a probability below e^-90 beside any other."""
    return {int(token): -100.0 for token in token_ids} or None


def check_expanded(expected: Sequence[Sequence[int]], expanded: Sequence[Sequence[int]], engine: str) -> None:
    """Refuse a generation whose engine (`engine` names it) expanded an image prompt into other token ids than the
    trainer's processor did: its completions would follow another prompt than the one trained on."""
    for i, (mine, theirs) in enumerate(zip(expected, expanded)):
        if list(mine) != list(theirs):
            raise ValueError(
                f"{engine} expanded the image placeholders of prompt {i} into a prompt of {len(theirs)} tokens, where "
                f"the trainer's processor made {len(mine)} (first difference at token "
                f"{next((t for t, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))}). "
                "The engine's processor must be the trainer's: serve the model directory saved with the processor "
                "the trainer uses (its max_pixels / size settings included)."
            )
