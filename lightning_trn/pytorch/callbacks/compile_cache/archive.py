"""Pack compile-cache files into a tar.gz and unpack one safely, for sharing a cache between machines.

An archive downloaded from shared storage is untrusted: `extract_archive` refuses the whole archive, writing
nothing, if any member is not a plain file or directory or would land outside the cache directory.
"""

from __future__ import annotations

import hashlib
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path

#: bookkeeping files this package keeps in a cache directory; never archived
PRIVATE_PREFIX = ".lightning_trn"


class UnsafeArchiveError(ValueError):
    """An archive holds a link, a device file, or a path escaping the directory it is extracted into."""


def list_entries(cache_dir: str) -> dict[str, int]:
    """Regular files under `cache_dir` (symlinks not followed), as relative path -> size."""
    entries: dict[str, int] = {}
    root = Path(cache_dir)
    if not root.is_dir():
        return entries
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = Path(dirpath) / name
            relative = path.relative_to(root).as_posix()
            if relative.startswith(PRIVATE_PREFIX) or path.is_symlink() or not path.is_file():
                continue
            entries[relative] = path.stat().st_size
    return entries


def archive_name(entries: Iterable[str]) -> str:
    """A content-derived file name, so two runs that add the same entries write the same archive."""
    digest = hashlib.sha256("\n".join(sorted(entries)).encode()).hexdigest()[:20]
    return f"entries-{digest}.tar.gz"


def pack_entries(cache_dir: str, entries: Iterable[str], archive_path: str) -> None:
    """Write the given relative paths of `cache_dir` into a gzip tar at `archive_path`."""
    with tarfile.open(archive_path, "w:gz") as tar:
        for relative in sorted(entries):
            tar.add(os.path.join(cache_dir, relative), arcname=relative, recursive=False)


def extract_archive(archive_path: str, cache_dir: str) -> int:
    """Extract a tar archive into `cache_dir` after checking every member; returns the number of files written.

    Raises:
        UnsafeArchiveError: a member is a link or special file, or its path is absolute or escapes `cache_dir`.
        tarfile.TarError, OSError, EOFError: the archive is corrupt or unreadable.
    """
    os.makedirs(cache_dir, exist_ok=True)
    destination = os.path.realpath(cache_dir)
    with tarfile.open(archive_path, "r:*") as tar:
        members = tar.getmembers()
        for member in members:
            if not (member.isfile() or member.isdir()):
                raise UnsafeArchiveError(f"archive member {member.name!r} is a link or special file")
            if os.path.isabs(member.name):
                raise UnsafeArchiveError(f"archive member {member.name!r} has an absolute path")
            try:
                tarfile.data_filter(member, destination)
            except tarfile.FilterError as err:
                raise UnsafeArchiveError(f"archive member {member.name!r} is refused: {err}") from err
        tar.extractall(destination, members=members, filter="data")
    return sum(member.isfile() for member in members)
