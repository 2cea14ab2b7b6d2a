"""`python -m lightning_trn.recipes.llm [fit|export] [key=value ...] [--help]` (`lightning_trn.recipes.cli`)."""

from lightning_trn.recipes.cli import main
from lightning_trn.recipes.llm import RECIPE

if __name__ == "__main__":
    main(RECIPE)
