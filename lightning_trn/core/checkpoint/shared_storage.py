"""Whether a directory is one filesystem that every rank writing into it shares, checked before a sharded checkpoint
is saved there.

A sharded checkpoint is a directory every rank writes its own shards into, and rank 0 commits
(`lightning_trn.core.checkpoint.sharded_save`). On a disk local to each node (an instance store, a container's own
filesystem) every save "succeeds" and each node keeps only its own ranks' shards: the checkpoint on rank 0's node is
incomplete. Lightning's `is_shared_filesystem` asks only whether every rank sees rank 0's file and answers yes or no;
this probe has every rank write a file and look for everyone else's, so it finds any set of ranks on their own storage
and says which.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: the probe files' name (hidden, no `.ckpt` suffix: `ModelCheckpoint` and `ckpt_path="last"` never pick one)
PROBE_PREFIX = ".lightning_trn_shared_probe"
#: how long a rank keeps looking for the other ranks' probe files: a shared filesystem may show a file that another
#: host just created a moment late (NFS clients cache directory lookups)
VISIBILITY_TIMEOUT_S = 3.0
_POLL_S = 0.05
#: hosts named per group of ranks in the error, the rest counted
_HOSTS_SHOWN = 4


class UnsharedDirectoryError(RuntimeError):
    """A sharded checkpoint's directory is not one filesystem shared by every rank that writes into it."""


@dataclass(frozen=True)
class RankProbe:
    """What one rank wrote for the probe."""

    rank: int
    host: str
    #: the directory as this rank resolved it
    directory: str
    token: str
    #: why this rank could not write its probe file (None: it did)
    error: str | None


@dataclass(frozen=True)
class SharedDirectoryReport:
    """The probe's result, the same on every rank: each rank's probe and the ranks whose probe files it did not
    see."""

    probes: list[RankProbe]
    unseen: list[list[int]]

    @property
    def shared(self) -> bool:
        return not any(self.unseen) and all(probe.error is None for probe in self.probes)

    def explain(self) -> str:
        """One paragraph: what was found, why a sharded checkpoint needs one shared directory, what to change."""
        directory = self.probes[0].directory
        found = [self._visibility()] if any(self.unseen) else []
        found += [f"Rank {p.rank} (host {p.host}) could not write there: {p.error}." for p in self.probes if p.error]
        if any(probe.directory != directory for probe in self.probes):
            named = "; ".join(f"rank {p.rank}: {p.directory}" for p in self.probes)
            found.append(f"The ranks name different directories ({named}).")
        return (
            f"lightning_trn: this run's sharded checkpoints go to {directory}, a directory each of the "
            f"{len(self.probes)} ranks writes its own shards into, but it is not one filesystem shared by all of them: "
            f"every rank wrote a probe file there and looked for the others'. {' '.join(found)} A sharded checkpoint "
            "is complete only when every rank's shards land in the one directory that rank 0 commits; on disks local "
            "to each node every save would seem to succeed while each node kept only its own ranks' shards, and the "
            "checkpoint would fail to load, or resume from parts of different steps. Point the checkpoint directory "
            "(ModelCheckpoint's `dirpath`, or the Trainer's `default_root_dir` when it has none; the path given to "
            "`trainer.save_checkpoint` or `fabric.save`) at a filesystem every node mounts at the same path, such as "
            "FSx for Lustre or EFS, or to `s3://bucket/prefix` (FSDP and model-parallel checkpoints; a single-file "
            "checkpoint, which rank 0 writes alone, with any strategy)."
        )

    def _visibility(self) -> str:
        """Which ranks saw which probe files: one clause per group of ranks that saw the same ones."""
        written = {probe.rank for probe in self.probes if probe.error is None}
        groups: dict[tuple[int, ...], list[RankProbe]] = {}
        for probe, unseen in zip(self.probes, self.unseen, strict=True):
            groups.setdefault(tuple(sorted(written - set(unseen))), []).append(probe)
        clauses = []
        for seen, members in groups.items():
            hosts = sorted({probe.host for probe in members})
            more = len(hosts) - _HOSTS_SHOWN
            shown = ", ".join(hosts[:_HOSTS_SHOWN]) + (f" and {more} more" if more > 0 else "")
            who = f"{_ranks([probe.rank for probe in members])} (host{'s' if len(hosts) > 1 else ''} {shown})"
            if len(seen) == len(written):
                what = "every probe file"
            else:
                what = f"only the files of {_ranks(list(seen))}" if seen else "no probe file"
            clauses.append(f"{who} saw {what}")
        text = "; ".join(clauses)
        return f"{text[0].upper()}{text[1:]}."


def _ranks(ranks: list[int]) -> str:
    """`rank 3` or `ranks 0-7, 9`."""
    ranks = sorted(ranks)
    spans: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(spans)}"


def _probe_name(token: str) -> str:
    return f"{PROBE_PREFIX}.{token}"


def _probe_path(directory: str, token: str) -> str:
    return os.path.join(directory, _probe_name(token))


def _write_probe(directory: str, token: str) -> str | None:
    """Create this rank's probe file in `directory` (and the directory); the error if it cannot."""
    try:
        os.makedirs(directory, exist_ok=True)
        with open(_probe_path(directory, token), "x") as file:
            file.write(token)
    except OSError as err:
        return str(err)
    return None


def _unseen(directory: str, probes: list[RankProbe], timeout: float) -> list[int]:
    """The ranks whose probe files this rank does not find in `directory` within `timeout` seconds (a rank that
    could not write one is reported as such, not here). One directory listing per look rather than a lookup per rank
    (fewer metadata operations on a filesystem many ranks share); a file missing from the listing is looked up by
    name as well, which no listing this host cached can hide (the names are new)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            names = set(os.listdir(directory))
        except OSError:  # this rank could not create the directory: it sees no file there
            names = set()
        missing = [
            p.rank
            for p in probes
            if p.error is None
            and _probe_name(p.token) not in names
            and not os.path.exists(_probe_path(directory, p.token))
        ]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(_POLL_S)


def probe_shared_directory(
    directory: str,
    rank: int,
    gather: Callable[[Any], list[Any]],
    timeout: float = VISIBILITY_TIMEOUT_S,
) -> SharedDirectoryReport:
    """Every rank writes a probe file into `directory` (created if missing) and looks for every other rank's; the
    files are deleted again. Called on every rank at the same point.

    Args:
        directory: the directory, as this rank names it.
        rank: this process's global rank.
        gather: every rank's object in rank order (an all-gather; it also waits for every rank).
        timeout: how long a rank keeps looking for files it does not find at once.
    """
    token = secrets.token_hex(8)
    error = _write_probe(directory, token)
    probes: list[RankProbe] = gather(RankProbe(rank, socket.gethostname(), directory, token, error))
    unseen: list[list[int]] = gather(_unseen(directory, probes, timeout))  # every rank has looked once this returns
    if error is None:
        with contextlib.suppress(OSError):  # the directory's filesystem went away meanwhile: nothing to clean up
            os.remove(_probe_path(directory, token))
    return SharedDirectoryReport(probes, unseen)


def check_shared_directory(
    directory: str,
    rank: int,
    gather: Callable[[Any], list[Any]],
    timeout: float = VISIBILITY_TIMEOUT_S,
) -> None:
    """`probe_shared_directory`; raises `UnsharedDirectoryError` on every rank, with the explanation, when some rank
    does not see the others' files there."""
    report = probe_shared_directory(directory, rank, gather, timeout)
    if not report.shared:
        raise UnsharedDirectoryError(report.explain())
