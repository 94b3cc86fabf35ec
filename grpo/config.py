"""`GRPOConfig`: every knob of the GRPO trainer, on top of `transformers.TrainingArguments`.

Field names follow TRL's `GRPOConfig` so that configs carry over. Each field is declared with `option`, which names
its section of the generated reference and, for a number, its valid range; its help text lives in the field metadata
only. `docs/config.md` explains the defaults. Invalid combinations raise in `__post_init__` with the fix in the
message.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import re
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from transformers import TrainingArguments
from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

from grpo.data import TRUNCATION_SIDES
from grpo.generation.settings import check_continuous_batching, check_generation_kwargs, check_vllm_engine
from grpo.objective.sequence_parallel import parallel_sizes
from grpo.objective.settings import ObjectiveSettings, objective_settings
from grpo.rewards import REWARD_ERRORS, REWARD_WORKER_TYPES
from grpo.training.inherited_fields import check_inherited_fields

# The largest learning_rate taken without `allow_large_learning_rate`. Fine-tuning uses 1e-6 to 1e-4 (TRL's default
# is 1e-6); Adam moves each weight by about lr per step, and an LM's weights are of order 0.02, so lr > 1 cannot be
# meant for one. It still admits the 0.5 of plain SGD on toy models, and refuses a lost minus sign (1e5) or 1e30.
MAX_LEARNING_RATE = 1.0
# Below this temperature sampling is close to greedy: at 0.1 a logit gap of 1 becomes one of 10 (odds of e^10), so the
# G completions of a group come out the same, their rewards tie and every advantage is 0.
MIN_USEFUL_TEMPERATURE = 0.1
# The keyword arguments of `apply_chat_template` the trainer sets itself at its call sites; `chat_template_kwargs`
# may not override them (the rendering would no longer be text, or lose its generation prompt or tools).
CHAT_TEMPLATE_OWN_KWARGS = (
    "conversation",
    "tools",
    "tokenize",
    "add_generation_prompt",
    "continue_final_message",
    "return_dict",
    "return_tensors",
)
# A Hugging Face Hub repository id: a name, or a namespace and a name (huggingface_hub's rule, without importing it).
HUB_REPO_ID = re.compile(r"(?:[\w.-]{1,96}/)?[\w.-]{1,96}")


class Interval(NamedTuple):
    """The valid values of a numeric field: `low <= x <= high` (`low < x` when `open_low`); None = unbounded."""

    low: float | None = None
    high: float | None = None
    open_low: bool = False
    why: str = ""  # what the value means, or how to choose it; ends the error message

    def __contains__(self, x) -> bool:
        above = self.low is None or (x > self.low if self.open_low else x >= self.low)
        return above and (self.high is None or x <= self.high)

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.open_low else '['}{self.low}, {self.high}]"
        if self.low is not None:
            return f"{'>' if self.open_low else '>='} {self.low}"
        return f"<= {self.high}" if self.high is not None else "a finite number"


class Section:
    """The headings of the generated reference (docs/config-reference.md). Each field names its own in `option`; the
    page lists the sections in the order of their first field in GRPOConfig's body."""

    OVERRIDDEN = "Overridden `TrainingArguments` defaults"
    MODEL = "Model"
    CPU_TUNING = "CPU tuning (opt-in: grpo/contrib/cpu/, one kind of machine)"
    DATA = "Data and generation"
    REWARDS = "Rewards and advantages"
    LOSS = "Loss"
    VLLM = "Generation on a vLLM server"
    ASYNC = "Asynchronous generation"
    AGENTS = "Tools and environments (multi-turn episodes)"
    OFFLINE = "Training from scored rollouts (offline)"
    LOGGING = "Logging"
    STOPS = "Stopping and resuming"


class Option(NamedTuple):
    """What a field of GRPOConfig declares besides its default and help text."""

    section: str  # its heading in docs/config-reference.md, one of `Section`'s
    range: Interval | None  # the valid values of a numeric field, checked in `__post_init__`


# Each GRPOConfig field's Option, filled in by `option` as the class body runs (dataclasses keeps these Field objects).
_OPTIONS: dict[dataclasses.Field, Option] = {}


def option(*, default: Any, section: str, range: Interval | None = None, help: str) -> Any:
    """A field of GRPOConfig: `field(default=default, metadata={"help": help})`, listed under `section` in the
    generated reference and, for a number, checked against `range` in `__post_init__`.

    Section and range stay out of the metadata because `HfArgumentParser`, with which TRL's scripts parse
    GRPOConfig, passes every metadata key to argparse's `add_argument`: "help" is one of its arguments, others fail.
    """
    f = field(default=default, metadata={"help": help})
    _OPTIONS[f] = Option(section, range)
    return f


@functools.cache
def options() -> dict[str, Option]:
    """{field name: Option} for the fields declared with `option`, in the order of GRPOConfig's body."""
    return {f.name: _OPTIONS[f] for f in dataclasses.fields(GRPOConfig) if f in _OPTIONS}


# The valid values of the TrainingArguments fields a GRPO user sets that GRPOConfig does not declare again (the ones
# it declares, such as learning_rate, give their range in `option`).
INHERITED_RANGES = {
    "max_steps": Interval(-1, why="-1 trains for num_train_epochs instead"),
    "num_train_epochs": Interval(0, open_low=True),
    "per_device_train_batch_size": Interval(1),
    "per_device_eval_batch_size": Interval(1),
    "gradient_accumulation_steps": Interval(1),
    "seed": Interval(0, 2**32 - 1, why="numpy's random seed range"),
    "weight_decay": Interval(0),
    "max_grad_norm": Interval(0, why="0 turns gradient clipping off"),
    "warmup_steps": Interval(0),
}


@functools.cache
def numeric_ranges() -> dict[str, Interval]:
    """{field: valid values} for every numeric field `_check_fields` checks: INHERITED_RANGES, then the ranges
    GRPOConfig's fields declare (every int and float field of its own has one; tests/test_bad_inputs.py checks that).
    Whether a field takes an int or a float, and None, comes from its annotation (`field_kinds`)."""
    declared = {name: o.range for name, o in options().items() if o.range is not None}
    return INHERITED_RANGES | declared


