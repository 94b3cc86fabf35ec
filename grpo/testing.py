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
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if not loop.last or not continue_final_message %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE with no merges: one token per byte, plus `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>`
    (EOS) and a ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {symbol: i for i, symbol in enumerate(sorted(alphabet))}
    for token in SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token="<|im_start|>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = CHATML_TEMPLATE
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
