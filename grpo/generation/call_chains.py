"""Token-exact training sequences from an agent's chat-completions calls (docs/agents.md "Any agent").

An episode's calls are merged into *chains*, each one trained sequence, built as `tools=` episodes are
(episodes.py): the first call's messages (with its `tools`) are rendered by the chat template once, as the chain's
prompt; each answer's ids are the ids the backend sampled; a later call whose messages are the chain's messages plus
the assistant message the endpoint returned (compared as data, field by field: `comparable`) plus new messages
*extends* the chain: the new messages' ids are the template's text after the assistant turn's EOS, rendered once
(`ToolTurnTokens`, which renders any messages, not only tool answers), appended as context (no loss), and the next
answer's sampled ids follow. No text is decoded and encoded again into a chain, so whatever the tokenizer would make
of the decoded answers, the trained ids are the sampled ones.

A call that extends no chain of its episode (the agent edited, summarised or cut its history, or changed its tools)
starts a new chain. Every chain that sampled a token is trained, each as a sequence of its own with the episode's
reward and advantage (a chain whose answers are all empty is not: its calls are counted in `tools/dropped_calls`).
An answer with `n` > 1 choices: the choice the next call extends is the one trained; at the end of a chain, the
first choice.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from grpo.generation.tool_calls import ToolCall


def text_of(content: Any) -> str:
    """A message's content as text: None is "", a list of OpenAI content parts is their text joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def comparable(message: dict) -> dict:
    """`message` as the data it carries, for comparing a request's history with what the endpoint returned: fields
    that are None or empty dropped (clients add `refusal: None`, `audio: None`...), the content as text, each tool
    call as (id, name, arguments parsed from their JSON)."""
    out = {}
    for key, value in message.items():
        if value is None or value == [] or value == "":
            continue
        if key == "content":
            value = text_of(value)
        elif key == "tool_calls" and isinstance(value, list):
            value = [
                (c.get("id"), c.get("function", {}).get("name"), _arguments(c.get("function", {}).get("arguments")))
                if isinstance(c, dict)
                else c
                for c in value
            ]
        out[key] = value
    return out


def for_template(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: content as text, tool-call arguments as objects."""
    out = []
    for message in messages:
        message = {**message, "content": text_of(message.get("content"))}
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))}}
                for c in message["tool_calls"]
            ]
        out.append(message)
    return out


def assistant_message(text: str, calls: list) -> dict:
    """The OpenAI message of one answer: its text, and the calls the run's parser read in it as `tool_calls` (ids
    made here, arguments as JSON strings). With calls, the content is the text before the first `<tool_call>` block
    (None when there is none): the calls are in `tool_calls`."""
    called = [c for c in calls if isinstance(c, ToolCall)]
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if called:
        before = text.split("<tool_call>")[0].strip() if "<tool_call>" in text else ""
        message["content"] = before or None
        message["tool_calls"] = [
            {
                "id": f"call_{secrets.token_hex(8)}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in called
        ]
    return message


@dataclass
class Choice:
    """One sampled answer, not yet part of its chain: the message returned, the sampled ids (cut after the first
    EOS or at the call's limit), the sampler's log-probs (None when the backend reports none), whether it ended with
    an EOS, and the tool calls and parse failures read in it."""

    message: dict
    ids: list[int]
    logprobs: list[float] | None
    ended: bool
    tool_calls: int = 0
    parse_failures: int = 0


@dataclass
class Chain:
    """One trained sequence of an episode: its prompt (the first call's messages and tools, rendered once), the
    completion so far (answers and context), which tokens were sampled, their log-probs (0 on context), and the
    last call's choices, waiting to be extended."""

    prompt_messages: list[dict]
    tools: list[dict] | None
    prompt_ids: list[int]
    prompt_cut: int = 0  # the whole turns the prompt lost to max_prompt_length (encode_prompts)
    messages: list[dict] = field(default_factory=list)  # everything after the prompt that is in `ids`
    ids: list[int] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    choices: list[Choice] = field(default_factory=list)
    calls: int = 0
    tool_calls: int = 0
    parse_failures: int = 0
    backend_logprobs: bool = True  # every answer came with the sampler's log-probs
    closed: bool = False  # its token budget ran out: no call extends it

    def history(self, choice: Choice | None = None) -> list[dict]:
        """The conversation a call must repeat to extend this chain with `choice`."""
        return self.prompt_messages + self.messages + ([choice.message] if choice is not None else [])

    def extension(self, messages: list[dict], tools: list[dict] | None) -> tuple[int, list[dict]] | None:
        """(the choice, the new messages) when `messages` (with `tools`) extend this chain, else None."""
        if self.closed or comparable_tools(tools) != comparable_tools(self.tools):
            return None
        wanted = [comparable(m) for m in messages]
        for k, choice in enumerate(self.choices):
            history = [comparable(m) for m in self.history(choice)]
            if len(wanted) > len(history) and wanted[: len(history)] == history:
                return k, messages[len(history) :]
        return None

    def commit(self, k: int, eos_id: int, with_eos: bool) -> None:
        """Choice `k` becomes part of the chain: its ids as sampled tokens; an answer cut before its EOS gets the
        EOS as context when the chain goes on (`with_eos`), since the template ends every assistant turn with it."""
        choice = self.choices[k]
        self.ids += choice.ids
        self.sampled += [1] * len(choice.ids)
        self.logprobs += choice.logprobs if choice.logprobs is not None else [0.0] * len(choice.ids)
        self.backend_logprobs = self.backend_logprobs and choice.logprobs is not None
        self.tool_calls += choice.tool_calls
        self.parse_failures += choice.parse_failures
        if with_eos and not choice.ended:
            self.add_context([eos_id], [])
        self.messages.append(choice.message)
        self.choices = []

    def add_context(self, ids: list[int], messages: list[dict]) -> None:
        self.ids += ids
        self.sampled += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.messages += messages

    @property
    def policy_tokens(self) -> int:
        return sum(self.sampled) + (len(self.choices[0].ids) if self.choices else 0)

    @property
    def truncated(self) -> bool:
        """Its last answer ran out of tokens before its EOS."""
        return bool(self.choices) and not self.choices[0].ended


def comparable_tools(tools: list[dict] | None) -> list:
    return [json.dumps(t, sort_keys=True) for t in tools or []]
