"""Each group's prompt computed once in a log-prob pass: the grouped layout and its attention mask.

A GRPO micro-batch holds G completions of each prompt, the G copies of the prompt in consecutive rows. The plain
padded forward runs every copy again: B x (P + T) tokens. Here the batch is rearranged into one row per run of
identical prompts, the prompt once followed by its completions packed one after another,

    row u:  [pad.. q_u | o_1[:-1] | o_2[:-1] | ... | o_k[:-1] | pad..]      U rows of L = P + max_u sum_i (|o_i| - 1)

and the model runs once on it, with position ids that restart at the prompt's length in every completion and a 4D
attention mask under which a completion token sees its prompt and the earlier tokens of its own completion, nothing
else. Each token then attends to exactly the keys, at exactly the positions, of the plain forward, so every hidden
state that predicts a completion token is the one the plain forward computes, up to float rounding (the order of
the sums changes; tests/test_shared_prompt.py). The prompt's last position predicts token 0 of every completion of
the run; position t of a completion predicts its token t + 1, so a completion's last token is never fed.

One forward call of the (wrapped) model per pass, as the plain path: DDP, DeepSpeed, FSDP2 and gradient
checkpointing see nothing unusual. In the backward the prompt's activations receive the sum of the gradients of
every completion that reads them, which is what the G copies of the plain forward receive one by one.

The mask comes from transformers' own mask builder for the model's attention implementation
(`ALL_MASK_ATTENTION_FUNCTIONS`: boolean for sdpa, additive for eager, a BlockMask for flex attention), which the
models' `create_causal_mask` passes through untouched when it is already 4D. `unsupported_reason` says where that
cannot hold: flash attention takes no 4D mask, and a sliding-window, chunked or linear-attention layer would be
given a full causal mask instead of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from grpo.objective.regularizers import router_aux_coef
from grpo.objective.sequence_parallel import check_model

logger = logging.getLogger(__name__)


def prompt_groups(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[list[int], list[int]]:
    """Runs of consecutive identical rows of (prompt_ids, prompt_mask), (B, P): each run's first row and its length.

    Rows [a, a, b, b, b, a] -> ([0, 2, 5], [2, 3, 1])."""
    same = (prompt_ids[1:] == prompt_ids[:-1]).all(1) & (prompt_mask[1:] == prompt_mask[:-1]).all(1)  # (B - 1,)
    firsts = [0] + (torch.nonzero(~same).flatten() + 1).tolist()
    counts = [b - a for a, b in zip(firsts, firsts[1:] + [prompt_ids.shape[0]])]
    return firsts, counts


def unsupported_reason(model) -> str | None:
    """Why the grouped layout cannot serve this causal LM, or None when it can. Read from its config only.

    - flash attention (and any implementation without a mask builder) takes no 4D mask: its variable-length kernels
      see sequences, not which keys each query may read;
    - sliding-window, chunked and linear-attention layers build their own masks (or states), which a ready 4D mask
      would replace by the full causal one;
    - models whose cache is not per-layer keys and values (recurrent layers) have no attention to mask."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    attention = getattr(model.config, "_attn_implementation", None) or "eager"
    if attention.startswith("flash_attention") or attention not in ALL_MASK_ATTENTION_FUNCTIONS:
        return f"attn_implementation={attention!r} takes no 4D attention mask (use 'sdpa' or 'eager' to share it)"
    kinds = set(getattr(config, "layer_types", None) or ())
    if kinds - {"full_attention"}:
        return f"the model has {sorted(kinds - {'full_attention'})} layers, whose own masks a 4D mask would replace"
    sliding = getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)
    if not kinds and (sliding or getattr(config, "attention_chunk_size", None) is not None):
        return "the model's attention is windowed or chunked, and a 4D mask would replace its own"
    supports = getattr(model, "_supports_default_dynamic_cache", None)
    if supports is not None and not supports():
        return f"{type(model).__name__} has recurrent layers, not attention over keys and values"
    return None


