"""Pretrained weights from a Hugging Face `save_pretrained` folder, read straight into a (sharded) model.

`load_pretrained(module, path)` fills a model built on the meta device or on the host and then parallelized (FSDP2
`fully_shard`, DTensor tensor parallelism, both; or plain tensors: single device, DDP, ZeRO-1) from the folder's
safetensors files. Each rank reads only the block of each tensor it keeps (`safe_open(...).get_slice(key)[block]`,
the block DCP would give it, `core.checkpoint.safetensors_blocks.local_block`), one tensor at a time, each file opened
for that tensor only: a rank's host holds its shards (on the stand-in device they are host memory too) plus one
tensor's block, never the model. Called from `configure_model` (Trainer) or a Fabric `parallelize_fn` after
parallelizing, it gives meta tensors their storage itself, so the strategy's `materialize` finds nothing left to draw.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from lightning_trn.core.checkpoint.safetensors_blocks import file_shapes, listed, read_into, weight_files
from lightning_trn.core.parallel.model_parallel import (
    _copy_shards,
    _own_tensors,
    _run_on_host,
    _unwrapped_name,
    empty_meta_tensors,
)

#: `config.json` `model_type`s whose `AutoModelForCausalLM` layout (names and shapes) is the Llama one this loader
#: is tested on
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_local_folder(path: str | Path) -> None:
    """Refuse, before any Hugging Face Hub call, a `path` that names a local folder which does not exist: an absolute
    path, one starting with `./`, `../` or `~`, or one with a separator whose parent folder exists (`runs/model`
    beside an existing `runs/`). Anything else (`org/name`, `gpt2`) is left to transformers, which downloads Hub ids:
    given a missing folder, it would take the value for a Hub id and spend a minute on retries before a network error.

    Raises:
        FileNotFoundError: the folder does not exist, or is a file.
    """
    text = os.fspath(path)
    local = Path(text).expanduser()
    separated = "/" in text or os.sep in text
    path_like = (
        local.is_absolute()
        or text.startswith(("./", "../", "~"))
        or text in (".", "..")
        or (separated and local.parent.is_dir())
    )
    if not path_like or local.is_dir():
        return
    what = "is a file, not a folder" if local.exists() else "does not exist"
    raise FileNotFoundError(
        f"{text!r}: the folder {str(local.resolve())!r} {what}. A pretrained model is a save_pretrained folder "
        "(config.json, *.safetensors and the tokenizer's files); a relative path is read from the working directory "
        f"({os.getcwd()}). A Hugging Face Hub id (`org/name`) is downloaded only when no folder of that form exists "
        "here."
    )


def meta_model_from_pretrained(path: str | Path, **from_config_kwargs: Any) -> Module:
    """`AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))` built on the meta device (no memory,
    nothing drawn), for parallelizing and then `load_pretrained(model, path)`. Keyword arguments go to
    `from_config` (e.g. `attn_implementation="eager"`).

    The parameters are in torch's default dtype (fp32), not the folder's `dtype` (bf16 for most published models),
    which `from_config` would take: training keeps fp32 master weights and the precision plugin decides what
    computes in bf16. Pass `dtype=` for another.

    Raises:
        ValueError: the folder's `model_type` is not one of `SUPPORTED_MODEL_TYPES`.
        FileNotFoundError: `path` names a local folder that does not exist (`check_local_folder`).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    check_local_folder(path)
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"{str(path)!r} holds a {config.model_type!r} model; lightning_trn loads pretrained causal language "
            f"models of the Llama layout: model_type {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **{"dtype": torch.get_default_dtype(), **from_config_kwargs})


