"""Multi-turn episodes with tools (docs/agents.md): the policy writes a turn, the tools it calls answer, the policy
goes on, until a turn calls nothing, `max_tool_calling_iterations` tool turns have run, or the episode's token
budget (`max_completion_length`, every turn and every tool answer together) is spent.

Token in, token out. An episode is one row of the `Rollout`: its prompt, then one "completion" holding every
policy turn and every tool answer in the order they came. The ids of a policy turn are exactly the ids the backend
sampled (cut after the turn's first EOS); the ids of a tool answer are the chat template's rendering of the tool
messages and the next generation prompt, tokenized once (`ToolTurnTokens`). Nothing is decoded and encoded again
between turns, so what the loss trains on is what was sampled, whatever the tokenizer would make of the decoded text.
`Rollout.sampled_mask` marks the policy's own tokens: tool answers are context only (no loss, no KL, no entropy, not
in the length metrics), and the sampler's log-probs are 0 there. `Rollout.turn_index` gives each completion token its
policy turn (0, 1, ...; -1 on tool answers), for turn-level credit (docs/agents.md, "Turn-level credit").

Each turn generates for every episode still going, in one backend call: turn k of an episode is conditioned on its
prompt and everything before it. `model.generate` carries each row's KV cache from one turn to the next and prefills
only the tool answers (`CarriedTurns`, model_generate.py); a vLLM engine finds the earlier turns in its prefix cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from grpo.data import InputError, encode_prompts, is_stream
from grpo.generation.base import Completions, cut_at_eos, limit_for
from grpo.generation.tool_calls import ParseFailure, ToolCall, resolve_parser
from grpo.generation.tool_executor import ToolCounts, ToolExecutor
from grpo.generation.tools import Episode, Toolbox
from grpo.rollout import Rollout

# A ChatML chat template that renders tools in the Hermes format (tools as JSON schemas in the system turn, calls as
# <tool_call> JSON, answers as <tool_response> in a user turn), for ChatML models whose own template ignores `tools`
# (SmolLM2-Instruct's). Prefix-preserving: a turn renders the same whatever follows it. An assistant turn is its text
# as written (its <tool_call> blocks included), so a conversation renders back to the tokens that were sampled.
CHATML_TOOLS_TEMPLATE = (
    "{% set system = messages[0]['content'] if messages and messages[0]['role'] == 'system' else none %}"
    "{% if tools %}<|im_start|>system\n{% if system %}{{ system }}\n\n{% endif %}"
    "You can call functions. Their JSON schemas are within <tools></tools>:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "To call one, write its name and arguments as JSON within <tool_call></tool_call> tags:\n"
    '<tool_call>\n{"name": <function-name>, "arguments": <arguments-object>}\n</tool_call><|im_end|>\n'
    "{% elif system %}<|im_start|>system\n{{ system }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first %}"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_STRING_PROMPT = (
    "Tools need conversational prompts (lists of {{'role': ..., 'content': ...}} messages), rendered by the chat "
    "template with the tools' schemas; got the string prompt {prompt!r}. Wrap it: [{{'role': 'user', 'content': ...}}]."
)
# The text of the tool answer `check_template_renders_tools` looks for in the template's rendering: one no template
# writes of its own.
_ANSWER_MARKER = "grpo-tool-answer-4d1c"
# The episode metrics a round reports, summed over episodes (the trainer turns them into means per episode).
EPISODE_STATS = ("turns", "tool_calls", "tool_errors", "tool_timeouts", "parse_failures", "budget_cuts")


@dataclass
class EpisodeState:
    """One episode as it grows: the completion so far (policy turns and tool answers), which of its tokens the
    policy sampled, the sampler's log-probs (0 on context tokens), and the conversation as messages."""

    episode: Episode
    prompt_ids: list[int]
    prompt_cut: int = 0  # the prompt was longer than max_prompt_length: the whole turns it lost (encode_prompts)
    ids: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)  # per token: its policy turn (0, 1, ...), -1 on tool answers
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    turns: int = 0  # policy turns
    counts: ToolCounts = field(default_factory=ToolCounts)
    truncated: bool = False  # the last policy turn ran out of budget before its EOS
    budget_cut: bool = False  # tool answers came that did not fit in the budget: the episode ended before them
    done: bool = False


