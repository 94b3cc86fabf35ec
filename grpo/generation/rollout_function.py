"""TRL's `rollout_func`, run unchanged (`GRPOTrainer(rollout_func=f)`, docs/agents.md "TRL's rollout_func").

`f(prompts, trainer)` gets the prompts of this process's rows of a round (deep copies, strings or chat messages; one
per row, each prompt already repeated G times by the sampler) and returns a dict with one entry per prompt in each of
  - `prompt_ids`, `completion_ids`: token ids, trained as returned (a completion is not cut at its EOS; it is
    truncated when its last id is neither an EOS nor the padding token, as in TRL);
  - `logprobs`: the sampler's log-prob of each completion token (a shorter row is padded with 0), or None: the
    behaviour policy of the importance-sampling correction;
  - optionally `env_mask`: per completion token, 1 where the model sampled it (trained), 0 where an environment or a
    tool wrote it (context, out of the loss); and `logprob_token_ids`, accepted and ignored;
  - any other key: a field for the reward functions, passed as a keyword (a list gives row i its i-th value,
    anything else goes to every row).

`RolloutFunction` is the agent the round maker asks for a round (`rollout`, as `EndpointAgent` in agent_function.py):
  1. it calls `f` with the round's prompts and the trainer (held by a weak reference), holding the round's sampler
     and model meanwhile, so that `generate_rollout_completions(trainer, prompts)` samples from the policy with the
     trainer's own generation backend;
  2. checks what `f` returned, naming the key and the row of each problem and its fix (`checked_output`);
  3. builds the round's `Rollout` (completions decoded for the rewards) and the reward columns: the rows' columns
     but `prompt`, then the extra fields.
An exception of `f` is re-raised as a `RolloutFuncError` that names the function, and ends the run as in TRL.
"""

from __future__ import annotations

import copy
import inspect
import math
import numbers
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from grpo.data import RESERVED_COLUMNS, InputError, decode_completions, encode_prompts, is_conversational
from grpo.generation.agent_function import check_agent_func, make_endpoint_agent
from grpo.generation.base import cut_at_eos, policy_logprobs
from grpo.generation.episodes import turn_sampler
from grpo.generation.settings import SamplingSettings
from grpo.rollout import Rollout

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")
IGNORED_KEYS = ("logprob_token_ids",)  # TRL's: the ids each log-prob was taken for; the completion's own here


class RolloutFuncError(RuntimeError):
    """The user's rollout_func raised; the original exception is the cause."""


def check_episodes(tools, environment_factory, agent_func, rollout_func, vision: bool = False, offline=None) -> None:
    """Refuse, when the trainer is built, episodes it cannot run: `agent_func`'s misuses (`check_agent_func`), and a
    `rollout_func` that is not callable as `f(prompts, trainer)`, that comes with tools=, environment_factory or
    agent_func (one way of making a round per trainer), or with data it cannot take (`vision`: images beside the
    prompts; `offline`: stored completions, which nothing generates)."""
    check_agent_func(agent_func, tools, environment_factory)
    if rollout_func is None:
        return
    if tools or environment_factory is not None or agent_func is not None:
        raise InputError(
            "rollout_func makes the whole round itself (it returns the token ids), so it cannot be combined with "
            "tools=, environment_factory or agent_func. Pass one of them."
        )
    if not callable(rollout_func):
        raise InputError(
            f"rollout_func must be a function `f(prompts, trainer)`, got a {type(rollout_func).__name__}."
        )
    try:
        inspect.signature(rollout_func).bind(None, None)
    except TypeError as error:
        raise InputError(
            f"rollout_func {_name(rollout_func)!r} must take two positional arguments, (prompts, trainer): {error}. "
            "TRL's signature: f(prompts: list, trainer) -> dict."
        ) from error
    except ValueError:  # a builtin without a signature: called as it is
        pass
    if vision:
        raise InputError(
            "The data set has an image column, but a rollout_func's round carries no images to the loss here. Train "
            "text prompts with rollout_func, or drop rollout_func."
        )
    if offline is not None:
        raise InputError(
            "rollout_func generates completions, but train_dataset holds scored completions (a `completion` "
            "column), which are trained on without generation. Pass one of them."
        )


