"""The process state a simulation changes, each change refused where it is untested and put back afterwards: the
torch internals of `hooks.registry.SIMULATION_HOOKS`, the fake process group, the stand-in's device count, the
thread count and `OMP_NUM_THREADS` (Lightning lowers both for the processes of one node), `rank_zero_only.rank`.

`native_device()` makes sure there is a `neuron` device to simulate on, loading the CPU stand-in where no Neuron
stack is installed, so the estimator runs the same with or without `LIGHTNING_TRN_STANDIN`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator

import lightning
import torch


class EstimateError(RuntimeError):
    """The estimator cannot simulate this job (or this environment); the message says why and what to do."""


def native_device() -> str:
    """Where the simulation's fake tensors live: TorchNeuron's `neuron` device, else the CPU stand-in (loaded here
    if it is not yet). Returns what it is, for the report's first line.

    Raises:
        EstimateError: the environment has neither, nor a torch the stand-in runs on (the XLA stack's torch 2.9).
    """
    from lightning_trn.hooks.registry import TESTED_TORCH_SIMULATION, simulation_torch_tested
    from lightning_trn.runtime import get_runtime
    from lightning_trn.runtime.selection import native_device_available

    if not simulation_torch_tested():
        low, high = TESTED_TORCH_SIMULATION
        xla = importlib.util.find_spec("torch_xla") is not None
        raise EstimateError(
            f"lightning_trn.estimate simulates a job on fake tensors with torch internals tested on torch >={low}, "
            f"<{high}; this environment has torch {torch.__version__}"
            + (" with torch_xla (the XLA stack), where no simulation is possible. " if xla else ". ")
            + "Run the estimator from an environment with the native stack's torch (on a machine without Trainium: "
            "`pip install torch==2.13.0 'lightning-trn[standin]'` in an environment without torch-xla, which uses "
            "the CPU stand-in); it estimates Trn1 (XLA "
            "stack) jobs as well with `--platform=trn1` / `estimate(..., platform='trn1')`."
        )
    if not native_device_available():
        if importlib.util.find_spec("torch_neuronx") is not None:
            raise EstimateError(
                "lightning_trn.estimate found torch-neuronx installed but torch has no `neuron` device: this is the "
                "XLA stack (torch-neuronx 2.9), on which no simulation is possible. Run the estimator where "
                "TorchNeuron (torch-neuronx 2.13+) or, on a machine without Trainium, the CPU stand-in is installed."
            )
        import lightning_trn.standin  # noqa: F401  loads it: fake tensors need a registered `neuron` device

        get_runtime.cache_clear()  # chosen before the device existed
    from lightning_trn.standin import is_loaded

    return "the CPU stand-in for TorchNeuron" if is_loaded() else "TorchNeuron"


@contextlib.contextmanager
def simulation_hooks() -> Iterator[None]:
    """`SIMULATION_HOOKS` and the pipeline stages' (`pipeline_simulation_hooks`) in place for the block, refused
    where the torch or Lightning version is untested or one of the patched attributes is missing."""
    from lightning_trn.hooks import registry

    hooks = (*registry.SIMULATION_HOOKS, *registry.pipeline_simulation_hooks())
    missing = [f"{hook.owner.__name__}.{hook.name}" for hook in hooks if not hasattr(hook.owner, hook.name)]
    if missing or not registry.simulation_torch_tested() or not registry.lightning_version_tested():
        raise EstimateError(
            f"lightning_trn.estimate patches torch internals for its simulation that were tested on torch "
            f"{registry.TESTED_TORCH_SIMULATION[0]} and Lightning {registry.TESTED_LIGHTNING[0]}; this process has "
            f"torch {torch.__version__} and Lightning {lightning.__version__}"
            + (f" and lacks {', '.join(missing)}" if missing else "")
            + ". Install the tested versions to estimate (the simulation would give wrong numbers or fail here)."
        )
    with registry.installed(hooks):
        yield


@contextlib.contextmanager
def fake_process_group(rank: int, world_size: int) -> Iterator[None]:
    """The default process group is PyTorch's fake one for this rank (every collective returns at once)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise EstimateError(
            "lightning_trn.estimate runs in a process without a process group; one is initialized. Call it before "
            "`init_process_group` (or outside a distributed run)."
        )
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def device_count(devices: int) -> Iterator[None]:
    """On the stand-in, at least `devices` devices for the block (a node of the simulated job: the Trainer checks
    its `devices` against them), so no device-count variable is needed; TorchNeuron's count is the host's."""
    from lightning_trn import standin
    from lightning_trn.runtime import get_runtime

    if not standin.is_loaded():
        yield
        return
    # the stand-in's own count (`LIGHTNING_TRN_STANDIN_DEVICES` at load); the runtime caches what it saw
    extension = standin._loaded()
    previous = extension.device_count()
    runtime = get_runtime()
    extension.set_device_count(max(previous, devices))
    runtime._platform = None  # type: ignore[attr-defined]  # the native runtime's cached device count
    try:
        yield
    finally:
        extension.set_device_count(previous)
        runtime._platform = None  # type: ignore[attr-defined]  # re-read with the count restored


@contextlib.contextmanager
def process_settings() -> Iterator[None]:
    """The thread count, `OMP_NUM_THREADS` and Lightning's printing rank as they were after the block.

    Lightning lowers the thread count for the processes of one node (to 1 under 64 devices) and records it in
    `OMP_NUM_THREADS`; the simulation runs in the caller's process, which keeps its own. Setting the variable keeps
    Lightning from lowering it at all: autograd's device thread, started by the simulation's first backward on
    `neuron`, takes the thread count of that moment for the life of the process (a lowered one changed a later
    conv3d gradient on the stand-in by one rounding step against the CPU's).
    """
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    printing_rank = rank_zero_only.rank  # type: ignore[attr-defined]  # Lightning sets it on the function
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        yield
    finally:
        rank_zero_only.rank = printing_rank  # type: ignore[attr-defined]  # as above
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
