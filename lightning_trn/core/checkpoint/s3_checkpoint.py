"""Sharded checkpoints in S3 (`S3Storage`: `s3://bucket/prefix/<name>.ckpt`) for the strategies that write
torch.distributed.checkpoint (DCP) directories (model-parallel and FSDP; Trainer and Fabric), atomic by a commit
object that rank 0 writes last.

S3 has no rename, so a save cannot be staged and swapped in as on a filesystem
(`lightning_trn.core.checkpoint.sharded_save`). Each save writes a new version under the checkpoint's prefix, and one
small object says which version is the checkpoint:

    <name>.ckpt/commit.json                         {"lightning_trn_checkpoint": 1, "version": "<v>"}: written last,
                                                    by rank 0, after every rank's files
    <name>.ckpt/<v>/.lightning_trn-lease            the writer's lease (`leases`), written first, renewed while the
                                                    version is written, deleted once it is committed
    <name>.ckpt/<v>/__<rank>_0.distcp, .metadata    DCP's files, every rank's, through AWS's s3torchconnector
    <name>.ckpt/<v>/random-state-rank<r>.pt         each rank's random state, written by that rank
    <name>.ckpt/<v>/meta.pt                         the rest of Lightning's checkpoint (rank 0)

A PUT replaces an object whole, so a reader gets the previous commit object or the new one, never a mix, and every
read goes through the commit object (`committed_version`): a version no commit object names is never loaded, never
picked by `ckpt_path="last"` (`newest_committed`), and a checkpoint without a commit object is refused by a load.
After the commit, rank 0 deletes the previous version in the background (DeleteObjects, up to 1,000 keys a request),
off the save's critical path.

**Ownership and concurrency.** Only versions (`<20 digits>-<8 hex>`) of a prefix whose commit object is ours, or that
hold our lease record, are ever deleted, and only when no commit object names them and their writer is proven gone
(`leases.is_live`; a version without a lease: once older than `leases.EXPIRY_S`, by the time in its name). So an
evaluation job, or another job's resume, never deletes a version a live writer is uploading; a user's objects, and a
`commit.json` that is not ours, are never touched. What a kill leaves is deleted by a later save into that checkpoint
(`discard_uncommitted`) and before a training resume (`sweep`).

Versions are `<time_ns>-<8 hex>`, made on rank 0 and broadcast: sortable by the time of the save that made them,
which is how "last" chooses between `last.ckpt` and `last-v1.ckpt`.

The clients (AWS's `s3torchconnector` for data, boto3 for batched deletions; imported when first used:
`import lightning_trn` works without them) take the region from `AWS_REGION` or `AWS_DEFAULT_REGION` and the
endpoint from `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` when set: the variables botocore reads as well, so s3fs
(through which Lightning's `ModelCheckpoint` lists and checks its `s3://` directory) reaches the same server.

How Lightning's own save and load reach S3: its model-parallel strategies write a DCP directory to a local `Path`
(`mkdir`, `_distributed_checkpoint_save(state, path)`, rank 0's `torch.save(meta, path / "meta.pt")`) and read it the
same way. So they get a local shadow directory (`shadow_directory`: the same path on every rank, as Lightning
broadcasts rank 0's), whose DCP reads and writes `lightning_trn.hooks.s3_checkpoint` sends to the S3 version
(`redirected`); around it, `staged_upload` uploads `meta.pt` and the commit object, `committed_source` downloads
`meta.pt`.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

from lightning_trn.core.checkpoint import leases
from lightning_trn.core.checkpoint.async_save import Deferral
from lightning_trn.core.parallel.process_group import ProcessGroup

log = logging.getLogger(__name__)

S3_SCHEME = "s3://"
#: the object that makes a version the checkpoint
COMMIT_OBJECT = "commit.json"
#: the key in a commit object that says lightning_trn wrote it
COMMIT_FORMAT = "lightning_trn_checkpoint"
#: the writer's lease inside a version being written
LEASE_OBJECT = f".{leases.OWNER_TAG}-lease"
_VERSION = re.compile(r"\d{20}-[0-9a-f]{8}")
REGION_VARIABLES = ("AWS_REGION", "AWS_DEFAULT_REGION")
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
#: the names `ModelCheckpoint` gives its "last" checkpoints (`last.ckpt`, `last-v1.ckpt`, ...), as Lightning matches
LAST_NAME = re.compile(r"last(-v?\d+)?\.ckpt")
#: how s3torchconnector's errors say that an object is missing (its GET's and its HEAD's)
_MISSING = ("the key does not exist", "the object was not found")
#: DeleteObjects takes at most this many keys a request
DELETE_BATCH = 1000


def is_s3(path: Any) -> bool:
    """Whether `path` names an S3 location."""
    return isinstance(path, str | os.PathLike) and os.fspath(path).startswith(S3_SCHEME)


def _split(url: str) -> tuple[str, str]:
    """`s3://bucket/key/` -> (bucket, key), the key without a trailing slash."""
    bucket, _, key = url[len(S3_SCHEME) :].partition("/")
    return bucket, key.strip("/")


def _join(bucket: str, key: str) -> str:
    return f"{S3_SCHEME}{bucket}/{key}" if key else f"{S3_SCHEME}{bucket}"


def _setting(names: tuple[str, ...]) -> str | None:
    return next((os.environ[name] for name in names if os.environ.get(name)), None)


def _region() -> str:
    region = _setting(REGION_VARIABLES)
    if region is None:
        raise ValueError(
            "lightning_trn: sharded checkpoints in S3 need the bucket's region: set AWS_REGION (or "
            "AWS_DEFAULT_REGION), as SageMaker and EKS jobs usually have it."
        )
    return region


@functools.lru_cache(maxsize=4)
def _client_for(region: str, endpoint: str | None) -> Any:
    from s3torchconnector._s3client import S3Client  # the client the DCP storage of s3torchconnector 1.5 takes

    return S3Client(region, endpoint=endpoint)


#: s3torchconnector is imported, and the first client made, by one thread at a time: the background deleter and a
#: save may start at once, and a concurrent first import of s3torchconnector fails ("partially initialized module")
_client_lock = threading.Lock()


def _s3_exception() -> type[Exception]:
    """s3torchconnector's error type, imported under the lock."""
    with _client_lock:
        from s3torchconnector import S3Exception

    return S3Exception


