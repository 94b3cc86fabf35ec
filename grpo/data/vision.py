"""Images beside conversational prompts, for vision-language models (docs/vlm.md).

A data set row may carry `image` (one image) or `images` (a list) beside a conversational `prompt`, as in TRL. Each
image is a PIL image, a path, bytes, or the `{"bytes", "path"}` dict a `datasets.Image` column gives undecoded. The
images are placed as `{"type": "image"}` blocks before the text of the prompt's first user message
(`with_image_blocks`), the processor renders that with its chat template and expands each block into the model's
image placeholder tokens, and builds the pixel values and the other vision inputs (`encode_vision_prompts`).

The placeholder tokens are prompt tokens: they are never in a completion, so never in the loss. Each row keeps its
own vision inputs as a dict of tensors (`VisionRow`), so rows can be sliced, moved and checkpointed like token rows;
`vision_batch` joins the rows of a forward pass into the keyword arguments the model takes:

- image tensors (`pixel_values`, `image_grid_thw`, `pixel_attention_mask`, `image_sizes`, ...) are concatenated
  along their first dimension, their other dimensions padded with zeros to the largest (what the processors do
  themselves: per-image tensors stack, per-row tensors of rows with fewer images get all-zero images, which the
  models skip);
- token tensors (`token_type_ids`, `mm_token_type_ids`: one value per prompt token) are padded on the left like the
  prompt and extended with zeros over the completion.
"""

from __future__ import annotations

import io
import logging
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from grpo.data import InputError, is_conversational

IMAGE_COLUMNS = ("image", "images")
# Per-token vision inputs some processors return beside input_ids (Gemma 3's token_type_ids, Qwen-VL's
# mm_token_type_ids): aligned with the prompt tokens, so padded and extended with the tokens.
TOKEN_FIELDS = ("token_type_ids", "mm_token_type_ids")

VisionRow = dict[str, torch.Tensor]
logger = logging.getLogger(__name__)


def image_column(columns: Sequence[str]) -> str | None:
    """The image column among a data set's `columns` ("images" before "image", as TRL reads them), or None."""
    return next((name for name in reversed(IMAGE_COLUMNS) if name in columns), None)


def is_processor(processing_class: Any) -> bool:
    """Whether `processing_class` is a multimodal processor (it holds an image processor and a tokenizer), not a
    tokenizer."""
    return hasattr(processing_class, "image_processor") and hasattr(processing_class, "tokenizer")


def text_tokenizer(processing_class: Any):
    """The tokenizer of a processor, or the tokenizer itself."""
    return processing_class.tokenizer if is_processor(processing_class) else processing_class


def row_images(example: dict[str, Any]) -> list | None:
    """The images of one data set row, as a list (None: the row has no image column)."""
    if "images" in example:
        images = example["images"]
        return [] if images is None else list(images)
    if "image" in example:
        return [] if example["image"] is None else [example["image"]]
    return None


def open_image(value: Any, where: str = "an image"):
    """A PIL image from what a data set row may hold: a PIL image, a path, bytes, or a `{"bytes", "path"}` dict."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        value = value.get("bytes") or value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return Image.open(io.BytesIO(value))
    if isinstance(value, str):
        return Image.open(value)
    raise InputError(
        f"{where} is a {type(value).__name__}; an image must be a PIL image, a path, bytes, or a "
        "{'bytes': ..., 'path': ...} dict (a datasets.Image column)."
    )


def open_rows(images: Sequence[list], prompts: Sequence | None = None) -> list[list]:
    """Each row's images as RGB PIL images (`open_image`), decoded here. An image object that several rows share (the
    G copies of a row share one list) is opened once, so those rows keep sharing one object: what
    `encode_vision_prompts` and the vLLM backends (grpo/generation/vllm/images.py) recognise a group's images by.
    An image that fails is named by its row's prompt (`prompts`): the trainer checked a sized data set's images
    when it was built (grpo/data/image_checks.py), so this is a stream's row or one past those decoded then."""
    opened: dict[int, Any] = {}
    rows = []
    for i, row in enumerate(images):
        for j, image in enumerate(row):
            if id(image) not in opened:
                try:
                    pil = open_image(image, f"Image {j} of row {i}")
                    opened[id(image)] = pil.convert("RGB") if pil.mode != "RGB" else pil
                    opened[id(image)].load()
                except InputError:
                    raise
                except Exception as error:  # noqa: BLE001 - PIL raises OSError, ValueError, ... on bad files
                    raise InputError(
                        f"Image {j} of {batch_row(i, prompts)} cannot be read ({error_line(error)}). Replace it or "
                        "drop the row."
                    ) from error
        rows.append([opened[id(image)] for image in row])
    return rows