@functools.cache
def field_kinds() -> dict[str, tuple[type, bool]]:
    """{field: (int, float or bool, whether None is allowed)} for the fields `_check_fields` covers: those with a
    range in `numeric_ranges()` and every bool field of GRPOConfig's own (a string "false" would otherwise count as
    true)."""
    hints = typing.get_type_hints(GRPOConfig)
    own = {f.name for f in dataclasses.fields(GRPOConfig)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    ranges = numeric_ranges()
    kinds = {}
    for name, hint in hints.items():
        args = typing.get_args(hint) or (hint,)
        types = [a for a in args if a is not type(None)]
        if len(types) == 1 and types[0] in (int, float, bool):
            if name in ranges or (types[0] is bool and (name in own or name == "bf16")):
                kinds[name] = (types[0], len(types) < len(args))
    return kinds


def _type_name(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "True or False"}[kind]


@dataclass
class GRPOConfig(TrainingArguments):
    # ---- Overridden TrainingArguments defaults ----
    learning_rate: float = option(
        default=1e-6,
        section=Section.OVERRIDDEN,
        range=Interval(0),
        help="Initial AdamW learning rate. RL fine-tuning uses far smaller steps than supervised training. Values "
        f"above {MAX_LEARNING_RATE:g} are refused unless `allow_large_learning_rate=True`.",
    )
    allow_large_learning_rate: bool = option(
        default=False,
        section=Section.OVERRIDDEN,
        help=f"Accept a learning_rate above {MAX_LEARNING_RATE:g}. Fine-tuning runs use 1e-6 to 1e-4; Adam moves each "
        "weight by about the learning rate per step, so a larger one (often a lost minus sign, 1e5 for 1e-5) replaces "
        "the weights within a step. Set it for toy models or plain SGD on purpose.",
    )
    logging_steps: float = option(
        default=10,
        section=Section.OVERRIDDEN,
        range=Interval(0, open_low=True, why="a number of steps, or a fraction of all steps below 1"),
        help="Log every N optimizer steps (a float in (0, 1) is a fraction of all steps).",
    )
    bf16: bool | None = option(
        default=None,
        section=Section.OVERRIDDEN,
        help="bfloat16 mixed precision. None (default) turns it on only where a CUDA device supports it and training "
        "runs on it (not with use_cpu=True), so the same script runs unchanged on a CPU-only machine.",
    )
    remove_unused_columns: bool = option(
        default=False,
        section=Section.OVERRIDDEN,
        help="Kept False: the trainer needs the `prompt` column and passes every other column to the reward "
        "functions.",
    )

    # ---- Model ----
    model_init_kwargs: dict[str, Any] | None = option(
        default=None,
        section=Section.MODEL,
        help="Keyword arguments for `AutoModelForCausalLM.from_pretrained` when `model` is a path or hub id "
        "(`AutoModelForImageTextToText` for a vision-language model). The default loads float32 weights "
        "(`dtype=torch.float32`), the right master copy for mixed precision.",
    )
    train_vision_tower: bool = option(
        default=False,
        section=Section.MODEL,
        help="Vision-language models (docs/vlm.md): train the vision tower and projector too. False (default) "
        "keeps them frozen: a PEFT adapter goes on the language model only (the vision modules are added to its "
        "exclude_modules), and without PEFT their weights get no gradient. No effect on a text-only model.",
    )
    trust_remote_code: bool = option(
        default=False,
        section=Section.MODEL,
        help="Allow models and tokenizers whose folder or hub repository ships its own Python code (`auto_map` in "
        "its config) to run that code when they load: the policy, its tokenizer, reward models named by path and "
        "their tokenizers, and the colocated vLLM engine (a server: `grpo vllm-serve --trust-remote-code`). A "
        "`trust_remote_code` key in `model_init_kwargs` wins for the policy. Only for code you have read.",
    )
    disable_dropout: bool = option(
        default=True,
        section=Section.MODEL,
        help="Set every dropout probability of the policy (and reference) to 0. Dropout makes the log-probs of "
        "the same tokens differ between passes, so the ratio pi/pi_old would not be 1 on-policy.",
    )
    cast_lm_head_to_fp32: bool = option(
        default=False,
        section=Section.MODEL,
        help="Run the output head's product h W^T in float32 for the policy's and the reference's log-probs, "
        "whatever the mixed-precision setting or the weights' dtype (ScaleRL, arXiv:2510.13786): in a bf16 run "
        "the logits otherwise carry bf16's rounding. The weights keep their dtype. An error with a PEFT adapter "
        "on the head, or under DeepSpeed ZeRO-3.",
    )
    logprobs_chunk_size: int | None = option(
        default=None,
        section=Section.MODEL,
        range=Interval(1, why="a number of tokens, or None to choose it from the vocabulary size"),
        help="Completion tokens projected onto the vocabulary at a time when computing log-probs (the full "
        "batch x length x vocabulary logits are never built). None picks it from the vocabulary size so one "
        "float32 chunk takes about 128 MiB; smaller saves memory, larger can be faster.",
    )
    use_liger_kernel: bool = option(
        default=False,
        section=Section.MODEL,
        help="Train on Liger's fused linear GRPO loss (`pip install 'grpo[liger]'`), which projects the hidden states "
        "and computes the loss and its gradients in chunks, where its options cover the run's loss; else this "
        "library's chunked log-probs, said in one log line (docs/performance.md). `Trainer` also applies Liger's "
        "layer kernels (`liger_kernel_config`) where Triton and a GPU let them run. An error with a PEFT adapter on "
        "the head.",
    )
    tiled_mlp_tokens: int | None = option(
        default=None,
        section=Section.MODEL,
        range=Interval(1, why="tokens per chunk, or None (off)"),
        help="Compute the MLP of every decoder layer of the policy this many tokens at a time, in the forward and "
        "in its backward (TiledMLP of Arctic Long Sequence Training, arXiv:2506.13996): a layer keeps only the "
        "MLP's input for backward and builds its (tokens x intermediate_size) tensors for one chunk at a time, "
        "instead of four of them for every token of the micro-batch, which is the largest part of a layer's "
        "recomputation under gradient checkpointing. Costs one more forward of the MLP per step; values and "
        "gradients equal the plain MLP's. For long completions: a value near the hidden size (e.g. 1024 to "
        "4096) keeps a chunk's tensors about the size of one MLP weight; passes of at most that many tokens run "
        "as before. None (default): off. Dense MLPs only (the `mlp` of each decoder layer, as in Llama, Qwen2, "
        "Mistral, Gemma); a Mixture-of-Experts model, or one without such a module, is refused.",
    )
    activation_offloading: bool = option(
        default=False,
        section=Section.MODEL,
        help="Keep the tensors the policy's training forward saves for backward in pinned host memory, copied "
        "back to the GPU as the backward reads them (TRL's SFTConfig has this field): with gradient checkpointing "
        "these are each layer's input, so the GPU holds one layer's at a time instead of every layer's. Parameters "
        "and tensors under 256 KiB stay on the device. Values and gradients are unchanged; each step copies the "
        "saved activations over PCIe twice. On a CUDA device only: elsewhere a no-op, said in one log line.",
    )
    padding_free: bool | None = option(
        default=None,
        section=Section.MODEL,
        help="Run the log-prob forward passes on all sequences of a micro-batch packed into one row, without "
        "padding. None turns it on where the attention implementation has variable-length kernels "
        "(flash_attention_2/3), where packing saves work; with sdpa or eager it is correct but builds a dense "
        "mask over the packed row, so it is off by default there.",
    )
    share_prompt: bool = option(
        default=True,
        section=Section.MODEL,
        help="Compute each group's prompt once in every log-prob pass (policy, old, reference): the micro-batch runs "
        "as one row per prompt with its completions after it, under an attention mask that lets each completion read "
        "only its prompt and itself; the results equal the plain forward's. Set False to debug, or to compare. It "
        "falls back to the plain forward, with one log line, where the attention cannot take that mask "
        "(flash_attention_2/3, sliding-window or linear-attention layers), and, micro-batch by micro-batch, where the "
        "shared row would cost more than the plain rows (long completions of a short prompt: dense attention over "
        "all G completions in one row costs about G times theirs; docs/long-sequences.md).",
    )

    # ---- CPU tuning (opt-in; grpo/contrib/cpu/, docs/performance.md) ----
    # Each tunes CPU training on one kind of machine and changes something the library does not otherwise touch, so
    # each is off by default: the same seed samples the same way on every machine unless a user switches one on.
    cpu_decode_kernel: bool = option(
        default=False,
        section=Section.CPU_TUNING,
        help="CPU tuning for one kind of machine (x86-64 with AVX-512 under Linux), off by default. Sampling "
        "with `model.generate` on a CPU: the decoding steps' matrix products of at most 16 rows (one new token "
        "per sequence) run grpo's own AVX-512 kernel (grpo/contrib/cpu/decode.py), which reads each weight once "
        "for all rows. It compiles C code: once per machine, with the system's C compiler, into "
        "$XDG_CACHE_HOME/grpo/kernels (~/.cache/grpo/kernels), and loads it through ctypes. Only for float32 "
        "models with at least 64 MiB of weight matrices and without autocast (bf16); results differ from "
        "torch's in the last bits. Without a C compiler, off Linux x86-64 or where "
        "torch.backends.cpu.get_cpu_capability() is not AVX512, torch's (MKL) products are used.",
    )
    cpu_inverse_cdf_sampling: bool = option(
        default=False,
        section=Section.CPU_TUNING,
        help="CPU tuning, off by default. Sampling with `model.generate` on a CPU: the next token of each "
        "row drawn by the inverse of the cumulative distribution with one uniform number per row "
        "(grpo/contrib/cpu/sampling.py) instead of torch.multinomial's row x vocabulary exponentials, which "
        "take a noticeable part of a decoding step at large vocabularies. For the models the decoding kernel "
        "serves (float32, at least 64 MiB of weight matrices, no autocast), whatever the CPU. The same "
        "distribution from another random stream: a seed gives other samples than with False.",
    )
    keep_freed_cpu_memory: bool = option(
        default=False,
        section=Section.CPU_TUNING,
        help="CPU tuning for one kind of machine (Linux with glibc), off by default. Training on a CPU: "
        "changes the malloc settings of the whole process, irreversibly (glibc's mallopt, "
        "grpo/contrib/cpu/memory.py): every block from the heap, none mapped afresh, up to 1 GiB of free heap "
        "kept rather than handed back to the OS, which saves the page faults of allocating every gradient "
        "anew at each step. Freed memory then stays in the process's resident size until reused. No effect on "
        "a GPU, on another C library or under a preloaded jemalloc or tcmalloc; False leaves the C library's "
        "settings alone.",
    )

    # ---- Data and generation ----
    num_generations: int = option(
        default=8,
        section=Section.DATA,
        range=Interval(
            2,
            why="GRPO needs at least 2 completions per prompt, since the baseline of each is its group's mean reward",
        ),
        help="G, completions sampled per prompt (a group). At least 2: the baseline is the group mean.",
    )
    num_generations_eval: int | None = option(
        default=None,
        section=Section.DATA,
        range=Interval(1, why="completions per prompt in evaluation, or None for num_generations"),
        help="Completions sampled per prompt in evaluation (None = num_generations). Fewer save time; with 1, "
        "eval_reward is the mean reward of one sample per prompt (its advantages, and so the eval loss but for a "
        "beta KL term, are 0: a group of one has no spread). per_device_eval_batch_size x processes must be a multiple of it.",
    )
    max_prompt_length: int | None = option(
        default=None,
        section=Section.DATA,
        range=Interval(1, why="a number of tokens, or None for no limit"),
        help="Longest prompt, in tokens. None (default, as in TRL 1.16) keeps whole prompts. A longer conversation "
        "loses its oldest whole turns (its system message and last turn are kept; one that still does not fit is "
        "refused, when the trainer is built for the data sets' rows), a longer string is cut on truncation_side; "
        "counted in `prompts/truncated` (and `prompts/turns_cut`) and warned about once.",
    )
    truncation_side: str = option(
        default="left",
        section=Section.DATA,
        help="Which end of a string prompt longer than max_prompt_length is cut: 'left' (default) drops its start "
        "and keeps the end, where the question is; 'right' keeps the start and drops the end. Conversations are "
        "never cut inside a turn: they lose whole turns, the oldest first.",
    )
    max_completion_length: int = option(
        default=256,
        section=Section.DATA,
        range=Interval(1),
        help="Maximum number of tokens sampled per completion.",
    )
    generation_batch_size: int | None = option(
        default=None,
        section=Section.DATA,
        range=Interval(1, why="a positive multiple of per_device_train_batch_size x processes"),
        help="Rows (prompts x G) sampled per generation round, over all processes. Set this or "
        "`steps_per_generation`, not both; by default one round feeds `gradient_accumulation_steps` micro-steps.",
    )
    steps_per_generation: int | None = option(
        default=None,
        section=Section.DATA,
        range=Interval(1),
        help="Micro-steps fed by one generation round. Default: `gradient_accumulation_steps`, so one round "
        "makes one optimizer step.",
    )
    shuffle_dataset: bool = option(
        default=True,
        section=Section.DATA,
        help="Shuffle the prompts (seeded by `seed`, identically on every process). A streamed "
        "`datasets.IterableDataset` is shuffled by its own buffer of 1000 rows, afresh at each pass; a torch "
        "`IterableDataset` cannot be, and is taken in its order (docs/config.md#streamed-data-sets).",
    )
    pad_to_multiple_of: int | str | None = option(
        default="auto",
        section=Section.DATA,
        help="Pad prompts and completions to a multiple of this many tokens, in the batches `model.generate` and "
        "every log-prob pass see, so that a compiler meets few distinct shapes. 'auto' (TRL's default) is 128 on "
        "an AWS Trainium (Neuron) device and None elsewhere; None pads only to the longest row. Padding is "
        "masked: the loss is the same.",
    )
    chat_template_kwargs: dict[str, Any] | str | None = option(
        default=None,
        section=Section.DATA,
        help="Extra keyword arguments for every `apply_chat_template` call: the prompts rendered for generation "
        "and evaluation, the texts reward models score, and the turns of multi-turn episodes. For example "
        "`{'enable_thinking': False}` for Qwen3's template. A JSON string is read as a dict (command lines).",
    )
    temperature: float = option(
        default=1.0,
        section=Section.DATA,
        range=Interval(0, open_low=True, why="GRPO samples several different completions per prompt"),
        help="Sampling temperature. Log-probs for the loss use the same temperature. Below "
        f"{MIN_USEFUL_TEMPERATURE:g} a warning: the completions of a group come out identical and nothing is learned.",
    )
    top_p: float = option(
        default=1.0,
        section=Section.DATA,
        range=Interval(0, 1, open_low=True, why="1.0 turns nucleus sampling off"),
        help="Nucleus sampling: keep the smallest token set with this total probability (1.0 = off).",
    )
    top_k: int = option(
        default=0,
        section=Section.DATA,
        range=Interval(0, why="0 turns top-k sampling off"),
        help="Keep only the k most likely tokens when sampling (0 = off).",
    )
    min_p: float | None = option(
        default=None,
        section=Section.DATA,
        range=Interval(0, 1, why="None turns it off"),
        help="Drop tokens whose probability is below min_p times the top token's (None = off).",
    )
    repetition_penalty: float = option(
        default=1.0,
        section=Section.DATA,
        range=Interval(0, open_low=True, why="1.0 turns it off"),
        help="Penalty on tokens already present in prompt or completion (1.0 = off).",
    )
    generation_kwargs: dict[str, Any] | None = option(
        default=None,
        section=Section.DATA,
        help="Extra keyword arguments for the generation backend (for `model.generate`, fields of "
        "`GenerationConfig`); they override top_p, top_k, min_p and repetition_penalty. temperature and the "
        "length come from their own fields.",
    )
    cache_implementation: str | None = option(
        default=None,
        section=Section.DATA,
        help="The KV cache `model.generate` samples with (GenerationConfig's `cache_implementation`, e.g. "
        "'static', 'offloaded', 'sliding_window'); None: the model's default dynamic cache. Not used with vLLM.",
    )
    ds3_gather_for_generation: bool = option(
        default=True,
        section=Section.DATA,
        help="DeepSpeed ZeRO-3 without vLLM: gather all of the policy's weights on every process for the "
        "length of `model.generate` (fast; each process then holds the whole model in the training dtype). "
        "False keeps them partitioned: every layer is gathered again at every generated token (slow, but no "
        "more memory than training), for models that do not fit whole on one device. No effect otherwise.",
    )
    use_transformers_continuous_batching: bool = option(
        default=False,
        section=Section.DATA,
        help="Sample with transformers' own continuous-batching engine (`ContinuousBatchingManager`, paged KV "
        "cache, finished rows leave the batch at once) instead of `model.generate`, on the policy's own weights "
        "(TRL's name; transformers >= 5.8). Not with use_vllm, a repetition_penalty, FSDP or DeepSpeed ZeRO-3 "
        "(docs/config.md#generation-backends).",
    )
    transformers_continuous_batching_config: dict[str, Any] | None = option(
        default=None,
        section=Section.DATA,
        help="Keyword arguments of `transformers.generation.ContinuousBatchingConfig` for "
        "use_transformers_continuous_batching (a dict, or its JSON text), e.g. {'page_size': 64}. Unset, the KV "
        "cache is sized for the round (every row's prompt and completion at once) rather than from free memory. "
        "`seed` is refused: each round's seed comes from the trainer's sampling stream.",
    )
    use_transformers_paged: bool = option(
        default=False,
        section=Section.DATA,
        help="Deprecated name of use_transformers_continuous_batching (as in TRL): True sets it, with a "
        "FutureWarning.",
    )

    # ---- Rewards and advantages ----
    reward_weights: list[float] | None = option(
        default=None,
        section=Section.REWARDS,
        help="One weight per reward function for the weighted sum of rewards (default: all 1.0).",
    )
    multi_objective_aggregation: str = option(
        default="sum_then_normalize",
        section=Section.REWARDS,
        help="How several reward functions make one advantage: 'sum_then_normalize' (the weighted sum of the "
        "rewards, then the group normalisation of `scale_rewards`) or 'normalize_then_sum' (GDPO, arXiv:2601.05242: "
        "each function's rewards normalised within their group, then weighted and summed, the sum normalised over "
        "the batch; `scale_rewards` does not apply), as in TRL.",
    )
    reward_errors: str = option(
        default="raise",
        section=Section.REWARDS,
        help="What an exception (or timeout) in a reward function does: 'raise' stops training with an error "
        "naming the function, the row and the exception; 'skip' gives that row None for that function, counts "
        "it in `rewards/<name>/errors` and continues.",
    )
    nonfinite: str = option(
        default="error",
        section=Section.REWARDS,
        help="What a non-finite reward (+-inf), loss term (loss, KL, ratio, advantage) or gradient does: "
        "'error' stops training before the optimizer step with an error naming the step, the reward function "
        "or loss term with its row, and the likely fix (weights and checkpoints untouched); 'skip' treats such "
        "reward rows as unscored and skips such steps (no update), counting them in `nonfinite/reward_rows` and "
        "`nonfinite/skipped_steps`. Rewards whose spread overflows float32 are an error either way.",
    )
    reward_timeout: float | None = option(
        default=None,
        section=Section.REWARDS,
        range=Interval(0, open_low=True, why="a number of seconds, or None for no limit"),
        help="Seconds one reward-function call may take (None = no limit). A call that takes longer is "
        "abandoned and treated as a failure of its rows (see reward_errors). Synchronous functions then run in "
        "threads.",
    )
    reward_num_workers: int = option(
        default=0,
        section=Section.REWARDS,
        range=Interval(0, why="0 calls the reward functions in the trainer's thread"),
        help="Threads for synchronous reward functions: with N > 0, each function is called on N slices of the "
        "rows at once (for slow row-wise functions such as remote judges or code execution). 0 calls them in "
        "the trainer's thread, one after the other. Async functions always run concurrently.",
    )
    reward_worker_type: str = option(
        default="thread",
        section=Section.REWARDS,
        help="What runs the reward_num_workers slices: 'thread' (for functions that wait: HTTP calls, "
        "subprocesses) or 'process', a pool of spawned worker processes (for CPU-bound pure-Python functions; "
        "the function and its arguments must be picklable, so define it at the top level of a module).",
    )
    scale_rewards: str = option(
        default="group",
        section=Section.REWARDS,
        help="Divide advantages by the reward std of the 'group' (GRPO), of the whole 'batch', or 'none' "
        "(Dr. GRPO). True means 'group', False means 'none'.",
    )
    turn_advantage: str | None = option(
        default=None,
        section=Section.REWARDS,
        help="Turn-level credit for multi-turn episodes (tools or environment_factory; docs/agents.md): each policy "
        "turn's tokens get the episode's advantage plus turn_advantage_coef times the advantage of that turn "
        "against the same turn of the other episodes of its group. 'mt_grpo' (MT-GRPO, arXiv:2505.11821) uses the "
        "turn's own score, 'reward_to_go' the sum of its scores from that turn on. Turn scores come from an "
        "environment's get_turn_rewards() or a reward function marked @turn_reward. None: off (one advantage per "
        "episode, as in TRL).",
    )
    turn_advantage_coef: float = option(
        default=1.0,
        section=Section.REWARDS,
        range=Interval(0, open_low=True, why="the weight of a turn's advantage against the episode's"),
        help="The weight of the turn advantage under turn_advantage (MT-GRPO's coefficient; 1.0 as in its authors' "
        "code).",
    )
    dynamic_sampling: bool = option(
        default=False,
        section=Section.REWARDS,
        help="DAPO dynamic sampling: drop the groups whose advantages are all zero (equal rewards: no gradient) "
        "and generate extra rounds from further prompts until the generation batch is full again.",
    )
    max_dynamic_sampling_rounds: int = option(
        default=4,
        section=Section.REWARDS,
        range=Interval(0, why="extra generation rounds allowed per batch"),
        help="Most extra generation rounds per generation batch under `dynamic_sampling`. If the batch is still "
        "not full, the remaining slots keep zero-advantage groups, so the batch size never changes.",
    )

    # ---- Loss ----
    loss_type: str = option(
        default="dapo",
        section=Section.LOSS,
        help="The objective and how its per-token losses become one number. PPO's clipped term with: 'grpo' (mean "
        "per sequence, then over sequences), 'bnpo' (token mean per micro-batch), 'dr_grpo' (sum / (rows x "
        "max_completion_length)), 'dapo' (token mean over the whole accumulated global batch; no length bias), "
        "'luspo' (sum per sequence, then mean over sequences; with importance_sampling_level='sequence'). Terms "
        "of their own: 'cispo' (MiniMax-M1: the ratio clipped as a detached weight at epsilon_high, dapo's mean), "
        "'sapo' (a smooth sigmoid gate instead of the clip, grpo's mean), 'vespo' (a Gamma-shaped weight of the "
        "sequence's ratio, dapo's mean). See docs/method.md.",
    )
    beta: float = option(
        default=0.0,
        section=Section.LOSS,
        range=Interval(0, why="0 disables the KL penalty and the reference model"),
        help="Weight of the k3 KL penalty to the reference model. 0 (default) loads no reference model and "
        "saves its memory and forward pass; DeepSeekMath used 0.04.",
    )
    sync_ref_model: bool = option(
        default=False,
        section=Section.LOSS,
        help="Move the reference toward the policy every `ref_model_sync_steps` optimizer steps: "
        "ref = alpha * policy + (1 - alpha) * ref with alpha = `ref_model_mixup_alpha` (TR-DPO, Gorbatovski et "
        "al., arXiv:2404.09656). Needs beta > 0 and a reference copy (not a PEFT adapter-disabled reference).",
    )
    ref_model_mixup_alpha: float = option(
        default=0.6,
        section=Section.LOSS,
        range=Interval(0, 1, open_low=True, why="1 copies the policy into the reference"),
        help="alpha of the soft reference update under `sync_ref_model`: 1 copies the policy.",
    )
    ref_model_sync_steps: int = option(
        default=512,
        section=Section.LOSS,
        range=Interval(1),
        help="Optimizer steps between two soft reference updates under `sync_ref_model`.",
    )
    ref_model_reset_steps: int | None = option(
        default=None,
        section=Section.LOSS,
        range=Interval(1, why="None never resets the reference"),
        help="The iterative scheme of DeepSeekMath (arXiv:2402.03300, Algorithm 1): every K optimizer steps "
        "the reference becomes the current policy, and callbacks with an `on_reference_reset` method run (where "
        "a reward model is refreshed on new samples; docs/method.md). None: the reference never resets. Needs "
        "beta > 0 and a reference copy.",
    )
    epsilon: float = option(
        default=0.2,
        section=Section.LOSS,
        range=Interval(0, open_low=True),
        help="Lower clipping range: the ratio is clipped below at 1 - epsilon.",
    )
    epsilon_high: float | None = option(
        default=None,
        section=Section.LOSS,
        range=Interval(0, open_low=True, why="None uses epsilon"),
        help="Upper clipping range (1 + epsilon_high). None uses `epsilon`; DAPO's clip-higher uses 0.28. With "
        "loss_type='cispo' it is the cap of the importance weight itself (ScaleRL's eps_max, e.g. 5.0), as in TRL.",
    )
    delta: float | None = option(
        default=None,
        section=Section.LOSS,
        range=Interval(1, open_low=True, why="it must also exceed 1 + epsilon_high; None turns it off"),
        help="Two-sided clipping (INTELLECT-2): cap the unclipped ratio at delta, which bounds the update of a "
        "token with negative advantage whose ratio has grown large. Must exceed 1 + epsilon_high; None = off.",
    )
    sapo_temperature_pos: float = option(
        default=1.0,
        section=Section.LOSS,
        range=Interval(0, open_low=True, why="the steepness of the gate"),
        help="loss_type='sapo': the gate's temperature tau for tokens with a positive advantage; the term is "
        "(4 / tau) * sigmoid(tau * (ratio - 1)) * A (SAPO, arXiv:2511.20347).",
    )
    sapo_temperature_neg: float = option(
        default=1.05,
        section=Section.LOSS,
        range=Interval(0, open_low=True, why="the steepness of the gate"),
        help="loss_type='sapo': the gate's temperature for tokens with a zero or negative advantage (the paper "
        "makes it the larger, so those tokens' gate falls off faster as the ratio moves).",
    )
    vespo_k_pos: float = option(
        default=2.0,
        section=Section.LOSS,
        range=Interval(0, why="the power of the sequence ratio w in the weight"),
        help="loss_type='vespo', advantage >= 0: k of the weight phi(w) = exp(lambda + k log w - lambda w) of "
        "the sequence ratio w; a larger k weighs sequences with w < 1 down harder (VESPO, arXiv:2602.10693).",
    )
    vespo_lambda_pos: float = option(
        default=3.0,
        section=Section.LOSS,
        range=Interval(0, why="the decay of the weight for w > 1"),
        help="loss_type='vespo', advantage >= 0: lambda of phi(w); a larger lambda weighs sequences with w > 1 "
        "down harder.",
    )
    vespo_k_neg: float = option(
        default=3.0,
        section=Section.LOSS,
        range=Interval(0, why="the power of the sequence ratio w in the weight"),
        help="loss_type='vespo', advantage < 0: k of phi(w).",
    )
    vespo_lambda_neg: float = option(
        default=2.0,
        section=Section.LOSS,
        range=Interval(0, why="the decay of the weight for w > 1"),
        help="loss_type='vespo', advantage < 0: lambda of phi(w).",
    )
    use_bias_correction_kl: bool = option(
        default=True,
        section=Section.LOSS,
        help="Multiply the k3 KL term by the importance ratio pi_theta / pi_old (at `importance_sampling_level`), "
        "which makes its gradient the unbiased gradient of KL(pi_theta || pi_ref) for tokens sampled from pi_old "
        "(DeepSeek-V3.2). The ratio is 1 in value on the first iteration: only the gradient changes. Default True, "
        "as in TRL 1.16. Only matters with beta > 0.",
    )
    off_policy_mask_threshold: float | None = option(
        default=None,
        section=Section.LOSS,
        range=Interval(0, why="a mean log-ratio per token, e.g. 0.5; None turns the masking off"),
        help="DeepSeek-V3.2's off-policy sequence masking: drop a completion with a negative advantage from the "
        "policy term when its mean per-token log(pi_sampler / pi_theta) exceeds this threshold (the sampler's own "
        "log-probs where it reports them, else pi_old's). None (default) = off.",
    )
    importance_sampling_level: str = option(
        default="token",
        section=Section.LOSS,
        help="'token': one ratio per token (GRPO). 'sequence': one ratio per completion, exp of the mean "
        "per-token log-ratio, clipped as a whole (GSPO).",
    )
    top_entropy_quantile: float = option(
        default=1.0,
        section=Section.LOSS,
        range=Interval(0, 1, open_low=True, why="the fraction of highest-entropy tokens; 1.0 = all"),
        help="Train the policy term only on this fraction of completion tokens with the highest entropy "
        "(threshold over all processes' tokens of the micro-step). 1.0 = all tokens; 0.2 is the paper's choice.",
    )
    entropy_coef: float = option(
        default=0.0,
        section=Section.LOSS,
        range=Interval(0, why="the weight of the entropy bonus; 0 turns it off"),
        help="Weight c of an entropy bonus: the loss gains -c H per token the policy term trains (H: the entropy of "
        "the tempered next-token distribution), aggregated like the policy term of `loss_type`; it keeps the policy "
        "from collapsing onto one answer. With `use_adaptive_entropy`, the starting coefficient. 0 (default) = off.",
    )
    use_adaptive_entropy: bool = option(
        default=False,
        section=Section.LOSS,
        help="Skywork-OR1's adaptive entropy control (arXiv:2505.22312): after each optimizer step the coefficient "
        "rises by `entropy_coef_delta` when the step's mean entropy (all processes, the tokens the policy term "
        "trained) was at or below `entropy_target`, and falls by it otherwise, within [entropy_coef_min, "
        "entropy_coef_max]; the bonus applies only in steps after one whose entropy was at or below the target. "
        "The coefficient is saved in checkpoints and logged as `entropy_coef`.",
    )
    entropy_coef_min: float = option(
        default=0.0,
        section=Section.LOSS,
        range=Interval(0, why="the adaptive coefficient's lower bound"),
        help="Lower bound of the adaptive entropy coefficient (`use_adaptive_entropy`).",
    )
    entropy_coef_max: float = option(
        default=1.0,
        section=Section.LOSS,
        range=Interval(0, why="the adaptive coefficient's upper bound, at least entropy_coef_min"),
        help="Upper bound of the adaptive entropy coefficient (`use_adaptive_entropy`).",
    )
    entropy_coef_delta: float = option(
        default=0.005,
        section=Section.LOSS,
        range=Interval(0, open_low=True, why="the adaptive coefficient's change per optimizer step"),
        help="How much the adaptive entropy coefficient moves per optimizer step (`use_adaptive_entropy`).",
    )
    entropy_target: float = option(
        default=0.2,
        section=Section.LOSS,
        range=Interval(0, why="a mean per-token entropy in nats"),
        help="The mean per-token entropy (nats) adaptive control aims at: the bonus applies, and grows, while the "
        "entropy is at or below it. Language models start at about 1-10 nats, so the default 0.2 acts only near "
        "collapse; set it near the `entropy` logged early in a run.",
    )
    router_aux_loss_coef: float | None = option(
        default=None,
        section=Section.LOSS,
        range=Interval(0, why="the weight of the load-balancing loss; None takes the model's own"),
        help="Weight of a Mixture-of-Experts model's load-balancing loss (its `aux_loss`, Switch Transformer's), "
        "added to the GRPO loss. None (default) takes the model config's `router_aux_loss_coef` (0 for a dense "
        "model); 0.0 turns it off. An error when set on a model that is not MoE.",
    )
    num_iterations: int = option(
        default=1,
        section=Section.LOSS,
        range=Interval(1),
        help="Optimisation passes over each generation batch (mu in the GRPO paper).",
    )
    mask_truncated_completions: bool = option(
        default=False,
        section=Section.LOSS,
        help="Exclude completions that hit `max_completion_length` without EOS from the loss (DAPO).",
    )

    # ---- Generation on a vLLM server (docs/vllm.md) ----
    use_vllm: bool = option(
        default=False,
        section=Section.VLLM,
        help="Generate completions on a vLLM server started with `grpo vllm-serve` instead of with "
        "`model.generate`. The trainer pushes its weights to the server before each generation that follows an "
        "optimizer step.",
    )
    vllm_mode: str = option(
        default="server",
        section=Section.VLLM,
        help="How vLLM runs: 'server' (a separate `grpo vllm-serve` process the trainer pushes weights to) or "
        "'colocate' (a vLLM engine inside each training process, sharing its device; docs/vllm.md#colocate-mode).",
    )
    vllm_model_impl: str = option(
        default="vllm",
        section=Section.VLLM,
        help="The model implementation vLLM runs: 'vllm' (vLLM's own), 'transformers' (the transformers modeling "
        "code, for architectures vLLM lacks) or 'auto'. Colocate mode builds its engine with it ('transformers' is "
        "refused there: vLLM changes the transformers model class in place, breaking the policy's forward); server "
        "mode checks that `grpo vllm-serve` was started with the same `--model-impl` (TRL's name and default).",
    )
    vllm_structured_outputs_regex: str | None = option(
        default=None,
        section=Section.VLLM,
        help="Constrain every completion to match this regular expression (vLLM's structured outputs, guided "
        "decoding), on the server and in colocate mode; the engine ends a completion with EOS once the pattern "
        "is complete. None (default): unconstrained. Only with use_vllm=True.",
    )
    vllm_server_base_url: str | None = option(
        default=None,
        section=Section.VLLM,
        help="The server's base URL, e.g. 'http://10.0.0.5:8000'; when set, host and port are ignored.",
    )
    vllm_server_host: str = option(
        default="127.0.0.1",
        section=Section.VLLM,
        help="Host of the vLLM server (ignored when vllm_server_base_url is set).",
    )
    vllm_server_port: int = option(
        default=8000,
        section=Section.VLLM,
        range=Interval(1, 65535),
        help="Port of the vLLM server (ignored when vllm_server_base_url is set).",
    )
    vllm_server_timeout: float = option(
        default=240.0,
        section=Section.VLLM,
        range=Interval(0, open_low=True, why="seconds"),
        help="Seconds to keep retrying, with backoff, when the server does not answer (still starting, or "
        "gone) before failing with an error that says how to start it; also the weight-sync group's timeout.",
    )
    vllm_request_timeout: float = option(
        default=1800.0,
        section=Section.VLLM,
        range=Interval(0, open_low=True, why="seconds"),
        help="Seconds the server may take to answer one request it has accepted (a generation round, a weight "
        "update) before the run fails naming the server: a hung server cannot hang the trainer. Generous, since a "
        "round of many long completions takes minutes; raise it for longer rounds.",
    )
    vllm_group_port: int = option(
        default=51216,
        section=Section.VLLM,
        range=Interval(1, 65535),
        help="Port on the server's host for the weight-sync process group (any free port).",
    )
    vllm_sync_bucket_mb: float = option(
        default=256.0,
        section=Section.VLLM,
        range=Interval(0, open_low=True),
        help="Size of the buckets the weights are sent in, in MiB (one broadcast per bucket).",
    )
    vllm_gpu_memory_utilization: float = option(
        default=0.3,
        section=Section.VLLM,
        range=Interval(0, 1, open_low=True, why="the fraction of each GPU's memory vLLM takes"),
        help="Colocate mode: the fraction of each GPU's memory the engine takes for its weights and KV cache "
        "(the trainer keeps the rest). vLLM's CPU build ignores it and sizes its KV cache from "
        "VLLM_CPU_KVCACHE_SPACE (GiB). Server mode: pass --gpu-memory-utilization to `grpo vllm-serve` instead.",
    )
    vllm_tensor_parallel_size: int = option(
        default=1,
        section=Section.VLLM,
        range=Interval(1, 1, why="one engine per process is built; server mode for more"),
        help="Colocate mode: devices per engine. Only 1 is built (one engine per training process); for a "
        "model that needs tensor parallelism use server mode (`grpo vllm-serve --tensor-parallel-size N`).",
    )
    vllm_enable_sleep_mode: bool = option(
        default=False,
        section=Section.VLLM,
        help="Colocate mode: put the engine to sleep after each generation (weights offloaded to CPU memory, KV "
        "cache freed) and wake it before the next, so training gets that memory back. Needs a CUDA, ROCm or XPU "
        "build of vLLM; elsewhere (vLLM's CPU build) it is an error when the engine starts.",
    )
    vllm_max_model_length: int | None = option(
        default=None,
        section=Section.VLLM,
        range=Interval(1, why="prompt + completion tokens, or None for the model's own limit"),
        help="Colocate mode: the engine's context length (prompt + completion tokens), which bounds its KV "
        "cache per sequence; None takes the model's own limit. Server mode: --max-model-len.",
    )
    vllm_importance_sampling_correction: bool = option(
        default=True,
        section=Section.VLLM,
        help="Reweight each token's loss by the capped ratio of the trainer's and the sampler's probability of "
        "the sampled token (truncated importance sampling), correcting for their numerical mismatch (vLLM) and, "
        "under async_generation, for the older weights that sampled a stale round.",
    )
    vllm_importance_sampling_mode: str = option(
        default="token_truncate",
        section=Section.VLLM,
        help="'token_truncate' (min(ratio, cap) per token), 'token_mask' (0 above the cap), "
        "'sequence_truncate' or 'sequence_mask' (one ratio per completion: the product over its tokens).",
    )
    vllm_importance_sampling_clip_max: float | None = option(
        default=2.0,
        section=Section.VLLM,
        range=Interval(0, open_low=True, why="None: no upper bound"),
        help="The upper bound C of the importance-sampling ratio: '*_truncate' modes cap it at C, '*_mask' modes "
        "zero ratios above C (TRL's name; TRL's default is 3.0 with its 'sequence_mask' mode).",
    )
    vllm_importance_sampling_clip_min: float | None = option(
        default=None,
        section=Section.VLLM,
        range=Interval(0, why="None: no lower bound"),
        help="The lower bound c of the importance-sampling ratio: '*_truncate' modes raise it to c, '*_mask' modes "
        "zero ratios below c. None (default): no lower bound.",
    )
    vllm_importance_sampling_cap: float | None = option(
        default=None,
        section=Section.VLLM,
        range=Interval(0, open_low=True, why="deprecated: set vllm_importance_sampling_clip_max"),
        help="Deprecated name of vllm_importance_sampling_clip_max (as in TRL): when set, it becomes clip_max, with "
        "a FutureWarning.",
    )

    # ---- Asynchronous generation (docs/vllm.md#asynchronous-generation) ----
    async_generation: bool = option(
        default=False,
        section=Section.ASYNC,
        help="Generate and score the next round in a background thread while the trainer trains on the "
        "current one; the sampler gets the new weights after each optimizer step. Needs a sampler with weights of "
        "its own: vLLM (server or colocate), or without vLLM a copy of the policy that `model.generate` samples "
        "from (the weights' memory twice). Rounds lag the weights they train by at most `max_staleness` steps.",
    )
    max_staleness: int = option(
        default=1,
        section=Section.ASYNC,
        range=Interval(0, why="0 never lets generation run ahead (the synchronous updates)"),
        help="Async generation: the most optimizer steps by which the weights a round was sampled with may lag "
        "the weights that first train on it. 0 gives the synchronous updates (no overlap); 1 samples round k+1 "
        "while round k trains. A stale round trains against the sampler's log-probs as its behaviour policy "
        "(truncated importance sampling, `vllm_importance_sampling_*`).",
    )

    # ---- Tools and environments: multi-turn episodes (docs/agents.md) ----
    max_tool_calling_iterations: int | None = option(
        default=None,
        section=Section.AGENTS,
        range=Interval(0, why="0 offers the tools but never runs a call"),
        help="With tools or an environment_factory: the most tool turns in one episode (TRL's name); None: as many "
        "as the episode's token budget, max_completion_length (every policy turn and tool answer), allows.",
    )
    tool_timeout: float | None = option(
        default=60.0,
        section=Section.AGENTS,
        range=Interval(0, open_low=True, why="seconds one tool call may run"),
        help="Seconds one tool call may run; a call that takes longer is answered with an error (a sync tool's thread "
        "cannot be stopped and runs on in the background). None: no limit, so a hung tool stalls training.",
    )
    tool_errors: str = option(
        default="answer",
        section=Section.AGENTS,
        help="What a tool that raises or times out does: 'answer' gives the model 'Error: ...' as the tool's answer "
        "and counts it (tools/errors, tools/timeouts), 'raise' stops training naming the tool and the episode.",
    )
    tool_num_workers: int = option(
        default=32,
        section=Section.AGENTS,
        range=Interval(1),
        help="Synchronous tool calls running at once (threads); async tools run on one event loop.",
    )
    environment_group_seed: bool = option(
        default=False,
        section=Section.AGENTS,
        help="With an environment_factory: the G episodes of one prompt reset with one seed (`reset(seed=..., "
        "**row)`), made from the row and `seed`, so that they start from the same state and the group baseline "
        "compares like with like. Needs a `seed` argument (or **kwargs) on reset; refused when the rows have a "
        "`seed` column.",
    )
    tool_max_hung_calls: int = option(
        default=32,
        section=Section.AGENTS,
        range=Interval(1),
        help="Tool calls that may still be running past tool_timeout (in threads that cannot be stopped: a sync "
        "call's, or an event loop an async tool blocked); with that many, the next call stops training with an error "
        "naming the tools.",
    )
    tool_call_parser: str | None = option(
        default=None,
        section=Section.AGENTS,
        help="How tool calls are read from a policy turn: 'hermes' (<tool_call> JSON, Qwen and ChatML models) or "
        "'llama3_json'; None picks one from the chat template. A parser of your own: set trainer.agent.parser = f "
        "after building the trainer (docs/agents.md).",
    )
    agent_timeout: float = option(
        default=600.0,
        section=Section.AGENTS,
        range=Interval(0, open_low=True, why="seconds one run of agent_func may take"),
        help="With agent_func: seconds one episode (one call of the function, all its requests included) may run; "
        "past it the episode is a failure (see agent_failure_reward), its row named in a log line, and its later "
        "requests are refused (a sync function's thread cannot be stopped and runs on in the background).",
    )
    agent_failure_reward: float | None = option(
        default=None,
        section=Section.AGENTS,
        range=Interval(why="the reward every function gives a failed episode"),
        help="With agent_func: every reward of an episode whose function raised, timed out or returned something "
        "other than a dict or None. None (default): unscored, like a reward function's None (advantage 0); 0.0 "
        "counts a failure against the policy. The reward functions still run, and see the error in `agent_error`.",
    )

    # ---- Training on stored, scored completions (docs/offline.md) ----
    offline_completion_column: str = option(
        default="completion",
        section=Section.OFFLINE,
        help="A train_dataset with this column (one row per completion), or with this name plus 's' (one row "
        "per prompt, lists of completions), is trained on as it is, without generation: rows are grouped by "
        "prompt and scored by the stored reward (and the reward functions, if any). docs/offline.md.",
    )
    offline_reward_column: str = option(
        default="reward",
        section=Section.OFFLINE,
        help="The stored reward's column in offline data: a number per completion (a list per prompt in the "
        "per-prompt form). It counts as the first reward (weight 1, or reward_weights' first entry when that "
        "list has one more entry than there are reward functions).",
    )
    offline_logprobs_column: str | None = option(
        default=None,
        section=Section.OFFLINE,
        help="Offline data: a column of behaviour log-probs, one per completion token (the appended EOS "
        "included), from the policy that produced the data. They become pi_old, so the ratio is clipped against "
        "that policy. None: pi_old is the current policy (the ratio is 1, the update the plain policy gradient).",
    )
    offline_baseline: float | None = option(
        default=None,
        section=Section.OFFLINE,
        range=Interval(why="the reward a lone stored completion is compared with; None refuses such groups"),
        help="Offline data: a prompt with a single stored completion gets advantage reward - offline_baseline "
        "(unscaled). None makes such prompts an error, since alone in its group a completion's advantage is 0. "
        "Groups of two or more never use it.",
    )
    save_rollouts: bool = option(
        default=False,
        section=Section.OFFLINE,
        help="Append every training round's completions with their rewards to output_dir/rollouts.jsonl, in "
        "the form offline training reads back (prompt, completion, reward = the combined reward, rewards per "
        "function, truncated, step).",
    )

    # ---- Logging ----
    log_completions: bool = option(
        default=False,
        section=Section.LOGGING,
        help="Print a table of sampled completions with their rewards every `logging_steps`.",
    )
    num_completions_to_print: int | None = option(
        default=None,
        section=Section.LOGGING,
        range=Interval(0, why="None prints every row"),
        help="Rows of that table (None = all rows of the generation batch).",
    )
    log_unique_prompts: bool = option(
        default=False,
        section=Section.LOGGING,
        help="With log_completions: the printed completions table shows each prompt once (its first completion) "
        "rather than once per completion of its group; completions.jsonl keeps every row.",
    )
    log_multimodal: bool = option(
        default=True,
        section=Section.LOGGING,
        help="With log_completions and a data set with images: each prompt image is saved once, as PNG, to "
        "output_dir/completions_images/ (named by a hash of its pixels), and each completions.jsonl record lists "
        "its row's images by path; the table marks prompts with images. False logs the text only.",
    )
    log_completions_hub_repo: str | None = option(
        default=None,
        section=Section.LOGGING,
        help="With log_completions: a Hugging Face Hub data set repository ('user/name', 'org/name' or 'name' in "
        "your own namespace) that completions.jsonl is pushed to at every logged step. The repository is created "
        "if needed (private if hub_private_repo=True). The trainer fails when it is built if no Hub token is set "
        "or the Hub cannot be reached.",
    )
    learning_signal_warnings: bool = option(
        default=True,
        section=Section.LOGGING,
        help="Warn once, with the likely fix, when the logged metrics show for 3 logged steps in a row that nothing "
        "can be learned: every completion truncated, nearly every group's rewards tied, nearly every token's ratio "
        "clipped, or the entropy collapsed (docs/metrics.md#when-nothing-is-learned).",
    )

    # ---- Stopping and resuming ----
    preemption_timeout: float = option(
        default=60.0,
        section=Section.STOPS,
        range=Interval(0, open_low=True, why="seconds"),
        help="Seconds a run may take, after a SIGTERM (a scheduler's or a spot instance's notice), to finish its "
        "optimizer step and write a checkpoint there before it stops at once without one; a second SIGTERM also "
        "stops it at once. Set it below the time your scheduler allows between SIGTERM and SIGKILL "
        "(docs/reliability.md#preemption).",
    )

    @property
    def micro_steps_per_round(self) -> int:
        """The micro-steps one generation round feeds: its `steps_per_generation` micro-batches, `num_iterations`
        times. The sampler repeats each round this often, the trainer makes a round at every multiple of it."""
        return self.steps_per_generation * self.num_iterations

    @property
    def eval_generations(self) -> int:
        """Completions per prompt in evaluation: `num_generations_eval`, or `num_generations` when it is None."""
        return self.num_generations_eval or self.num_generations

    def generations(self, mode: str) -> int:
        """G of a round: `num_generations` in training ("train"), `eval_generations` in evaluation ("eval")."""
        return self.eval_generations if mode == "eval" else self.num_generations

    @property
    def sequence_parallel_size(self) -> int:
        """The processes that split each sequence: accelerate's sp_size (`parallelism_config`, or an accelerate
        config's parallelism_config section); 1 without sequence parallelism (grpo/objective/sequence_parallel.py)."""
        return parallel_sizes(self)[0]

    @property
    def eval_name(self) -> str:
        """The field `eval_generations` comes from, for error messages."""
        return "num_generations" if self.num_generations_eval is None else "num_generations_eval"

    @classmethod
    def for_model(cls, model) -> GRPOConfig:
        """The default config for `model` (a path, hub id or loaded model): every default, output in
        `<model name>-GRPO`."""
        name = model if isinstance(model, str) else model.config._name_or_path
        return cls(output_dir=f"{str(name).rstrip('/').split('/')[-1] or 'model'}-GRPO")

    def __post_init__(self):
        if self.bf16 is None:
            gpu = torch.cuda.is_available() and not self.use_cpu
            self.bf16 = bool(gpu and torch.cuda.is_bf16_supported()) and not self.fp16
        if isinstance(self.scale_rewards, bool):
            self.scale_rewards = "group" if self.scale_rewards else "none"
        if self.dataloader_pin_memory and not torch.cuda.is_available():
            self.dataloader_pin_memory = False  # pinned memory only speeds copies to a GPU; on CPU torch warns
        self._check_fields()  # before TrainingArguments', which fails deep inside on a string or a NaN
        super().__post_init__()
        check_inherited_fields(self)  # TrainingArguments fields this trainer would otherwise ignore
        self._check_launch()
        self._check_values()
        self._check_rendering_and_logging()
        check_continuous_batching(self)  # the generation stage's checks (grpo/generation/settings.py)
        check_vllm_engine(self)
        self._resolve_sampling_cap()
        settings = self.stage_settings()  # the objective's checks run as its settings are built
        self._check_steps_and_prompts()
        self._resolve_generation_batch(settings.loss.spans_the_step)

    def _check_fields(self):
        """Type, finiteness and range of every field in `field_kinds()`: an int field takes only integers, a float
        field any finite real number, a bool field only True or False."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, (kind, optional) in field_kinds().items():
            value = getattr(self, name)
            if value is None and optional:
                continue
            interval = numeric_ranges().get(name, Interval())
            valid = f"{_type_name(kind)}{'' if kind is bool else ' ' + str(interval)}{', or None' if optional else ''}"
            well_typed = isinstance(value, bool) if kind is bool else isinstance(value, numbers.Real)
            if kind is int:
                well_typed = isinstance(value, numbers.Integral) and not isinstance(value, bool)
            elif kind is float:
                well_typed = well_typed and not isinstance(value, bool)
            if not well_typed:
                raise TypeError(
                    f"{name}={value!r} ({type(value).__name__}) must be {valid}. Pass a plain {kind.__name__} "
                    f"without quotes{' or decimal point' if kind is int else ''}, e.g. {name}={defaults[name]!r}."
                )
            if kind is bool:
                continue
            if not math.isfinite(value):
                raise ValueError(
                    f"{name}={value!r} is not a finite number; {name} must be {valid}. Set a finite value, e.g. the "
                    f"default {name}={defaults[name]!r}."
                )
            if value not in interval:
                raise ValueError(
                    f"{name}={value!r} must be {interval}{', or None' if optional else ''}"
                    f"{': ' + interval.why if interval.why else ''}."
                )

    def stage_settings(self) -> ObjectiveSettings:
        """The objective's settings as typed values (grpo/objective/settings.py: advantages, log-probs, the loss),
        built from the fields as they are now; each refuses what its stage cannot run with. `__post_init__` builds
        them once, so every such check runs when the config is built; the trainer builds them again from the config
        it is given."""
        return objective_settings(self)

    def _check_values(self):
        """Choices among strings, and what depends on more than one field (numbers alone: `_check_fields`; the
        objective's own: `stage_settings`)."""
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if (self.sync_ref_model or self.ref_model_reset_steps is not None) and self.beta == 0:
            setting = (
                "sync_ref_model=True" if self.sync_ref_model else f"ref_model_reset_steps={self.ref_model_reset_steps}"
            )
            raise ValueError(
                f"{setting} moves the reference model, but beta=0 means there is none (no KL term). Set beta > 0 "
                "(e.g. 0.04), or leave the reference alone."
            )
        if self.sync_ref_model and self.ref_model_reset_steps is not None:
            raise ValueError(
                "sync_ref_model=True (soft updates) and ref_model_reset_steps (hard resets) both move the reference; "
                "pick one."
            )
        check_generation_kwargs(self)
        if self.remove_unused_columns:
            raise ValueError(
                "remove_unused_columns=True would drop the 'prompt' column and the columns reward functions read; "
                "GRPO needs them. Leave it False."
            )
        if self.reward_errors not in REWARD_ERRORS:
            raise ValueError(
                f"reward_errors={self.reward_errors!r} is not one of {REWARD_ERRORS}: 'raise' stops on a failing reward "
                "function, 'skip' gives the failed rows None and continues."
            )
        if self.nonfinite not in ("error", "skip"):
            raise ValueError(
                f"nonfinite={self.nonfinite!r} is not one of ('error', 'skip'): 'error' stops training at a non-finite "
                "reward, loss or gradient, 'skip' skips that reward row or optimizer step and counts it."
            )
        if self.tool_errors not in ("answer", "raise"):
            raise ValueError(
                f"tool_errors={self.tool_errors!r} is not one of ('answer', 'raise'): 'answer' gives the model the "
                "error as the tool's answer and counts it, 'raise' stops training."
            )
        if self.reward_worker_type not in REWARD_WORKER_TYPES:
            raise ValueError(f"reward_worker_type={self.reward_worker_type!r} is not one of {REWARD_WORKER_TYPES}.")
        if self.vllm_mode not in ("server", "colocate"):
            raise ValueError(
                f"vllm_mode={self.vllm_mode!r} is not one of ('server', 'colocate'): 'server' generates on a "
                "`grpo vllm-serve` process, 'colocate' on a vLLM engine inside each training process (docs/vllm.md)."
            )
        self._check_async()
        if self.reward_weights is not None:
            if not isinstance(self.reward_weights, (list, tuple)):
                raise TypeError(
                    f"reward_weights={self.reward_weights!r} must be a list with one number per reward function, "
                    "e.g. [1.0, 0.5]."
                )
            for i, w in enumerate(self.reward_weights):
                if not isinstance(w, numbers.Real) or isinstance(w, bool) or not math.isfinite(w):
                    raise ValueError(
                        f"reward_weights[{i}]={w!r} must be a finite number (not a string, NaN or infinity, which "
                        "would make every row's total reward useless). Give one finite weight per reward function, "
                        "e.g. reward_weights=[1.0, 0.5]."
                    )

    def _check_steps_and_prompts(self):
        """A learning rate no fine-tuning run means, a temperature at which nothing is learned (a warning), and the
        side long prompts are cut on."""
        if self.max_steps == 0:  # transformers reads 0 as "not set" and trains for num_train_epochs instead
            raise ValueError(
                "max_steps=0 would train for num_train_epochs instead of not at all. Give a positive number of "
                "steps, or max_steps=-1 (the default) to train for num_train_epochs."
            )
        if self.learning_rate > MAX_LEARNING_RATE and not self.allow_large_learning_rate:
            raise ValueError(
                f"learning_rate={self.learning_rate!r} is above {MAX_LEARNING_RATE:g}: fine-tuning uses 1e-6 to 1e-4, "
                "and Adam moves each weight by about the learning rate per step. Fix its exponent (e.g. 1e-5), or set "
                "allow_large_learning_rate=True if you mean it."
            )
        if self.temperature < MIN_USEFUL_TEMPERATURE:
            warnings.warn(
                f"temperature={self.temperature!r} is below {MIN_USEFUL_TEMPERATURE:g}: sampling is then close to "
                f"greedy, so the {self.num_generations} completions of a group come out identical, their rewards tie, "
                "every advantage is 0 and nothing is learned (frac_reward_zero_std near 1). GRPO learns from the "
                "differences within a group: use a temperature of 0.6 to 1.0 (the default is 1.0).",
                stacklevel=4,
            )
        if self.truncation_side not in TRUNCATION_SIDES:
            raise ValueError(
                f"truncation_side={self.truncation_side!r} is not one of {TRUNCATION_SIDES}: 'left' keeps the end of "
                "a long string prompt, 'right' keeps its start."
            )

    def _resolve_sampling_cap(self):
        """The old `vllm_importance_sampling_cap` fills TRL's `vllm_importance_sampling_clip_max` (the bounds
        themselves are checked by `SamplingCorrection`, grpo/objective/settings.py)."""
        if self.vllm_importance_sampling_cap is not None:
            warnings.warn(
                f"vllm_importance_sampling_cap={self.vllm_importance_sampling_cap} is deprecated: it is used as "
                "vllm_importance_sampling_clip_max, TRL's name for the upper bound. Set that instead.",
                FutureWarning,
                stacklevel=4,  # the GRPOConfig(...) call
            )
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap

    def _check_rendering_and_logging(self):
        """The fields TRL 1.16 has for chat templates, padding, the KV cache and the completions log: strings from a
        command line read as TRL reads them, `pad_to_multiple_of="auto"` resolved for the device, wrong values
        refused."""
        kwargs = self.chat_template_kwargs
        if isinstance(kwargs, str):  # a command line passes the dict as JSON, as TRL's does
            try:
                kwargs = self.chat_template_kwargs = json.loads(kwargs)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"chat_template_kwargs={kwargs!r} is not JSON ({e}); give a dict, e.g. "
                    "chat_template_kwargs='{\"enable_thinking\": false}' on a command line."
                ) from None
        if kwargs is not None and (not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs)):
            raise TypeError(
                f"chat_template_kwargs={kwargs!r} must be a dict of keyword arguments for apply_chat_template, e.g. "
                "{'enable_thinking': False}, or None."
            )
        taken = sorted(set(kwargs or ()) & set(CHAT_TEMPLATE_OWN_KWARGS))
        if taken:
            raise ValueError(
                f"chat_template_kwargs sets {taken}, which the trainer passes to apply_chat_template itself (it "
                "renders text, adds the generation prompt or continues a prefilled assistant message, and passes "
                "the tools of an episode). Remove them; chat_template_kwargs is for the template's own variables, "
                "such as enable_thinking."
            )
        self._resolve_pad_to_multiple_of()
        cache = self.cache_implementation
        if cache is not None:
            if cache not in ALL_CACHE_IMPLEMENTATIONS:
                raise ValueError(
                    f"cache_implementation={cache!r} is not a cache `model.generate` knows; use one of "
                    f"{list(ALL_CACHE_IMPLEMENTATIONS)}, or None for the model's default."
                )
            if self.use_vllm:
                raise ValueError(
                    f"cache_implementation={cache!r} sets the KV cache of `model.generate`, but use_vllm=True "
                    "generates with vLLM, which manages its own cache. Remove cache_implementation."
                )
            if "cache_implementation" in (self.generation_kwargs or {}):
                raise ValueError(
                    "cache_implementation is set both as a field and in generation_kwargs; keep one (the field)."
                )
        for name in ("log_unique_prompts", "log_completions_hub_repo"):
            if getattr(self, name) not in (None, False) and not self.log_completions:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} shapes the completions log, which is off (log_completions="
                    "False). Set log_completions=True, or remove it."
                )
        repo = self.log_completions_hub_repo
        if repo is not None and (not isinstance(repo, str) or not HUB_REPO_ID.fullmatch(repo)):
            raise ValueError(
                f"log_completions_hub_repo={repo!r} is not a Hub repository id: give 'name', 'user/name' or "
                "'org/name' (letters, digits, '-', '_', '.')."
            )

    def _resolve_pad_to_multiple_of(self):
        """`pad_to_multiple_of`: a positive int or None; "auto" is 128 on a Neuron device, where every new shape
        is compiled, and None elsewhere (TRL's rule); "none", "null" and digits from a command line as TRL reads
        them."""
        value = self.pad_to_multiple_of
        if isinstance(value, str) and value != "auto":
            if value.lower() in ("none", "null"):
                value = None
            elif value.strip().isdigit():
                value = int(value)
        if value == "auto":
            value = 128 if self.device.type == "neuron" else None
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(
                f"pad_to_multiple_of={self.pad_to_multiple_of!r} must be a positive number of tokens, 'auto' (128 "
                "on AWS Trainium, else no padding) or None."
            )
        self.pad_to_multiple_of = value

    def _check_launch(self):
        """A process that a launcher started as one of several (`WORLD_SIZE` > 1) but that would train alone: every
        process of the launch would train its own copy of the run into one `output_dir`, each overwriting the
        others' checkpoints. `accelerate launch` on a machine without GPUs does that unless CPU training is asked
        for."""
        try:
            launched = int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:  # not a count: the launcher's own error says more
            return
        if launched > 1 and self.world_size == 1:
            raise ValueError(
                f"This process is one of {launched} that a launcher started (WORLD_SIZE={launched}), but it would "
                f"train alone: no GPU was found and CPU training across processes was not asked for, so each of the "
                f"{launched} processes would train its own copy of the run into the same output_dir. On a machine "
                f"without GPUs, launch with ACCELERATE_USE_CPU=1 (ACCELERATE_USE_CPU=1 accelerate launch "
                f"--num_processes {launched} ...) or set use_cpu=True (recipes: use_cpu: true); to train in one "
                "process, run without the launcher."
            )

    def _check_async(self):
        """What asynchronous generation cannot combine with."""
        if not self.async_generation:
            return
        if self.dynamic_sampling:
            raise ValueError(
                "async_generation=True and dynamic_sampling=True: dynamic sampling decides which extra rounds to "
                "generate from the rewards of the current one, which a producer running ahead has not seen. Turn one "
                "of them off."
            )
        if self.max_staleness > 0 and not self.vllm_importance_sampling_correction:
            raise ValueError(
                f"async_generation=True with max_staleness={self.max_staleness} trains on rounds sampled by older "
                "weights, which is correct only with the truncated importance-sampling correction (the sampler's "
                "log-probs as the behaviour policy). Set vllm_importance_sampling_correction=True, or "
                "max_staleness=0."
            )

    def _resolve_generation_batch(self, spans_the_step: bool):
        """Resolve `generation_batch_size` from `steps_per_generation` or the other way round, then check that a
        generation round splits into whole micro-batches on every process and holds whole groups (and, where the
        loss type normalises over the whole optimizer step, `spans_the_step`, covers whole optimizer steps). Under
        sequence parallelism the processes of a group train the same rows, each generating 1/sp_size of them."""
        sp_size = self.sequence_parallel_size
        # Rows of one micro-step, all processes (a sequence-parallel group trains one micro-batch).
        rows_per_step = self.per_device_train_batch_size * self.world_size // sp_size
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            raise ValueError(
                "Set generation_batch_size or steps_per_generation, not both: each determines the other "
                f"(generation_batch_size = per_device_train_batch_size x processes x steps_per_generation = "
                f"{rows_per_step} x steps_per_generation)."
            )
        if self.generation_batch_size is None:
            if self.steps_per_generation is None:
                self.steps_per_generation = self.gradient_accumulation_steps
            self.generation_batch_size = rows_per_step * self.steps_per_generation
        else:
            if self.generation_batch_size < 1 or self.generation_batch_size % rows_per_step != 0:
                raise ValueError(
                    f"generation_batch_size={self.generation_batch_size} must be a positive multiple of "
                    f"per_device_train_batch_size x processes = {rows_per_step}, so that a generation round splits "
                    "into whole micro-batches."
                )
            self.steps_per_generation = self.generation_batch_size // rows_per_step
        if (self.per_device_train_batch_size * self.steps_per_generation) % sp_size != 0:
            raise ValueError(
                f"sp_size={sp_size}: each process of a sequence-parallel group generates its share of the group's "
                f"rows of a round, per_device_train_batch_size x steps_per_generation / sp_size = "
                f"{self.per_device_train_batch_size} x {self.steps_per_generation} / {sp_size}, which must be a whole "
                "number. Raise per_device_train_batch_size or steps_per_generation."
            )
        if self.generation_batch_size % self.num_generations != 0:
            raise ValueError(
                f"generation_batch_size={self.generation_batch_size} (per_device_train_batch_size x processes x "
                f"steps_per_generation) is not a multiple of num_generations={self.num_generations}: every generation "
                "round must hold whole groups. Change num_generations, per_device_train_batch_size or "
                "gradient_accumulation_steps / steps_per_generation."
            )
        if spans_the_step and self.steps_per_generation % self.gradient_accumulation_steps != 0:
            raise ValueError(
                f"loss_type={self.loss_type!r} with steps_per_generation={self.steps_per_generation} and "
                f"gradient_accumulation_steps={self.gradient_accumulation_steps}: {self.loss_type} divides by the "
                "number of loss tokens of the whole optimizer step, which must be known at its first micro-step, so "
                "one generation round must cover whole optimizer steps. Make steps_per_generation a multiple of "
                "gradient_accumulation_steps (the default sets them equal)."
            )
        if self.eval_strategy != "no":
            eval_rows = self.per_device_eval_batch_size * self.world_size
            if eval_rows % self.eval_generations != 0:
                raise ValueError(
                    f"per_device_eval_batch_size x processes = {eval_rows} is not a multiple of {self.eval_name}="
                    f"{self.eval_generations}: each evaluation batch must hold whole groups. Change "
                    f"per_device_eval_batch_size or {self.eval_name}."
                )