def _client() -> Any:
    with _client_lock:
        return _client_for(_region(), _setting(ENDPOINT_VARIABLES))


@functools.lru_cache(maxsize=4)
def _batch_client_for(region: str, endpoint: str | None) -> Any:
    import boto3  # s3torchconnector has no DeleteObjects

    return boto3.client("s3", region_name=region, endpoint_url=endpoint)


def _missing(error: Exception) -> bool:
    return any(text in str(error).lower() for text in _MISSING)


def _get(bucket: str, key: str) -> bytes | None:
    """The object's bytes, or None where there is none."""
    S3Exception = _s3_exception()  # the class, named as s3torchconnector names it
    try:
        return _client().get_object(bucket, key).read()
    except S3Exception as error:
        if _missing(error):
            return None
        raise


def _put(bucket: str, key: str, data: bytes) -> None:
    with _client().put_object(bucket, key) as writer:
        writer.write(data)


def _delete(bucket: str, key: str) -> None:
    """Delete one object; already gone is fine (another process deleted it meanwhile)."""
    S3Exception = _s3_exception()  # the class, named as s3torchconnector names it
    try:
        _client().delete_object(bucket, key)
    except S3Exception as error:
        if not _missing(error):
            raise


def delete_keys(bucket: str, keys: list[str]) -> int:
    """Delete `keys` with DeleteObjects, `DELETE_BATCH` a request (a key already gone counts as deleted); returns the
    number of requests."""
    with _client_lock:
        client = _batch_client_for(_region(), _setting(ENDPOINT_VARIABLES))
    requests = 0
    for start in range(0, len(keys), DELETE_BATCH):
        batch = keys[start : start + DELETE_BATCH]
        answer = client.delete_objects(
            Bucket=bucket, Delete={"Objects": [{"Key": key} for key in batch], "Quiet": True}
        )
        requests += 1
        errors = answer.get("Errors", [])
        if errors:
            raise OSError(f"lightning_trn: S3 did not delete {len(errors)} object(s) of {bucket}: {errors[:3]}")
    return requests


#: deletions that need not finish before a save returns (the previous version, a removed checkpoint): one thread,
#: joined at interpreter exit
_background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_trn-s3-delete")


def _delete_later(bucket: str, keys: list[str], marker: str | None = None) -> None:
    """Delete `keys` in the background, then `marker` (a version's lease: it marks the rest as lightning_trn's until
    they are gone) in a request of its own."""
    if keys:
        _background.submit(_delete_or_warn, bucket, keys)
    if marker is not None:
        _background.submit(_delete_or_warn, bucket, [marker])