def error_line(error: BaseException) -> str:
    """An error's type and message on one line, at most 160 characters, without the address of the BytesIO object
    PIL names."""
    message = re.sub(r" ?<_io\.BytesIO object at 0x[0-9a-f]+>", "", str(error))
    text = " ".join(f"{type(error).__name__}: {message}".split())
    return text if len(text) <= 160 else text[:157] + "..."


def batch_row(i: int, prompts: Sequence | None) -> str:
    """Row `i` of a batch, named by the start of its prompt's last user message (what finds it in the data)."""
    if prompts is None:
        return f"row {i} of the batch"
    users = [m.get("content") for m in prompts[i] if isinstance(m, dict) and m.get("role") == "user"]
    text = users[-1] if users and isinstance(users[-1], str) else str(prompts[i])
    return f"the data set row whose prompt starts {text[:60]!r}"


def with_image_blocks(prompt: list[dict], num_images: int) -> list[dict]:
    """`prompt`'s messages with their text as `{"type": "text"}` blocks and `num_images` `{"type": "image"}` blocks
    before the text of the first user message (TRL's convention). A prompt whose contents are already block lists
    is returned with its text messages converted; its own image blocks count towards `num_images`."""
    out, placed = (
        [],
        sum(
            1 for m in prompt if isinstance(m["content"], list) for part in m["content"] if part.get("type") == "image"
        ),
    )
    for message in prompt:
        content = message["content"]
        if isinstance(content, str):
            content = [{"type": "text", "text": content}]
            if message["role"] == "user" and placed < num_images:
                content = [{"type": "image"} for _ in range(num_images - placed)] + content
                placed = num_images
        out.append({**message, "content": content})
    if placed != num_images:
        raise InputError(
            f"A prompt has {placed} image blocks for {num_images} images. Give each image its own "
            "{'type': 'image'} block, or write the prompt's messages as strings and let the trainer place the "
            "images before the first user message's text."
        )
    return out


