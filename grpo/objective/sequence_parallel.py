"""Sequence parallelism: each row's sequence split across the processes of a group, through DeepSpeed's Ulysses
attention (`UlyssesSPAttentionHF`, which accelerate's `ParallelismConfig(sp_size=N, sp_backend="deepspeed")` wires
into a DeepSpeed run). docs/distributed.md, "Sequence parallelism".

What a group of N processes does (N = `sp_size`):

- Rounds are generated and scored as in data parallelism: each process samples its own 1/N of the group's rows
  (generation is never repeated). Once the advantages are known, the group pools its rows (`Rollout.pooled`): from
  then on every process of the group holds the same micro-batches, of `per_device_train_batch_size` rows.
- Every log-prob pass (policy, pi_old, pi_ref) lays each row out whole and unpadded on the left, its prompt's real
  tokens then its completion, right-padded to a common width L, a multiple of N (`SequenceShards`), with positions
  0 .. L-1: causal attention then needs no mask, which Ulysses cannot take (it drops 4D masks). Process r runs the
  model on columns [r L/N, (r+1) L/N) of every row; inside each attention layer DeepSpeed's all-to-all trades
  those sequence shards for head shards, so each process attends over whole sequences with 1/N of the heads.
- Process r projects the hidden states of its columns that predict completion tokens (the chunked projection, as
  without sequence parallelism) and the group sums its (B, T) pieces (`SequenceShards.combine`): every process then
  holds every row's log-probs and computes the same loss, with the token counts of whole sequences.
- The sum's backward passes each process the gradient of its own pieces only (every process holds the same loss:
  the sum of their gradients would count it N times). DeepSpeed adds the gradients of all processes and divides by
  the number of data-parallel groups under ZeRO-1/2, or by the number of processes under ZeRO-3, which the
  backward makes up for (`gradient_factor`): the update equals one process's on the same rows.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from transformers import TrainerCallback

# The keyword that carries a forward's Ulysses attention from the model's call to its attention layers
# (transformers passes the forward's extra keywords down to the attention function).
ULYSSES_KEYWORD = "grpo_ulysses_attention"
# Attention implementations Ulysses can wrap: they take no 4D mask, or are causal without one.
ULYSSES_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")


def parallel_sizes(args) -> tuple[int, int]:
    """(sp_size, cp_size) of a run: `args.parallelism_config` (accelerate's `ParallelismConfig`), else an
    accelerate config's `parallelism_config` section, which `accelerate launch` passes to the processes as
    ACCELERATE_USE_PARALLELISM_CONFIG and PARALLELISM_CONFIG_* variables; (1, 1) without either."""
    config = getattr(args, "parallelism_config", None)
    if config is not None:
        return int(config.sp_size or 1), int(config.cp_size or 1)
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return 1, 1
    return int(os.environ.get("PARALLELISM_CONFIG_SP_SIZE", "1")), int(
        os.environ.get("PARALLELISM_CONFIG_CP_SIZE", "1")
    )


def check_config(args, sp_size: int, cp_size: int) -> None:
    """Refuse the settings sequence parallelism cannot run with (GRPOConfig calls it when sp_size or cp_size > 1)."""
    if cp_size > 1:
        raise ValueError(
            f"cp_size={cp_size}: GRPOTrainer does not run torch's context parallelism (its ring attention replaces "
            "only CUDA's flash, efficient and cuDNN attention kernels, and accelerate runs it under FSDP2 only). "
            "Split long sequences with DeepSpeed's Ulysses instead: sp_size, sp_backend='deepspeed' under a "
            "DeepSpeed config (examples/accelerate_configs/deepspeed_ulysses.yaml)."
        )
    if args.padding_free:
        raise ValueError(
            f"padding_free=True with sp_size={sp_size}: a packed row needs a mask between its sequences, which "
            "Ulysses drops. Set padding_free=False (each row is laid out whole, unpadded on the left, instead)."
        )
    if args.top_entropy_quantile < 1.0:
        raise ValueError(
            f"top_entropy_quantile={args.top_entropy_quantile} with sp_size={sp_size}: its threshold is a quantile "
            "over every process's tokens, and the processes of a group hold the same tokens, each counted sp_size "
            "times. Set top_entropy_quantile=1.0."
        )
    if args.world_size % sp_size != 0:
        raise ValueError(
            f"sp_size={sp_size} must divide the number of processes ({args.world_size}): each group of sp_size "
            "processes splits the same sequences. Launch a multiple of sp_size processes."
        )


def check_model(model, sp_size: int, router_coef: float) -> None:
    """Refuse a model Ulysses cannot split: an attention implementation it cannot wrap, a layer that attends over
    anything but the whole causal prefix (sliding windows, chunks, recurrent states), a router loss (each process's
    covers only its shard), and a head count the group does not divide."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    attention = getattr(model.config, "_attn_implementation", None) or "eager"
    if attention not in ULYSSES_ATTENTION and "/" not in attention:  # "org/kernel": a hub flash-attention kernel
        raise ValueError(
            f"Sequence parallelism splits each sequence with DeepSpeed's Ulysses attention, which wraps sdpa or "
            f"flash attention, but the model runs attn_implementation={attention!r}. Load it with "
            "model_init_kwargs={'attn_implementation': 'sdpa'} (or flash_attention_2), and set the same "
            "parallelism_config_sp_attn_implementation in the accelerate config."
        )
    kinds = set(getattr(config, "layer_types", None) or ()) - {"full_attention"}
    windowed = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if kinds or windowed or getattr(config, "attention_chunk_size", None) is not None:
        raise ValueError(
            "Sequence parallelism needs full causal attention in every layer: Ulysses drops the masks that "
            f"sliding-window, chunked or linear-attention layers build ({sorted(kinds) or 'windowed attention'}). "
            "Train this model without sp_size."
        )
    if router_coef != 0.0:
        raise ValueError(
            f"router_aux_loss_coef={router_coef}: under sequence parallelism each process's router loss covers "
            "only its shard of the tokens. Set router_aux_loss_coef=0.0."
        )
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or 1
    if heads % sp_size != 0 or (kv_heads % sp_size != 0 and sp_size % kv_heads != 0):
        raise ValueError(
            f"sp_size={sp_size} must divide the model's {heads} attention heads, and divide or be a multiple of its "
            f"{kv_heads} key/value heads: Ulysses gives each process of a group 1/sp_size of the heads. Use an "
            "sp_size that does."
        )


def gradient_factor(deepspeed_config: dict, sp_size: int) -> int:
    """What a process's gradient is multiplied by so that DeepSpeed's reduction gives one process's update.

    DeepSpeed 0.19 adds the gradients of every process of the run; ZeRO-0/1/2 divide the sum by the data-parallel
    groups (processes / sp_size), which is the mean over groups: 1. ZeRO-3's reduce-scatter divides it by every
    process instead (`reduce_scatter_coalesced`), sp_size times more: sp_size. Under ZeRO-3 without reduce_scatter
    the divisor depends on each bucket's size (its contiguous all-reduce divides as ZeRO-2 does), so it is refused."""
    zero = deepspeed_config.get("zero_optimization", {})
    if zero.get("stage", 0) != 3:
        return 1
    if not zero.get("reduce_scatter", True):
        raise ValueError(
            "Sequence parallelism under ZeRO-3 with reduce_scatter: false: DeepSpeed then divides some gradient "
            "buckets by the processes and others by the data-parallel groups. Remove reduce_scatter: false."
        )
    return sp_size


class _SumOverGroup(torch.autograd.Function):
    """Forward: the sum of every group process's tensor (their pieces are disjoint, so the sum is exact). Backward:
    the gradient times `factor` (`gradient_factor`). Every process computes the same loss from the sum, so each
    process's own pieces get the loss's gradient once, from itself; summing the group's gradients would count it
    once per process."""

    @staticmethod
    def forward(ctx, tensor, group, factor):
        ctx.factor = factor
        total = tensor.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad if ctx.factor == 1 else grad * ctx.factor, None, None


class SequenceShards:
    """One pass's batch in the sequence-parallel layout (module docstring), seen from process `rank` of `size`.

    Row i holds its p_i real prompt tokens then its T completion columns, from column 0, and padding up to L (a
    multiple of `size`); position ids 0 .. L-1. Column j predicts column j + 1, so completion token t of row i is
    predicted at column p_i - 1 + t. This process holds columns [rank w, (rank + 1) w), w = L / size.

    input_ids, position_ids: (B, w), this process's columns. completion_mask: (B, T) bool, the completion tokens
    predicted in this process's columns. predicting: (N,) their columns' indices in the flattened (B * w), in
    row-major order of `completion_mask`. completions_from: 1 (any column may predict), as in `GroupedLayout`."""

    completions_from = 1

    def __init__(self, prompt_ids, prompt_mask, completion_ids, completion_mask, parallel, multiple_of=None):
        rows, prompt_width = prompt_ids.shape
        completion_width = completion_ids.shape[1]
        lengths = prompt_mask.sum(dim=1)  # (B,) p_i
        if bool((lengths == 0).any()):
            raise ValueError("Every row needs a prompt token: its first completion token is predicted there.")
        step = parallel.size * (multiple_of or 1)
        full = -(-(int(lengths.max()) + completion_width) // step) * step  # L
        width = full // parallel.size
        device = prompt_ids.device
        columns = torch.arange(full, device=device)  # (L,)
        # Column j of row i is column P - p_i + j of [prompt | completion]: the left padding removed.
        source = (prompt_width - lengths)[:, None] + columns  # (B, L)
        joined = torch.cat([prompt_ids, completion_ids], dim=1)
        real = source < prompt_width + completion_width
        ids = joined.gather(1, source.clamp(max=prompt_width + completion_width - 1)).masked_fill(~real, 0)
        start = parallel.rank * width
        self.input_ids = ids[:, start : start + width]  # (B, w)
        self.position_ids = columns[start : start + width].expand(rows, width)  # (B, w)
        at = lengths[:, None] - 1 + torch.arange(completion_width, device=device)  # (B, T) predicting column
        self.completion_mask = completion_mask.bool() & (at >= start) & (at < start + width)
        row = torch.arange(rows, device=device)[:, None].expand_as(at)
        self.predicting = (row * width + at - start)[self.completion_mask]  # (N,)
        self.parallel = parallel

    def model_inputs(self, language_model) -> dict:
        """The forward's inputs: this process's columns, their positions, and the Ulysses attention that joins the
        group's columns inside every attention layer (no attention mask: causal over whole rows)."""
        attention = self.parallel.attention(self.input_ids.shape[0], language_model.config)
        install(language_model.config._attn_implementation)  # after accelerate's, which prepare may have put back
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, ULYSSES_KEYWORD: attention}

    def combine(self, values: torch.Tensor | None) -> torch.Tensor | None:
        """(B, T) values of this process's completion tokens (0 elsewhere) -> every row's, on every process."""
        return None if values is None else _SumOverGroup.apply(values, self.parallel.group, self.parallel.factor)


class SequenceParallel(TrainerCallback):
    """The sequence-parallel group of this process, of `size` processes: DeepSpeed's (`parallel_state_sp`, which
    accelerate creates as it prepares the model), looked up at first use. As a callback, it takes the attention
    implementation back from accelerate's wrapper once the model is prepared (`install`), before the first sample."""

    def __init__(self, size: int):
        self.size = size
        self._attention = {}  # batch size -> UlyssesSPAttentionHF

    @property
    def group(self):
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        try:
            group = parallel_state_sp.get_sequence_parallel_group()
        except AssertionError:
            group = None
        if group is None or dist.get_world_size(group) != self.size:
            raise RuntimeError(
                f"sp_size={self.size}, but DeepSpeed has no sequence-parallel group of that size: accelerate creates "
                "it when it prepares the model under a DeepSpeed config with parallelism_config_sp_size "
                "(examples/accelerate_configs/deepspeed_ulysses.yaml)."
            )
        return group

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        install(model.config._attn_implementation)

    @property
    def factor(self) -> int:
        """`gradient_factor` of this run's DeepSpeed configuration."""
        from accelerate.state import AcceleratorState

        return gradient_factor(AcceleratorState().deepspeed_plugin.deepspeed_config, self.size)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def gather_objects(self, value) -> list:
        """Every group process's `value` (picklable), in group rank order."""
        everyone = [None] * self.size
        dist.all_gather_object(everyone, value, group=self.group)
        return everyone

    def attention(self, batch_size: int, config):
        """DeepSpeed's Ulysses attention for `batch_size` rows of a model with `config`, around the model's own
        attention function; the attention layers call it where a forward passes it (`install`)."""
        if batch_size not in self._attention:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF
            from transformers.modeling_utils import AttentionInterface

            core = config._attn_implementation
            text = config.get_text_config()
            self._attention[batch_size] = UlyssesSPAttentionHF(
                attn=AttentionInterface._global_mapping[core],
                batch_size=batch_size,
                attn_head_count=text.num_attention_heads,
                attn_head_size=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
                kv_head_count=text.num_key_value_heads,
                num_hidden_layers=text.num_hidden_layers,
                process_group=self.group,
                seq_length_is_variable=True,
            )
            self._attention[batch_size].core_attn_implementation = core
        return self._attention[batch_size]


def install(core: str) -> None:
    """Make attention implementation `core` sequence-parallel where a forward asks for it (`ULYSSES_KEYWORD`) and
    plain everywhere else. accelerate, preparing a DeepSpeed model with sp_size > 1, registers DeepSpeed's own
    wrapper under the same name, which splits every training-mode call and no evaluation-mode one; here the
    reference model's passes (evaluation mode) are split too, and sampling, reward models and any other call of the
    implementation are not."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    if getattr(ALL_ATTENTION_FUNCTIONS.get(core), "grpo_gated", False):
        return
    plain = AttentionInterface._global_mapping[core]

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        ulysses = kwargs.pop(ULYSSES_KEYWORD, None)
        if ulysses is None:
            return plain(module, query, key, value, attention_mask, *args, **kwargs)
        groups = getattr(module, "num_key_value_groups", None)
        try:
            return ulysses(module, query, key, value, None, *args, **kwargs)
        finally:  # Ulysses rewrites it when it replicates key/value heads; a plain call after must see the model's
            if groups is not None:
                module.num_key_value_groups = groups

    attention.grpo_gated = True
    ALL_ATTENTION_FUNCTIONS[core] = attention
