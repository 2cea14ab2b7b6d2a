"""The native suite: the CPU stand-in for TorchNeuron's `neuron` device, with two devices."""

import os

os.environ.setdefault("LIGHTNING_TRN_STANDIN_DEVICES", "2")

import lightning_trn.standin  # noqa: E402,F401  builds (first time) and loads the stand-in
