"""The demo's reward, next to its recipe (examples/recipes/demo.yaml names it `demo_rewards:last_number`)."""

import re


def last_number(completions, answer, **kwargs):
    """1.0 when the last integer of the reply equals the `answer` column, else 0.0.

    Deliberately literal: the built-in `accuracy` with math-verify evaluates a restated "1 + 9" to 10, and a demo run
    learned to restate the question without answering ("To calculate 1 + 9, you simply add them") for full reward.

    >>> last_number(["1 + 9 = 10", "To calculate 1 + 9, you simply add them", "ten"], answer=["10", "10", "10"])
    [1.0, 0.0, 0.0]
    """
    rewards = []
    for completion, gold in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", text)
        rewards.append(float(bool(numbers) and numbers[-1] == str(gold).strip()))
    return rewards
