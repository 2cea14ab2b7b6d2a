"""Checkout-only aliases: `python -m recipes.<name>` runs `python -m lightning_trn.recipes.<name>`.

The wheel does not install this package (a top-level `recipes` would shadow users' own); pip users run
`python -m lightning_trn.recipes.<name>`.
"""
