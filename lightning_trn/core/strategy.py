"""`NeuronStrategyCore`: the device logic every Neuron strategy shares, the Trainer's (`NeuronStrategyBase`) and
Fabric's (`lightning_trn.fabric`) alike: the runtime, portable checkpoints with the run's random state, moving a
module without untying its weights, and the device prefetcher."""

from __future__ import annotations

import io
import logging
import os
from collections import deque
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.utilities import find_shared_parameters, set_shared_parameters
from torch import Tensor
from torch.distributed import ReduceOp
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_trn.core.checkpoint.checkpoint_io import NeuronCheckpointIO, to_portable
from lightning_trn.core.checkpoint.checkpointer import Checkpointer, CheckpointLayout
from lightning_trn.core.checkpoint.distributed_checkpoint import LIGHTNING_META_FILE
from lightning_trn.core.checkpoint.random_state import (
    RANDOM_STATE_KEY,
    base_device_seed,
    host_states,
    not_exact_notice,
    rank_entry,
    set_host_states,
    step_seed,
)
from lightning_trn.core.device_loader import BATCHES_YIELDED, DevicePrefetchLoader
from lightning_trn.core.parallel.process_group import OneProcess, ProcessGroup
from lightning_trn.core.scalars import place_scalars
from lightning_trn.runtime import DeviceRuntime, get_runtime
from lightning_trn.runtime.collectives import Collectives

#: how many of the latest batches from the device prefetchers `delivered` recognises (Lightning's fetcher reads one
#: batch ahead, so the batch being transferred is the last or the second-to-last one delivered)
_RECENT_DELIVERIES = 4

log = logging.getLogger(__name__)

#: the Trainer's entries of a DCP checkpoint that are sharded state dicts, written as DCP entries (the rest, and
#: Fabric's entries other than modules and optimizers, go to `meta.pt`)
_SHARDED_ENTRIES = ("state_dict", "optimizer_states")

#: which submodules to checkpoint: a set of module classes, or a policy of torch's (`ModuleWrapPolicy`, a callable)
CheckpointingPolicy = set[type[Module]] | Callable[..., bool] | Any

if TYPE_CHECKING:

    class _LightningStrategy:
        """What `NeuronStrategyCore` reads from, and overrides in, the Lightning strategy class it is mixed in before
        (the Trainer's or Fabric's; single-device or parallel): their common members, typed so that each of them is
        compatible with it. Seen by the type checker only: at run time the core's base is `object`."""

        accelerator: Any
        cluster_environment: ClusterEnvironment | None
        parallel_devices: list[torch.device] | None
        # attributes of Lightning's single-device strategies, properties of its parallel ones
        global_rank: int
        local_rank: int
        world_size: int

        @property
        def root_device(self) -> torch.device: ...
        @property
        def node_rank(self) -> int: ...
        @property
        def is_global_zero(self) -> bool: ...
        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]: ...
        @classmethod
        def register_strategies(cls, strategy_registry: Any) -> None: ...
        def setup_environment(self) -> None: ...
        def teardown(self) -> None: ...
        def all_reduce(
            self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
        ) -> Any: ...
        def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor: ...
        def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool: ...
        def barrier(self, name: str | None = None) -> None: ...
        def broadcast(self, obj: Any, src: int = 0) -> Any: ...
        # the Trainer's `(checkpoint_path, weights_only)`, Fabric's `(path, state, strict, weights_only)`
        def load_checkpoint(self, *args: Any, **kwargs: Any) -> Any: ...
        # members of Lightning's DDP, FSDP and model-parallel strategies, which the core serves from its process group
        @property
        def num_processes(self) -> int: ...
        @property
        def process_group_backend(self) -> str | None: ...
        def set_world_ranks(self) -> None: ...
        def _set_world_ranks(self) -> None: ...
        def _setup_distributed(self) -> None: ...

else:
    _LightningStrategy = object