def make_function_agent(episodes: Sequence, trainer, tokenizer, eos_token_ids: Sequence[int], args):
    """The agent of `episodes` = (tools, environment_factory, agent_func, rollout_func) that a function makes: an
    `EndpointAgent` for agent_func, a `RolloutFunction` for rollout_func, None for neither."""
    agent_func, rollout_func = episodes[2], episodes[3]
    if rollout_func is not None:
        return RolloutFunction(rollout_func, trainer, tokenizer, eos_token_ids, args)
    return make_endpoint_agent(agent_func, tokenizer, eos_token_ids, args)


class SamplingRound(NamedTuple):
    """What `generate_rollout_completions` samples with while a round's rollout_func runs."""

    sample: Callable  # `turn_sampler(backend)`: sample(model, prompt_ids, max_new_tokens) -> Completions
    model: torch.nn.Module
    lockstep: Any  # not None: a sharded policy whose processes must generate together


class RolloutFunction:
    """The rollout_func of one trainer (module docstring): `rollout` makes a round; `generate` is
    `generate_rollout_completions`'s sampler; `give_back` and `close` are the round maker's calls."""

    def __init__(self, rollout_func: Callable, trainer, tokenizer, eos_token_ids: Sequence[int], args):
        self.function, self.tokenizer, self.args = rollout_func, tokenizer, args
        self.trainer = weakref.ref(trainer)  # the trainer holds this agent: no reference cycle
        self.eos_token_ids = list(eos_token_ids)
        self.temperature = SamplingSettings.from_config(args).temperature
        # The rounds running now, by the thread that runs each (async generation's producer and an evaluation may
        # overlap); a lock so that threads of one function sample one at a time.
        self.active: dict[int, SamplingRound] = {}
        self.lock = threading.Lock()

    def rollout(self, inputs: list[dict[str, Any]], backend, model, lockstep=None) -> tuple[Rollout, dict[str, list]]:
        """Steps 1-3 of the module docstring for the dataset rows `inputs`: (Rollout, columns for the rewards)."""
        trainer = self.trainer()
        if trainer is None:
            raise RuntimeError("The trainer this rollout_func belongs to no longer exists.")
        prompts = copy.deepcopy([row["prompt"] for row in inputs])
        thread = threading.get_ident()
        self.active[thread] = SamplingRound(turn_sampler(backend), model, lockstep)
        try:
            output = self.function(prompts, trainer)
        except Exception as error:  # noqa: BLE001 (re-raised, named)
            raise RolloutFuncError(
                f"rollout_func {_name(self.function)!r} raised {type(error).__name__}: {error}"
            ) from error
        finally:
            del self.active[thread]
        rows, extras = checked_output(output, len(prompts), inputs[0], _vocab_size(model))
        if rows["logprobs"] is None and self.args.async_generation and self.args.max_staleness > 0:
            raise ValueError(
                "rollout_func returned logprobs=None, but async_generation with max_staleness > 0 trains on rounds "
                "sampled by older weights, which needs the sampler's log-probs to correct for: return them, or set "
                "max_staleness=0."
            )
        return self._to_rollout(inputs, prompts, rows, extras)

    def _to_rollout(self, inputs, prompts, rows: dict, extras: dict) -> tuple[Rollout, dict[str, list]]:
        """The round's `Rollout` of the checked `rows`, and the reward columns: the rows' but `prompt`, then
        `extras`."""
        pad_id, ids, logprobs = self.tokenizer.pad_token_id, rows["completion_ids"], rows["logprobs"]
        ends = {*self.eos_token_ids, pad_id}
        with_logprobs = logprobs is not None and all(row is not None for row in logprobs)
        rollout = Rollout.from_tokens(
            prompts,
            decode_completions(ids, prompts, self.tokenizer),
            rows["prompt_ids"],
            ids,
            [row[-1] not in ends for row in ids],
            pad_id,
            mask_truncated=self.args.mask_truncated_completions,
            sampling_logps=logprobs if with_logprobs else None,
            sampled_masks=rows["env_mask"],
        )
        rollout.prompt_truncated = torch.zeros(len(prompts), dtype=torch.long)  # the function tokenized them
        columns = {key: [row[key] for row in inputs] for key in inputs[0] if key != "prompt"}
        for key, value in extras.items():
            columns[key] = list(value) if isinstance(value, list) else [value] * len(prompts)
        return rollout, columns

    def give_back(self, columns: dict[str, list]) -> None:
        """Nothing to give back: the function holds its own resources."""

    def close(self) -> None:
        """Nothing to close."""

    # ---- generate_rollout_completions ----

    def generate(self, prompts: Sequence, as_chat: bool | None = None) -> list[dict[str, Any]]:
        """One completion per prompt from the policy, with the sampler of the round that runs now (see
        `generate_rollout_completions`)."""
        current = self._current_round()
        if current.lockstep is not None:
            raise InputError(
                "generate_rollout_completions cannot sample from a sharded policy (FSDP, ZeRO-3 generating "
                "collectively): every process would have to call it as often as the others. Use vLLM "
                "(use_vllm=True) or data parallelism."
            )
        prompts = list(prompts)
        for i, prompt in enumerate(prompts):
            if as_chat is not None and is_conversational(prompt) != as_chat:
                kind = "a list of chat messages" if as_chat else "a string"
                raise ValueError(f"generate_rollout_completions(as_chat={as_chat}): prompts[{i}] is not {kind}.")
        if not prompts:
            return []
        args = self.args
        prompt_ids, _ = encode_prompts(
            prompts,
            self.tokenizer,
            args.max_prompt_length,
            args.truncation_side,
            chat_template_kwargs=args.chat_template_kwargs,
        )
        with self.lock:
            raw = current.sample(current.model, prompt_ids, args.max_completion_length)
            ids, _ = cut_at_eos(raw.ids, self.eos_token_ids, args.max_completion_length)
            if raw.logprobs is not None:
                logprobs = [[float(x) for x in row[: len(cut)]] for row, cut in zip(raw.logprobs, ids)]
            else:
                logprobs = policy_logprobs(current.model, prompt_ids, ids, self.temperature)
        texts = self.tokenizer.batch_decode(ids, skip_special_tokens=True)
        return [
            {"prompt_ids": p, "completion_ids": c, "logprobs": lp, "text": t}
            for p, c, lp, t in zip(prompt_ids, ids, logprobs, texts)
        ]

    def _current_round(self) -> SamplingRound:
        """The round of this thread, or the only one running (a thread the function started)."""
        current = self.active.get(threading.get_ident())
        if current is None and len(self.active) == 1:
            current = next(iter(self.active.values()))
        if current is None:
            raise RuntimeError(
                "generate_rollout_completions samples with the trainer's policy during a round, from inside its "
                "rollout_func (GRPOTrainer(..., rollout_func=f), f calling it); no round is running now"
                + (" on this thread." if self.active else ".")
            )
        return current