class ToolTurnTokens:
    """The token ids that follow a policy turn's EOS when tools answer it: the template's end of that turn, the tool
    messages and the next generation prompt. Rendered on a fixed stand-in conversation (a user message and an empty
    assistant turn), cut after the assistant turn's EOS, so the ids do not depend on what the policy wrote."""

    def __init__(self, tokenizer, eos_token_ids: Sequence[int], chat_template_kwargs: dict | None = None):
        self.tokenizer, self.template_kwargs = tokenizer, chat_template_kwargs or {}
        self.eos_texts = [tokenizer.convert_ids_to_tokens(int(i)) for i in eos_token_ids]
        self.stand_in = [{"role": "user", "content": "?"}, {"role": "assistant", "content": ""}]
        before = tokenizer.apply_chat_template(self.stand_in, tokenize=False, **self.template_kwargs)
        ends = [before.rfind(text) + len(text) for text in self.eos_texts if text and text in before]
        if not ends:
            raise InputError(
                f"The chat template does not end an assistant turn with an EOS token ({self.eos_texts}): tool answers "
                "cannot be appended to the sampled tokens. Give the tokenizer a chat template whose assistant turns "
                "end with its EOS token (docs/agents.md)."
            )
        self.before = before[: max(ends)]

    def __call__(self, tool_messages: list[dict]) -> list[int]:
        after = self.tokenizer.apply_chat_template(
            self.stand_in + tool_messages, tokenize=False, add_generation_prompt=True, **self.template_kwargs
        )
        if not after.startswith(self.before):
            raise InputError(
                "The chat template renders the conversation before a tool answer differently once the answer is "
                "added (it is not prefix-preserving), so tool answers cannot be appended to the sampled tokens. Use "
                "a template that renders earlier turns the same whatever follows (docs/agents.md)."
            )
        return self.tokenizer(after[len(self.before) :], add_special_tokens=False)["input_ids"]