def shares_prompt(enabled: bool, model, announce: bool = True) -> bool:
    """Whether a run's log-prob passes use the grouped layout: the trainer's one decision (`share_prompt`). On
    unless the user turned it off or the model cannot take it (`unsupported_reason`), which is said in one log line
    when `announce` (the main process). A PEFT model is read through its base model."""
    if not enabled:
        return False
    reason = unsupported_reason(model.get_base_model() if hasattr(model, "get_base_model") else model)
    if reason is not None and announce:
        logger.warning(f"share_prompt: each completion computes its prompt again, because {reason}.")
    return reason is None


def sharing_pays(layout: GroupedLayout, rows: int, width: int, config) -> bool:
    """Whether the grouped layout costs less than the plain one for this micro-batch: `rows` rows of `width` columns
    in the plain layout against the layout's U rows of L columns, by an estimate of one decoder layer's forward FLOPs,

        cost(rows, width) = rows * width * (2 * (4 d^2 + 3 d m) + 4 d * width)        d: hidden size, m: MLP width

    the projections and MLP per token, then attention over every key of the row: dense and masked kernels compute
    the whole square, so packing G long completions into one row multiplies the attention by about G while it
    saves only the prompt's G - 1 copies. Sharing pays for long prompts and short completions and not the other
    way round (SmolLM2-135M, G = 2 completions of 2048 tokens after 16 prompt tokens: 1.36x the plain estimate;
    G = 8 of 64 after 512: 0.24x). Flex attention's block mask skips what is masked: there it always pays."""
    if getattr(config, "_attn_implementation", None) == "flex_attention":
        return True
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    d = text.hidden_size
    per_token = 2 * (4 * d * d + 3 * d * (getattr(text, "intermediate_size", None) or 4 * d))

    def cost(count: int, columns: int) -> int:
        return count * columns * (per_token + 4 * d * columns)

    return cost(*layout.input_ids.shape) < cost(rows, width)


def forward_layout(args, model, announce: bool = True) -> tuple[bool, bool]:
    """(padding_free, share_prompt) for a run's log-prob passes, from its `GRPOConfig` and model. Packing sequences
    without padding pays only with variable-length attention kernels, so `padding_free=None` means flash attention.
    Sequence parallelism takes neither (Ulysses drops the masks both need; sequence_parallel.py), and checks that
    it can split the model."""
    if args.sequence_parallel_size > 1:
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        check_model(lm, args.sequence_parallel_size, router_aux_coef(lm.config, args.router_aux_loss_coef))
        if args.share_prompt and announce:
            logger.info("share_prompt: off under sequence parallelism, whose attention takes no 4D mask.")
        return False, False
    attention = getattr(model.config, "_attn_implementation", None) or ""
    padding_free = args.padding_free if args.padding_free is not None else "flash_attention" in attention
    return padding_free, shares_prompt(args.share_prompt, model, announce)


