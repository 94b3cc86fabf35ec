"""The agent demo's tool and reward, next to its recipe (examples/recipes/agent_calculator.yaml names them
`agent_calculator:multiply` and `agent_calculator:final_answer`)."""

import re


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a * b


def final_answer(completions, answer, **kwargs):
    """1.0 when the last integer of the episode's last assistant turn equals the `answer` column, else 0.0.

    Only the answer is paid, not the call: the model earns its reward by calling `multiply` only because that is how
    it gets two-digit products right. A turn that still holds a call (the episode ran out of tool turns or tokens)
    is not an answer.

    >>> call = {"role": "assistant", "content": "<tool_call>...</tool_call>", "tool_calls": [{}]}
    >>> final_answer([[call, {"role": "tool", "content": "408"}, {"role": "assistant", "content": "12 * 34 = 408"}],
    ...               [{"role": "assistant", "content": "12 * 34 = 418"}], [call]], answer=["408", "408", "408"])
    [1.0, 0.0, 0.0]
    """
    rewards = []
    for completion, gold in zip(completions, answer):
        last = completion[-1] if isinstance(completion, list) else {"role": "assistant", "content": completion}
        answered = last.get("role") == "assistant" and not last.get("tool_calls")
        numbers = re.findall(r"-?\d+", last["content"]) if answered else []
        rewards.append(float(bool(numbers) and numbers[-1] == str(gold).strip()))
    return rewards
