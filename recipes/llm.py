"""`python -m recipes.llm` in a checkout: the installed `python -m lightning_trn.recipes.llm`."""

import runpy

if __name__ == "__main__":
    runpy.run_module("lightning_trn.recipes.llm", run_name="__main__", alter_sys=True)
