"""`python -m recipes.vit` in a checkout: the installed `python -m lightning_trn.recipes.vit`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("lightning_trn.recipes.vit", run_name="__main__", alter_sys=True)
