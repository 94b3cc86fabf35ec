"""Agents that call a chat API themselves, trained as they are (`GRPOTrainer(agent_func=...)`, docs/agents.md
"Any agent").

`EndpointAgent` plays the part `AgentLoop` (episodes.py) plays for `tools=`: the round maker asks it for a round's
`Rollout` (`rollout`), and it answers with one trained sequence per dataset row. For a round it
  1. gives each row an episode id and starts `agent_func(row, endpoint)` G times per prompt, each in a thread of its
     own (an `async def` function runs on an event loop in that thread), against the trainer's OpenAI-compatible
     endpoint (endpoint.py, started at the first round and kept for the run, closed by `close`);
  2. runs the batching loop in the round's thread, the one that owns the model: the requests that episodes have
     queued are sent to the generation backend together (`turn_sampler(backend)`: `model.generate` carries KV
     caches across calls, vLLM finds earlier turns in its prefix cache), as soon as every running episode has one
     waiting, or `BATCH_WINDOW` seconds after the first of them arrived; each answer is built from the sampled ids;
  3. merges each episode's calls into token-exact chains (call_chains.py) and makes the rollout: one row per
     episode, its longest chain, and its other chains as extra sequences (rows of their own with the episode's
     advantage, made when the advantages are known: `Rollout.with_extra_sequences`), with the rows' columns and what
     each function returned for the reward functions.

An episode whose function raises, returns something other than a dict or None, or runs past `agent_timeout` is a
*failed* episode: a log line names its row and the error, the reward functions see the error in the `agent_error`
column, and every reward of the row is then `agent_failure_reward` (None: unscored, advantage 0). The run goes on. A
function that times out cannot be stopped: its thread runs on (a daemon thread), and its later requests get 401.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from grpo.data import RESERVED_COLUMNS, InputError, encode_prompts, is_conversational
from grpo.generation.base import cut_at_eos, policy_logprobs
from grpo.generation.call_chains import Chain, Choice, assistant_message, for_template
from grpo.generation.endpoint import MODEL_NAME, Call, ChatEndpoint, RequestError
from grpo.generation.episodes import EPISODE_STATS, ToolTurnTokens, turn_sampler
from grpo.generation.settings import SamplingSettings
from grpo.generation.tool_calls import ParseFailure, ToolCall, resolve_parser
from grpo.rollout import Rollout

logger = logging.getLogger(__name__)

BATCH_WINDOW = 0.05  # seconds a queued request waits for the other episodes' before the batch is generated
# Columns the reward functions get from this module; an agent function's dict may not name them (nor a row column).
AGENT_COLUMNS = ("agent_error", "environments", *RESERVED_COLUMNS)


def check_agent_func(agent_func, tools, environment_factory) -> None:
    """Refuse, when the trainer is built, an agent function that cannot be called as `agent_func(row, endpoint)`
    or that is given with `tools=` / `environment_factory` (one way of running episodes per trainer)."""
    if agent_func is None:
        return
    if tools or environment_factory is not None:
        raise InputError(
            "agent_func runs the whole episode itself, so it cannot be combined with tools= or environment_factory "
            "(the agent calls its own tools). Pass one of them."
        )
    if not callable(agent_func):
        raise InputError(f"agent_func must be a function `f(row, endpoint)`, got a {type(agent_func).__name__}.")
    try:
        inspect.signature(agent_func).bind(None, None)
    except TypeError as error:
        raise InputError(
            f"agent_func {getattr(agent_func, '__name__', agent_func)!r} must take two positional arguments, "
            f"(row, endpoint): {error}. The row is the dataset row; the endpoint has base_url, api_key and model."
        ) from error
    except ValueError:  # a builtin without a signature: called as it is
        pass


class Episode:
    """One run of the agent function: its row, its chains, and how it ended."""

    def __init__(self, episode_id: str, index: int, row: dict, deadline: float):
        self.id, self.index, self.row, self.deadline = episode_id, index, row, deadline
        self.chains: list[Chain] = []
        self.result: dict | None = None
        self.error: str | None = None
        self.finished = False  # the function returned or raised
        self.timed_out = False
        self.waited = 0.0  # seconds its requests waited for the trainer: not counted against agent_timeout

    @property
    def over(self) -> bool:
        return self.finished or self.timed_out

    def trained_chains(self) -> list[Chain]:
        """The chains trained, each a sequence of its own: first the one with the most sampled tokens (the latest of
        equals), which is the episode's row, then the others that sampled any token, in the order they started."""
        chains = [c for c in self.chains if c.policy_tokens]
        if not chains:
            return []
        first = max(reversed(chains), key=lambda c: c.policy_tokens)
        return [first, *(c for c in chains if c is not first)]