def _delete_or_warn(bucket: str, keys: list[str]) -> None:
    """A background deletion that fails leaves its objects to a later sweep, with a warning."""
    try:
        delete_keys(bucket, keys)
    except Exception as error:  # noqa: BLE001  # a background thread has no caller to raise to
        log.warning(
            "lightning_trn: could not delete %d object(s) of s3://%s (%s); a later sweep deletes them.",
            len(keys),
            bucket,
            error,
        )


def wait_for_deletions() -> None:
    """Wait for the background deletions submitted so far (tests, benchmarks)."""
    _background.submit(lambda: None).result()


def _discard_or_warn(url: str) -> None:
    """`discard_uncommitted` in the background: a failure leaves the objects to a later sweep, with a warning."""
    try:
        discard_uncommitted(url)
    except Exception as error:  # noqa: BLE001  # a background thread has no caller to raise to
        log.warning("lightning_trn: could not sweep %s (%s); a later sweep does.", url, error)


def _keys(bucket: str, prefix: str) -> list[str]:
    return [info.key for page in _client().list_objects(bucket, prefix) for info in page.object_info]


def _children(bucket: str, prefix: str) -> list[str]:
    """The names directly under `prefix/` that hold objects ("pseudo-directories")."""
    pages = _client().list_objects(bucket, f"{prefix}/" if prefix else "", "/")
    return [child.rstrip("/").rsplit("/", 1)[-1] for page in pages for child in page.common_prefixes]


def _decode_commit(data: bytes | None) -> str | None:
    """The version a commit object of ours names; None for no object, or one lightning_trn did not write (a
    `{"version": <v>}` object of lightning_trn 0.x counts as ours)."""
    if data is None:
        return None
    try:
        fields = json.loads(data)
    except ValueError:
        return None
    if not isinstance(fields, dict) or not _VERSION.fullmatch(str(fields.get("version", ""))):
        return None
    if fields.get(COMMIT_FORMAT) != 1 and set(fields) != {"version"}:
        return None
    return str(fields["version"])


def committed_version(url: str) -> str | None:
    """The version the commit object of checkpoint `url` names, or None (no commit object of ours: not a
    checkpoint)."""
    bucket, key = _split(url)
    return _decode_commit(_get(bucket, f"{key}/{COMMIT_OBJECT}"))


def version_url(url: str, version: str) -> str:
    """Where the files of `version` of checkpoint `url` are."""
    return f"{url.rstrip('/')}/{version}"


def _abandoned(bucket: str, key: str, version: str, committed: str | None) -> bool:
    """Whether uncommitted `version` of checkpoint `key` may be deleted (module docstring: ownership): its lease is
    dead, or, without one, its checkpoint has a commit object of ours naming a newer version and it is older than
    `leases.EXPIRY_S` (a writer deletes its lease only after its commit object names it: an unleased version newer
    than the commit is one whose commit this process has not seen yet)."""
    lease = _get(bucket, f"{key}/{version}/{LEASE_OBJECT}")
    if lease is not None:
        record = leases.LeaseRecord.decode(lease)
        if record is None:
            return False
        if leases.writer().owns(record.writer):  # this process's: abandoned unless still being written
            return not leases.writer().holds(version_url(_join(bucket, key), version))
        return not leases.is_live(record)
    written = int(version.split("-", 1)[0]) / 1e9
    return committed is not None and version < committed and time.time() - written > leases.EXPIRY_S


def discard_uncommitted(url: str) -> None:
    """Delete every version of checkpoint `url` that its commit object does not name and whose writer is gone (what
    killed saves left; module docstring), in batches. The commit object is read again right before the deletion: a
    commit that landed while the versions were checked keeps its version."""
    bucket, key = _split(url)
    committed = committed_version(url)
    by_version: dict[str, list[str]] = {}
    for name in _keys(bucket, f"{key}/"):
        version = name[len(key) + 1 :].split("/", 1)[0]
        if _VERSION.fullmatch(version) and version != committed:
            by_version.setdefault(version, []).append(name)
    doomed = {version for version in by_version if _abandoned(bucket, key, version, committed)}
    doomed.discard(committed_version(url) or "")
    if doomed:
        delete_keys(bucket, [name for version in sorted(doomed) for name in by_version[version]])


def sweep(directory: str) -> None:
    """`discard_uncommitted` in every checkpoint of `directory` (rank 0, before a training resume)."""
    bucket, key = _split(directory)
    for name in _children(bucket, key):
        discard_uncommitted(_join(bucket, f"{key}/{name}" if key else name))