def load_pretrained(
    module: Module,
    path: str | Path,
    prefix: str | None = None,
    device: torch.device | None = None,
    stage: Sequence[Sequence[str]] | None = None,
) -> Module:
    """Fill `module`'s parameters and persistent buffers, in place, from the `save_pretrained` folder `path`
    (`model.safetensors`, or shards listed in `model.safetensors.index.json`), each rank reading only its blocks.
    Values are cast to each tensor's dtype. Tied tensors stay tied (a tied group needs any one of its names in the
    files, as `lm_head.weight` is absent with `tie_word_embeddings`). Returns `module`.

    Non-persistent buffers (the rotary `inv_freq`) are not in the files: the module's own values are kept; on the
    meta device they are computed on the host by the innermost Hugging Face model's `_init_weights` (or
    `reset_parameters`) and copied over.

    Under a `FakeTensorMode` (a memory estimate: `python -m lightning_trn.estimate llm model.pretrained=DIR`) nothing
    is read, as fake tensors hold no values: meta tensors get their (fake) storage as above, so a folder with only
    `config.json` serves; the loaded values would add no device memory, being copied into storage that exists.

    Args:
        prefix: where the Hugging Face model sits in `module` (`"model."` for a LightningModule's `self.model`);
            None: found by matching the files' names to the ends of the module's.
        device: where meta tensors get storage; None: the attached Trainer's root device (`configure_model`).
        stage: `module` is one pipeline stage of the model (`lightning_trn.pipeline_split`): the files' weights of
            other stages are skipped, and a weight tied to another stage's is read under any of its names (given
            here, `Pipeline.tied_names`: a tied output head is absent from the files, its embedding is not).

    Raises:
        ValueError: names missing from the files, names the module lacks, shapes that differ (a few of each are
            listed), or meta tensors with no `device` to put them on.
        FileNotFoundError: the folder does not exist or has no safetensors weights.
    """
    groups = _tensor_groups(module)
    if _fake_mode_active():
        _give_storage(module, groups, device)
        return module
    if not Path(path).expanduser().is_dir():
        check_local_folder(path)
        raise FileNotFoundError(
            f"{str(path)!r} is not a local folder: load_pretrained reads a save_pretrained folder on this machine "
            "(fetch a Hugging Face Hub model first, e.g. with `huggingface_hub.snapshot_download`)."
        )
    files = weight_files(Path(path).expanduser())
    shapes = file_shapes(files)
    names = {name for group in groups for name in group[0]}
    prefix = _find_prefix(names, set(shapes)) if prefix is None else prefix
    sources = _match(groups, shapes, prefix, path, stage)
    _give_storage(module, groups, device)
    with torch.no_grad():
        for (_, slots), key in zip(groups, sources, strict=True):
            submodule, attribute = slots[0]
            read_into(_own_tensors(submodule)[attribute], files[key], key)
    return module


#: a tensor's names in the module (wrapper segments removed) and the (submodule, attribute) slots that hold it
_Group = tuple[list[str], list[tuple[Module, str]]]


def _slots(module: Module) -> list[tuple[str, tuple[Module, str], Tensor]]:
    """Every (name, slot, tensor) of a parameter or persistent buffer, tied ones once per slot."""
    slots = []
    for module_name, submodule in module.named_modules(remove_duplicate=False):
        for attribute, tensor in _own_tensors(submodule).items():
            if attribute in submodule._non_persistent_buffers_set:
                continue
            name = _unwrapped_name(f"{module_name}.{attribute}" if module_name else attribute)
            slots.append((name, (submodule, attribute), tensor))
    return slots


def _tensor_groups(module: Module) -> list[_Group]:
    """The module's tensors, tied ones (one tensor in several slots) as one group."""
    groups: dict[int, _Group] = {}
    for name, slot, tensor in _slots(module):
        names, slots = groups.setdefault(id(tensor), ([], []))
        if name not in names:
            names.append(name)
        if slot not in slots:
            slots.append(slot)
    return list(groups.values())


def _find_prefix(names: set[str], keys: set[str]) -> str:
    """The prefix `p` for which most file keys `k` are module names `p + k`: where the Hugging Face model sits."""
    counts = Counter(
        name[: len(name) - len(key)]
        for key in keys
        for name in names
        if name.endswith(key) and (len(name) == len(key) or name[len(name) - len(key) - 1] == ".")
    )
    return max(counts, key=lambda prefix: (counts[prefix], -len(prefix))) if counts else ""


