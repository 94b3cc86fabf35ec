"""The two-tool agent recipe's tools, reward and data, next to its recipe (examples/recipes/agent_two_tools.yaml names
`agent_two_tools:multiply`, `agent_two_tools:add` and `agent_two_tools:final_answer`).

The rows, `agent_two_tools.jsonl` beside this file, are made by `rows()` with a fixed seed; to write them again:

    python examples/recipes/agent_two_tools.py
"""

import json
import random
import re
from pathlib import Path

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