def remove(url: str) -> None:
    """Delete checkpoint `url` (one process): the commit object first, so the rest is invisible at once; the rest in
    the background (its version's prefix, which no later save reuses), marked first with this process's lease record
    so that a kill before the deletion ends leaves it to a later sweep."""
    bucket, key = _split(url)
    version = _decode_commit(_get(bucket, f"{key}/{COMMIT_OBJECT}"))
    if version is None:
        return  # no checkpoint of ours under that name
    lease = f"{key}/{version}/{LEASE_OBJECT}"
    _put(bucket, lease, leases.writer().record().encode())
    _delete(bucket, f"{key}/{COMMIT_OBJECT}")
    _delete_later(bucket, [name for name in _keys(bucket, f"{key}/{version}/") if name != lease], marker=lease)


def newest_committed(directories: Iterable[str], name: re.Pattern[str] = LAST_NAME) -> str | None:
    """The checkpoint whose name matches `name` with the newest commit in the S3 `directories`, or None."""
    found: list[tuple[str, str]] = []
    for directory in directories:
        bucket, key = _split(directory)
        for child in _children(bucket, key):
            if name.fullmatch(child):
                url = _join(bucket, f"{key}/{child}" if key else child)
                version = committed_version(url)
                if version is not None:
                    found.append((version, url))
    return max(found)[1] if found else None


def storage_writer(url: str) -> Any:
    """s3torchconnector's DCP writer of the files of `url`, on the client of this module (its endpoint)."""
    from s3torchconnector.dcp import S3FileSystem, S3StorageWriter

    writer = S3StorageWriter(_region(), url)
    # the writer takes no endpoint of its own; its own `fs` is an S3FileSystem too, typed as torch's base
    writer.fs = S3FileSystem(_region(), s3_client=_client())  # type: ignore[assignment]  # see above
    return writer


def storage_reader(url: str) -> Any:
    """s3torchconnector's DCP reader of the files of `url` (see `storage_writer`)."""
    from s3torchconnector.dcp import S3FileSystem, S3StorageReader

    reader = S3StorageReader(_region(), url)
    reader.fs = S3FileSystem(_region(), s3_client=_client(), reader_constructor=reader._reader_constructor)
    return reader


def shadow_directory(url: str) -> str:
    """The local directory Lightning's save and load of the S3 version `url` work on: the same path on every rank
    and node (Lightning broadcasts rank 0's path)."""
    digest = hashlib.sha256(url.encode()).hexdigest()[:24]
    return os.path.join(tempfile.gettempdir(), "lightning_trn-s3", digest)


@dataclass
class _Redirect:
    target: str
    used: bool = False


_redirects: dict[str, _Redirect] = {}


def redirect_target(path: Any) -> str | None:
    """The S3 version whose DCP files a read or write of local directory `path` goes to (None: `path` itself);
    called by `lightning_trn.hooks.s3_checkpoint`."""
    redirect = _redirects.get(os.path.abspath(os.fspath(path)))
    if redirect is None:
        return None
    redirect.used = True
    return redirect.target


def _target_of(shadow: str) -> str:
    """The S3 version of a save's or load's shadow directory."""
    return _redirects[os.path.abspath(shadow)].target


@contextmanager
def redirected(shadow: str, target: str) -> Iterator[str]:
    """DCP reads and writes of `shadow` go to S3 version `target` for the block; it raises if none did (the hooks
    are not in place: a Lightning version they were not tested with), rather than commit or load a checkpoint that
    never reached S3."""
    redirect = _redirects[os.path.abspath(shadow)] = _Redirect(target)
    try:
        yield shadow
    finally:
        del _redirects[os.path.abspath(shadow)]
    if not redirect.used:
        raise RuntimeError(
            f"lightning_trn: the sharded checkpoint {target} did not go through S3: this Lightning version's "
            "model-parallel checkpointing is not one `lightning_trn.hooks.s3_checkpoint` was tested with. Save to a "
            "shared filesystem instead."
        )


def new_version() -> str:
    """A version name: sortable by its save's time, unique."""
    return f"{time.time_ns():020d}-{secrets.token_hex(4)}"


def _version_lease(target: str) -> AbstractContextManager[None]:
    """This process's lease on the version `target` while it is written (module docstring)."""
    bucket, key = _split(target)
    lease = f"{key}/{LEASE_OBJECT}"
    return leases.writer().hold(
        target, lambda data: _put(bucket, lease, data), lambda: _delete(bucket, lease), keep_on_error=True
    )


