"""`python -m recipes.mlp` in a checkout: the installed `python -m lightning_trn.recipes.mlp`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("lightning_trn.recipes.mlp", run_name="__main__", alter_sys=True)