class NeuronStrategyCore(_LightningStrategy):
    """The base of the Trainer's and Fabric's Neuron strategy bases (`NeuronStrategyBase`, `NeuronFabricStrategyBase`),
    before Lightning's strategy class. A strategy holds a `ProcessGroup` (`_process_group`), which serves Lightning's
    parallel API (reductions, barriers, broadcasts, world ranks): a multi-process strategy its process groups, a
    one-process strategy `OneProcess`, whose collectives give the one rank's answer as Lightning's single-device
    strategies do.

    Args:
        activation_checkpointing_policy: checkpoint these submodules (e.g. `{Block}`), as Lightning's FSDPStrategy's
            argument of that name does (docs/memory.md).
        process_group: the process groups of a multi-process strategy (None: one process, `OneProcess`).
    """

    _checkpoint_io: CheckpointIO | None
    #: the name and description the strategy is registered under (the Trainer's and Fabric's registries alike)
    strategy_name: str
    strategy_description: str

    def __init__(
        self,
        *args: Any,
        activation_checkpointing_policy: CheckpointingPolicy | None = None,
        process_group: ProcessGroup | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._activation_checkpointing_policy = activation_checkpointing_policy
        self._process_group = process_group or OneProcess()
        self._num_nodes = 1
        #: the latest batches this strategy's prefetchers handed out (already on the device)
        self._deliveries: deque = deque(maxlen=_RECENT_DELIVERIES)
        #: the run's base device seed; training batch i draws from `step_seed(_device_seed, i)`
        self._device_seed = 0
        #: saves, loads and removes this strategy's checkpoints
        self._checkpointer = Checkpointer(self._process_group)

    @property
    def checkpointer(self) -> Checkpointer:
        """What saves, loads and removes this strategy's checkpoints (`lightning_trn.core.checkpoint.checkpointer`)."""
        return self._checkpointer

    @property
    def runtime(self) -> DeviceRuntime:
        """The device runtime every device call goes through."""
        return get_runtime()

    @property
    @override
    def root_device(self) -> torch.device:
        """This process's NeuronCore: `xla:0` on XLA (each process sees only its own), natively
        `neuron:<local rank>`."""
        return self.runtime.device()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description=cls.strategy_description)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        if self._checkpoint_io is None:
            self._checkpoint_io = NeuronCheckpointIO()
        return self._checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO | None) -> None:
        self._checkpoint_io = io

    def _check_accelerator(self) -> None:
        from lightning_trn.accelerator import NeuronAccelerator

        accelerator = getattr(self, "accelerator", None)
        if not isinstance(accelerator, NeuronAccelerator):
            raise ValueError(
                f"{type(self).__name__} runs on NeuronCores or XLA:CPU only: use it with `accelerator='neuron'`, "
                f"found accelerator {type(accelerator).__name__}."
            )

    @override
    def setup_environment(self) -> None:
        """A multi-process strategy claims this process's NeuronCore and joins the process group first: TorchNeuron
        refuses a `neuron` process group once a device tensor exists (the accelerator's setup runs a probe on it).
        A checkpoint IO the strategy cannot serve is refused before that, so a refused run leaves no process group."""
        io = self._checkpoint_io
        async_save = isinstance(io, NeuronCheckpointIO) and io.async_save
        self._checkpointer.configure(async_save, self._checkpoint_layout(), type(self).__name__)
        if self._process_group.is_distributed:
            self._claim_device()
            self._setup_distributed()
        self._check_accelerator()
        super().setup_environment()

    @override
    def teardown(self) -> None:
        """An asynchronous save in flight is written and committed first (at the end of `fit`, and on the exception
        path a SIGTERM takes): Lightning's sharded strategies never tear their checkpoint IO down."""
        try:
            self._checkpointer.teardown()
        finally:
            try:
                super().teardown()
            finally:
                self._process_group.env.restore()

    @property
    def is_distributed(self) -> bool:
        """Read by Lightning's connector for strategies it does not know: enables the DistributedSampler and
        `self.log(..., sync_dist=True)` reduction."""
        return self._process_group.is_distributed

    @property
    @override
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    @override
    def num_processes(self) -> int:
        """Processes (NeuronCores) per node."""
        if not self._process_group.is_distributed:
            return 1
        devices = self.parallel_devices
        return len(devices) if devices is not None else 0

    @property
    @override
    def process_group_backend(self) -> str | None:
        return self._process_group.backend

    @property
    def collectives(self) -> Collectives:
        """The cross-process collectives, available once the process group is set up (none in one process)."""
        return self._process_group.collectives

    @override
    def set_world_ranks(self) -> None:
        """Tell the cluster environment this process's global rank and the world size (as Lightning's DDP does)."""
        if not self._process_group.is_distributed:
            return
        cluster = self.cluster_environment
        if cluster is not None:
            cluster.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            cluster.set_world_size(self.num_nodes * self.num_processes)
        # Lightning keeps the rank as an attribute it sets on its `rank_zero_only` function
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]  # see above

    @override
    def _set_world_ranks(self) -> None:
        """Fabric's connector calls `set_world_ranks` by this name."""
        self.set_world_ranks()

    def _claim_device(self) -> None:
        """Claim this process's NeuronCore (the runtime's environment variables) before the device is first touched."""
        assert self.cluster_environment is not None
        self.set_world_ranks()
        self.runtime.configure_process(
            global_rank=self.global_rank,
            local_rank=self.local_rank,
            world_size=self.world_size,
            local_world_size=self.num_processes,
            main_address=self.cluster_environment.main_address,
            env=self._process_group.env,
        )

    @override
    def _setup_distributed(self) -> None:
        """Join the process group (once; Lightning's `ModelParallelStrategy.setup_environment` calls it again)."""
        sizes = f"num_nodes={self.num_nodes} x devices={self.num_processes}"
        self._process_group.join(self.cluster_environment, self.world_size, sizes)

    @override
    def all_reduce(
        self,
        tensor: Tensor | Any,
        group: Any | None = None,
        reduce_op: ReduceOp | str | None = "mean",
    ) -> Tensor | Any:
        """Reduce `tensor` over all ranks with sum, mean ("avg"), max or min (a host tensor over the host group);
        non-tensors are returned unchanged."""
        return self._process_group.all_reduce(tensor, group, reduce_op)

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Every rank's `tensor`, stacked along a new first dimension (gradients do not flow back through it)."""
        return self._process_group.all_gather(tensor, group, sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Decided on the host group: no device tensor, so no device round trip (early stopping, checkpointing)."""
        return self._process_group.reduce_boolean_decision(decision, self.world_size, all)

    @override
    def barrier(self, name: str | None = None) -> None:
        self._process_group.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._process_group.broadcast(obj, src)

    def _explain_failure(self, exception: BaseException) -> None:
        """Say what a failed collective usually means (multi-process strategies)."""
        self._process_group.explain_failure(exception, self.global_rank, self.world_size)

    def _route_metric_syncs(self, model: Module | None) -> None:
        """Give the module's torchmetrics metrics the collectives' gather where their default cannot work."""
        self._process_group.route_metric_syncs(model)

    def _apply_activation_checkpointing(self, module: Module) -> None:
        """Wrap the submodules `activation_checkpointing_policy` selects in torch's `checkpoint_wrapper`, with the
        helpers of Lightning's FSDPStrategy (so the policy means the same; a model already holding checkpoint
        wrappers is left alone, with a warning). State-dict keys do not change."""
        if self._activation_checkpointing_policy is None:
            return
        from lightning.fabric.strategies.fsdp import _activation_checkpointing_kwargs, _setup_activation_checkpointing

        kwargs = _activation_checkpointing_kwargs(None, self._activation_checkpointing_policy)
        _setup_activation_checkpointing(module, kwargs)

    def _move_keeping_ties(self, module: Module) -> None:
        """Move `module` to the device, keeping tied weights tied (moving between the host and the device creates new
        Parameters, one per module that holds a shared one), its 0-dim tensors as device buffers, not graph
        constants (`lightning_trn.hooks.metric_states`)."""
        shared = find_shared_parameters(module)
        place_scalars(module, self.root_device, self.runtime)
        module.to(self.root_device)
        set_shared_parameters(module, shared)

    def _prefetching(
        self,
        dataloader: object,
        position: Callable[[], int] | None = None,
        before_batch: Callable[[], None] | None = None,
    ) -> DevicePrefetchLoader:
        """`dataloader` with its batches copied to the device in the background while the previous step runs."""
        if isinstance(dataloader, DevicePrefetchLoader):
            return dataloader
        return DevicePrefetchLoader(
            dataloader,
            self.root_device,
            self.runtime,
            self._deliveries,
            position=position,
            before_batch=before_batch,
        )

    def _delivered(self, batch: Any) -> bool:
        """Whether `batch` is one of the latest the prefetchers handed out, so already on the device as it is."""
        return any(batch is delivered for delivered in self._deliveries)

    def _seed_device(self) -> None:
        """Make `seed_everything(s)` reach the device RNG (dropout, stochastic rounding): every rank gets the same
        seed, as Lightning seeds every rank's host RNG the same. It is also the base of the per-batch seeds."""
        seed = os.environ.get("PL_GLOBAL_SEED")
        self._device_seed = base_device_seed(seed)
        if seed is not None:
            self.runtime.manual_seed(self._device_seed)

    def _seed_batch(self, batch_index: int) -> None:
        """Seed the device RNG for training batch `batch_index` of the run
        (`lightning_trn.core.checkpoint.random_state`)."""
        self.runtime.manual_seed(step_seed(self._device_seed, batch_index))

    def _neuron_precision(self) -> Any:
        """The strategy's precision plugin (the Trainer calls it `precision_plugin`, Fabric `precision`)."""
        raise NotImplementedError

    def _split_checkpoint(self, checkpoint: dict[str, Any], path: Any) -> tuple[dict[str, Any], Any]:
        """Called on every rank before rank 0 writes `checkpoint` to `path`: what rank 0 writes where (sharded
        ZeRO-1 checkpoints write each rank's part here)."""
        return checkpoint, path

    def _checkpoint_layout(self) -> CheckpointLayout:
        """What this strategy's checkpoints are on disk."""
        return CheckpointLayout.FILE

    def _checkpoint_meta(self, state: dict[str, Any]) -> dict[str, Any]:
        """What Lightning writes beside the shards of a DCP checkpoint (`meta.pt`), of the state it saves."""
        raise NotImplementedError

    def _save_in_background(self, state: dict[str, Any], directory: str) -> None:
        """Called on every rank inside the save's block: write the checkpoint `state` (the Trainer's checkpoint dict,
        Fabric's state) into the DCP staging `directory` through the checkpointer's background writer. Implemented by
        the strategies whose layout is `CheckpointLayout.DCP`."""
        raise NotImplementedError

    def _save_through_checkpointer(
        self,
        state: dict[str, Any],
        path: Any,
        entry: dict[str, Any],
        write: Callable[[dict[str, Any], Any], None],
        event: Hashable | None = None,
        background: bool = False,
    ) -> None:
        """Every rank: save `state` with this rank's random-state `entry` to `path`, `write(state, target)` (Lightning's
        save, or `_save_in_background` where `background`) writing into the directory the checkpointer gives (module
        `checkpointer`). A save of the same `event` as the previous one (another name of one `ModelCheckpoint` event)
        links the previous checkpoint's files instead of writing them again."""
        layout = self._checkpoint_layout()
        state = {**state, RANDOM_STATE_KEY: self._checkpointer.random_state_to_save(entry, self.world_size, layout)}
        if layout is CheckpointLayout.DCP:
            # Lightning writes the rest beside the shards (`meta.pt`) with a plain `torch.save`, device tensors and
            # all (ModelCheckpoint's scores): made portable here, as NeuronCheckpointIO makes a one-file checkpoint
            sharded = {key: state[key] for key in _SHARDED_ENTRIES if key in state}
            state = {**to_portable({k: v for k, v in state.items() if k not in sharded}), **sharded}
        source = self._checkpointer.linked_source(event, path, layout)
        if source is not None:
            buffer = io.BytesIO()
            torch.save(self._checkpoint_meta(state), buffer)
            self._checkpointer.link(source, path, {LIGHTNING_META_FILE: buffer.getvalue()}, self.global_rank)
            return
        with self._checkpointer.save_destination(path, self.global_rank, self.world_size, layout, background) as target:
            if layout.sharded:
                self._checkpointer.write_rank_file(target, path, self.global_rank, entry)
            state, target = self._split_checkpoint(state, target)
            write(state, target)
        self._checkpointer.saved(event, path)

    def reduce_gradients(self, optimizer: Optimizer) -> None:
        """Hook between backward and the optimizer update (data-parallel strategies average the gradients there);
        single-device and sharded strategies have nothing to reduce."""

    def _after_update(self, optimizer: Any) -> None:
        """Hook after the optimizer's update, before the step's graph cut (ZeRO-1 gathers the parameters)."""

    def _gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order (multi-process strategies gather over the host group)."""
        return self._process_group.gather_objects(obj, self.world_size)

    def _random_state_entry(
        self, loaders: list[DevicePrefetchLoader], mid_epoch: bool | None, **extra: Any
    ) -> dict[str, Any]:
        """This rank's random state, for a checkpoint (called on every rank).

        `mid_epoch`: whether the run resumes inside the training loaders' current epoch (None: each loader says
        whether its iteration is under way). The host states are those of the first loader's epoch start then, the
        states now otherwise."""
        states = [loader.random_state(loader.in_epoch if mid_epoch is None else mid_epoch) for loader in loaders]
        host = next((state["host"] for state in states if state["host"] is not None), None)
        return {
            "host": host if host is not None else host_states(),
            "loaders": [{"generators": s["generators"], BATCHES_YIELDED: s[BATCHES_YIELDED]} for s in states],
            "device_seed": self._device_seed,
            **extra,
        }

    def _restore_random_state(
        self, saved: Any, loaders: list[DevicePrefetchLoader], skip: bool = False
    ) -> dict[str, Any] | None:
        """Put back this rank's random state from a checkpoint's `RANDOM_STATE_KEY` value (`saved`, None if absent);
        returns the rank's entry, or None after logging once why the resume is not exact."""
        entry, reason = rank_entry(saved, self.global_rank, self.world_size)
        if entry is not None and len(entry["loaders"]) != len(loaders):
            reason = (
                f"the checkpoint holds the random state of {len(entry['loaders'])} training loader(s) and this run "
                f"has {len(loaders)}"
            )
            entry = None
        if entry is not None:
            restored = [
                loader.restore_random_state(state, skip)
                for loader, state in zip(loaders, entry["loaders"], strict=True)
            ]
            if not all(restored):
                entry, reason = None, "a training loader's generators differ from those of the checkpoint's loader"
        if entry is None:
            if self.global_rank == 0:
                log.warning(not_exact_notice(reason))
            return None
        set_host_states(entry["host"])
        self._device_seed = int(entry["device_seed"])
        return entry


if TYPE_CHECKING:
    #: the base of a mixin placed before a Neuron strategy base (`SingleDeviceCore`, `DataParallelCore`): the type
    #: checker sees `NeuronStrategyCore`'s members; at run time it is `object`, so the MRO holds no extra class
    CoreMixinBase = NeuronStrategyCore
else:
    CoreMixinBase = object


class SingleDeviceCore(CoreMixinBase):
    """Mixed into the Trainer's and Fabric's single-device Neuron strategies: one process, device 0 of the runtime's
    type (`xla:0`, or `neuron:0` natively)."""

    strategy_name = "neuron_single"
    strategy_description = "Single NeuronCore / XLA:CPU (lightning_trn)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, device=torch.device(get_runtime().device_type, 0), **kwargs)