def _commit(url: str, version: str) -> None:
    """Make `version` checkpoint `url` (rank 0, every file of it written): the commit object, then the previous
    version deleted in the background."""
    bucket, key = _split(url)
    previous = committed_version(url)
    _put(bucket, f"{key}/{COMMIT_OBJECT}", json.dumps({COMMIT_FORMAT: 1, "version": version}).encode())
    if previous is not None and previous != version:
        _delete_later(bucket, _keys(bucket, f"{key}/{previous}/"))


@contextmanager
def staged_upload(url: str, rank: int, broadcast: Callable[[Any], Any], barrier: Callable[[], None]) -> Iterator[str]:
    """Every rank saves its part of the sharded checkpoint `url` into the local directory this yields; its DCP files
    go to a new version in S3, and on leaving the block, once every rank is done, rank 0 uploads the rest (`meta.pt`)
    and writes the commit object. A rank that raises commits nothing.

    Args:
        url: `s3://bucket/prefix/<name>`.
        rank: this process's global rank; rank 0 cleans up, holds the version's lease, uploads and commits.
        broadcast: rank 0's object on every rank (the version; it also waits for rank 0's lease).
        barrier: waits for every rank.
    """
    url = url.rstrip("/")
    with contextlib.ExitStack() as held:
        version = None
        if rank == 0:
            _background.submit(_discard_or_warn, url)  # what a killed save into this checkpoint left
            version = new_version()
            held.enter_context(_version_lease(version_url(url, version)))
        version = broadcast(version)
        target = version_url(url, version)
        shadow = shadow_directory(target)
        os.makedirs(shadow, exist_ok=True)
        held.callback(shutil.rmtree, shadow, True)
        with redirected(shadow, target):
            yield shadow
        barrier()
        if rank == 0:
            bucket, key = _split(target)
            for root, _, files in os.walk(shadow):
                for name in files:
                    local = os.path.join(root, name)
                    with open(local, "rb") as file:
                        _put(bucket, f"{key}/{os.path.relpath(local, shadow)}", file.read())
            _commit(url, version)
        barrier()  # every rank's shadow stays until rank 0 uploaded from its own (the ranks of a host share it)


def read_committed_version(url: str) -> str:
    """`committed_version`, or a FileNotFoundError saying why there is none."""
    version = committed_version(url.rstrip("/"))
    if version is None:
        raise FileNotFoundError(
            f"lightning_trn: {url} is no committed checkpoint: it has no `{COMMIT_OBJECT}` written by lightning_trn, "
            "the object a sharded save to S3 writes last. Either nothing was saved there, or the save was interrupted "
            "before it finished (its objects are deleted by the next save there and before a training resume from its "
            "directory)."
        )
    return version


@contextmanager
def committed_source(url: str, broadcast: Callable[[Any], Any], barrier: Callable[[], None]) -> Iterator[str]:
    """The local directory Lightning's load of sharded checkpoint `url` reads (every rank): `meta.pt` downloaded
    into it, DCP's reads sent to the committed version in S3. Every rank leaves the block together. The directory is
    this load's own (a token from rank 0): another job on the host loading the same version never deletes it."""
    url = url.rstrip("/")
    target = version_url(url, read_committed_version(url))
    shadow = shadow_directory(target) + "-" + broadcast(secrets.token_hex(4))
    os.makedirs(shadow, exist_ok=True)
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    bucket, key = _split(target)
    data = _get(bucket, f"{key}/{_METADATA_FILENAME}")
    if data is None:
        raise FileNotFoundError(f"lightning_trn: the committed checkpoint {target} has no {_METADATA_FILENAME}.")
    partial = os.path.join(shadow, f".{_METADATA_FILENAME}.{os.getpid()}")
    with open(partial, "wb") as file:  # the ranks of one host share the directory: each replaces the file whole
        file.write(data)
    os.replace(partial, os.path.join(shadow, _METADATA_FILENAME))
    try:
        with redirected(shadow, target):
            yield shadow
        barrier()
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(shadow)


