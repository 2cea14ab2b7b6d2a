"""`python -m recipes.bert` in a checkout: the installed `python -m lightning_trn.recipes.bert`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("lightning_trn.recipes.bert", run_name="__main__", alter_sys=True)
