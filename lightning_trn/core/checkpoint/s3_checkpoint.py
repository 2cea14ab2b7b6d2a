"""Sharded checkpoints in S3 (`s3://bucket/prefix/<name>.ckpt`) for the strategies that write
torch.distributed.checkpoint (DCP) directories (model-parallel and FSDP; Trainer and Fabric), atomic by a commit
object that rank 0 writes last.

S3 has no rename, so a save cannot be staged and swapped in as on a filesystem
(`lightning_trn.core.checkpoint.sharded_save`). Each save writes a new version under the checkpoint's prefix, and one
small object says which version is the checkpoint:

    <name>.ckpt/commit.json                         {"version": "<v>"}: written last, by rank 0, after every rank's
    <name>.ckpt/<v>/__<rank>_0.distcp, .metadata    DCP's files, every rank's, through AWS's s3torchconnector
    <name>.ckpt/<v>/meta.pt                         the rest of Lightning's checkpoint (rank 0)

A PUT replaces an object whole, so a reader gets the previous commit object or the new one, never a mix, and every
read goes through the commit object (`committed_version`): a version no commit object names is never loaded, never
picked by `ckpt_path="last"` (`newest_committed`), and a checkpoint without a commit object is refused by a load.
What a kill during a save leaves: the previous commit object, naming the previous complete version, plus the killed
save's objects under a version nothing names; the next save into that checkpoint deletes them first
(`discard_uncommitted`), and rank 0 deletes them in every checkpoint of a directory before a resume (`sweep`, called
by `sharded_save.recover_before_resume`). A removal (`remove`, ModelCheckpoint's `save_top_k`) deletes the commit
object first, so a kill during it leaves an invisible rest that the next sweep deletes.

Versions are `<time_ns>-<8 hex>`, made on rank 0 and broadcast: sortable by the time of the save that made them,
which is how "last" chooses between `last.ckpt` and `last-v1.ckpt`.

The client (AWS's `s3torchconnector`, imported when first used: `import lightning_trn` works without it) takes its
region from `AWS_REGION` or `AWS_DEFAULT_REGION` and its endpoint from `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL`
when set: the variables botocore reads as well, so s3fs (through which Lightning's `ModelCheckpoint` lists and checks
its `s3://` directory) reaches the same server.

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
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

S3_SCHEME = "s3://"
#: the object that makes a version the checkpoint
COMMIT_OBJECT = "commit.json"
_VERSION = re.compile(r"\d{20}-[0-9a-f]{8}")
REGION_VARIABLES = ("AWS_REGION", "AWS_DEFAULT_REGION")
ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
#: the names `ModelCheckpoint` gives its "last" checkpoints (`last.ckpt`, `last-v1.ckpt`, ...), as Lightning matches
LAST_NAME = re.compile(r"last(-v?\d+)?\.ckpt")
#: how s3torchconnector's errors say that an object is missing (its GET's and its HEAD's)
_MISSING = ("the key does not exist", "the object was not found")


def is_s3(path: Any) -> bool:
    """Whether `path` names an S3 location."""
    return isinstance(path, str | os.PathLike) and os.fspath(path).startswith(S3_SCHEME)


def _split(url: str) -> tuple[str, str]:
    """`s3://bucket/key/` -> (bucket, key), the key without a trailing slash."""
    bucket, _, key = url[len(S3_SCHEME) :].partition("/")
    return bucket, key.strip("/")


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


def _client() -> Any:
    return _client_for(_region(), _setting(ENDPOINT_VARIABLES))


def _missing(error: Exception) -> bool:
    return any(text in str(error).lower() for text in _MISSING)


def _get(bucket: str, key: str) -> bytes | None:
    """The object's bytes, or None where there is none."""
    from s3torchconnector import S3Exception

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
    from s3torchconnector import S3Exception

    try:
        _client().delete_object(bucket, key)
    except S3Exception as error:
        if not _missing(error):
            raise


def _keys(bucket: str, prefix: str) -> list[str]:
    return [info.key for page in _client().list_objects(bucket, prefix) for info in page.object_info]


def _children(bucket: str, prefix: str) -> list[str]:
    """The names directly under `prefix/` that hold objects ("pseudo-directories")."""
    pages = _client().list_objects(bucket, f"{prefix}/" if prefix else "", "/")
    return [child.rstrip("/").rsplit("/", 1)[-1] for page in pages for child in page.common_prefixes]


def committed_version(url: str) -> str | None:
    """The version the commit object of checkpoint `url` names, or None (no commit object: not a checkpoint)."""
    bucket, key = _split(url)
    data = _get(bucket, f"{key}/{COMMIT_OBJECT}")
    return None if data is None else str(json.loads(data)["version"])


