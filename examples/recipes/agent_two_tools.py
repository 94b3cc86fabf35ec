"""The two-tool agent recipe's tools, reward and data, next to its recipe (examples/recipes/agent_two_tools.yaml names
`agent_two_tools:multiply`, `agent_two_tools:add` and `agent_two_tools:final_answer`).

The rows, `agent_two_tools.jsonl` beside this file, are made by `rows()` with a fixed seed; to write them again:

    python examples/recipes/agent_two_tools.py
"""

import json
import random
import re
from pathlib import Path

from grpo import turn_reward

ROWS = Path(__file__).with_suffix(".jsonl")


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a * b


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def final_answer(completions, answer, **kwargs):
    """1.0 when the last integer of the episode's last assistant turn equals the `answer` column, else 0.0.

    Only the answer is paid, never a call: the tools earn their place because the model gets `a * b + c` wrong in its
    head. A turn that still holds a call (the episode ran out of tool turns or tokens) is not an answer.

    >>> call = {"role": "assistant", "content": "<tool_call>...</tool_call>", "tool_calls": [{}]}
    >>> final_answer([[call, {"role": "tool", "content": "408"}, call, {"role": "tool", "content": "500"},
    ...                {"role": "assistant", "content": "500"}],
    ...               [{"role": "assistant", "content": "12 * 34 + 92 = 510"}], [call]], answer=["500"] * 3)
    [1.0, 0.0, 0.0]
    """
    rewards = []
    for completion, gold in zip(completions, answer):
        last = completion[-1] if isinstance(completion, list) else {"role": "assistant", "content": completion}
        answered = last.get("role") == "assistant" and not last.get("tool_calls")
        numbers = re.findall(r"-?\d+", last["content"]) if answered else []
        rewards.append(float(bool(numbers) and numbers[-1] == str(gold).strip()))
    return rewards


@turn_reward
def right_steps(prompts, completions, **kwargs):
    """Turn-level credit (`turn_advantage`): per policy turn, 1.0 when it is the right step of the plan, else 0.0:
    turn 1 calls `multiply(a, b)`, turn 2 calls `add(a * b, c)`, turn 3 calls nothing and its last integer is
    `a * b + c` (a turn cut off by the token budget in the middle of a call is not an answer). A third turn that
    answers (calls nothing) with another number gets 0.5: after two right calls the model's pull is to call `add`
    again, and without this half the choice to answer earns nothing until the answer is also right. The episode's
    answer is paid by `final_answer` too; these say which turn went wrong when it is not.

    >>> prompt = [{"role": "user", "content": "Calculate 12 * 34 + 56."}]
    >>> call = lambda name, a, b: {"role": "assistant", "content": "...", "tool_calls": [
    ...     {"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}]}
    >>> right_steps([prompt] * 4, [
    ...     [call("multiply", 12, 34), {"role": "tool", "content": "408"}, call("add", 408, 56),
    ...      {"role": "tool", "content": "464"}, {"role": "assistant", "content": "408 + 56 = 464"}],
    ...     [call("multiply", 12, 34), {"role": "tool", "content": "408"}, call("add", 408, 65),
    ...      {"role": "tool", "content": "473"}, {"role": "assistant", "content": "408 + 65 = 473"}],
    ...     [call("add", 12, 34), {"role": "tool", "content": "46"}, {"role": "assistant", "content": "408 + 56:\\n<tool"}],
    ...     [call("multiply", 12, 34), {"role": "tool", "content": "408"}, call("add", 408, 56),
    ...      {"role": "tool", "content": "464"}, call("add", 464, 56)],
    ... ])
    [[1.0, 1.0, 1.0], [1.0, 0.0, 0.5], [0.0, 0.0], [1.0, 1.0, 0.0]]
    """
    out = []
    for prompt, completion in zip(prompts, completions):
        question = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        a, b, c = (int(n) for n in re.findall(r"\d+", question)[-3:])
        wanted = [[("multiply", {"a": a, "b": b})], [("add", {"a": a * b, "b": c})], []]
        turns = [m for m in completion if m.get("role") == "assistant"]
        scores = []
        for k, turn in enumerate(turns):
            calls = [(t["function"]["name"], t["function"]["arguments"]) for t in turn.get("tool_calls") or []]
            right = k < len(wanted) and calls == wanted[k]
            if right and k == 2:  # the answer: no call (0.5), and the sum as its last number (1.0)
                numbers = re.findall(r"-?\d+", turn["content"])
                right = 1.0 if numbers and int(numbers[-1]) == a * b + c else 0.5
            scores.append(float(right))
        out.append(scores)
    return out


def rows(count: int = 432, seed: int = 0) -> list[dict]:
    """`count` distinct rows `{"prompt": "Calculate a * b + c.", "answer": "..."}`: a and b of two digits, c of two or
    three, drawn with `random.Random(seed)`.

    >>> rows(2)
    [{'prompt': 'Calculate 59 * 63 + 51.', 'answer': '3768'}, {'prompt': 'Calculate 43 * 75 + 507.', 'answer': '3732'}]
    """
    draw, seen, made = random.Random(seed), set(), []
    while len(made) < count:
        a, b, c = draw.randint(10, 99), draw.randint(10, 99), draw.randint(10, 999)
        if (a, b, c) not in seen:
            seen.add((a, b, c))
            made.append({"prompt": f"Calculate {a} * {b} + {c}.", "answer": str(a * b + c)})
    return made


if __name__ == "__main__":
    ROWS.write_text("".join(json.dumps(row) + "\n" for row in rows()))
    print(f"wrote {ROWS}")
