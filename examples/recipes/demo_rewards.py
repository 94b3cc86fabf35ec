"""The demo's rewards, next to its recipe (examples/recipes/demo.yaml names `demo_rewards:answer_then_stop`)."""

import re

# What may follow the answer in a reply that stopped there: closing punctuation and white space, nothing else.
_END = re.compile(r"[\s.!)\]]*")


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


def answer_then_stop(completions, answer, **kwargs):
    """`last_number`, with full pay only for a reply that ends at its answer: 1.0 when the last integer is the
    `answer` and nothing but punctuation follows it, 0.5 when the right answer is followed by more words, else 0.0.

    The half pay for talking on is there to teach the model to end its reply (emit EOS) after the answer, so that a
    longer `max_completion_length` changes nothing: with `last_number` alone, "6 + 4 = 10" followed by an
    explanation that the 12-token limit cuts earns as much as the bare answer, and the model keeps talking.

    >>> answer_then_stop(["1 + 9 = 10", "1 + 9 = 10.\\n\\nThe sum", "The answer is 10, because", "1 + 9 = 11"],
    ...                  answer=["10", "10", "10", "10"])
    [1.0, 0.5, 0.5, 0.0]
    """
    rewards = []
    for completion, gold in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        found = list(re.finditer(r"-?\d+", text))
        if not found or found[-1].group() != str(gold).strip():
            rewards.append(0.0)
            continue
        rewards.append(1.0 if _END.fullmatch(text[found[-1].end() :]) else 0.5)
    return rewards