def encode_vision_prompts(
    prompts: Sequence[list[dict]],
    images: Sequence[list],
    processor,
    max_prompt_length: int | None,
    chat_template_kwargs: dict | None = None,
) -> tuple[list[list[int]], list[VisionRow]]:
    """Token ids and vision inputs of each prompt with its images, one row at a time through `processor` (its chat
    template renders the image blocks, with the template variables `chat_template_kwargs`; its call expands them
    into the model's placeholder tokens and builds the pixel values). A prompt longer than `max_prompt_length` is refused: cutting it could cut an image's
    placeholder tokens, which must match the image's features one for one."""
    if not hasattr(processor, "apply_chat_template") or getattr(processor, "chat_template", None) is None:
        raise InputError(
            "Prompts with images are rendered with the processor's chat template, and this processor has none. Set "
            "processor.chat_template, or pass the model's own processor (AutoProcessor.from_pretrained(...))."
        )
    ids, rows, cache = [], [], {}
    for i, (prompt, row) in enumerate(zip(prompts, open_rows(images, prompts))):
        if not is_conversational(prompt):
            raise InputError(
                "A row with images needs a conversational prompt (a list of {'role', 'content'} messages): the "
                f"processor's chat template places the images; got {type(prompt).__name__}: {str(prompt)[:80]!r}."
            )
        if not row:
            raise InputError(
                f"An empty image column in {batch_row(i, prompts)}. In a data set with an `image` or `images` "
                "column every row needs at least one image; train text-only rows in a data set without that column."
            )
        key = (id(prompt), tuple(id(image) for image in row))
        if key not in cache:  # the G copies of a row share one dict and one list of images
            text = _render(prompt, len(row), processor, chat_template_kwargs)
            try:
                encoded = processor(text=[text], images=[row], return_tensors="pt")
            except ValueError as error:  # an image the processor refuses (Qwen-VL: aspect ratio 200 or more)
                sizes = ", ".join(f"{image.width} x {image.height}" for image in row)
                raise InputError(
                    f"The model's processor refuses the images ({sizes}) of {batch_row(i, prompts)}: "
                    f"{error_line(error)}. Resize or pad them, or drop the row."
                ) from error
            cache[key] = _split_row(encoded)
        row_ids, vision = cache[key]
        if max_prompt_length is not None and len(row_ids) > max_prompt_length:
            raise InputError(
                f"A prompt with its images is {len(row_ids)} tokens, more than max_prompt_length={max_prompt_length}, "
                "and prompts with images are never cut (a cut could split an image's placeholder tokens). Raise "
                "max_prompt_length, set it to None, or make the images smaller (the processor's max_pixels or size)."
            )
        ids.append(list(row_ids))
        rows.append(vision)
    return ids, rows


def _render(prompt: list[dict], num_images: int, processor, chat_template_kwargs: dict | None) -> str:
    """A prompt's text with one placeholder per image, as the processor's chat template writes it."""
    prefill = prompt[-1]["role"] == "assistant"
    return processor.apply_chat_template(
        with_image_blocks(prompt, num_images),
        tokenize=False,
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        **(chat_template_kwargs or {}),
    )


class ImagePrompts(NamedTuple):
    """Rows with images, as a sampler that runs the processor itself (vLLM) takes them: the ids of each prompt
    with one placeholder per image, which it expands against the images, and each row's images."""

    prompt_ids: list[list[int]]
    images: list[list]


def image_prompts(
    prompts: Sequence[list[dict]], images: Sequence[list], processor, chat_template_kwargs: dict | None = None
) -> ImagePrompts:
    """`ImagePrompts` of rows that `encode_vision_prompts` encoded (`images` from `open_rows`): each prompt rendered
    the same way and tokenized by the processor's tokenizer alone, so its placeholders are not expanded. vLLM
    expands the placeholders of a token prompt whether or not they already are, so it must get them unexpanded."""
    tokenizer, ids, cache = text_tokenizer(processor), [], {}
    for prompt, row in zip(prompts, images):
        key = (id(prompt), len(row))
        if key not in cache:
            cache[key] = tokenizer(_render(prompt, len(row), processor, chat_template_kwargs))["input_ids"]
        ids.append(list(cache[key]))
    return ImagePrompts(ids, [list(row) for row in images])


def _split_row(encoded) -> tuple[list[int], VisionRow]:
    """One processed row: its token ids, and its vision inputs (token fields as 1-D tensors of the prompt's length)."""
    input_ids = encoded["input_ids"][0]
    vision = {}
    for name, value in encoded.items():
        if name in ("input_ids", "attention_mask") or not isinstance(value, torch.Tensor):
            continue
        vision[name] = value[0] if name in TOKEN_FIELDS else value
    return input_ids.tolist(), vision


