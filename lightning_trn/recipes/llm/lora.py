"""LoRA fine-tuning for the LLM recipe (`model.lora.r=16 model.lora.alpha=32 model.lora.target=[q_proj,v_proj]`),
through PEFT's `inject_adapter_in_model`: the targeted `Linear`s of the `model.pretrained` model become PEFT LoRA
layers in place, so the recipe's `self.net` stays the Hugging Face model (FSDP2 still shards each decoder layer, the
forward and `save_pretrained` are unchanged). The base weights are frozen; only the adapters (`lora_A`, `lora_B`)
train and sit in the optimizer, so ZeRO-1 and FSDP2 shard only their state.

Loading: the folder's names are the plain model's (`q_proj.weight`), PEFT's are `q_proj.base_layer.weight`, so the
weights load while `base_layers` puts each base layer back in its LoRA layer's place; the adapters are then
initialized as PEFT does (`lora_A` Kaiming-uniform, `lora_B` zero: the model starts as the pretrained one), drawn on
the host from a generator seeded with torch's seed, whatever the device, the sharding or what drew before, and each
rank copies its block. Checkpoints hold the whole `state_dict` (base weights and adapters), so they load without the
folder. `merge_adapters` folds the adapters into the base weights for export (PEFT's `merge_and_unload`).

Not with tensor parallelism: its plans address the `Linear`s that LoRA replaces (`check_config` refuses it).
"""

from __future__ import annotations

import difflib
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from omegaconf import DictConfig, OmegaConf
from torch.nn import Module

if TYPE_CHECKING:
    from peft.tuners.lora import LoraLayer

#: the model type `add_adapters` and `merge_adapters` give back: PEFT changes the model in place
ModelT = TypeVar("ModelT", bound=Module)


def lora_hparams(settings: DictConfig) -> dict[str, Any] | None:
    """`model.lora` as the plain dict `CausalLM(lora=...)` takes (saved with its hyperparameters), None when off."""
    # a DictConfig converts to a dict (`to_container` is typed for lists and scalars too)
    return OmegaConf.to_container(settings) if settings.r else None  # type: ignore[return-value]  # see above


def check_config(cfg: DictConfig) -> None:
    """Refuse `model.lora` where it cannot work.

    Raises:
        ValueError: LoRA without `model.pretrained` (frozen random weights learn nothing), or with tensor parallelism
            (its plans shard the `Linear`s that LoRA layers replace).
    """
    if not cfg.model.lora.r:
        return
    if not cfg.model.pretrained:
        raise ValueError(
            f"model.lora.r={cfg.model.lora.r} needs model.pretrained=DIR: LoRA trains adapters on top of "
            "frozen pretrained weights."
        )
    if cfg.model.tensor_parallel_size != 1:
        raise ValueError(
            f"model.lora.r={cfg.model.lora.r} with model.tensor_parallel_size="
            f"{cfg.model.tensor_parallel_size}: LoRA is not supported with tensor parallelism; use "
            "model.tensor_parallel_size=1 (FSDP2 over all devices) or a full fine-tune (model.lora.r=0)."
        )


def add_adapters(net: ModelT, lora: Mapping[str, Any], meta: bool) -> ModelT:
    """`net` with PEFT LoRA layers in place of the `Linear`s named by `lora["target"]` (their base weights frozen,
    like every other tensor of `net`); with `meta`, the adapters on the meta device, for `init_adapters`.

    Raises:
        ValueError: a name in the targets matches no module of `net` (PEFT would drop it silently as long as another
            one matches), listing the names of the `Linear` layers that exist.
    """
    from peft import LoraConfig, inject_adapter_in_model

    check_targets(net, lora["target"])
    config = LoraConfig(
        r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"], target_modules=list(lora["target"])
    )
    return cast(ModelT, inject_adapter_in_model(config, net, low_cpu_mem_usage=meta))  # `net` itself, changed


