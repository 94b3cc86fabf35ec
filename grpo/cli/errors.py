"""`RecipeError`, apart from the recipe reader (grpo/cli/recipe.py, which loads `GRPOConfig` and with it torch), so
that the command line catches it, and raises it for a usage mistake, without loading either."""

from grpo.errors import InputError


class RecipeError(InputError):
    """A recipe (or a command-line override) that cannot be used as written; the message says what to change."""