def vision_batch(
    rows: Sequence[VisionRow], prompt_width: int, completion_width: int, device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """The model's vision keyword arguments for a forward over `rows` (their prompts left-padded to `prompt_width`,
    followed by `completion_width` completion columns): see the module docstring."""
    names = list(dict.fromkeys(name for row in rows for name in row))
    batch = {}
    for name in names:
        values = [row[name] for row in rows if name in row]
        if name in TOKEN_FIELDS:
            padded = values[0].new_zeros(len(values), prompt_width + completion_width)
            for i, value in enumerate(values):
                padded[i, prompt_width - value.shape[0] : prompt_width] = value
            batch[name] = padded
            continue
        shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
        padded = []
        for value in values:
            grow = [0] * (2 * len(shape))
            for d, size in enumerate(shape):  # torch's pad lists the last dimension first
                grow[2 * (len(shape) - 1 - d) + 1] = size - value.shape[d + 1]
            padded.append(torch.nn.functional.pad(value, grow) if any(grow) else value)
        batch[name] = torch.cat(padded)
    return {name: value.to(device) for name, value in batch.items()} if device is not None else batch


def rows_to(rows: Sequence[VisionRow] | None, device: torch.device | str) -> list[VisionRow] | None:
    """`rows` with every tensor on `device`."""
    if rows is None:
        return None
    return [{name: value.to(device) for name, value in row.items()} for row in rows]


NOT_A_PROCESSOR = (
    "The data set has an image column, and processing_class is a tokenizer, which cannot turn images into the "
    "model's inputs. Pass the model's processor (AutoProcessor.from_pretrained(...)), or leave processing_class out "
    "to load it from the model's path."
)


def check_vision_run(args, processing_class, images: Any, tools: Any, offline: Any) -> None:
    """Refuse, before any weight loads, the settings a run with images (`images`: the data sets' `ImageScan`,
    grpo/data/image_checks.py, or None without an image column) cannot take yet, each with its fix (`tools`,
    `offline`: the trainer's tools or environments and offline data, or None), and an image the given processor
    refuses; then log how its log-prob passes run."""
    if not images:
        return
    if processing_class is not None and not is_processor(processing_class):
        raise InputError(NOT_A_PROCESSOR)
    problems = [
        (
            args.async_generation,
            "images are not supported with async_generation yet: set async_generation=False (use_vllm without it "
            "takes images)",
        ),
        (
            args.use_transformers_continuous_batching,
            "images are not supported with use_transformers_continuous_batching yet: set it to False",
        ),
        (bool(tools), "images are not supported with tools or environments yet: train single-turn completions"),
        (offline is not None, "images are not supported in offline training (scored completions) yet"),
        (
            args.padding_free is True,
            "padding_free=True packs sequences into one row, which vision inputs cannot be packed with: set "
            "padding_free=None or False",
        ),
        (
            getattr(args, "sequence_parallel_size", 1) > 1,
            "images are not supported with sequence parallelism (sp_size > 1): a shard of a sequence would hold "
            "image placeholders whose features the model merges in only with the whole prompt",
        ),
    ]
    found = [text for problem, text in problems if problem]
    if found:
        raise InputError(f"The data set has an image column, and {found[0]}.")
    if processing_class is not None and hasattr(images, "check_processor"):
        images.check_processor(processing_class)  # the images of extreme shape, before any weight loads
    logger.info(
        "Images in the data: the log-prob passes run padded, each row with its own prompt and images (padding-free "
        "packing and the shared-prompt forward are off for vision inputs)%s.",
        "; vLLM is given the images themselves and runs the processor on them" if args.use_vllm else "",
    )


def placeholder_token_ids(config) -> list[int]:
    """The token ids a vision-language model's configuration reserves for images and videos (`image_token_id`,
    Qwen-VL's `vision_start_token_id`, LLaVA's `image_token_index`, ...): what a completion must not hold, since the
    model would look for an image's features at each of them."""
    ids = set()
    for name, value in vars(config).items():
        if isinstance(value, int) and name.endswith(("_token_id", "_token_index")):
            if any(word in name for word in ("image", "video", "vision")):
                ids.add(value)
    return sorted(ids)
