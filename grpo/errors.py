"""The error type of bad input, in a module that imports nothing, so that the command line can name and catch it
without loading torch (`grpo --help` and the usage errors answer at once). `grpo.data` re-exports it."""


class InputError(ValueError):
    """Bad input found before training starts (a data set, a reward, a recipe); the message names it and the fix."""