def version_url(url: str, version: str) -> str:
    """Where the files of `version` of checkpoint `url` are."""
    return f"{url.rstrip('/')}/{version}"


def discard_uncommitted(url: str) -> None:
    """Delete every version of checkpoint `url` that its commit object does not name (what killed saves and
    replaced saves left; one process)."""
    bucket, key = _split(url)
    committed = committed_version(url)
    for name in _keys(bucket, f"{key}/"):
        version = name[len(key) + 1 :].split("/", 1)[0]
        if _VERSION.fullmatch(version) and version != committed:
            _delete(bucket, name)


def sweep(directory: str) -> None:
    """`discard_uncommitted` in every checkpoint of `directory` (rank 0, before a resume chooses a checkpoint)."""
    bucket, key = _split(directory)
    for name in _children(bucket, key):
        discard_uncommitted(f"{S3_SCHEME}{bucket}/{key}/{name}" if key else f"{S3_SCHEME}{bucket}/{name}")


def remove(url: str) -> None:
    """Delete checkpoint `url` (one process): the commit object first, so a kill during the rest leaves nothing
    visible."""
    bucket, key = _split(url)
    _delete(bucket, f"{key}/{COMMIT_OBJECT}")
    for name in _keys(bucket, f"{key}/"):
        _delete(bucket, name)


def newest_committed(directories: Iterable[str], name: re.Pattern[str] = LAST_NAME) -> str | None:
    """The checkpoint whose name matches `name` with the newest commit in the S3 `directories`, or None."""
    found: list[tuple[str, str]] = []
    for directory in directories:
        bucket, key = _split(directory)
        for child in _children(bucket, key):
            if name.fullmatch(child):
                url = f"{S3_SCHEME}{bucket}/{key}/{child}" if key else f"{S3_SCHEME}{bucket}/{child}"
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


@contextmanager
def staged_upload(
    url: str, rank: int, gather: Callable[[Any], list[Any]], barrier: Callable[[], None]
) -> Iterator[str]:
    """Every rank saves its part of the sharded checkpoint `url` into the local directory this yields; its DCP files
    go to a new version in S3, and on leaving the block, once every rank is done, rank 0 uploads the rest (`meta.pt`)
    and writes the commit object, then deletes the previous version. A rank that raises commits nothing.

    Args:
        url: `s3://bucket/prefix/<name>`.
        rank: this process's global rank; rank 0 cleans up, uploads and commits.
        gather: every rank's object in rank order (an all-gather; rank 0's version reaches every rank).
        barrier: waits for every rank.
    """
    url = url.rstrip("/")
    if rank == 0:
        discard_uncommitted(url)  # what a killed save into this checkpoint left
    version = gather(new_version() if rank == 0 else None)[0]
    target = version_url(url, version)
    shadow = shadow_directory(target)
    os.makedirs(shadow, exist_ok=True)
    try:
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
            checkpoint_bucket, checkpoint_key = _split(url)
            _put(checkpoint_bucket, f"{checkpoint_key}/{COMMIT_OBJECT}", json.dumps({"version": version}).encode())
            discard_uncommitted(url)  # the previous version
        barrier()
    finally:
        shutil.rmtree(shadow, ignore_errors=True)


def read_committed_version(url: str) -> str:
    """`committed_version`, or a FileNotFoundError saying why there is none."""
    version = committed_version(url.rstrip("/"))
    if version is None:
        raise FileNotFoundError(
            f"lightning_trn: {url} is no committed checkpoint: it has no `{COMMIT_OBJECT}`, the object a sharded save "
            "to S3 writes last. Either nothing was saved there, or the save was interrupted before it finished (its "
            "objects are deleted by the next save there and before a resume from its directory)."
        )
    return version


@contextmanager
def committed_source(url: str, barrier: Callable[[], None]) -> Iterator[str]:
    """The local directory Lightning's load of sharded checkpoint `url` reads (every rank): `meta.pt` downloaded
    into it, DCP's reads sent to the committed version in S3. Every rank leaves the block together."""
    url = url.rstrip("/")
    target = version_url(url, read_committed_version(url))
    shadow = shadow_directory(target)
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


def refusal(directory: str, writes_dcp: bool, async_save: bool) -> str | None:
    """Why a sharded checkpoint cannot go to remote `directory` (None: it can): only DCP directories go to S3, and
    synchronously."""
    if is_s3(directory) and writes_dcp and not async_save:
        return None
    if not is_s3(directory):
        what = f"{directory} is not an S3 location"
    elif not writes_dcp:
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
