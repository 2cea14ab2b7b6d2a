"""Make `Trainer(accelerator="neuron")` and `Fabric(accelerator="neuron")` work: registry entries plus
version-guarded connector hooks, the same for both of Lightning's APIs (`_API` says what differs).

Lightning discovers no outside accelerators and, for a registered "neuron" string, its connectors
(`_AcceleratorConnector` for the Trainer, `_Connector` for Fabric) would pick `SingleDeviceStrategy("cpu")` (or
"ddp") and a non-XLA precision plugin. We wrap exactly the methods that decide this, only for the Lightning versions
we test: `_check_config_and_set_final_flags` (a precision typo is refused with the values the plugin accepts),
`_choose_auto_accelerator` ("auto" means neuron on real NeuronCores), `_choose_strategy`,
`_check_strategy_and_fallback` (Lightning's strategy names on a Neuron run) and `_check_and_init_precision`.
Everything that is not a Neuron run goes to the original methods untouched.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import lightning
from lightning.fabric.accelerators import ACCELERATOR_REGISTRY as FABRIC_ACCELERATORS
from lightning.fabric.connector import _Connector, _convert_precision_to_unified_args
from lightning.fabric.plugins.precision import Precision as FabricPrecision
from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGIES
from lightning.fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from lightning.fabric.strategies import Strategy as FabricStrategy
from lightning.pytorch.accelerators import AcceleratorRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy, Strategy, StrategyRegistry
from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

from lightning_trn import fabric
from lightning_trn.accelerator import NeuronAccelerator
from lightning_trn.core.parallel.fsdp import lightning_fsdp_arguments
from lightning_trn.core.parallel.model_parallel import lightning_model_parallel_arguments
from lightning_trn.core.precision import check_precision
from lightning_trn.core.strategy import NeuronStrategyCore
from lightning_trn.hooks.registry import TESTED_LIGHTNING, lightning_version_tested
from lightning_trn.hooks.resume import install_resume_hook
from lightning_trn.hooks.throughput import install_throughput_hooks
from lightning_trn.pytorch.precision import NeuronPrecision
from lightning_trn.pytorch.strategies import (
    NeuronDDPStrategy,
    NeuronFSDPStrategy,
    NeuronModelParallelStrategy,
    NeuronStrategyBase,
    SingleDeviceNeuronStrategy,
)
from lightning_trn.runtime import neuron_hardware_present

_HOOKED = (
    "_check_config_and_set_final_flags",
    "_choose_auto_accelerator",
    "_choose_strategy",
    "_check_strategy_and_fallback",
    "_check_and_init_precision",
)
_NAME = NeuronAccelerator.name()
_DDP_STRATEGY_NAME = NeuronDDPStrategy.strategy_name
_NEURON_STRATEGY_NAMES = (
    _DDP_STRATEGY_NAME,
    NeuronDDPStrategy.zero1_strategy_name,
    SingleDeviceNeuronStrategy.strategy_name,
    NeuronModelParallelStrategy.strategy_name,
    NeuronFSDPStrategy.strategy_name,
)
#: Lightning's FSDP strategy names, served by `NeuronFSDPStrategy`
_FSDP_NAMES = ("fsdp", "fsdp_cpu_offload")
#: Lightning strategy names that mean what `neuron_ddp` does: one process per device, started with the script
_DDP_ALIASES = ("ddp", "ddp_find_unused_parameters_false")


@dataclass(frozen=True)
class _API:
    """What differs between the Trainer's and Fabric's registration: the connector, registries and classes."""

    name: str
    #: where the API's Neuron classes are public
    package: str
    #: the connector class (`_AcceleratorConnector`, `_Connector`), whose methods `_install_connector_hooks` replaces
    #: by name: the two classes share those names, not a type
    connector: Any
    accelerators: Any
    strategies: Any
    strategy_base: type[NeuronStrategyCore]
    single: type[NeuronStrategyCore]
    ddp: type[NeuronStrategyCore]
    model_parallel: type[NeuronStrategyCore]
    #: Lightning's `ModelParallelStrategy` of this API, which a Neuron run replaces by `model_parallel`
    lightning_model_parallel: type
    #: the Neuron strategy for Lightning's `FSDPStrategy` arguments, and Lightning's
    fsdp: type[NeuronStrategyCore]
    lightning_fsdp: type
    #: the connector's Neuron precision plugin, or None when the user passed a precision plugin object
    precision: Callable[[Any], Any]


def _trainer_precision(connector: _AcceleratorConnector) -> Any:
    if isinstance(connector._precision_plugin_flag, Precision):
        return None
    connector._validate_precision_choice()
    return NeuronPrecision(connector._precision_flag)


def _fabric_precision(connector: _Connector) -> Any:
    if isinstance(connector._precision_instance, FabricPrecision):
        return None
    return fabric.NeuronPrecision(connector._precision_input)


TRAINER = _API(
    "Trainer",
    "lightning_trn",
    _AcceleratorConnector,
    AcceleratorRegistry,
    StrategyRegistry,
    NeuronStrategyBase,
    SingleDeviceNeuronStrategy,
    NeuronDDPStrategy,
    NeuronModelParallelStrategy,
    ModelParallelStrategy,
    NeuronFSDPStrategy,
    FSDPStrategy,
    _trainer_precision,
)
FABRIC = _API(
    "Fabric",
    "lightning_trn.fabric",
    _Connector,
    FABRIC_ACCELERATORS,
    FABRIC_STRATEGIES,
    fabric.strategies.NeuronFabricStrategyBase,
    fabric.SingleDeviceNeuronStrategy,
    fabric.NeuronDDPStrategy,
    fabric.NeuronModelParallelStrategy,
    FabricModelParallelStrategy,
    fabric.NeuronFSDPStrategy,
    FabricFSDPStrategy,
    _fabric_precision,
)


def _is_neuron(connector: Any) -> bool:
    """Whether the connector sets up a Neuron run (its accelerator is already constructed when the hooks run).

    Raises:
        RuntimeError: "neuron" was registered by another package (AWS's neuronx-distributed) after lightning_trn.
    """
    if isinstance(connector.accelerator, NeuronAccelerator):
        return True
    if connector._accelerator_flag == _NAME:
        raise RuntimeError(
            f"`accelerator='neuron'` resolved to {_qualname(type(connector.accelerator))}, not lightning_trn's "
            "NeuronAccelerator: another package (e.g. AWS's `neuronx_distributed.lightning`) registered the name "
            "'neuron' after `import lightning_trn`. The two packages' accelerators, strategies and precision plugins "
            "do not mix. Use one of them: import lightning_trn last (it takes the name back), or pass the "
            "accelerator object itself, `Trainer(accelerator=lightning_trn.NeuronAccelerator())`."
        )
    return False


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _neuron_strategy_flag(api: _API, flag: Any) -> Any:
    """The strategy flag for a Neuron run: Lightning's DDP names become `neuron_ddp`; strategies that cannot run on
    NeuronCores are refused before anything starts (they would fail inside `fit` with a CUDA/device-id message)."""
    if isinstance(flag, api.strategy_base) or flag in _NEURON_STRATEGY_NAMES:
        return flag
    if flag in _DDP_ALIASES:
        return _DDP_STRATEGY_NAME
    if isinstance(flag, api.lightning_model_parallel):  # a script written for GPUs: the same arguments on NeuronCores
        return api.model_parallel(**lightning_model_parallel_arguments(flag))
    if flag in _FSDP_NAMES:
        return api.fsdp(cpu_offload=flag == "fsdp_cpu_offload")
    if isinstance(flag, api.lightning_fsdp):
        return api.fsdp(**lightning_fsdp_arguments(flag))
    name = type(flag).__name__ if isinstance(flag, (Strategy, FabricStrategy)) else repr(flag)
    raise ValueError(
        f"`{api.name}(accelerator='neuron', strategy={name})` is not supported. On NeuronCores lightning_trn trains "
        "data-parallel with its own strategy, which `strategy='ddp'` or 'auto' selects (`NeuronDDPStrategy`): one "
        "process per NeuronCore, started by the script itself (`python train.py`), torchrun or SLURM, gradients "
        "all-reduced once per optimizer step. Spawned or forked processes ('ddp_spawn', 'ddp_fork', "
        "'ddp_notebook') cannot share the device runtime, `find_unused_parameters=True` is not available, and "
        "of the sharded strategies lightning_trn offers ZeRO-1, the optimizer state sharded over the data-parallel "
        "ranks (`strategy='neuron_zero1'`), and on the native backend Lightning's `ModelParallelStrategy` (FSDP2 "
        "and tensor parallelism) and `FSDPStrategy` / 'fsdp' (served by FSDP2); DeepSpeed is not available."
    )


def _check_precision_flag(precision: Any) -> None:
    """A precision Lightning does not know, on a Neuron run: refused with the values the plugin accepts rather than
    Lightning's whole list (fp16 and 64-bit among them, which the plugin refuses). Lightning's own values and aliases
    (`"bf16"`, `32`) go on to Lightning and the plugin."""
    if precision is None or isinstance(precision, (Precision, FabricPrecision)):
        return
    try:
        _convert_precision_to_unified_args(precision)
    except ValueError:
        check_precision(precision)


def _choose_neuron_strategy(api: _API, connector: Any) -> Any:
    if connector._num_nodes_flag > 1 or len(connector._parallel_devices) > 1:
        return _DDP_STRATEGY_NAME
    return api.single()


def _install_connector_hooks(api: _API) -> bool:
    """Wrap the connector's strategy and precision choice; returns False (and warns) if the version is untested."""
    connector = api.connector
    if getattr(connector, "_lightning_trn_hooked", False):
        return True
    if not lightning_version_tested() or not all(hasattr(connector, name) for name in _HOOKED):
        warnings.warn(
            f"lightning_trn was tested with lightning>={TESTED_LIGHTNING[0]},<{TESTED_LIGHTNING[1]}, found "
            f"{lightning.__version__}: "
            f"`{api.name}(accelerator='neuron')` will not pick the Neuron strategy by itself. Pass it explicitly: "
            f"`{api.name}(accelerator='neuron', strategy='neuron_single')` (or 'neuron_ddp'), "
            f"`plugins=[{api.package}.NeuronPrecision(...)]`.",
            stacklevel=3,
        )
        return False

    check_config_and_set_final_flags = connector._check_config_and_set_final_flags
    choose_auto_accelerator = connector._choose_auto_accelerator
    choose_strategy = connector._choose_strategy
    check_strategy_and_fallback = connector._check_strategy_and_fallback
    check_and_init_precision = connector._check_and_init_precision

    def _check_config_and_set_final_flags(self: Any, **flags: Any) -> None:
        accelerator = flags.get("accelerator")
        if accelerator == _NAME or isinstance(accelerator, NeuronAccelerator):
            _check_precision_flag(flags.get("precision"))
        check_config_and_set_final_flags(self, **flags)

    def _choose_auto_accelerator() -> str:
        return _NAME if neuron_hardware_present() else choose_auto_accelerator()

    def _choose_strategy(self: Any) -> Any:
        if _is_neuron(self):
            return _choose_neuron_strategy(api, self)
        return choose_strategy(self)

    def _check_strategy_and_fallback(self: Any) -> None:
        if _is_neuron(self):
            self._strategy_flag = _neuron_strategy_flag(api, self._strategy_flag)
        check_strategy_and_fallback(self)

    def _check_and_init_precision(self: Any) -> Any:
        if isinstance(self.strategy, api.strategy_base):
            precision = api.precision(self)
            if precision is not None:
                return precision
        return check_and_init_precision(self)

    connector._check_config_and_set_final_flags = _check_config_and_set_final_flags
    connector._choose_auto_accelerator = staticmethod(_choose_auto_accelerator)
    connector._choose_strategy = _choose_strategy
    connector._check_strategy_and_fallback = _check_strategy_and_fallback
    connector._check_and_init_precision = _check_and_init_precision
    connector._lightning_trn_hooked = True
    return True


def _register_accelerator(registry: Any) -> None:
    """Register "neuron" as lightning_trn's accelerator, taking the name back (with a warning) from another package
    that registered it first, so `accelerator="neuron"` never mixes two packages' classes."""
    entry = dict.get(registry, _NAME)
    if entry is not None and entry["accelerator"] is NeuronAccelerator:
        return
    if entry is not None:
        warnings.warn(
            f"`accelerator='neuron'` was registered by {_qualname(entry['accelerator'])} (AWS's neuronx-distributed?); "
            "lightning_trn registers its own NeuronAccelerator under that name now. To use the other package's "
            "accelerator, pass its object: `accelerator=<its class>()`.",
            stacklevel=3,
        )
        del registry[_NAME]
    NeuronAccelerator.register_accelerators(registry)


def register() -> None:
    """Register the accelerator and strategies with the Trainer's and Fabric's registries, hook their connectors,
    `ThroughputMonitor`'s peak-FLOPs lookup and the Trainer's choice of a checkpoint to resume (idempotent)."""
    for api in (TRAINER, FABRIC):
        _register_accelerator(api.accelerators)
        for strategy in (api.single, api.ddp, api.model_parallel, api.fsdp):
            if strategy.strategy_name not in api.strategies:
                strategy.register_strategies(api.strategies)
        _install_connector_hooks(api)
    install_throughput_hooks()
    install_resume_hook()
