"""Tiny models and tokenizers built in code, for tests, benchmarks and docs examples (no download).

    tokenizer = tiny_tokenizer()
    model = tiny_model(tokenizer)                 # random LlamaForCausalLM, hidden 64, 2 layers
    path = save_tiny_model(tmp_dir)               # a folder `from_pretrained` and GRPOTrainer(model=path) load

The tokenizer is byte-level (256 bytes + ChatML specials), so any text round-trips. The model has 2 attention heads
of dimension 32 and 1 KV head: vLLM's CPU attention rejects head_dim 16.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2VLProcessor

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if not loop.last or not continue_final_message %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: one token per byte, plus `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>`
    (EOS) and a ChatML chat template."""
    tokenizer = _byte_tokenizer(SPECIAL_TOKENS)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _byte_tokenizer(specials: list[str]) -> PreTrainedTokenizerFast:
    """One token per byte (byte-level BPE, no merges), then `specials` in order; EOS, pad and BOS as ChatML's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    for token in specials:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": specials})
    return tokenizer


def tiny_config(tokenizer: PreTrainedTokenizerFast | None = None, **overrides) -> LlamaConfig:
    """The tiny Llama configuration: hidden size 64, 2 layers, 2 heads of dimension 32, 1 KV head."""
    tokenizer = tokenizer or tiny_tokenizer()
    settings = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaConfig(**{**settings, **overrides})


def tiny_model(
    tokenizer: PreTrainedTokenizerFast | None = None, seed: int = 0, **config_overrides
) -> LlamaForCausalLM:
    """A randomly initialised Llama with hidden size 64 and 2 layers (about 100k parameters), float32."""
    tokenizer = tokenizer or tiny_tokenizer()
    config = tiny_config(tokenizer, **config_overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
    )
    return model


def save_tiny_reward_model(path: str | Path, seed: int = 1) -> Path:
    """Save a randomly initialised one-label reward model (`LlamaForSequenceClassification`, 1 layer) and the tiny
    tokenizer to `path` and return it."""
    from transformers import LlamaForSequenceClassification

    path = Path(path)
    tokenizer = tiny_tokenizer()
    torch.manual_seed(seed)
    LlamaForSequenceClassification(tiny_config(tokenizer, num_hidden_layers=1, num_labels=1)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_model(path: str | Path, seed: int = 0, **config_overrides) -> Path:
    """Save a tiny model and its tokenizer to `path` and return it."""
    path = Path(path)
    tokenizer = tiny_tokenizer()
    tiny_model(tokenizer, seed=seed, **config_overrides).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# ---- Tiny vision-language models (docs/vlm.md) ----

# A ChatML template whose message contents may be lists of {"type": "text"} and {"type": "image"} blocks; each image
# block becomes `image_token`, which the processor expands into the model's placeholder tokens.
VLM_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}IMAGE_TOKEN{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if not loop.last or not continue_final_message %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The special tokens of each kind's processor: Qwen2-VL's image span and placeholder, Idefics3's (SmolVLM's) image
# wrapping tokens.
_VLM_TOKENS = {
    "qwen2_vl": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"],
    "idefics3": ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"],
}
VLM_KINDS = tuple(_VLM_TOKENS)


def tiny_vlm_processor(kind: str = "idefics3"):
    """The processor of a tiny vision-language model of `kind` ("idefics3": SmolVLM-shaped, 64 x 64 pixel images as
    4 placeholder tokens; "qwen2_vl": Qwen2-VL-shaped, images resized to at most 56 x 56 pixels, 14-pixel patches
    merged 2 x 2, up to 4 placeholder tokens). The byte-level tokenizer of `tiny_tokenizer` plus the kind's special
    tokens, and the kind's image processor (its PIL implementation: no torchvision needed)."""
    if kind not in _VLM_TOKENS:
        raise ValueError(f"kind must be one of {VLM_KINDS}, got {kind!r}")
    tokenizer = _byte_tokenizer(SPECIAL_TOKENS + _VLM_TOKENS[kind])
    if kind == "idefics3":
        from transformers import Idefics3Processor

        try:  # transformers >= 5.2x: the PIL implementation under its own name (the default one needs torchvision)
            from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
        except ImportError:
            from transformers import Idefics3ImageProcessor as Idefics3ImageProcessorPil

        template = VLM_TEMPLATE.replace("IMAGE_TOKEN", "<image>")
        tokenizer.chat_template = template
        images = Idefics3ImageProcessorPil(
            do_image_splitting=False, size={"longest_edge": 64}, max_image_size={"longest_edge": 64}
        )
        return Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4, chat_template=template)
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:
        from transformers import Qwen2VLImageProcessor as Qwen2VLImageProcessorPil

    template = VLM_TEMPLATE.replace("IMAGE_TOKEN", "<|vision_start|><|image_pad|><|vision_end|>")
    tokenizer.chat_template = template
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 56, patch_size=14, merge_size=2)
    return ImageOnlyQwen2VLProcessor(image_processor=images, tokenizer=tokenizer, chat_template=template)


