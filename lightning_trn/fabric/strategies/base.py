"""`NeuronFabricStrategyBase`: the base of every Fabric Neuron strategy, over Lightning Fabric's strategy class: what
it adds to the shared device logic (`lightning_trn.core.strategy`): Fabric's hooks for moving modules and optimizers,
the graph cut, checkpoints. `setup_module` and `setup_optimizer` run the strategy's `setup_module_steps` and
`setup_optimizer_steps`, each a method `_<name>(module or optimizer)` returning it, listed by reference at the end of
the class (docs/architecture.md lists them).

Where the graph is cut (one compiled graph per step, nothing read from the device between steps): after each
`optimizer.step()` (the step's forward, backward, gradient reduction and update become one graph), and when the next
batch is taken from a loader set up with `fabric.setup_dataloaders` if no optimizer step ran since the last batch
(an evaluation loop, or a gradient-accumulation micro-batch: that batch's work becomes its own graph instead of
growing, and changing, the next one).

Random state (docs/fault-tolerance.md): `fabric.save` also stores every rank's random state (host generators, the
loaders' generators, the device seed and how many batches the loaders handed out), and `fabric.load(path, state)`
puts it back; a loader that was inside an epoch then skips, at its next iteration, the batches it had handed out, so
a loop that re-enters that epoch continues exactly where the saved run was.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.types import _PATH
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_trn.core.checkpoint.random_state import RANDOM_STATE_KEY
from lightning_trn.core.device_loader import DevicePrefetchLoader
from lightning_trn.core.parallel.gradients import clip_grad_norm_
from lightning_trn.core.strategy import NeuronStrategyCore
from lightning_trn.fabric.precision import NeuronPrecision
from lightning_trn.hooks import registry as lightning_hooks

# the type checker sees Lightning's strategy members here; at run time each strategy names its Lightning class after
# this base, which keeps it out of the MRO in between (`object` changes nothing)
if TYPE_CHECKING:
    from lightning.fabric.strategies import Strategy as _LightningStrategy
else:
    _LightningStrategy = object


#: a step of `setup_module` / `setup_optimizer`: a strategy method returning the module / optimizer
ModuleStep = Callable[[Any, Module], Module]
OptimizerStep = Callable[[Any, Optimizer], Optimizer]


class NeuronFabricStrategyBase(NeuronStrategyCore, _LightningStrategy):
    """Over Fabric's strategy classes; data-parallel strategies override `reduce_gradients`."""

    _precision: Precision | None
    #: Lightning's `save_checkpoint` gets the modules and optimizers themselves (sharded strategies collect their
    #: shards), not their state dicts
    saves_stateful_objects: bool = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: the last optimizer step ended with a graph cut, and no batch was taken since
        self._cut_after_step = False
        #: host Parameter -> its device Parameter, for optimizers built before the module moved
        self._moved: dict[Tensor, Tensor] = {}
        self._device_seeded = False
        #: the loaders set up with `fabric.setup_dataloaders`, in order (their random state goes into checkpoints)
        self._loaders: list[DevicePrefetchLoader] = []
        #: batches handed out by those loaders: batch i's random numbers come from `step_seed(device seed, i)`
        self._batches_taken = 0
        #: optimizers whose gradients were already reduced for their coming step (to clip them)
        self._reduced: list[Optimizer] = []

    @property
    @override
    def precision(self) -> Precision:
        if self._precision is None:
            self._precision = NeuronPrecision()
        return self._precision

    @precision.setter
    def precision(self, precision: Precision | None) -> None:
        self._precision = precision

    @override
    def _neuron_precision(self) -> Precision:
        return self.precision

    @override
    def module_to_device(self, module: Module) -> None:
        """Move to the device keeping tied weights tied, and remember which device Parameter replaced which host one
        (on XLA moving creates new Parameters, which optimizers built on the host do not know)."""
        before = dict(module.named_parameters())
        self._move_keeping_ties(module)
        after = dict(module.named_parameters())
        self._moved.update({old: after[name] for name, old in before.items() if after[name] is not old})

    @override
    def setup_module(self, module: Module) -> Module:
        """The strategy's `setup_module_steps`, in order."""
        for step in self.setup_module_steps:
            module = getattr(self, step.__name__)(module)
        return module

    @override
    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """The strategy's `setup_optimizer_steps`, in order."""
        for step in self.setup_optimizer_steps:
            optimizer = getattr(self, step.__name__)(optimizer)
        return optimizer

    def _seed_device_rng(self, module: Module) -> Module:
        """Seed the device's random generator from `fabric.seed_everything` (dropout, stochastic rounding), once."""
        if not self._device_seeded:
            self._seed_device()
            self._device_seeded = True
        return module

    def _checkpoint_activations(self, module: Module) -> Module:
        """Apply `activation_checkpointing_policy` to the module (before any sharding)."""
        self._apply_activation_checkpointing(module)
        return module

    def _lightning_setup_module(self, module: Module) -> Module:
        return super().setup_module(module)

    def _sync_torchmetrics(self, module: Module) -> Module:
        """Route the module's torchmetrics syncs through the collectives (multi-process strategies)."""
        self._route_metric_syncs(module)
        return module

    def _point_to_device_parameters(self, optimizer: Optimizer) -> Optimizer:
        """Point an optimizer built on the host parameters to the device ones (Fabric does this for its XLA strategy
        only)."""
        for group in optimizer.param_groups:
            group["params"] = [self._moved.get(parameter, parameter) for parameter in group["params"]]
        return optimizer

    def _lightning_setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        return super().setup_optimizer(optimizer)

    @override
    def process_dataloader(self, dataloader: Any) -> Any:
        """Batches are copied to the device in the background while the previous step runs; the graph is cut before
        a batch when no optimizer step did since the last one (module docstring)."""
        loader = self._prefetching(dataloader, before_batch=self._before_batch)
        if not any(loader is known for known in self._loaders):
            self._loaders.append(loader)
        return loader

    def _before_batch(self) -> None:
        """Cut the graph unless an optimizer step just did, then seed the device RNG for this batch."""
        if not self._cut_after_step:
            self.runtime.sync()
        self._cut_after_step = False
        self._seed_batch(self._batches_taken)
        self._batches_taken += 1

    def _reduce_for_step(self, optimizer: Optimizer) -> None:
        """Reduce the gradients for `optimizer`'s coming step, unless done already (clipping reduces first)."""
        if not any(optimizer is reduced for reduced in self._reduced):
            self.reduce_gradients(optimizer)
            self._reduced.append(optimizer)

    @override
    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float | int,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor:
        """Clip by the norm of all gradients together, DTensor gradients (FSDP2, tensor parallel) whatever their
        meshes (`lightning_trn.core.parallel.gradients`), once they are reduced for the step (`reduce_gradients`)."""
        self._reduce_for_step(optimizer)
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm_(
            self.precision.main_params(optimizer),
            max_norm,
            norm_type,
            error_if_nonfinite,
            scope=getattr(self.precision, "gradient_norm_scope", None),
        )

    @override
    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float | int) -> None:
        """Clip each gradient once it is reduced for the step (`reduce_gradients`)."""
        self._reduce_for_step(optimizer)
        super().clip_gradients_value(module, optimizer, clip_val)

    @override
    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        """Reduce gradients, update, then cut the graph once so the whole step compiles as one graph."""
        self._reduce_for_step(optimizer)
        output = super().optimizer_step(optimizer, **kwargs)
        self._reduced = [reduced for reduced in self._reduced if reduced is not optimizer]
        self._after_update(optimizer)
        self.runtime.sync()
        self._cut_after_step = True
        return output

    @override
    def save_checkpoint(
        self,
        path: _PATH,
        state: dict[str, Any],
        storage_options: Any | None = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Materialise pending device work first, so the tensors copied to the host are the current ones; the file
        holds CPU tensors only (`NeuronCheckpointIO`), as the Trainer's do, and this rank's random state. Called on
        every rank. A sharded checkpoint (a directory every rank writes part of) replaces the previous one only once
        complete, through the strategy's checkpointer (`lightning_trn.core.checkpoint.checkpointer`)."""
        self.runtime.sync()
        entry = self._random_state_entry(self._loaders, None, batches=self._batches_taken)
        if not self.saves_stateful_objects:
            state, filter = self._convert_stateful_objects_in_state(state, filter or {}), None

        # Lightning's sharded save refuses `storage_options` and `filter`: such a save is written synchronously
        background = self._checkpointer.writes_in_background and storage_options is None and filter is None

        def write(state: dict[str, Any], target: Any) -> None:
            if background:
                self._save_in_background(state, target)
            else:
                super(NeuronFabricStrategyBase, self).save_checkpoint(
                    target, state, storage_options=storage_options, filter=filter
                )

        with lightning_hooks.installed(lightning_hooks.S3_CHECKPOINT_HOOKS):
            self._save_through_checkpointer(state, path, entry, write, background=background)

    @override
    def load_checkpoint(self, path: _PATH, state: Any | None = None, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Fabric's load; restoring a training state (`state` a dict) also puts back the saved random state (this
        rank's own), or says once why the resume is not exact. Set up the dataloaders before loading. An asynchronous
        save in flight is finished first, and what dead writers left in the checkpoint's directory is finished
        (rank 0; `lightning_trn.core.checkpoint.storage.recover_before_resume`)."""
        self._checkpointer.wait()  # the checkpoint may be the one being written
        self._checkpointer.recover([os.path.dirname(os.fspath(path))], self.global_rank)
        # an `s3://` sharded checkpoint: its committed version, DCP's reads sent there by the hooks
        with (
            lightning_hooks.installed(lightning_hooks.S3_CHECKPOINT_HOOKS),
            self._checkpointer.load_source(path, self._checkpoint_layout()) as source,
        ):
            remainder = super().load_checkpoint(source, state, *args, **kwargs)
            saved = self._checkpointer.read_rank_file(
                remainder.pop(RANDOM_STATE_KEY, None), source, path, self.global_rank, self.world_size
            )
        if isinstance(state, dict) and state:
            entry = self._restore_random_state(saved, self._loaders, skip=True)
            if entry is not None:
                self._batches_taken = int(entry.get("batches", 0))
        return remainder

    #: what `setup_module` does, in order: each step a method `(module) -> module`, run by its name (a subclass's
    #: override of a step runs)
    setup_module_steps: tuple[ModuleStep, ...] = (_seed_device_rng, _checkpoint_activations, _lightning_setup_module)
    #: what `setup_optimizer` does, in order: each step a method `(optimizer) -> optimizer`, run by its name
    setup_optimizer_steps: tuple[OptimizerStep, ...] = (_point_to_device_parameters, _lightning_setup_optimizer)
