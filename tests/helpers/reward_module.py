"""A reward module for the recipe tests: `tests.helpers.reward_module:contains_digit` and a factory."""


def contains_digit(completions, **kwargs):
    """1.0 when the completion text holds a digit."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(any(ch.isdigit() for ch in text)) for text in texts]


def length_at_most(limit):
    def length_at_most(completions, **kwargs):
        return [float(len(c if isinstance(c, str) else c[-1]["content"]) <= limit) for c in completions]

    return length_at_most