def copy_checkpoint(source: str, url: str, replace: dict[str, bytes]) -> None:
    """Make `url` a second committed checkpoint of the files of committed checkpoint `source` (rank 0): each object
    copied by S3 itself (CopyObject: no byte passes through this host), the objects of `replace` written instead,
    then committed."""
    source_bucket, source_key = _split(version_url(source, read_committed_version(source)))
    version = new_version()
    target = version_url(url.rstrip("/"), version)
    bucket, key = _split(target)
    with _version_lease(target):
        for name in _keys(source_bucket, f"{source_key}/"):
            relative = name[len(source_key) + 1 :]
            if relative not in replace and relative != LEASE_OBJECT:
                _client().copy_object(source_bucket, name, bucket, f"{key}/{relative}")
        for relative, data in replace.items():
            _put(bucket, f"{key}/{relative}", data)
        _commit(url.rstrip("/"), version)


def refusal(directory: str, writes_dcp: bool, async_save: bool) -> str | None:
    """Why a sharded checkpoint cannot go to `directory` in S3 (None: it can): only DCP directories go to S3, and
    synchronously."""
    if writes_dcp and not async_save:
        return None
    if not writes_dcp:
        what = (
            "this strategy's sharded checkpoints are ZeRO-1 directories (one `zero1-rank<r>.pt` per rank, written "
            "through the local filesystem), which have no S3 writer"
        )
    else:
        what = "asynchronous saves (`NeuronCheckpointIO(async_save=True)`) write through the local filesystem only"
    return (
        f"lightning_trn: sharded checkpoints cannot be saved to {directory}: {what}. A sharded checkpoint is one "
        "directory every rank writes its own part into, and it becomes a checkpoint only once all parts are complete; "
        "in S3 that takes the commit object that lightning_trn writes after the torch.distributed.checkpoint files of "
        "the model-parallel and FSDP strategies (`strategy='fsdp'` or `ModelParallelStrategy`, native backend, "
        "synchronous saves). Save this run's checkpoints to a filesystem every node mounts (FSx for Lustre, EFS), or "
        "write one-file checkpoints, which rank 0 writes alone (`state_dict_type='full'`), to S3."
    )


class S3Storage:
    """Checkpoints in S3 (module docstring): every `s3://` path."""

    name = "s3"

    def claims(self, path: str) -> bool:
        return is_s3(path)

    def refusal(self, path: str, writes_dcp: bool, async_save: bool) -> str | None:
        return refusal(path, writes_dcp, async_save)

    def check_shared(self, directory: str, rank: int, gather: Callable[[Any], list[Any]]) -> None:
        """Every rank reaches the same bucket."""

    def save_destination(
        self, path: str, rank: int, group: ProcessGroup, defer: Deferral | None
    ) -> AbstractContextManager[str]:
        return staged_upload(path, rank, group.broadcast, group.barrier)

    def load_refusal(self, path: str, reads_dcp: bool) -> str | None:
        """A sharded checkpoint in S3 is read through torch.distributed.checkpoint only: a one-file strategy would read
        its prefix as one file (an `EOFError`)."""
        if reads_dcp or committed_version(path.rstrip("/")) is None:
            return None
        return (
            f"lightning_trn: {path} is a sharded checkpoint in S3 (torch.distributed.checkpoint files and a commit "
            "object), which only the strategies that write such checkpoints read: `strategy='fsdp'` or "
            "`ModelParallelStrategy` (any number of devices, also one). This run's strategy reads one-file "
            "checkpoints. Load it with one of those strategies, or copy the prefix's committed version to a local "
            "directory and load that (a local DCP directory loads with any strategy, `python -m "
            "lightning_trn.consolidate` makes one file of it)."
        )

    def load_source(self, path: str, group: ProcessGroup) -> AbstractContextManager[str]:
        return committed_source(path, group.broadcast, group.barrier)

    def write_file(self, destination: str, name: str, data: bytes) -> None:
        """Upload one rank's file `name` into the version a save's shadow `destination` stands for."""
        bucket, key = _split(_target_of(destination))
        _put(bucket, f"{key}/{name}", data)

    def read_file(self, source: str, name: str) -> bytes | None:
        bucket, key = _split(_target_of(source))
        return _get(bucket, f"{key}/{name}")

    def link(self, source: str, path: str, replace: dict[str, bytes]) -> None:
        copy_checkpoint(source, path, replace)

    def remove(self, path: str) -> None:
        remove(path)

    def recover(self, directories: list[str], rank: int, barrier: Callable[[], None] | None) -> None:
        if rank == 0:
            for directory in sorted(set(directories)):
                sweep(directory)
        if barrier is not None:
            barrier()

    def newest_last(self, directories: list[str]) -> str | None:
        """Lightning's own "last" lists a directory through fsspec, whose S3 names lack the `s3://` (so it never finds
        one), and would count a checkpoint whose save was killed before its commit object."""
        return newest_committed(directories)