class AgentLoop:
    """The turn loop of one trainer: its tools and environments (`Toolbox`), how calls are parsed and run, and the
    token budget. `rollout` makes a round's `Rollout` of episodes with any generation backend."""

    def __init__(self, toolbox: Toolbox, tokenizer, eos_token_ids: Sequence[int], args, dataset=None):
        self.toolbox, self.tokenizer, self.eos_token_ids, self.args = toolbox, tokenizer, list(eos_token_ids), args
        self.parser = resolve_parser(args.tool_call_parser, getattr(tokenizer, "chat_template", None))
        self.executor = ToolExecutor(
            timeout=args.tool_timeout,
            errors=args.tool_errors,
            max_workers=args.tool_num_workers,
            max_hung=args.tool_max_hung_calls,
        )
        self.tool_turn = ToolTurnTokens(tokenizer, self.eos_token_ids, args.chat_template_kwargs)
        check_template_renders_tools(tokenizer, toolbox.schemas(), args.chat_template_kwargs)
        if (
            dataset is not None
            and not is_stream(dataset)
            and len(dataset)
            and isinstance(dataset[0].get("prompt"), str)
        ):
            raise InputError(_STRING_PROMPT.format(prompt=dataset[0]["prompt"][:60]))

    def give_back(self, columns: dict[str, list]) -> None:
        """A scored round's environment objects (`columns["environments"]`) are free for the next episodes."""
        self.toolbox.give_back(columns.get("environments", ()))

    def close(self) -> None:
        """At the end of training: stop the tool executor and close every environment object (`Toolbox.close`)."""
        self.executor.close()
        self.toolbox.close()

    def rollout(
        self, inputs: list[dict[str, Any]], backend, model: nn.Module, lockstep: Callable[[bool], bool] | None = None
    ) -> tuple[Rollout, dict[str, list]]:
        """The episodes of the dataset rows `inputs`, as a `Rollout` (not scored) and the rows' other columns with
        `environments` (one object per row, None without a factory) for the reward functions. `lockstep`, when
        given, is asked each turn whether any process still has an episode going (a collective call), so that every
        process runs the same number of backend calls (a sharded model generates collectively)."""
        states, logprobs = self._start(inputs), None
        generate = turn_sampler(backend)
        for turn in range(self._turn_limit()):
            going = [s for s in states if not s.done]
            if lockstep is not None and not lockstep(bool(going)):
                break
            if not going and lockstep is None:
                break
            rows = going or states[:1]  # a process with nothing left generates a row it discards (lockstep)
            # No turn asks for more than the most any of its rows has left of its episode's budget.
            left = max(self.args.max_completion_length - len(s.ids) for s in rows) if going else 1
            raw = generate(model, [s.prompt_ids + s.ids for s in rows], left)
            if not going:
                continue
            logprobs = raw.logprobs is not None
            rows_logprobs = raw.logprobs if logprobs else [None] * len(going)
            calls = [self._add_policy_turn(s, ids, lp) for s, ids, lp in zip(going, raw.ids, rows_logprobs)]
            last = turn == self._turn_limit() - 1
            calling = [(s, c) for s, c in zip(going, calls) if c and not s.done and not last]
            for s, c in zip(going, calls):
                s.done = s.done or not c or last
            self._answer(calling)
        return self._to_rollout(states, inputs, bool(logprobs))

    def _turn_limit(self) -> int:
        """Policy turns at most: one more than the tool turns (None: as many as the token budget allows)."""
        limit = self.args.max_tool_calling_iterations
        return self.args.max_completion_length if limit is None else limit + 1

    def _start(self, inputs: list[dict[str, Any]]) -> list[EpisodeState]:
        episodes = self.toolbox.start_episodes(inputs)
        for episode in episodes:
            if isinstance(episode.prompt, str):
                raise InputError(_STRING_PROMPT.format(prompt=episode.prompt[:60]))
        tools = [[t.schema for t in e.tools.values()] for e in episodes]
        args = self.args
        prompt_ids, cut = encode_prompts(
            [e.prompt for e in episodes],
            self.tokenizer,
            args.max_prompt_length,
            args.truncation_side,
            tools,
            args.chat_template_kwargs,
        )
        return [EpisodeState(e, ids, prompt_cut=c) for e, ids, c in zip(episodes, prompt_ids, cut)]

    def _add_policy_turn(self, state: EpisodeState, raw_ids: list[int], raw_logprobs) -> list:
        """Append one sampled turn, cut after its first EOS and to what is left of the budget; return the tool
        calls it makes (parse failures included), or [] when the episode ends with it."""
        left = self.args.max_completion_length - len(state.ids)
        (ids,), (truncated,) = cut_at_eos([raw_ids], self.eos_token_ids, left)
        state.ids += ids
        state.sampled += [1] * len(ids)
        state.turn_ids += [state.turns] * len(ids)
        state.logprobs += list(raw_logprobs[: len(ids)]) if raw_logprobs is not None else [0.0] * len(ids)
        state.turns += 1
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        calls = self.parser(text, list(state.episode.tools)) if not truncated else []
        message: dict[str, Any] = {"role": "assistant", "content": text}
        called = [c for c in calls if isinstance(c, ToolCall)]
        if called:
            message["tool_calls"] = [c.as_message() for c in called]
        state.messages.append(message)
        state.truncated = truncated
        state.done = truncated
        return calls

    def _answer(self, calling: list[tuple[EpisodeState, list[ToolCall | ParseFailure]]]) -> None:
        """Run the calls of every episode that made some, and append their answers as context tokens; an episode
        whose answers do not fit in its budget (with room for one more token) ends before them."""
        if not calling:
            return
        answers, _ = self.executor.run([c for _, c in calling], [s.episode.tools for s, _ in calling])
        for (state, _), episode_answers in zip(calling, answers):
            for answer in episode_answers:
                state.counts.add(answer.status)
            if not episode_answers:  # only unanswered parse failures: nothing to go on with
                state.done = True
                continue
            messages = [a.as_message() for a in episode_answers]
            ids = self.tool_turn(messages)
            if len(state.ids) + len(ids) >= self.args.max_completion_length:
                state.budget_cut, state.done = True, True
                continue
            state.ids += ids
            state.sampled += [0] * len(ids)
            state.turn_ids += [-1] * len(ids)
            state.logprobs += [0.0] * len(ids)
            state.messages += messages

    def _to_rollout(self, states: list[EpisodeState], inputs: list[dict[str, Any]], logprobs: bool):
        rollout = Rollout.from_tokens(
            [s.episode.prompt for s in states],
            [s.messages for s in states],
            [s.prompt_ids for s in states],
            [s.ids for s in states],
            [s.truncated for s in states],
            self.tokenizer.pad_token_id,
            mask_truncated=self.args.mask_truncated_completions,
            sampling_logps=[s.logprobs for s in states] if logprobs else None,
            sampled_masks=[s.sampled for s in states],
            turn_indices=[s.turn_ids for s in states],
        )
        rollout.episode_stats = episode_stats(states)
        rollout.prompt_truncated = torch.tensor([s.prompt_cut for s in states], dtype=torch.long)
        columns = {key: [row[key] for row in inputs] for key in inputs[0] if key != "prompt"}
        columns["environments"] = [s.episode.environment for s in states]
        return rollout, columns


