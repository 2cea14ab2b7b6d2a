"""`import_xla`: how lightning_trn imports torch_xla modules, always lazily (inside the function that needs one), so
that `import lightning_trn` works where torch_xla is not installed.

Its own module so that the XLA runtime and its collectives share it without importing each other.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from lightning_trn.runtime.discovery import detect_platform, torch_xla_installed


def import_xla(module: str) -> ModuleType:
    """Import a torch_xla module, turning a missing install into the package's explanatory error."""
    if module in sys.modules:
        return sys.modules[module]
    if not torch_xla_installed():
        detect_platform()  # raises NeuronUnavailableError naming the fix
    return importlib.import_module(module)