def generate_rollout_completions(
    trainer, prompts: Sequence, *, generation_overrides: dict | None = None, as_chat: bool | None = None
) -> list[dict[str, Any]]:
    """Sample one completion per prompt from the policy being trained, inside a `rollout_func` (the name and return
    of TRL's former OpenEnv helper): a list with one dict per prompt, with `prompt_ids`, `completion_ids` (cut after
    the first EOS, which is kept; at most `max_completion_length`), `logprobs` (the sampler's, or the policy's at the
    run's temperature from one forward pass) and `text` (the completion decoded).

    It samples with the trainer's own generation backend at the run's settings; chat prompts (or all, with
    `as_chat=True`) are rendered with the chat template, and prompts are cut to `max_prompt_length`. Called outside
    a round of the trainer's rollout_func, it raises. `generation_overrides` is refused: the policy learns from its
    own samples at the run's settings (set them in `GRPOConfig`).

        def rollout_func(prompts, trainer):
            outs = generate_rollout_completions(trainer, prompts)
            return {key: [o[key] for o in outs] for key in ("prompt_ids", "completion_ids", "logprobs")}
    """
    if generation_overrides:
        raise ValueError(
            f"generate_rollout_completions(generation_overrides={generation_overrides!r}): the policy samples at the "
            "run's settings here, the ones it learns from. Set them in GRPOConfig (temperature, top_p, "
            "max_completion_length, generation_kwargs) instead."
        )
    agent = getattr(trainer, "agent", None)
    if not isinstance(agent, RolloutFunction):
        raise RuntimeError(
            "generate_rollout_completions samples for a rollout_func, and this trainer has none: build it with "
            "GRPOTrainer(..., rollout_func=f) and call the helper from f."
        )
    return agent.generate(prompts, as_chat)


