"""`Rollout`: one generation round, typed, from sampling to the micro-batches the loss reads.

A rollout is built by `GRPOTrainer._generate_round` (generation, EOS cut, scoring) and, for offline training, can
be built from already scored data the same way: it needs token ids, masks and rewards, nothing of the sampler.
Its rows come in two scopes:

- *local* fields hold this process's rows (B_local): the texts, the token tensors and, once computed, the
  advantages and log-probs the loss needs;
- *gathered* fields hold every process's rows (B_global = B_local x processes, in process order): the rewards,
  because a group of G completions may span processes and its advantages need all of them.

Token tensors are padded: prompts on the left, completions on the right. `trim` drops the columns that are padding
in every row; `gather` makes every field global (dynamic sampling chooses groups across processes); `select` builds
a rollout from chosen rows of several gathered ones; `micro_batches` cuts the local rows into the `MicroBatch`es
`GRPOTrainer.compute_loss` takes (and checkpoints store).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, NamedTuple

import torch
from accelerate.utils import gather, gather_object

from grpo.data import content_widths, pad
from grpo.data.vision import rows_to

LOCAL, GATHERED = "local", "gathered"


class TokenBatch(NamedTuple):
    """The four tensors a forward pass over (prompt, completion) rows needs; a `Rollout` and a `MicroBatch` have
    them as fields too, so anything that reads these attributes takes any of the three."""

    prompt_ids: torch.Tensor  # (B, P) long, left-padded
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, T) long, right-padded
    completion_mask: torch.Tensor  # (B, T)
    # Vision-language models: each row's images as the model takes them (grpo/data/vision.py); None: text only.
    vision: list[dict[str, torch.Tensor]] | None = None


def _tensor(scope: str, padded: str | None = None, default_none: bool = False):
    """A tensor field: its row scope and the side its last dimension is padded on (None: not a token dimension)."""
    metadata = {"scope": scope, "padded": padded}
    return field(default=None, metadata=metadata) if default_none else field(metadata=metadata)


@dataclass
class Rollout:
    """One generation round. Shapes: B local rows, B_g gathered rows, P prompt and T completion columns,
    K outcome and K_p process reward functions."""

    prompts: list  # (B,) the prompts as the dataset gave them: strings or chat messages
    completions: list  # (B,) decoded completions: strings, or one assistant message for chat prompts
    prompt_ids: torch.Tensor = _tensor(LOCAL, "left")  # (B, P) long
    prompt_mask: torch.Tensor = _tensor(LOCAL, "left")  # (B, P) 1 on prompt tokens
    completion_ids: torch.Tensor = _tensor(LOCAL, "right")  # (B, T) long, cut after the first EOS
    completion_mask: torch.Tensor = _tensor(LOCAL, "right")  # (B, T) 1 on completion tokens
    # (B, T) 1 on the tokens the policy sampled: completion_mask, but 0 on the tool answers of a multi-turn episode
    sampled_mask: torch.Tensor = _tensor(LOCAL, "right")
    loss_mask: torch.Tensor = _tensor(LOCAL, "right")  # (B, T) sampled_mask, 0 on masked truncated rows
    is_truncated: torch.Tensor = _tensor(LOCAL)  # (B,) bool: no EOS within max_completion_length
    rewards_per_func: torch.Tensor = _tensor(GATHERED)  # (B_g, K) float32, NaN where a function gave none
    step_rewards: torch.Tensor = _tensor(GATHERED, "right")  # (B_g, K_p, T_g) at each step's last token, else NaN
    # Multi-turn episodes (None otherwise): the policy turn (0, 1, ...) of each completion token, -1 on tool answers
    # and padding, (B_g, T_g) long; the episodes record this process's rows, which scoring gathers with the rewards
    # (turn-level credit compares the turns of a whole group). With turn reward functions (grpo/rewards/turns.py):
    # function k's score of policy turn n of each row, NaN where it gave none, (B_g, K_t, N) float32.
    turn_index: torch.Tensor | None = _tensor(GATHERED, "right", True)
    turn_rewards: torch.Tensor | None = _tensor(GATHERED, "right", True)
    sampling_logps: torch.Tensor | None = _tensor(LOCAL, "right", True)  # (B, T) the sampler's own (vLLM)
    # (B,) long: 0, or the prompt was cut to max_prompt_length: the whole turns a conversation lost, 1 for a string
    prompt_truncated: torch.Tensor | None = _tensor(LOCAL, default_none=True)
    # Filled after scoring (steps 5-7), local rows only:
    advantages: torch.Tensor | None = _tensor(LOCAL, default_none=True)  # (B,), or (B, T) with process rewards
    old_logps: torch.Tensor | None = _tensor(LOCAL, "right", True)  # (B, T) pi_old, when batches are reused
    ref_logps: torch.Tensor | None = _tensor(LOCAL, "right", True)  # (B, T) pi_ref, when beta != 0
    # Offline data (grpo/data/offline.py): groups of different sizes that never span processes, so processes hold
    # different row counts (as they may in a last, shorter evaluation batch). `group_sizes`: every process's groups, in gathered order (None: groups of G rows);
    # `first_row`: this process's first row in the gathered fields (None: process index x B).
    group_sizes: list[int] | None = None
    first_row: int | None = None
    # The optimizer step whose weights sampled this process's rows (async generation; None: the current ones).
    weights_version: int | None = None
    # Multi-turn episodes (grpo/generation/episodes.py): this process's sums of turns, tool calls, errors... (None:
    # single-turn completions).
    episode_stats: dict[str, float] | None = None
    # Vision-language models (grpo/data/vision.py): each local row's vision inputs (pixel values, image grids, ...),
    # a dict of tensors per row; None: text only. Rows are sliced, moved and gathered with the token tensors.
    vision: list[dict[str, torch.Tensor]] | None = None
    # `log_multimodal`: each local row's images as the data set gave them, for the completions log only (None: no
    # images, or none logged). Dropped once the round is recorded, so buffers and checkpoints never hold them.
    images: list | None = None
    # `agent_func` episodes whose agent edited its history (grpo/generation/agent_function.py): each local row's other
    # trained sequences, as dicts of unpadded lists (`prompt`, `completion`, `prompt_ids`, `completion_ids`,
    # `sampled`, `logprobs`, `truncated`). They share their row's reward and advantage: `with_extra_sequences` makes
    # them rows of their own once the advantages are known. None: one sequence per row.
    extra_sequences: list[list[dict]] | None = None

    @classmethod
    def from_tokens(
        cls,
        prompts: list,
        completions: list,
        prompt_ids: Sequence[Sequence[int]],
        completion_ids: Sequence[Sequence[int]],
        is_truncated: Sequence[bool],
        pad_token_id: int,
        mask_truncated: bool = False,
        sampling_logps: Sequence[Sequence[float]] | None = None,
        sampled_masks: Sequence[Sequence[int]] | None = None,
        turn_indices: Sequence[Sequence[int]] | None = None,
    ) -> Rollout:
        """A rollout of unpadded token lists (completions already cut after their EOS), not yet scored: prompts
        padded on the left, completions on the right; with `mask_truncated`, truncated rows get no loss tokens.
        `sampled_masks`: per completion token, 1 where the policy sampled it (None: every token); `turn_indices`
        (episodes): per completion token, its policy turn, -1 on tool answers."""
        prompt_ids, prompt_mask = pad(prompt_ids, pad_token_id, side="left")
        completion_ids, completion_mask = pad(completion_ids, pad_token_id, side="right")
        sampled_mask = completion_mask if sampled_masks is None else pad(sampled_masks, 0, side="right")[0]
        truncated = torch.tensor(list(is_truncated), dtype=torch.bool)
        loss_mask = sampled_mask * (~truncated).long().unsqueeze(1) if mask_truncated else sampled_mask
        if sampling_logps is not None:
            width = completion_ids.shape[1]
            sampling_logps = torch.tensor([list(row) + [0.0] * (width - len(row)) for row in sampling_logps])
        return cls(
            prompts=list(prompts),
            completions=list(completions),
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            sampled_mask=sampled_mask,
            loss_mask=loss_mask,
            is_truncated=truncated,
            rewards_per_func=torch.empty(0, 0),
            step_rewards=torch.empty(0, 0, 0),
            sampling_logps=sampling_logps,
            turn_index=None if turn_indices is None else pad(turn_indices, -1, side="right")[0],
        )

    @property
    def num_rows(self) -> int:
        return len(self.prompts)

    def _tensors(self, scope: str | None = None) -> list[tuple[str, str | None]]:
        """(name, padded side) of the tensor fields that are set, of `scope` or all."""
        return [
            (f.name, f.metadata["padded"])
            for f in fields(self)
            if "scope" in f.metadata
            and getattr(self, f.name) is not None
            and (scope is None or f.metadata["scope"] == scope)
        ]

    def completion_lists(self) -> list[list[int]]:
        """The local completions' token ids without padding, one list per row (what reward functions receive)."""
        return [row[mask.bool()].tolist() for row, mask in zip(self.completion_ids, self.completion_mask)]

    def token_inputs(self) -> TokenBatch:
        """The four tensors a forward pass needs (`GRPOTrainer.logprobs`)."""
        return TokenBatch(self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask, self.vision)

    def to(self, device: torch.device | str) -> Rollout:
        moved = {name: getattr(self, name).to(device) for name, _ in self._tensors()}
        return replace(self, vision=rows_to(self.vision, device), **moved)

    def trim(self) -> Rollout:
        """The local token tensors cut to this rollout's longest prompt (on the left) and completion (on the right);
        per-token advantages too. Gathered fields keep their width."""
        prompt_width, completion_width = content_widths(self.prompt_mask, self.completion_mask)
        cut = {}
        for name, side in self._tensors(LOCAL):
            value = getattr(self, name)
            if side == "left":
                cut[name] = value[:, -prompt_width:]
            elif side == "right" or (name == "advantages" and value.dim() == 2):
                cut[name] = value[:, :completion_width]
        return replace(self, **cut)

    def local_slice(self, process_index: int) -> slice:
        """This process's rows within the gathered fields."""
        start = process_index * self.num_rows if self.first_row is None else self.first_row
        return slice(start, start + self.num_rows)

    def groups(self, num_generations: int) -> int | list[int]:
        """What the group statistics take: G when every group has `num_generations` rows, else each group's size."""
        return num_generations if self.group_sizes is None else self.group_sizes

    def gather(self, accelerator, pad_token_id: int) -> Rollout:
        """Every process's rows, in process order: local tensors padded to a common width across processes, texts
        by `gather_object`. The gathered fields are already global."""
        out = {"prompts": gather_object(self.prompts), "completions": gather_object(self.completions)}
        if self.vision is not None:  # per-row dicts of tensors, by object (rows differ in shape)
            device = self.prompt_ids.device
            out["vision"] = rows_to(gather_object(rows_to(self.vision, "cpu")), device)
        if self.images is not None:
            out["images"] = gather_object(self.images)
        if self.extra_sequences is not None:
            out["extra_sequences"] = gather_object(self.extra_sequences)
        for name, side in self._tensors(LOCAL):
            value = getattr(self, name)
            if side is not None:
                fill = padding_value(name, pad_token_id)
                value = accelerator.pad_across_processes(value, dim=1, pad_index=fill, pad_first=side == "left")
            out[name] = gather(value)
        return replace(self, **out)

    def pooled(self, gather_objects: Callable[[Any], list], pad_token_id: int) -> Rollout:
        """The local rows of every process of a sequence-parallel group, in its order, with their texts: the same
        rollout on each of them (grpo/objective/sequence_parallel.py). `gather_objects(value)`: every group
        process's picklable `value`. Local tensors are padded to the widest (per-token advantages on the right);
        gathered fields are unchanged. Only a rollout with advantages and nothing per row beyond texts and tensors
        (no images, no agent's extra sequences) is pooled."""
        if self.advantages is None or any(v is not None for v in (self.vision, self.images, self.extra_sequences)):
            raise ValueError("a pooled rollout needs its advantages, and no images or extra sequences")
        local = self._tensors(LOCAL)
        mine = {name: getattr(self, name).cpu() for name, _ in local}
        everyone = gather_objects((self.prompts, self.completions, mine))
        device = self.prompt_ids.device
        out: dict[str, Any] = {
            "prompts": [p for prompts, _, _ in everyone for p in prompts],
            "completions": [c for _, completions, _ in everyone for c in completions],
        }
        for name, side in local:
            rows = [row.to(device) for _, _, tensors in everyone for row in tensors[name]]
            per_token = name == "advantages" and rows[0].dim() == 1
            out[name] = stack_rows(rows, padding_value(name, pad_token_id), "right" if per_token else side)
        return replace(self, **out, first_row=None)

    @classmethod
    def select(cls, rollouts: Sequence[Rollout], rows: Sequence[tuple[int, int]], local: slice, pad_token_id: int):
        """The rollout made of `rows` ((index into `rollouts`, row) pairs, in batch order) of gathered rollouts:
        local fields from `rows[local]` (this process's share, trimmed), gathered fields from every row."""
        picked = rows[local]
        out: dict[str, Any] = {
            "prompts": [rollouts[r].prompts[i] for r, i in picked],
            "completions": [rollouts[r].completions[i] for r, i in picked],
        }
        if rollouts[0].vision is not None:
            out["vision"] = [rollouts[r].vision[i] for r, i in picked]
        if rollouts[0].images is not None:
            out["images"] = [rollouts[r].images[i] for r, i in picked]
        if rollouts[0].extra_sequences is not None:
            out["extra_sequences"] = [rollouts[r].extra_sequences[i] for r, i in picked]
        for name, side in rollouts[0]._tensors():
            scope = rollouts[0].__dataclass_fields__[name].metadata["scope"]
            chosen = picked if scope == LOCAL else rows
            fill = padding_value(name, pad_token_id)
            out[name] = stack_rows([getattr(rollouts[r], name)[i] for r, i in chosen], fill, side)
        return cls(**out).trim()

    def with_extra_sequences(self, pad_token_id: int, mask_truncated: bool = False) -> Rollout:
        """The local rows followed by every row's `extra_sequences`, each a row of its own with its owner's
        advantage (needs per-row advantages: step 5). Gathered fields are unchanged (rewards are per episode); so are
        the local fields computed later (reference log-probs), which must not be set yet."""
        extras = self.extra_sequences or []
        owners = [row for row, sequences in enumerate(extras) for _ in sequences]
        if not owners:
            return replace(self, extra_sequences=None)
        if self.advantages is None or self.advantages.dim() != 1 or self.vision is not None:
            raise ValueError("extra sequences need per-row advantages and text-only rows")
        flat = [sequence for sequences in extras for sequence in sequences]
        added = Rollout.from_tokens(
            [s["prompt"] for s in flat],
            [s["completion"] for s in flat],
            [s["prompt_ids"] for s in flat],
            [s["completion_ids"] for s in flat],
            [s["truncated"] for s in flat],
            pad_token_id,
            mask_truncated=mask_truncated,
            sampling_logps=[s["logprobs"] for s in flat] if self.sampling_logps is not None else None,
            sampled_masks=[s["sampled"] for s in flat],
        )
        added.advantages = self.advantages[torch.tensor(owners, device=self.advantages.device)]
        if self.prompt_truncated is not None:
            added.prompt_truncated = torch.tensor([s.get("prompt_cut", 0) for s in flat], dtype=torch.long)
        out: dict[str, Any] = {
            "prompts": self.prompts + added.prompts,
            "completions": self.completions + added.completions,
        }
        for name, side in self._tensors(LOCAL):
            ours, theirs = getattr(self, name), getattr(added, name)
            if theirs is None:
                raise ValueError(f"extra sequences cannot carry the field {name!r} (computed before them)")
            rows = [*ours, *theirs.to(ours.device)]
            out[name] = stack_rows(rows, padding_value(name, pad_token_id), side)
        return replace(self, **out, extra_sequences=None)

    def micro_batches(self, num: int) -> list[MicroBatch]:
        """The local rows cut into `num` consecutive `MicroBatch`es, each trimmed to its own longest prompt and
        completion (what `compute_loss` reads and checkpoints store). Rows that do not divide evenly (offline groups
        of different sizes) go one more to each of the first micro-batches. Needs the advantages (step 5)."""
        if self.num_rows < num:
            raise ValueError(
                f"This process holds {self.num_rows} rows for {num} micro-batches (steps_per_generation): each needs "
                "a row. With offline data, use larger groups, more groups per round (generation_batch_size) or fewer "
                "steps_per_generation."
            )
        bounds = [i * self.num_rows // num for i in range(num + 1)]
        out = []
        for i in range(num):
            part = self._rows(slice(bounds[i], bounds[i + 1])).trim()
            out.append(MicroBatch(**{name: getattr(part, name) for name in MicroBatch.ROLLOUT_FIELDS}))
        return out

    def _rows(self, rows: slice) -> Rollout:
        """Local rows `rows` (gathered fields unchanged)."""
        cut = {name: getattr(self, name)[rows] for name, _ in self._tensors(LOCAL)}
        vision = None if self.vision is None else self.vision[rows]
        images = None if self.images is None else self.images[rows]
        extras = None if self.extra_sequences is None else self.extra_sequences[rows]
        texts = {"prompts": self.prompts[rows], "completions": self.completions[rows]}
        return replace(self, **texts, vision=vision, images=images, extra_sequences=extras, **cut)


@dataclass
class MicroBatch:
    """What one `compute_loss` reads: consecutive local rows of a scored `Rollout` (`Rollout.micro_batches`), trimmed
    to their own widths, plus what the trainer adds per micro-batch. The trainer's buffer of them goes into
    checkpoints as plain dicts (`state_dict` / `from_state_dict`), so loading unpickles no class. Shapes: b rows, P
    prompt and T completion columns."""

    prompt_ids: torch.Tensor  # (b, P) long, left-padded
    prompt_mask: torch.Tensor  # (b, P)
    completion_ids: torch.Tensor  # (b, T) long, right-padded
    completion_mask: torch.Tensor  # (b, T)
    loss_mask: torch.Tensor  # (b, T) the tokens the loss counts
    advantages: torch.Tensor  # (b,), or (b, T) with process rewards
    sampling_logps: torch.Tensor | None = None  # (b, T) the sampler's own log-probs (vLLM), for its correction
    ref_logps: torch.Tensor | None = None  # (b, T) pi_ref, when beta != 0
    # pi_old (grpo/objective/old_policy.py): its log-probs from a no-grad pass or stored (offline); None: from the
    # training pass. `old_logps_at_step`: record them from the first training pass, which must come at this step.
    old_logps: torch.Tensor | None = None  # (b, T)
    old_logps_at_step: int | None = None
    # The loss tokens of this micro-batch's optimizer step on all processes, for loss types normalised over the step
    # (grpo/objective/loss.py, `accumulation`); None for the others.
    window_loss_tokens: torch.Tensor | None = None  # 0-d float
    # Vision-language models: each row's vision inputs (grpo/data/vision.py); None: text only.
    vision: list[dict[str, torch.Tensor]] | None = None

    # The fields copied from the rollout's local rows.
    ROLLOUT_FIELDS = (
        "prompt_ids",
        "prompt_mask",
        "completion_ids",
        "completion_mask",
        "loss_mask",
        "advantages",
        "sampling_logps",
        "ref_logps",
        "old_logps",
        "vision",
    )

    @property
    def num_rows(self) -> int:
        return self.prompt_ids.shape[0]

    def state_dict(self) -> dict[str, Any]:
        """The set fields, as a dict of tensors and ints (what a checkpoint stores)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> MicroBatch:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(state) - names)
        if unknown:
            raise ValueError(f"A saved micro-batch has fields {unknown} that MicroBatch does not: {sorted(names)}.")
        return cls(**state)


def gather_rows(accelerator, value: torch.Tensor, fill: float = 0) -> torch.Tensor:
    """`gather` along the first dimension when processes hold different row counts (offline groups): each process's
    rows padded to the most rows with `fill`, gathered, and the padding dropped. Equal counts: plain `gather`."""
    if accelerator.num_processes == 1:
        return value
    counts = gather(torch.tensor([value.shape[0]], device=value.device)).tolist()
    if len(set(counts)) == 1:
        return gather(value)
    # .to: accelerate pads a bool tensor into an int64 one (zeros + fill), which would not gather with the others.
    padded = accelerator.pad_across_processes(value, dim=0, pad_index=fill).to(value.dtype)
    everyone, width = gather(padded), padded.shape[0]
    return torch.cat([everyone[p * width : p * width + count] for p, count in enumerate(counts)])


def first_row(accelerator, rows: int) -> int:
    """This process's first row among every process's `rows`, in process order: a collective call, for processes
    that hold different row counts (a last, shorter evaluation batch)."""
    if accelerator.num_processes == 1:
        return 0
    counts = gather(torch.tensor([rows], device=accelerator.device)).tolist()
    return sum(counts[: accelerator.process_index])


def padding_value(name: str, pad_token_id: int) -> float:
    """What a `Rollout` tensor field is padded with: the pad token for ids, NaN for rewards per step or turn, -1
    for turn indices, else 0."""
    special = {"step_rewards": torch.nan, "turn_rewards": torch.nan, "turn_index": -1}
    return pad_token_id if name.endswith("_ids") else special.get(name, 0)


def stack_rows(values: Sequence[torch.Tensor], fill: float, side: str | None) -> torch.Tensor:
    """Stack tensors whose last dimension may differ, padding it with `fill` on `side` to the widest."""
    if side is None:
        return torch.stack(list(values))
    width = max(v.shape[-1] for v in values)
    padded = []
    for v in values:
        padding = v.new_full((*v.shape[:-1], width - v.shape[-1]), fill)
        padded.append(torch.cat([padding, v], -1) if side == "left" else torch.cat([v, padding], -1))
    return torch.stack(padded)
