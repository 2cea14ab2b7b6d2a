"""Test configuration: everything runs on XLA:CPU (`PJRT_DEVICE=CPU`), as the README's test command does."""

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")
