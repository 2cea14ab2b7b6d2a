"""`NeuronCompileCache`: a persistent compile cache in a local directory, optionally shared through S3."""

from __future__ import annotations

import logging
import os
import tempfile

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_trn.pytorch.callbacks.compile_cache.archive import (
    archive_name,
    extract_archive,
    list_entries,
    pack_entries,
)
from lightning_trn.pytorch.callbacks.compile_cache.s3_store import S3CacheStore, is_s3_url, redact
from lightning_trn.pytorch.callbacks.compiler_flags import NeuronCompilerFlags, cc_flags_digest
from lightning_trn.runtime import get_runtime
from lightning_trn.runtime.discovery import CPU
from lightning_trn.runtime.environment import NEURON_CC_FLAGS, cc_flag_value

log = logging.getLogger(__name__)

#: records which S3 archives were already extracted into a local cache directory
_PULLED_FILE = ".lightning_trn_pulled"


class NeuronCompileCache(Callback):
    """Keeps compiled graphs between runs: `url` is a local directory or `s3://bucket/prefix`.

    On Neuron the cache is the compiler's (`NEURON_COMPILE_CACHE_URL`, keyed by graph and compiler flags); on XLA:CPU
    it is torch_xla's persistent cache, in a subdirectory named after a hash of `NEURON_CC_FLAGS` so that, as on
    Neuron, a run with other compiler flags does not reuse entries. For S3 the cache lives in `local_dir`: archives
    under the prefix are pulled before the first compile and the entries this run added are pushed as a new archive
    when it ends (local rank 0 of each node transfers, the other ranks wait at a barrier). Every S3 or archive
    failure is a warning; training goes on with the local cache.

    The cache must be set before this process compiles anything. The Trainer enables it in `setup`; if the process
    may compile earlier, call `enable()` before creating the Trainer. Once enabled it stays on for the process.
    """

    def __init__(
        self,
        url: str,
        local_dir: str | None = None,
        endpoint_url: str | None = None,
        pull: bool = True,
        push: bool = True,
        connect_timeout: float = 5.0,
        max_attempts: int = 2,
    ) -> None:
        self.url = url
        self._store: S3CacheStore | None = None
        if is_s3_url(url):
            self._store = S3CacheStore(url, endpoint_url, connect_timeout, max_attempts)
            default_dir = os.path.join(
                tempfile.gettempdir(), "lightning-trn-compile-cache", self._store.bucket, self._store.prefix
            )
            self.local_dir = os.path.abspath(local_dir or default_dir)
        else:
            self.local_dir = os.path.abspath(os.path.expanduser(local_dir or url))
        self._pull, self._push = pull, push
        self._pulled = False
        self._said_no_cache = False  # the native backend's warning, given once per callback
        self._baseline: dict[str, int] | None = None
        #: the directory the runtime uses, once `enable` succeeded
        self.cache_dir: str | None = None

    def resolve_cache_dir(self) -> str:
        """The directory handed to the runtime: `local_dir` on Neuron, a per-flags subdirectory on XLA:CPU."""
        if get_runtime().detect_platform().kind == CPU:
            flags = os.environ.get(NEURON_CC_FLAGS, "")
            return os.path.join(self.local_dir, f"xla-cpu-flags-{cc_flags_digest(flags)}")
        return self.local_dir

    def enable(self) -> bool:
        """Pull from S3 (if configured) and point the runtime's cache here; False, with a warning, if too late or if
        the backend has no such cache (the native one: nothing is pulled, created or pushed then)."""
        if self.cache_dir is not None:
            return True
        runtime = get_runtime()
        if not runtime.has_compile_cache:
            if not self._said_no_cache:
                rank_zero_warn(
                    f"NeuronCompileCache: the {runtime.name} backend has no compile cache this callback can set "
                    "(TorchNeuron compiles op by op, and `torch.compile` graphs under its own `TORCH_NEURONX_*` "
                    "settings); it does nothing in this process. Leave it out on Trn2/Trn3 (docs/torchneuron.md)."
                )
                self._said_no_cache = True
            return False
        if self._store is not None and self._pull and not self._pulled:
            self.pull()
        cache_dir = self.resolve_cache_dir()
        os.makedirs(cache_dir, exist_ok=True)
        if cc_flag_value(os.environ.get(NEURON_CC_FLAGS, ""), "--cache_dir") is not None:
            rank_zero_warn(f"NeuronCompileCache: `--cache_dir` in {NEURON_CC_FLAGS} overrides the cache {cache_dir}.")
        if not runtime.enable_compile_cache(cache_dir):
            rank_zero_warn(
                f"NeuronCompileCache: could not enable the compile cache at {cache_dir}: this process already "
                "compiled graphs, so the runtime's compile cache is already set. Graphs compile without it. Call "
                "`NeuronCompileCache(...).enable()` before any XLA work (before creating the model on the device)."
            )
            return False
        self.cache_dir = cache_dir
        self._baseline = list_entries(self.local_dir)
        log.info("NeuronCompileCache: compile cache at %s.", cache_dir)
        return True

    def pull(self) -> int:
        """Extract the S3 archives not pulled before into `local_dir`; returns files written (never raises)."""
        self._pulled = True
        if self._store is None:
            return 0
        os.makedirs(self.local_dir, exist_ok=True)
        done = self._pulled_keys()
        written = 0
        try:
            keys = [key for key in self._store.list_archives() if key not in done]
        except Exception as err:  # noqa: BLE001 - any S3 failure: go on with the local cache
            self._warn("could not list", self.url, err)
            return 0
        for key in keys:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "archive.tar.gz")
                try:
                    self._store.download(key, path)
                    written += extract_archive(path, self.local_dir)
                except Exception as err:  # noqa: BLE001 - a bad archive must not stop training
                    self._warn("skipped archive", f"s3://{self._store.bucket}/{key}", err)
                    continue
            done.add(key)
        with open(os.path.join(self.local_dir, _PULLED_FILE), "w") as f:
            f.write("\n".join(sorted(done)))
        log.info("NeuronCompileCache: pulled %d archive(s), %d file(s) from %s.", len(keys), written, self.url)
        return written

    def push(self) -> str | None:
        """Upload the entries added since `enable` as one new archive; returns its key (never raises)."""
        if self._store is None or self._baseline is None:
            return None
        current = list_entries(self.local_dir)
        added = [path for path, size in current.items() if self._baseline.get(path) != size]
        if not added:
            log.info("NeuronCompileCache: no new compile-cache entries to push.")
            return None
        key = self._store.key(archive_name(added))
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "archive.tar.gz")
            try:
                pack_entries(self.local_dir, added, path)
                self._store.upload(path, key)
            except Exception as err:  # noqa: BLE001 - a failed upload must not fail the finished run
                self._warn("could not push to", self.url, err)
                return None
        self._baseline = current
        log.info("NeuronCompileCache: pushed %d new entries to s3://%s/%s.", len(added), self._store.bucket, key)
        return key

    def _pulled_keys(self) -> set[str]:
        try:
            with open(os.path.join(self.local_dir, _PULLED_FILE)) as f:
                return {line for line in f.read().splitlines() if line}
        except OSError:
            return set()

    @staticmethod
    def _warn(what: str, where: str, err: BaseException) -> None:
        rank_zero_warn(
            f"NeuronCompileCache: {what} {where} ({type(err).__name__}: {redact(str(err))}); "
            "training goes on with the local compile cache."
        )

    def _pull_on_node(self, trainer: pl.Trainer) -> None:
        """Local rank 0 pulls while the node's other ranks wait, so nobody compiles before the entries are there."""
        if trainer.local_rank == 0:
            self.pull()
        trainer.strategy.barrier("lightning_trn_compile_cache_pull")
        self._pulled = True

    def _push_from_node(self, trainer: pl.Trainer) -> None:
        """Once every rank of the node finished compiling, local rank 0 pushes what they added."""
        if self._store is None or not self._push:
            return
        trainer.strategy.barrier("lightning_trn_compile_cache_push")
        if trainer.local_rank == 0:
            self.push()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not get_runtime().has_compile_cache:
            self.enable()  # warns that there is nothing to do: no pull from S3 either
            return
        # the flags name the XLA:CPU cache directory: set them first (Lightning's connectors set `callbacks` on the
        # Trainer; its class does not declare it)
        for callback in trainer.callbacks:  # type: ignore[attr-defined]  # see above
            if isinstance(callback, NeuronCompilerFlags):
                callback.apply()
        if self._store is not None and self._pull and not self._pulled:
            self._pull_on_node(trainer)
        if self.cache_dir is not None and self.resolve_cache_dir() != self.cache_dir:
            rank_zero_warn(
                f"NeuronCompileCache: {NEURON_CC_FLAGS} changed after the cache was enabled at {self.cache_dir}; "
                "entries are filed under the earlier flags. Apply `NeuronCompilerFlags` before `enable()`."
            )
        self.enable()

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._push_from_node(trainer)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.state.fn == TrainerFn.VALIDATING:
            self._push_from_node(trainer)

    @override
    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._push_from_node(trainer)

    @override
    def on_predict_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._push_from_node(trainer)
