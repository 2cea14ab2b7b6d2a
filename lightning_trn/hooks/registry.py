"""Every Lightning (and torch) internal that lightning_trn replaces, in one list, and when it is in place.

At `import lightning_trn` (`lightning_trn.registration`): five `_AcceleratorConnector` methods that check the precision
flag and choose the accelerator, strategy and precision, and (`lightning_trn.hooks.throughput`) the peak-FLOPs and
compute-dtype lookups of `ThroughputMonitor`. They hand every run, device and plugin that is not a Neuron one to
Lightning's originals.

For the duration of a Neuron run only (`HOOKS` below): from `NeuronStrategyBase.setup` to its `teardown`, after
which Lightning's originals are back, so a CPU or GPU run in the same process runs Lightning's own code. Each saves
host time or a device sync per step on Neuron and gives Lightning's result (tests/hooks/test_logging_fast_path.py,
tests/hooks/test_loop_shortcuts.py), or frees the previous step's gradients before the forward instead of after it
(`zero_grad`, tests/hooks/test_zero_grad_first.py), or makes torch's activation checkpointing work on the run's
device (`activation_checkpointing`, tests/strategies/test_activation_checkpointing.py), or gives random ops on
`neuron` DTensors independent values per shard (`DTENSOR_RANDOM_HOOKS`, torch's tracker;
tests/strategies/test_dtensor_random.py); each is skipped where the Lightning (or torch) version is untested or
lacks what it replaces. Fabric has no teardown: its Neuron precision installs the checkpointing hooks
(`CHECKPOINT_HOOKS`) for each forward and backward pass only (`installed`), and its model-parallel strategy the
DTensor random-op rule from `setup_module` on. Holders are counted per hook, so those nest inside a Trainer run's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Generator, Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lightning
import torch
import torch.distributed
import torch.distributed.tensor._random
import torch.utils.checkpoint
from lightning.fabric.strategies import model_parallel as fabric_model_parallel
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loops import _EvaluationLoop, _FitLoop, _PredictionLoop
from lightning.pytorch.loops.optimization.automatic import Closure
from lightning.pytorch.strategies import model_parallel as trainer_model_parallel
from lightning.pytorch.trainer.connectors.logger_connector import logger_connector, result
from packaging.version import Version
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import _sharding_prop, _utils
from torchmetrics import Metric

from lightning_trn.core.parallel import dtensor_random
from lightning_trn.hooks import (
    activation_checkpointing,
    host_copies,
    loaders,
    loop_shortcuts,
    metric_states,
    s3_checkpoint,
    simulation,
    zero_grad,
)
from lightning_trn.hooks import logging as logging_hooks

#: Lightning versions whose internals the hooks were written against, as pyproject.toml's range: the suite runs on
#: 2.6.6; later 2.6 patch releases are let in untested, a new minor release (which may rework the internals) is not
TESTED_LIGHTNING = (Version("2.6.6"), Version("2.7.0"))
_ABSENT = object()
_NOT_INSTALLED = object()


#: torch versions whose internals `SIMULATION_HOOKS` (and the estimator's use of torch's memory trackers) were written
#: against: the native stack's torch 2.13; another version is refused by `lightning_trn.estimate`
TESTED_TORCH_SIMULATION = (Version("2.13.0"), Version("2.14.0"))


def lightning_version_tested() -> bool:
    """Whether the installed Lightning is one the hooks were tested against."""
    return TESTED_LIGHTNING[0] <= Version(lightning.__version__) < TESTED_LIGHTNING[1]


def simulation_torch_tested() -> bool:
    """Whether the installed torch is one `SIMULATION_HOOKS` were tested against (local builds' `+cpu` suffixes
    ignored)."""
    return TESTED_TORCH_SIMULATION[0] <= Version(Version(torch.__version__).base_version) < TESTED_TORCH_SIMULATION[1]


@dataclass(frozen=True)
class Hook:
    """`owner.name` (a class or module attribute) replaced by `make(original)` during Neuron runs; `make` gets None
    when `owner` does not define the attribute itself, and returns None when the hook does not apply."""

    owner: Any
    name: str
    make: Callable[[Any], Any]


#: what makes torch's activation checkpointing work (and really recompute) on the run's device
CHECKPOINT_HOOKS: tuple[Hook, ...] = (
    Hook(torch, "xla", activation_checkpointing.xla_device_module),
    Hook(torch.utils.checkpoint, "_get_device_module", activation_checkpointing.device_module_lookup),
    Hook(
        torch.utils.checkpoint, "_checkpoint_without_reentrant_generator", activation_checkpointing.fenced_non_reentrant
    ),
    Hook(torch.utils.checkpoint, "CheckpointFunction", activation_checkpointing.fenced_reentrant),
)

#: torch's tracker of random ops on DTensors: the `neuron` device's rule (`lightning_trn.core.parallel.dtensor_random`),
#: so a model initialised after parallelization draws independent values on every shard
DTENSOR_RANDOM_HOOKS: tuple[Hook, ...] = (
    Hook(torch.distributed.tensor._random, "_rng_tracker", dtensor_random.tracker_for_neuron_run),
)

#: Lightning's DCP reads and writes of the model-parallel strategies (the Trainer's saves, and every load, go through
#: Fabric's module): a local shadow directory of an `s3://` checkpoint goes to S3 (`lightning_trn.hooks.s3_checkpoint`).
#: Installed by the Neuron strategies' `save_checkpoint` and `load_checkpoint` for the call (Trainer and Fabric)
S3_CHECKPOINT_HOOKS: tuple[Hook, ...] = (
    Hook(trainer_model_parallel, "_distributed_checkpoint_save", s3_checkpoint.redirecting_save),
    Hook(fabric_model_parallel, "_distributed_checkpoint_save", s3_checkpoint.redirecting_save),
    Hook(fabric_model_parallel, "_distributed_checkpoint_load", s3_checkpoint.redirecting_load),
)

#: torch internals patched while `lightning_trn.estimate` simulates a job on fake tensors and a fake process group
#: (`lightning_trn.hooks.simulation`), restored after it; the estimator refuses to run where
#: `simulation_torch_tested()` is False
SIMULATION_HOOKS: tuple[Hook, ...] = (
    Hook(DeviceMesh, "__init__", simulation.on_real_tensors),
    Hook(DeviceMesh, "__eq__", simulation.mesh_equal_with_groups),
    Hook(DeviceMesh, "__hash__", simulation.mesh_hash_with_groups),
    Hook(_utils, "compute_local_shape_and_global_offset", simulation.on_real_tensors),
    Hook(torch.utils, "swap_tensors", simulation.swap_unless_unchanged),
    Hook(_sharding_prop, "detect_fake_mode", simulation.own_propagation_mode),
    Hook(torch.distributed, "new_group", simulation.fake_host_groups),
    Hook(torch.distributed, "broadcast_object_list", simulation.own_objects),
)


def pipeline_simulation_hooks() -> tuple[Hook, ...]:
    """What pipeline stages need in a simulation (`lightning_trn.hooks.simulation`: their shapes and the vote
    without the process group, their transfers counted), installed with `SIMULATION_HOOKS`; built at the
    simulation, since importing `torch.distributed.pipelining` would add 0.1 s to `import lightning_trn`."""
    from torch.distributed.pipelining import schedules, stage

    return (
        Hook(stage.PipelineStage, "_recv_meta", simulation.recorded_stage_inputs),
        Hook(stage.PipelineStage, "_send_meta", simulation.recording_stage_outputs),
        Hook(schedules._PipelineSchedule, "_warmup_p2p", simulation.warmup_without_vote),
        Hook(schedules, "_batch_p2p", simulation.counted_stage_transfers),
    )


HOOKS: tuple[Hook, ...] = (
    Hook(result, "convert_tensors_to_scalars", logging_hooks.conversion_unless_deferred),
    Hook(logger_connector._LoggerConnector, "metrics", logging_hooks.deferring_metrics),
    Hook(result._ResultMetric, "to", logging_hooks.result_move_shortcut),
    Hook(logger_connector._LoggerConnector, "log_metrics", logging_hooks.logging_from_host),
    Hook(Metric, "reset", metric_states.reset_from_host),
    Hook(Trainer, "_teardown", host_copies.teardown_in_one_transfer),
    Hook(Closure, "closure", zero_grad.zero_grad_first),
    Hook(LightningModule, "log", logging_hooks.log_fast_path),
    Hook(LightningModule, "__setattr__", loop_shortcuts.fx_name_setattr),
    *(
        Hook(module, "is_param_in_hook_signature", loop_shortcuts.cached_signature_check)
        for module in loop_shortcuts.SIGNATURE_CALLERS
    ),
    *(
        Hook(module, "has_len_all_ranks", loop_shortcuts.host_length_check)
        for module in loop_shortcuts.LENGTH_CHECK_CALLERS
    ),
    *(
        Hook(loop, "setup_data", loaders.setup_data_showing_user_loaders)
        for loop in (_FitLoop, _EvaluationLoop, _PredictionLoop)
    ),
    *CHECKPOINT_HOOKS,
    *DTENSOR_RANDOM_HOOKS,
)

#: how many holders each hook has (installed while above 0), and the original each installed hook replaced
_holders: Counter = Counter()
_originals: dict[Hook, Any] = {}


def acquire(hooks: Iterable[Hook] = HOOKS) -> None:
    """A Neuron run starts: install `hooks` (each unless another run already holds it)."""
    if not lightning_version_tested():
        return
    for hook in hooks:
        _holders[hook] += 1
        if _holders[hook] > 1:
            continue
        original = hook.owner.__dict__.get(hook.name, _ABSENT)
        replacement = hook.make(None if original is _ABSENT else original)
        if replacement is not None:
            setattr(hook.owner, hook.name, replacement)
            _originals[hook] = original


def release(hooks: Iterable[Hook] = HOOKS) -> None:
    """A Neuron run ended: put back the originals of `hooks` that no other run holds."""
    if not lightning_version_tested():
        return
    for hook in reversed(tuple(hooks)):
        _holders[hook] -= 1
        if _holders[hook] > 0:
            continue
        del _holders[hook]
        original = _originals.pop(hook, _NOT_INSTALLED)
        if original is _ABSENT:
            delattr(hook.owner, hook.name)
        elif original is not _NOT_INSTALLED:
            setattr(hook.owner, hook.name, original)


@contextmanager
def installed(hooks: Iterable[Hook]) -> Generator[None, None, None]:
    """`hooks` in place for the duration of the block (nested in a run that holds them: nothing changes)."""
    hooks = tuple(hooks)
    acquire(hooks)
    try:
        yield
    finally:
        release(hooks)