class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without its video processor, which needs torchvision: transformers 5 checks the class of
    every part a processor's `__init__` names, and without torchvision the video part's base class does not exist."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)


def tiny_vlm(processor=None, kind: str = "idefics3", seed: int = 0):
    """A randomly initialised vision-language model of `kind` matching `tiny_vlm_processor(kind)` (built when not
    given): a 2-layer text model of hidden size 64 (2 heads of dimension 32, 1 KV head) after a 1- or 2-layer vision
    tower, float32, about 150k-190k parameters. Returns (model, processor)."""
    processor = processor or tiny_vlm_processor(kind)
    tokenizer = processor.tokenizer
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in _VLM_TOKENS[kind]}
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = _tiny_idefics3(text, ids, tokenizer.pad_token_id) if kind == "idefics3" else _tiny_qwen2_vl(text, ids)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id
    )
    return model, processor


def _tiny_idefics3(text: dict, ids: dict[str, int], pad_token_id: int):
    """SmolVLM-shaped: a 1-layer vision tower on 64 x 64 images in 16-pixel patches, then the llama text model of
    `text`; `ids` are the special tokens' ids."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    config = Idefics3Config(
        text_config=dict(model_type="llama", head_dim=32, **text),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=64,
            patch_size=16,
        ),
        image_token_id=ids["<image>"],
        scale_factor=2,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
    )
    return Idefics3ForConditionalGeneration(config)


def _tiny_qwen2_vl(text: dict, ids: dict[str, int]):
    """Qwen2-VL-shaped: a 2-layer vision tower on 14-pixel patches merged 2 x 2, then the Qwen2 text model of `text`;
    `ids` are the special tokens' ids."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    # Qwen2-VL's 3-D rotary positions: the 16 frequency pairs of a 32-dimensional head split over time, height
    # and width.
    rope = {"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 10000.0}
    config = Qwen2VLConfig(
        text_config=dict(rope_parameters=rope, **text),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=2,
            mlp_ratio=2,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_channels=3,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    return Qwen2VLForConditionalGeneration(config)


def squares_image(count: int, size: int = 64, seed: int = 0, colour: str = "red"):
    """A `size` x `size` white PIL image with `count` non-overlapping filled squares of `colour` (for the synthetic
    counting task of docs/vlm.md); the positions come from `seed`."""
    import random

    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    side = size // 4
    cells = [(x, y) for x in range(4) for y in range(4)]
    image = Image.new("RGB", (size, size), "white")
    draw = ImageDraw.Draw(image)
    for x, y in rng.sample(cells, count):
        draw.rectangle([x * side + 2, y * side + 2, (x + 1) * side - 3, (y + 1) * side - 3], fill=colour)
    return image