def check_targets(net: Module, targets: Sequence[str]) -> None:
    """Every name in `targets` must name a module of `net` as PEFT matches them (the module's name, or its end after
    a dot: `q_proj`, `self_attn.q_proj`).

    Raises:
        ValueError: a target matches no module; the paragraph lists the names of the `Linear` layers that exist.
    """
    names = [name for name, _ in net.named_modules() if name]
    unmatched = [target for target in targets if not any(n == target or n.endswith(f".{target}") for n in names)]
    if not unmatched:
        return
    linears = sorted({name.rsplit(".", 1)[-1] for name, m in net.named_modules() if isinstance(m, torch.nn.Linear)})
    hints = [
        f"{target!r} (did you mean {close[0]!r}?)"
        if (close := difflib.get_close_matches(target, linears, n=1))
        else repr(target)
        for target in unmatched
    ]
    raise ValueError(
        f"model.lora.target={list(targets)}: {', '.join(hints)} matches no module of the model, so it would get no "
        f"adapters (PEFT drops such a name as long as another one matches). The model's Linear layers are named "
        f"{', '.join(linears)}; every name in model.lora.target must be one of them (or end one of the model's "
        "module names after a dot, e.g. self_attn.q_proj)."
    )


def _lora_layers(net: Module) -> list[tuple[Module, str, LoraLayer]]:
    """(parent, attribute, LoRA layer) of every PEFT LoRA layer in `net`, in `named_modules` order."""
    if "peft" not in sys.modules:  # no PEFT layer exists before PEFT is imported: spare plain models its import (s)
        return []
    from peft.tuners.lora import LoraLayer

    return [
        (parent, attribute, child)
        for parent in net.modules()
        for attribute, child in parent.named_children()
        if isinstance(child, LoraLayer)
    ]


@contextmanager
def base_layers(net: Module) -> Iterator[Module]:
    """`net` with each LoRA layer's base layer in its place while the context lasts: the plain model, whose names are
    those of the pretrained files (`load_pretrained`); the adapters are out of reach until it ends."""
    layers = _lora_layers(net)
    for parent, attribute, layer in layers:
        setattr(parent, attribute, layer.get_base_layer())
    try:
        yield net
    finally:
        for parent, attribute, layer in layers:
            setattr(parent, attribute, layer)


def adapter_parameters(net: Module) -> list[torch.nn.Parameter]:
    """The adapters' parameters (`lora_A`, `lora_B`), in `named_parameters` order."""
    return [param for name, param in net.named_parameters() if ".lora_A." in name or ".lora_B." in name]


def init_adapters(net: Module, device: torch.device) -> None:
    """Initialize every adapter as PEFT does (`lora_A` Kaiming-uniform with a = sqrt(5), `lora_B` zero), the values
    drawn at full size on the host from a generator seeded with `torch.initial_seed()`, so that one device and any
    sharding start alike; each rank copies its block (a DTensor's local shard). Adapters still on the meta device
    get storage on `device` first. Nothing for a model without adapters."""
    from torch.distributed.tensor import DTensor

    from lightning_trn.core.parallel.model_parallel import empty_meta_tensors, local_block

    layers = _lora_layers(net)
    if not layers:
        return
    empty_meta_tensors(net, device)  # the whole model: FSDP2 re-points its sharded parameters in the root's `_apply`
    generator = torch.Generator().manual_seed(torch.initial_seed())
    with torch.no_grad():
        for _, _, layer in layers:
            for name in layer.active_adapters:
                # each adapter is a layer with a `weight` Parameter (a Linear for the recipe's Linear targets)
                a, b = (cast(torch.Tensor, adapters[name].weight) for adapters in (layer.lora_A, layer.lora_B))
                full_a = torch.nn.init.kaiming_uniform_(torch.empty(a.shape), a=math.sqrt(5), generator=generator)
                for param, full in ((a, full_a), (b, torch.zeros(b.shape))):
                    local = param.to_local() if isinstance(param, DTensor) else param
                    local.copy_(full[local_block(full.shape, param)])


def merge_adapters(net: ModelT) -> ModelT:
    """`net` with each LoRA layer's adapters added into its base weight and the base layer put back in its place
    (PEFT's `merge_and_unload`): the plain Hugging Face model, which `save_pretrained` writes without PEFT."""
    for parent, attribute, layer in _lora_layers(net):
        layer.merge(safe_merge=True)
        setattr(parent, attribute, layer.get_base_layer())
    if hasattr(net, "peft_config"):  # set by the injection; the merged model has no adapters left
        del net.peft_config
    return net