class EndpointAgent:
    """The agent function of one trainer (module docstring): `rollout` makes a round's episodes, `give_back` and
    `close` are the round maker's calls at the end of a round and of training."""

    def __init__(self, agent_func: Callable, tokenizer, eos_token_ids: Sequence[int], args):
        self.function, self.tokenizer, self.args = agent_func, tokenizer, args
        self.eos_token_ids = list(eos_token_ids)
        self.parser = resolve_parser(args.tool_call_parser, getattr(tokenizer, "chat_template", None))
        self.context_tokens = ToolTurnTokens(tokenizer, self.eos_token_ids, args.chat_template_kwargs)
        # The EOS the template ends an assistant turn with: added as context after an answer cut before its own.
        self.turn_eos = next(
            (i for i in self.eos_token_ids if self.context_tokens.before.endswith(tokenizer.convert_ids_to_tokens(i))),
            self.eos_token_ids[0],
        )
        self.sampling = SamplingSettings.from_config(args)
        self.endpoint: ChatEndpoint | None = None
        self.condition = threading.Condition()
        self.pending: list[Call] = []
        self.rounds = 0
        self.batch_window = BATCH_WINDOW

    # ---- The round maker's calls ----

    def rollout(self, inputs: list[dict[str, Any]], backend, model, lockstep=None) -> tuple[Rollout, dict[str, list]]:
        """The episodes of the dataset rows `inputs` as a `Rollout` (not scored) and the columns for the rewards."""
        if lockstep is not None:
            raise InputError(
                "agent_func cannot run on a sharded policy (FSDP, ZeRO-3 generating collectively): each process "
                "serves its own episodes. Use data parallelism or vLLM."
            )
        if self.endpoint is None:
            self.endpoint = ChatEndpoint(self.submit, self.sampling)
            # A trainer dropped without `close` (no train(), or a failure) frees the port when it is collected.
            weakref.finalize(self, self.endpoint.close)
        self.rounds += 1
        deadline = time.monotonic() + self.args.agent_timeout
        episodes = [Episode(f"r{self.rounds}e{i}", i, dict(row), deadline) for i, row in enumerate(inputs)]
        self.endpoint.open_episodes([e.id for e in episodes])
        for episode in episodes:
            endpoint = self.endpoint.endpoint(episode.id)
            threading.Thread(
                target=self._run, args=(episode, endpoint), name=f"agent-{episode.id}", daemon=True
            ).start()
        try:
            self._serve(episodes, turn_sampler(backend), model)
        finally:
            self.endpoint.close_episodes([e.id for e in episodes])
            self._refuse_pending(lambda call: True, "The round is over: this episode no longer runs.", 401)
        return self._to_rollout(episodes)

    def give_back(self, columns: dict[str, list]) -> None:
        """Nothing to give back: agent functions hold their own resources."""

    def close(self) -> None:
        """At the end of training: stop the endpoint (a later round starts a new one)."""
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None

    def score_failures(self, scores, columns: dict[str, list]):
        """`scores` (`RewardScores`) with every reward of a failed episode's row set to `agent_failure_reward`
        (NaN for None: unscored) and its step rewards unscored."""
        failed = [i for i, error in enumerate(columns.get("agent_error", ())) if error is not None]
        if not failed:
            return scores
        value = self.args.agent_failure_reward
        rewards = scores.rewards.clone()
        rewards[failed] = torch.nan if value is None else float(value)
        steps = scores.step_rewards
        if steps is not None and steps.numel():
            steps = steps.clone()
            steps[failed] = torch.nan
        return scores._replace(rewards=rewards, step_rewards=steps)

    # ---- The agents' threads ----

    def _run(self, episode: Episode, endpoint) -> None:
        """Run the agent function for one episode; record its result or its error, then wake the round's thread."""
        try:
            result = self.function(dict(episode.row), endpoint)
            if inspect.isawaitable(result):
                result = asyncio.run(_awaited(result))
            episode.result = self._checked_result(result, episode.row)
        except BaseException as error:  # noqa: BLE001 (any failure of the user's function is the episode's)
            episode.error = f"{type(error).__name__}: {error}"
        finally:
            with self.condition:
                episode.finished = True
                self.condition.notify_all()
        if episode.error is not None and not episode.timed_out:
            logger.warning("agent_func failed on row %s: %s", _row_label(episode), episode.error)

    @staticmethod
    def _checked_result(result, row: dict) -> dict | None:
        if result is None:
            return None
        if not isinstance(result, dict):
            raise TypeError(
                f"agent_func returned a {type(result).__name__}; it must return a dict of columns for the reward "
                "functions (e.g. {'answer': text}) or None."
            )
        clashes = sorted(k for k in result if k in row or k in AGENT_COLUMNS or not str(k).isidentifier())
        if clashes:
            raise ValueError(
                f"agent_func returned the keys {clashes}, which name a column of the row, a column the trainer "
                f"passes ({', '.join(AGENT_COLUMNS)}) or no valid argument name: rename them."
            )
        return result

    def submit(self, call: Call) -> None:
        """A checked request from the endpoint's handler thread: queued for the round's thread."""
        with self.condition:
            self.pending.append(call)
            self.condition.notify_all()

    # ---- The round's thread: batching and answering ----

    def _serve(self, episodes: list[Episode], generate, model) -> None:
        """Until every episode is over: wait for a batch of requests (`_next_batch`) and answer it."""
        by_id = {e.id: e for e in episodes}
        while True:
            batch = self._next_batch(episodes)
            if batch is None:
                return
            self._answer(batch, by_id, generate, model)

    def _next_batch(self, episodes: list[Episode]) -> list[Call] | None:
        """The queued requests, once every running episode has one waiting or the first has waited BATCH_WINDOW
        seconds; None when every episode is over. Episodes past their deadline are marked timed out here."""
        with self.condition:
            while True:
                now, waiting = time.monotonic(), {call.episode for call in self.pending}
                for episode in episodes:
                    if not episode.over and episode.id not in waiting and now >= episode.deadline + episode.waited:
                        episode.timed_out = True
                        episode.error = f"TimeoutError: agent_func ran past agent_timeout={self.args.agent_timeout}s"
                        logger.warning("agent_func timed out on row %s: %s", _row_label(episode), episode.error)
                over = {e.id for e in episodes if e.over}
                self._refuse_locked(
                    lambda call, over=over: call.episode in over, "The episode is over (it timed out).", 408
                )
                running = [e for e in episodes if not e.over]
                if not running:
                    return None
                if self.pending and (
                    all(e.id in waiting for e in running) or now >= self.pending[0].arrived + self.batch_window
                ):
                    batch, self.pending = self.pending, []
                    return batch
                wake = min((e.deadline + e.waited for e in running if e.id not in waiting), default=now + 3600)
                if self.pending:
                    wake = min(wake, self.pending[0].arrived + self.batch_window)
                self.condition.wait(max(wake - now, 0.001))

    def _refuse_pending(self, which: Callable[[Call], bool], message: str, status: int) -> None:
        with self.condition:
            self._refuse_locked(which, message, status)

    def _refuse_locked(self, which: Callable[[Call], bool], message: str, status: int) -> None:
        refused = [call for call in self.pending if which(call)]
        self.pending = [call for call in self.pending if not which(call)]
        for call in refused:
            call.answer(status, RequestError(message, status=status).body())

    def _answer(self, batch: list[Call], by_id: dict[str, Episode], generate, model) -> None:
        """Render each request onto its episode's chain, generate every row of the batch in one backend call, and
        answer each request from its rows."""
        planned = []
        for call in batch:
            try:
                planned.append((call, *self._plan(call, by_id[call.episode])))
            except RequestError as error:
                call.answer(error.status, error.body())
        rows = [
            chain.prompt_ids + chain.ids for call, chain, limit in planned if limit > 0 for _ in range(call.body["n"])
        ]
        # One backend call for the batch: it may sample up to the largest limit among its rows (each is cut to its own).
        most = max((limit for _, _, limit in planned), default=0)
        try:
            raw = generate(model, rows, most) if rows else None
        except BaseException:
            for call, _, _ in planned:
                call.answer(500, RequestError("Generation failed in the trainer.", status=500).body())
            raise
        position = 0
        for call, chain, limit in planned:
            n = call.body["n"]
            if limit <= 0:  # the episode's token budget is spent: an empty answer, cut for length
                chain.choices = [Choice({"role": "assistant", "content": ""}, [], [], False)] * n
                chain.closed = True
            else:
                ids = raw.ids[position : position + n]
                logprobs = raw.logprobs[position : position + n] if raw.logprobs is not None else [None] * n
                chain.choices = [self._choice(i, lp, limit, call.body) for i, lp in zip(ids, logprobs)]
                position += n
            chain.calls += 1
            call.answer(200, self._response(call, chain, model))
        for call in batch:
            by_id[call.episode].waited += time.monotonic() - call.arrived

    def _plan(self, call: Call, episode: Episode) -> tuple[Chain, int]:
        """The chain `call` goes on (extended with its new messages as context) or starts, and how many tokens its
        answer may take (0: the episode's budget, max_completion_length, is spent)."""
        messages, tools, budget = call.body["messages"], call.body["tools"], self.args.max_completion_length
        found = None
        for candidate in reversed(episode.chains):
            extension = candidate.extension(messages, tools)
            if extension is not None:
                found = candidate, extension
                break
        if found is not None:
            chain, (k, new) = found
            chain.commit(k, self.turn_eos, with_eos=True)
            try:
                ids = self.context_tokens(for_template(new))
            except Exception as error:  # noqa: BLE001 (a template error on the agent's messages is a bad request)
                raise RequestError(f"The chat template cannot render the new messages: {error}", "messages") from error
            if len(chain.ids) + len(ids) >= budget:
                return chain, 0
            chain.add_context(ids, list(new))
        else:
            try:
                prompt_ids, cut = encode_prompts(
                    [for_template(messages)],
                    self.tokenizer,
                    self.args.max_prompt_length,
                    self.args.truncation_side,
                    [tools],
                    self.args.chat_template_kwargs,
                )
            except InputError as error:  # longer than max_prompt_length, even with only the last turn
                raise RequestError(str(error), "messages") from error
            except Exception as error:  # noqa: BLE001
                raise RequestError(f"The chat template cannot render the messages: {error}", "messages") from error
            chain = Chain(list(messages), tools, prompt_ids[0], cut[0])
            episode.chains.append(chain)
        limit = budget - len(chain.ids)
        return chain, limit if call.body["max_tokens"] is None else min(limit, call.body["max_tokens"])

    def _choice(self, raw_ids: list[int], raw_logprobs, limit: int, body: dict) -> Choice:
        """One sampled row as an answer: cut after its first EOS (or at `limit`), decoded, its tool calls parsed
        by the run's parser when the request offers tools and tool_choice is "auto"."""
        (ids,), (truncated,) = cut_at_eos([raw_ids], self.eos_token_ids, limit)
        logprobs = list(raw_logprobs[: len(ids)]) if raw_logprobs is not None else None
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        calls = []
        if body["tools"] and body["tool_choice"] == "auto" and not truncated:
            calls = self.parser(text, [t.get("function", {}).get("name") for t in body["tools"]])
        return Choice(
            assistant_message(text, calls),
            ids,
            logprobs,
            not truncated,
            tool_calls=sum(isinstance(c, ToolCall) for c in calls),
            parse_failures=sum(isinstance(c, ParseFailure) for c in calls),
        )

    def _response(self, call: Call, chain: Chain, model) -> dict:
        """The OpenAI chat-completion object of `chain`'s new choices."""
        choices = []
        for k, choice in enumerate(chain.choices):
            finish = "length" if not choice.ended else "tool_calls" if "tool_calls" in choice.message else "stop"
            entry = {"index": k, "message": choice.message, "finish_reason": finish, "logprobs": None}
            if call.body["logprobs"]:
                entry["logprobs"] = {"content": self._token_logprobs(chain, choice, model)}
            choices.append(entry)
        prompt_tokens = len(chain.prompt_ids) + len(chain.ids)
        completion_tokens = sum(len(c.ids) for c in chain.choices)
        return {
            "id": f"chatcmpl-{call.episode}-{chain.calls}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": MODEL_NAME,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    @torch.no_grad()
    def _token_logprobs(self, chain: Chain, choice: Choice, model) -> list[dict]:
        """`logprobs.content` of one choice: the sampler's log-probs, or (a backend that reports none, such as
        `model.generate`) the policy's at the run's temperature from one forward pass."""
        values = choice.logprobs
        if values is None and choice.ids:
            context = chain.prompt_ids + chain.ids
            (values,) = policy_logprobs(model, [context], [choice.ids], self.sampling.temperature)
        out = []
        for token, value in zip(choice.ids, values or []):
            text = self.tokenizer.decode([token])
            out.append({"token": text, "logprob": value, "bytes": list(text.encode()), "top_logprobs": []})
        return out

    # ---- The round's rollout ----

    def _to_rollout(self, episodes: list[Episode]) -> tuple[Rollout, dict[str, list]]:
        """One row per episode, its first trained chain (a failed episode without one: its row's prompt and one EOS
        as context, nothing trained), its other trained chains as the row's `extra_sequences` (rows of their own
        once the advantages are known, rollout.py), and the columns for the reward functions."""
        trained = [e.trained_chains() for e in episodes]
        rows = [
            self._chain_row(chains[0]) if chains else self._untrained_row(e) for e, chains in zip(episodes, trained)
        ]
        chains = [c for row in trained for c in row]
        with_logprobs = bool(chains) and all(c.backend_logprobs for c in chains)
        rollout = Rollout.from_tokens(
            [r["prompt"] for r in rows],
            [r["completion"] for r in rows],
            [r["prompt_ids"] for r in rows],
            [r["completion_ids"] for r in rows],
            [r["truncated"] for r in rows],
            self.tokenizer.pad_token_id,
            mask_truncated=self.args.mask_truncated_completions,
            sampling_logps=[r["logprobs"] for r in rows] if with_logprobs else None,
            sampled_masks=[r["sampled"] for r in rows],
        )
        rollout.episode_stats = agent_stats(episodes, trained)
        rollout.prompt_truncated = torch.tensor([r["prompt_cut"] for r in rows], dtype=torch.long)
        extras = [[self._chain_row(c) for c in row[1:]] for row in trained]
        rollout.extra_sequences = extras if any(extras) else None
        return rollout, self._columns(episodes)

    def _untrained_row(self, episode: Episode) -> dict:
        """The row of an episode without a trained chain: its prompt and one EOS as context, nothing trained."""
        prompt = episode.row.get("prompt")
        try:
            prompt_ids = encode_prompts([prompt], self.tokenizer, self.args.max_prompt_length)[0][0]
        except Exception:  # noqa: BLE001 (a row the function read its own way: its prompt is not trained anyway)
            prompt_ids = [self.turn_eos]
        return {
            "prompt": prompt if isinstance(prompt, str) or is_conversational(prompt or []) else str(prompt),
            "completion": [{"role": "assistant", "content": ""}],
            "prompt_ids": prompt_ids or [self.turn_eos],
            "prompt_cut": 0,
            "completion_ids": [self.turn_eos],
            "sampled": [0],
            "logprobs": [0.0],
            "truncated": False,
        }

    def _chain_row(self, chain: Chain) -> dict:
        """A trained chain as the lists a row is made of; its last answer (choice 0 of it) committed."""
        truncated = chain.truncated
        if chain.choices:
            chain.commit(0, self.turn_eos, with_eos=False)
        return {
            "prompt": chain.prompt_messages,
            "completion": chain.messages,
            "prompt_ids": chain.prompt_ids,
            "prompt_cut": chain.prompt_cut,
            "completion_ids": chain.ids,
            "sampled": chain.sampled,
            "logprobs": chain.logprobs,
            "truncated": truncated,
        }

    def _columns(self, episodes: list[Episode]) -> dict[str, list]:
        """The rows' columns but `prompt`, each key the functions returned (None where a row's did not), and
        `agent_error` (None, or the failure as text)."""
        columns = {key: [e.row.get(key) for e in episodes] for key in episodes[0].row if key != "prompt"}
        returned = dict.fromkeys(key for e in episodes for key in (e.result or {}))
        for key in returned:
            columns[key] = [(e.result or {}).get(key) if e.error is None else None for e in episodes]
        columns["agent_error"] = [e.error for e in episodes]
        return columns


def agent_stats(episodes: list[Episode], trained: list[list[Chain]]) -> dict[str, float]:
    """This process's sums of `EPISODE_STATS` over the trained chains (`trained`: each episode's), and of the
    agent's own counts: failed and timed-out episodes, the trained sequences, and the calls of chains not trained
    (`dropped_calls`: their answers sampled no token)."""
    chains = [c for row in trained for c in row]
    stats = dict.fromkeys(EPISODE_STATS, 0.0)
    stats.update(
        {
            "episodes": float(len(episodes)),
            "turns": float(sum(c.calls for c in chains)),
            "tool_calls": float(sum(c.tool_calls for c in chains)),
            "parse_failures": float(sum(c.parse_failures for c in chains)),
            "budget_cuts": float(sum(c.closed for c in chains)),
            "agent_failures": float(sum(e.error is not None and not e.timed_out for e in episodes)),
            "agent_timeouts": float(sum(e.timed_out for e in episodes)),
            "sequences": float(len(chains)),
            "dropped_calls": float(
                sum(c.calls for e, t in zip(episodes, trained) for c in e.chains if all(c is not k for k in t))
            ),
        }
    )
    return stats


def make_endpoint_agent(agent_func, tokenizer, eos_token_ids: Sequence[int], args) -> EndpointAgent | None:
    """The trainer's `EndpointAgent` for `agent_func` (None without one)."""
    return None if agent_func is None else EndpointAgent(agent_func, tokenizer, eos_token_ids, args)


async def _awaited(awaitable):
    return await awaitable


def _row_label(episode: Episode) -> str:
    """A failed episode's row, for the log line: its index in the round and its columns, shortened."""
    text = repr(episode.row)
    return f"{episode.index} ({text[:200]}{'...' if len(text) > 200 else ''})"
