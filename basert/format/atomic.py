"""Atomic file replacement: write a temp file beside the target, fsync it, rename it over the target.

A save killed before its rename leaves its temp file; `remove_stale_temp_files` removes those at start.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from basert.errors import BaseRTError

log = logging.getLogger("basert.storage")

# A temp file is `.<target name>.<tag>.tmp` beside its target, the tag 8 characters of [a-z0-9_]: the form
# of tempfile's names, so temp files that earlier versions (which used mkstemp) left behind match too.
_TAG_CHARACTERS = "abcdefghijklmnopqrstuvwxyz0123456789_"
_TAG_LENGTH = 8
_TEMP_NAME = re.compile(rf"\.(?P<target>.+)\.[{_TAG_CHARACTERS}]{{{_TAG_LENGTH}}}\.tmp", re.DOTALL)


class StorageError(BaseRTError):
    """Writing to disk failed (no space, quota, read-only or I/O error) during `operation`.

    The message names the operation and the system's reason, never a path: it reaches clients.
    """

    status = 507
    code = "insufficient_storage"

    def __init__(self, operation: str, cause: OSError):
        super().__init__(f"{operation} failed: {cause.strerror or type(cause).__name__}")
        self.operation = operation
        self.cause = cause


@contextmanager
def storage_errors(operation: str) -> Iterator[None]:
    """Any OSError in the block becomes a StorageError for `operation`."""
    try:
        yield
    except OSError as exc:
        raise StorageError(operation, exc) from exc


def _temp_name(target_name: str) -> str:
    tag = "".join(secrets.choice(_TAG_CHARACTERS) for _ in range(_TAG_LENGTH))
    return f".{target_name}.{tag}.tmp"


@contextmanager
def atomic_file(path: Path, mode: int | None = None) -> Iterator[BinaryIO]:
    """A binary file that becomes `path` only if the block completes; on any error nothing changes at `path`.

    `mode` sets the permissions (the temp file is created 0600).
    """
    while True:
        temp = path.with_name(_temp_name(path.name))
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as out:
            yield out
            out.flush()
            os.fsync(out.fileno())
        if mode is not None:
            os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable: the directory entry itself must reach the disk."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def stale_temp_files(directory: Path, target_name: str | None = None) -> list[Path]:
    """atomic_file's temp files in `directory` (only those for `target_name`, when given); links and folders never."""
    found = []
    with os.scandir(directory) as entries:
        for entry in entries:
            match = _TEMP_NAME.fullmatch(entry.name)
            if match and target_name in (None, match["target"]) and entry.is_file(follow_symlinks=False):
                found.append(directory / entry.name)
    return found


def remove_stale_temp_files(directory: Path, target_name: str | None = None) -> int:
    """Remove the temp files of killed saves from `directory` (see stale_temp_files); call it before saving there."""
    return remove_leftovers(stale_temp_files(directory, target_name), directory)


def remove_leftovers(paths: list[Path], directory: Path) -> int:
    """Delete files that interrupted saves left in `directory`; logs and returns how many."""
    for path in paths:
        path.unlink(missing_ok=True)
    if paths:
        log.info("Removed %d files left in %s by interrupted saves", len(paths), directory)
    return len(paths)