def turn_sampler(backend) -> Callable[[nn.Module, list[list[int]], int], Completions]:
    """What samples the turns of this process's episodes in one round with `backend`, as `sample(model, contexts,
    max_new_tokens)`: its `generate`, except for
    - a backend that can carry a batch's KV cache across turns (`model.generate`: `turns()`), whose turn sampler
      prefills only what each turn adds;
    - the vLLM server backend, whose `generate` gathers every process's rows as groups of G equal prompts (a first
      turn's shape, not a later one's); its `generate_local` sends this process's rows itself, with no collective
      call. The server's prefix cache serves the contexts that earlier turns computed.
    `max_new_tokens` reaches a `generate` that takes it (`limit_for`); one that does not samples its own length."""
    from grpo.generation.vllm.server_backend import VLLMGeneration

    if hasattr(backend, "turns"):
        generate = backend.turns().generate
    else:
        generate = backend.generate_local if isinstance(backend, VLLMGeneration) else backend.generate
    takes_limit = bool(limit_for(generate, {"max_new_tokens": 1}))

    def sample(model: nn.Module, contexts: list[list[int]], max_new_tokens: int) -> Completions:
        return generate(model, contexts, max_new_tokens=max_new_tokens) if takes_limit else generate(model, contexts)

    return sample


def make_agent(toolbox: Toolbox | None, tokenizer, eos_token_ids: Sequence[int], args, dataset=None):
    """The trainer's `AgentLoop` for its tools and environments (None without): checks that the chat template
    renders the tools and that the training prompts are conversations, when the trainer is built."""
    return None if toolbox is None else AgentLoop(toolbox, tokenizer, eos_token_ids, args, dataset)


def episode_stats(states: Sequence[EpisodeState]) -> dict[str, float]:
    """This process's sums of `EPISODE_STATS` over its episodes, their count (`episodes`), and the calls of unknown
    tools (`unknown_tools`, also in `parse_failures`), which `tools/failure_frequency` counts as failed calls."""
    return {
        "episodes": float(len(states)),
        "turns": float(sum(s.turns for s in states)),
        "tool_calls": float(sum(s.counts.calls for s in states)),
        "tool_errors": float(sum(s.counts.errors for s in states)),
        "tool_timeouts": float(sum(s.counts.timeouts for s in states)),
        "parse_failures": float(sum(s.counts.parse_failures for s in states)),
        "budget_cuts": float(sum(s.budget_cut for s in states)),
        "unknown_tools": float(sum(s.counts.unknown_tools for s in states)),
    }


def check_template_renders_tools(tokenizer, schemas: list[dict], chat_template_kwargs: dict | None = None) -> None:
    """Refuse a chat template that drops the tools (many do, SmolLM2-Instruct's among them): the model would never
    learn what it may call; or one that drops `tool` messages: the model would never see what its calls answered.
    Checked once, when the trainer is built, on the conversation `ToolTurnTokens` renders tool answers after."""
    if not schemas:
        return
    if getattr(tokenizer, "chat_template", None) is None:
        raise InputError("Tools need a tokenizer with a chat template that renders them; this tokenizer has none.")
    kwargs = chat_template_kwargs or {}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tools=schemas, tokenize=False, **kwargs)
    missing = [s["function"]["name"] for s in schemas if s["function"]["name"] not in text]
    if missing:
        raise InputError(
            f"The tokenizer's chat template does not render the tools {missing} (it ignores `tools=`), so the model "
            "would never see them. Give it a template that does, e.g. grpo.generation.episodes.CHATML_TOOLS_TEMPLATE "
            "for a ChatML model (tokenizer.chat_template = ...; docs/agents.md)."
        )
    name = schemas[0]["function"]["name"]
    conversation = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "name": name, "content": _ANSWER_MARKER},
    ]
    try:
        text = tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=False, **kwargs)
    except Exception as error:  # e.g. a template that requires a `tool_call_id` the trainer's messages do not have
        raise InputError(
            f"The tokenizer's chat template fails on a tool answer ({{'role': 'tool', 'name': ..., 'content': ...}}): "
            f"{type(error).__name__}: {error}. Give it a template that renders such messages, e.g. "
            "grpo.generation.episodes.CHATML_TOOLS_TEMPLATE for a ChatML model (docs/agents.md)."
        ) from error
    if _ANSWER_MARKER not in text:
        raise InputError(
            "The tokenizer's chat template renders the tools but not the tool answers (messages of role 'tool'), so "
            "the model would never see what its calls return, while the metrics count them as answered. Give it a "
            "template that renders tool messages, e.g. grpo.generation.episodes.CHATML_TOOLS_TEMPLATE for a ChatML "
            "model (tokenizer.chat_template = ...; docs/agents.md)."
        )
