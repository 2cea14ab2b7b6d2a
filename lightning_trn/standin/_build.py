"""Build (once) and import the stand-in's C++ extension, with errors that name the fix instead of a C++ traceback.

The build is cached per torch version and source hash under `LIGHTNING_TRN_STANDIN_CACHE` (default
`~/.cache/lightning_trn/standin`): the first load compiles for about a minute on 2 cores, later loads import the
built library directly. A file lock (not named `lock`: torch.utils.cpp_extension keeps its own file of that name
there) lets several processes (torchrun ranks) ask at once; one builds.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

#: torch releases the C++ core was written and tested against (PrivateUse1 and allocator APIs change between them).
SUPPORTED_TORCH = ("2.13",)
CSRC = Path(__file__).parent / "csrc"


class StandinError(RuntimeError):
    """The stand-in cannot be built or loaded here; the message says why and what to do."""


def torch_release() -> str:
    """`major.minor` of the running torch."""
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def check_torch() -> None:
    """Raise `StandinError` naming the fix when the running torch is not one the C++ core was written for."""
    if torch_release() not in SUPPORTED_TORCH:
        raise StandinError(
            f"lightning_trn.standin was written for torch {' / '.join(SUPPORTED_TORCH)} and this environment has "
            f"torch {torch.__version__}. Its C++ core uses PyTorch's PrivateUse1 device APIs, which change between "
            "releases. Use the native development environment (`bash scripts/setup.sh` builds `.venv-native/` with "
            "torch 2.13.0), or install `torch==2.13.0` in a virtual environment of its own (the XLA stack's torch "
            "2.9 cannot share one)."
        )


def check_toolchain() -> None:
    """Raise `StandinError` naming the fix when a C++ compiler or ninja is missing (needed only to build)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise StandinError(
            f"lightning_trn.standin compiles a small C++ extension on first use and found no C++ compiler "
            f"({compiler!r} is not on PATH). Install one (Debian/Ubuntu: `apt-get install g++`; macOS: "
            "`xcode-select --install`) or point the CXX environment variable at it, then load the stand-in again."
        )
    from torch.utils.cpp_extension import verify_ninja_availability

    try:
        verify_ninja_availability()
    except RuntimeError:
        raise StandinError(
            "lightning_trn.standin builds its C++ extension with ninja, which is not installed in this "
            "environment. Run `pip install ninja` (or `pip install 'lightning-trn[standin]'`), then load the "
            "stand-in again."
        ) from None


def cache_dir() -> Path:
    """Where the built extension for this torch version and this source lives."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    root = Path(os.environ.get("LIGHTNING_TRN_STANDIN_CACHE", Path.home() / ".cache" / "lightning_trn" / "standin"))
    return root / f"torch{torch.__version__.replace('+', '_')}-{digest.hexdigest()[:12]}"


def _import_built(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build() -> ModuleType:
    """The compiled extension module, built on first use and imported from the cache afterwards."""
    check_torch()
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    name = "lightning_trn_standin_" + directory.name.rsplit("-", 1)[1]
    library, done = directory / f"{name}.so", directory / "BUILT"
    with open(directory / "build.flock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (done.exists() and library.exists()):
            check_toolchain()
            from torch.utils.cpp_extension import load

            try:
                sources = [str(path) for path in sorted(CSRC.glob("*.cpp"))]
                module = load(name, sources, build_directory=str(directory), extra_cflags=["-O2"], verbose=False)
            except Exception as err:  # the compiler's output is in the message: keep its end
                tail = "\n".join(str(err).strip().splitlines()[-25:])
                raise StandinError(
                    f"lightning_trn.standin could not compile its C++ extension in {directory} with torch "
                    f"{torch.__version__}. Check that the C++ compiler works (`c++ --version`) and that torch's "
                    "headers are installed (a CPU wheel of torch 2.13.0 has them); delete the directory to force a "
                    f"clean rebuild. The build ended with:\n{tail}"
                ) from err
            done.write_text(torch.__version__)
            return module
    return _import_built(name, library)
