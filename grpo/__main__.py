"""`python -m grpo ...` runs the command line; `accelerate launch -m grpo train RECIPE.yaml` uses this too."""

import sys

from grpo.cli import main

if __name__ == "__main__":
    sys.exit(main())