def _match(
    groups: list[_Group], shapes: dict[str, list[int]], prefix: str, path: Any, stage: Sequence[Sequence[str]] | None
) -> list[str]:
    """The file key each group loads from (for a pipeline stage, `stage`'s tied names, as `load_pretrained`).

    Raises:
        ValueError: missing, unexpected or shape-mismatched names.
    """
    sources: list[str] = []
    missing, mismatched, used = [], [], set()
    tied = {name: ties for ties in stage or () for name in ties}
    for names, slots in groups:
        names = [*names, *(other for name in names for other in tied.get(name, ()) if other not in names)]
        keys = [name[len(prefix) :] for name in names if name.startswith(prefix) and name[len(prefix) :] in shapes]
        used.update(keys)
        if not keys:
            missing.append(names[0])
            continue
        tensor = _own_tensors(slots[0][0])[slots[0][1]]
        if list(tensor.shape) != list(shapes[keys[0]]):
            mismatched.append(f"{keys[0]} {list(shapes[keys[0]])} vs {list(tensor.shape)}")
        sources.append(keys[0])
    unexpected = sorted(set(shapes) - used) if stage is None else []  # a stage holds part of the files
    problems = [
        f"{what} ({len(items)}): {listed(items)}"
        for what, items in (
            ("missing from the files", missing),
            ("in the files but not in the module", unexpected),
            ("shape in the files vs the module", mismatched),
        )
        if items
    ]
    if problems:
        raise ValueError(
            f"The weights in {str(path)!r} do not fit the module (module names taken as {prefix!r} + the files' "
            f"names): {'; '.join(problems)}. Build the module from the folder's config.json "
            "(`lightning_trn.meta_model_from_pretrained`) and pass `prefix=` if the names differ by more than a prefix."
        )
    return sources


def _device(module: Module, device: torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        return trainer.strategy.root_device
    raise ValueError(
        "The module has tensors on the meta device: pass `device=` (the strategy's `root_device`, Fabric's "
        "`fabric.device`) to give them storage there."
    )


def _fake_mode_active() -> bool:
    from torch._guards import detect_fake_mode

    return detect_fake_mode() is not None


def _give_storage(module: Module, groups: list[_Group], device: torch.device | None) -> None:
    """Storage on the device for the module's meta tensors, tied ones tied again, and the meta-born non-persistent
    buffers computed (`_initialize`); nothing when no tensor is on the meta device."""
    if not any(tensor.is_meta for tensor in [*module.parameters(), *module.buffers()]):
        return
    unfilled = [
        sub
        for sub in module.modules()
        if any(tensor.is_meta and name in sub._non_persistent_buffers_set for name, tensor in _own_tensors(sub).items())
    ]
    empty_meta_tensors(module, _device(module, device))
    _retie(groups)
    _initialize(module, unfilled)


def _retie(groups: list[_Group]) -> None:
    """Put a tied group's first tensor back into all its slots: giving meta tensors storage replaces each slot's
    tensor on its own, which would untie them."""
    for _, slots in groups:
        first = _own_tensors(slots[0][0])[slots[0][1]]
        for submodule, attribute in slots[1:]:
            slots_of = submodule._parameters if attribute in submodule._parameters else submodule._buffers
            slots_of[attribute] = first  # type: ignore[assignment]  # a Parameter in _parameters, a buffer in _buffers


def _initialize(module: Module, submodules: list[Module]) -> None:
    """Initialize `submodules` (those with meta-born non-persistent buffers, which no file holds) on the host with
    their innermost Hugging Face model's `_init_weights`, or their own `reset_parameters`, and copy their shards to
    the device; the loaded tensors are written afterwards, so what this drew for them does not survive."""
    inits: dict[Module, Callable[[Module], None]] = {}
    for owner in module.modules():
        init = getattr(owner, "_init_weights", None)
        if callable(init) and hasattr(owner, "config"):
            inits.update(dict.fromkeys(owner.modules(), init))  # inner models come later and win
    for submodule in submodules:
        init = inits.get(submodule)
        if init is None and callable(getattr(submodule, "reset_parameters", None)):
            init = lambda sub: sub.reset_parameters()  # noqa: E731
        if init is None:
            raise ValueError(
                f"{type(submodule).__name__} was built on the meta device and has non-persistent buffers, which no "
                "weights file holds, and no `reset_parameters()` to compute them: build it on the host."
            )
        _copy_shards(submodule, _run_on_host(submodule, init))