# ---- Checking what the function returned ----


def checked_output(output, rows: int, row: dict, vocab_size: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """`output` of a rollout_func for `rows` prompts, checked: ({prompt_ids, completion_ids, logprobs, env_mask} as
    plain lists, logprobs and env_mask possibly None; the extra fields for the rewards). `row`: a dataset row, whose
    columns an extra field may not name. Raises naming the key and the row of the first problem, and the fix."""
    if not isinstance(output, dict):
        raise TypeError(
            f"rollout_func returned a {type(output).__name__}; it must return a dict with the keys "
            f"{list(REQUIRED_KEYS)} (one entry per prompt each) and any extra fields for the reward functions."
        )
    missing = sorted(set(REQUIRED_KEYS) - set(output))
    if missing:
        raise ValueError(
            f"rollout_func must return keys {missing} in its output dict. Add them: one list of token ids per "
            "prompt for prompt_ids and completion_ids, and for logprobs the sampler's log-prob of each completion "
            "token per prompt (or None)."
        )
    checked = {
        "prompt_ids": _id_rows(output["prompt_ids"], "prompt_ids", rows, vocab_size),
        "completion_ids": _id_rows(output["completion_ids"], "completion_ids", rows, vocab_size),
    }
    lengths = [len(ids) for ids in checked["completion_ids"]]
    checked["logprobs"] = _logprob_rows(output["logprobs"], lengths)
    checked["env_mask"] = _mask_rows(output.get("env_mask"), lengths)
    extras = {k: v for k, v in output.items() if k not in (*REQUIRED_KEYS, *IGNORED_KEYS, "env_mask")}
    clashes = sorted(k for k in extras if k in row or k in RESERVED_COLUMNS or not str(k).isidentifier())
    if clashes:
        raise ValueError(
            f"rollout_func returned the extra field(s) {clashes}, which name a column of the dataset row "
            f"({', '.join(row)}), one the trainer passes the reward functions ({', '.join(RESERVED_COLUMNS)}) or no "
            "valid argument name: rename them."
        )
    for key, value in extras.items():
        if isinstance(value, list) and len(value) != rows:
            raise ValueError(
                f"rollout_func's extra field {key!r} is a list of {len(value)} values for {rows} prompts: give one "
                "value per prompt (a value that is not a list goes to every row)."
            )
    return checked, extras


def _rows_of(value, key: str, rows: int) -> list:
    """`value` as a list of `rows` rows, each a list (a tensor or array row converted), or a ValueError."""
    if hasattr(value, "tolist") and not isinstance(value, list):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or len(value) != rows:
        count = f"{len(value)} rows" if isinstance(value, (list, tuple)) else f"a {type(value).__name__}"
        raise ValueError(f"rollout_func returned {count} in {key!r} for {rows} prompts: return one row per prompt.")
    out = []
    for i, row in enumerate(value):
        row = row.tolist() if hasattr(row, "tolist") else row
        if not isinstance(row, (list, tuple)):
            raise ValueError(f"rollout_func's {key}[{i}] is a {type(row).__name__}, not a list (one per token).")
        out.append(list(row))
    return out


def _id_rows(value, key: str, rows: int, vocab_size: int | None) -> list[list[int]]:
    """Token-id rows: non-empty, of integers in [0, vocab_size)."""
    out = _rows_of(value, key, rows)
    for i, ids in enumerate(out):
        if not ids:
            raise ValueError(f"rollout_func's {key}[{i}] is empty: each row needs at least one token (e.g. an EOS).")
        bad = [t for t in ids if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
        if bad:
            raise ValueError(
                f"rollout_func's {key}[{i}] holds {bad[0]!r} ({type(bad[0]).__name__}): token ids are ints."
            )
        wrong = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
        if wrong:
            raise ValueError(
                f"rollout_func's {key}[{i}] holds the token id {wrong[0]}, outside the model's vocabulary "
                f"[0, {vocab_size}): tokenize with trainer.processing_class."
            )
        out[i] = [int(t) for t in ids]
    return out


def _logprob_rows(value, lengths: list[int]) -> list[list[float] | None] | None:
    """Log-prob rows (None: none at all; a row None: none for that row), each of finite numbers, at most as long as
    its completion."""
    if value is None:
        return None
    if hasattr(value, "tolist") and not isinstance(value, list):
        value = value.tolist()
    missing = set()
    if isinstance(value, (list, tuple)):
        missing = {i for i, row in enumerate(value) if row is None}
        value = [[] if row is None else row for row in value]
    out = _rows_of(value, "logprobs", len(lengths))
    for i, row in enumerate(out):
        if len(row) > lengths[i]:
            raise ValueError(
                f"rollout_func's logprobs[{i}] has {len(row)} values for the {lengths[i]} tokens of "
                f"completion_ids[{i}]: give one log-prob per completion token."
            )
        bad = [x for x in row if not isinstance(x, numbers.Real) or isinstance(x, bool) or not math.isfinite(x)]
        if bad:
            raise ValueError(
                f"rollout_func's logprobs[{i}] holds {bad[0]!r}: log-probs are finite numbers. (vLLM reports one it "
                "could not compute as None: give that row as None, and the round trains without the sampler's "
                "log-probs.)"
            )
        out[i] = None if i in missing else [float(x) for x in row]
    return out


def _mask_rows(value, lengths: list[int]) -> list[list[int]] | None:
    """env_mask rows (None: every token sampled), each as long as its completion, of 0s and 1s."""
    if value is None:
        return None
    out = _rows_of(value, "env_mask", len(lengths))
    for i, row in enumerate(out):
        if len(row) != lengths[i]:
            raise ValueError(
                f"rollout_func's env_mask[{i}] has {len(row)} values for the {lengths[i]} tokens of "
                f"completion_ids[{i}]: give one per completion token (1: the model sampled it, 0: the environment "
                "wrote it)."
            )
        if any(x not in (0, 1) for x in row):
            raise ValueError(f"rollout_func's env_mask[{i}] holds values other than 0 and 1: {sorted(set(row))}.")
        out[i] = [int(x) for x in row]
    return out


def _vocab_size(model) -> int | None:
    """The rows of the model's input embeddings (None when it has none to read)."""
    try:
        return int(model.get_input_embeddings().num_embeddings)
    except (AttributeError, TypeError, NotImplementedError):
        return None


def _name(function) -> str:
    return getattr(function, "__name__", repr(function))
