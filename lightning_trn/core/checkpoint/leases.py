"""Who owns a checkpoint's in-flight work, and when another process may finish or delete it.

Everything lightning_trn creates beside a checkpoint (a staging directory, a previous copy set aside, a copy being
deleted, an S3 version not yet committed) carries the id of the writer that made it (`Writer.id`, 16 hex digits, in
the entry's name). While a writer works on a directory it holds a lease there: a small record (`LeaseRecord`) that a
heartbeat thread rewrites every `RENEW_S` seconds (a file beside the checkpoints on a filesystem, an object in S3).
Another process (a second job's resume, an evaluation job, a later save of the same job after a crash) acts on a
writer's entries only when that writer is proven gone (`is_live` is False):

- the record names this host, boot and PID namespace, and its process is gone (or the PID now belongs to a process
  started at another time): proven at once;
- any other host's record: not rewritten for `EXPIRY_S` seconds (the writer's heartbeat stopped), judged by this
  host's clock against the time in the record, so clocks may differ by up to `EXPIRY_S - RENEW_S` seconds;
- no record at all: the writer released its lease (its work is finished or abandoned) or never took one.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

#: how often a writer rewrites its lease records while it holds them
RENEW_S = 15.0
#: how old another host's lease record must be before its writer counts as gone (covers `RENEW_S` and clock skew)
EXPIRY_S = 180.0
#: the marker every entry lightning_trn creates beside a checkpoint carries in its name, before the writer id
OWNER_TAG = "lightning_trn"


def _read(path: str) -> str | None:
    try:
        with open(path) as file:
            return file.read().strip()
    except OSError:
        return None


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, /proc), or None where it does not exist or /proc does not."""
    stat = _read(f"/proc/{pid}/stat")
    if stat is None:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # field 22; the command name before it may hold spaces


def _host_key() -> str:
    """This host, boot and PID namespace: records that carry the same key can be checked by their PID."""
    boot = _read("/proc/sys/kernel/random/boot_id") or ""
    with contextlib.suppress(OSError):
        boot += ":" + str(os.stat("/proc/self/ns/pid").st_ino)
    return f"{socket.gethostname()}:{boot}"


@dataclass(frozen=True)
class LeaseRecord:
    """What a writer's lease says: who holds it and when it last said so."""

    writer: str
    host: str
    pid: int
    start: str | None
    renewed: float

    def encode(self) -> bytes:
        return json.dumps({"lightning_trn_lease": 1, **asdict(self)}).encode()

    @classmethod
    def decode(cls, data: bytes | str) -> LeaseRecord | None:
        """The record, or None where `data` is no lease record of ours (a user's file is never taken for one)."""
        try:
            fields = json.loads(data)
            if not isinstance(fields, dict) or fields.get("lightning_trn_lease") != 1:
                return None
            return cls(
                str(fields["writer"]),
                str(fields["host"]),
                int(fields["pid"]),
                fields["start"],
                float(fields["renewed"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def is_live(record: LeaseRecord | None, now: float | None = None) -> bool:
    """Whether the writer of `record` may still be working (module docstring)."""
    if record is None:
        return False
    fresh = (time.time() if now is None else now) - record.renewed < EXPIRY_S
    if record.host != _host_key():
        return fresh
    if record.start is not None and os.path.isdir("/proc/self"):
        return _process_start(record.pid) == record.start
    return fresh and _pid_runs(record.pid)  # no /proc (macOS): the PID, and the record's age for a reused PID


@dataclass
class _Held:
    """One lease this process holds: how to write and delete its record, and how many blocks hold it."""

    write: Callable[[bytes], None]
    release: Callable[[], None]
    count: int = 1


class Writer:
    """This process's identity as a writer of checkpoints (one per process, made at first use), and the leases it
    holds: `hold(key, write, release)` keeps a lease for a block, rewritten by one heartbeat thread."""

    def __init__(self) -> None:
        self.id = secrets.token_hex(8)
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._heartbeat: threading.Thread | None = None
        self._start = _process_start(os.getpid())

    def record(self) -> LeaseRecord:
        return LeaseRecord(self.id, _host_key(), os.getpid(), self._start, time.time())

    def owns(self, writer: str) -> bool:
        return writer == self.id

    def holds(self, key: str) -> bool:
        """Whether this process holds the lease `key` now (its own work in flight there)."""
        with self._lock:
            return key in self._held

    @contextlib.contextmanager
    def hold(
        self, key: str, write: Callable[[bytes], None], release: Callable[[], None], keep_on_error: bool = False
    ) -> Iterator[None]:
        """Hold the lease `key` (written by `write`, deleted by `release`) for the block; nested holds of one key
        count, and the record is deleted when the outermost ends. `keep_on_error`: a block that raises leaves the
        record (no longer renewed), so that what it marks is deleted once this process is gone, or by this process's
        own next cleanup."""
        with self._lock:
            held = self._held.get(key)
            if held is not None:
                held.count += 1
        if held is None:
            write(self.record().encode())  # before the key is held: a failed write leaves nothing to renew
            with self._lock:
                held = self._held.setdefault(key, _Held(write, release, 0))
                held.count += 1
                if self._heartbeat is None:
                    self._heartbeat = threading.Thread(target=self._renew, name="lightning_trn-lease", daemon=True)
                    self._heartbeat.start()
        failed = True
        try:
            yield
            failed = False
        finally:
            with self._lock:
                held.count -= 1
                last = held.count == 0
                if last:
                    del self._held[key]
            if last and not (failed and keep_on_error):
                with contextlib.suppress(OSError):
                    release()

    def _renew(self) -> None:
        while True:
            time.sleep(RENEW_S)
            with self._lock:
                held = list(self._held.items())
            record = self.record().encode()
            for key, lease in held:  # outside the lock: a slow storage must not hold up `hold`
                with contextlib.suppress(Exception):  # a failed renewal is retried; the lease expires if all fail
                    lease.write(record)
                with self._lock:
                    released = key not in self._held
                if released:  # released while this renewal wrote it: delete the record again
                    with contextlib.suppress(Exception):
                        lease.release()


_writer: Writer | None = None
_writer_lock = threading.Lock()


def writer() -> Writer:
    """This process's writer."""
    global _writer
    with _writer_lock:
        if _writer is None:
            _writer = Writer()
        return _writer
