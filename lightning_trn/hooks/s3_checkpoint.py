"""Lightning's model-parallel strategies read and write torch.distributed.checkpoint (DCP) directories through two
module functions, `_distributed_checkpoint_save(state, path)` and `_distributed_checkpoint_load(state, path)`, which
let torch pick a filesystem reader or writer for the local `path`. Replaced here: a call for a directory that
`lightning_trn.core.checkpoint.s3_checkpoint` redirects (the local shadow of an `s3://` checkpoint) goes to AWS's
s3torchconnector reader or writer of that checkpoint's S3 version; every other call runs Lightning's function. The
Trainer's Neuron runs hold these hooks with the others (`registry.HOOKS`); Fabric's model-parallel strategy from
`setup_module` on, as its DTensor rule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_trn.core.checkpoint import s3_checkpoint


def _redirecting(
    original: Callable[..., Any] | None, dcp_function: str, storage: Callable[[Any], dict[str, Any]]
) -> Callable[..., Any] | None:
    """`original(state, path)`, except that for a redirected directory DCP's `dcp_function` (`save` / `load`) runs
    with the S3 storage `storage(target)` gives; None where Lightning has no `original`."""
    if original is None:
        return None

    def redirected(state: dict[str, Any], path: Any) -> None:
        target = s3_checkpoint.redirect_target(path)
        if target is None:
            original(state, path)
            return
        import torch.distributed.checkpoint as dcp

        getattr(dcp, dcp_function)(state, **storage(target))

    return redirected


def redirecting_save(original: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """`_distributed_checkpoint_save`, to S3 for a redirected directory."""
    return _redirecting(original, "save", lambda target: {"storage_writer": s3_checkpoint.storage_writer(target)})


def redirecting_load(original: Callable[..., Any] | None) -> Callable[..., Any] | None:
    """`_distributed_checkpoint_load`, from S3 for a redirected directory."""
    return _redirecting(original, "load", lambda target: {"storage_reader": s3_checkpoint.storage_reader(target)})