@dataclass
class GroupedLayout:
    """A micro-batch in the grouped layout (module docstring): U rows of L columns.

    input_ids, position_ids, segments: (U, L); segments is 0 on the prompt's real tokens, i on the i-th completion
    of the run (1-based), -1 on padding. predicting: (N,) the index in the flattened (U * L) positions of the one
    that predicts each completion token, in row-major order of completion_mask == 1. completions_from: the column
    where every row's completions start (the prompt width P), so columns P - 1 .. L - 1 hold every predicting
    position."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    segments: torch.Tensor
    predicting: torch.Tensor
    completions_from: int

    def attention_mask(self, config, dtype: torch.dtype):
        """The 4D mask, (U, 1, L, L) or a BlockMask, in the form `config._attn_implementation` takes: a query reads
        the real prompt tokens of its row and, causally, its own completion (segment). A padding position reads
        itself only, so that no row of the mask is empty (an empty row gives NaN, which would reach the real
        positions' gradients through 0 x NaN)."""
        segments = self.segments

        def allowed(batch, head, q, kv):  # index-based: broadcasts over (U, 1, L, 1) x (1, 1, 1, L) index tensors
            query, key = segments[batch, q], segments[batch, kv]
            return ((kv <= q) & (key >= 0) & ((key == 0) | (key == query))) | (kv == q)

        rows, width = segments.shape
        builder = ALL_MASK_ATTENTION_FUNCTIONS[getattr(config, "_attn_implementation", None) or "eager"]
        return builder(
            batch_size=rows,
            q_length=width,
            kv_length=width,
            mask_function=allowed,
            attention_mask=None,
            allow_is_causal_skip=False,
            dtype=dtype,
            device=segments.device,
            config=config,
        )


def grouped_layout(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> GroupedLayout | None:
    """The micro-batch rearranged into the grouped layout; None when no prompt repeats (nothing to share) or a
    completion mask is not a prefix (the positions of the plain forward would then skip its holes).

    prompt_ids/prompt_mask (B, P) left-padded; completion_ids/completion_mask (B, T) right-padded. A group split
    across micro-batches is simply a shorter run; runs of different prompts may have different prompt lengths."""
    firsts, counts = prompt_groups(prompt_ids, prompt_mask)
    rows, width = completion_ids.shape
    if len(firsts) == rows:
        return None
    device = completion_ids.device
    columns = torch.arange(width, device=device)
    lengths = completion_mask.sum(1)  # (B,) |o_i|
    if not torch.equal(completion_mask.bool(), columns < lengths[:, None]):
        return None
    run = torch.repeat_interleave(torch.arange(len(firsts), device=device), torch.tensor(counts, device=device))
    first = torch.tensor(firsts, device=device)
    # Completion i of a run is fed |o_i| - 1 tokens; its slot starts where the run's previous slots end.
    fed = (lengths - 1).clamp(min=0)  # (B,)
    before = fed.cumsum(0) - fed  # (B,) tokens fed by all earlier rows
    prompt_width = prompt_ids.shape[1]
    start = prompt_width + before - before.index_select(0, first).index_select(0, run)  # (B,) slot's first column
    run_fed = torch.zeros(len(firsts), dtype=fed.dtype, device=device).index_add_(0, run, fed)
    total = prompt_width + int(run_fed.max())  # L

    # 1. The prompts, once per run, left-padded as they came; positions count real tokens as the plain forward does.
    prompt_rows = prompt_mask.index_select(0, first)  # (U, P)
    input_ids = completion_ids.new_zeros(len(firsts), total)
    position_ids = torch.zeros_like(input_ids)
    segments = torch.full_like(input_ids, -1)
    input_ids[:, :prompt_width] = prompt_ids.index_select(0, first)
    position_ids[:, :prompt_width] = (prompt_rows.cumsum(1) - 1).clamp(min=0)
    segments[:, :prompt_width] = torch.where(prompt_rows.bool(), 0, -1)

    # 2. Each completion's fed tokens 0 .. |o_i| - 2 into its slot, at positions p_u .. p_u + |o_i| - 2.
    at = (run * total + start)[:, None] + columns[: width - 1]  # (B, T - 1) flat column of fed token t
    feeds = completion_mask[:, 1:].bool()  # (B, T - 1) token t is fed iff token t + 1 exists
    prompt_lengths = prompt_mask.sum(1)  # (B,)
    ordinal = torch.arange(rows, device=device) - first.index_select(0, run) + 1  # (B,) 1-based within its run
    for target, values in (
        (input_ids, completion_ids[:, :-1]),
        (position_ids, prompt_lengths[:, None] + columns[: width - 1]),
        (segments, ordinal[:, None].expand(rows, width - 1)),
    ):
        target.view(-1)[at[feeds]] = values[feeds].to(target.dtype)

    # 3. Which position predicts completion token t: the prompt's last for t = 0, the slot's column t - 1 after.
    predictor = torch.cat([(run * total + prompt_width - 1)[:, None], at], dim=1)  # (B, T)
    return GroupedLayout(input_ids, position_ids, segments, predictor[completion_mask.bool()], prompt_width)
