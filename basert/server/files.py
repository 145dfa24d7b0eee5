"""The files store behind `/v1/files` and slot snapshots, and the filename check for slot directories.

Synchronous plain-filesystem code; the server calls it from trio through `trio.to_thread`.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import stat
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from basert.errors import InvalidRequestError, NotFoundError
from basert.format.atomic import atomic_file, fsync_directory, remove_leftovers, stale_temp_files, storage_errors

MAX_FILENAME_LENGTH = 255
_ID_PATTERN = re.compile(r"file-[0-9a-f]{24}")
_PARTIAL_PATTERN = re.compile(r"\.slot-[0-9a-f]{32}\.partial")  # the names new_partial_path gives


class UnsafeFilenameError(InvalidRequestError, ValueError):
    """A filename that is not a single safe path component, or that leads outside its directory."""


class FileNotFoundInStoreError(NotFoundError, LookupError):
    """No stored file has this id (or the id is malformed)."""

    code = "file_not_found"

    def __init__(self, file_id: str):
        super().__init__(f"No such file: {file_id!r}")
        self.file_id = file_id


class StoreFullError(InvalidRequestError, ValueError):
    """Storing a file would take the store beyond `--files-max-bytes`."""

    def __init__(self, size: int, used: int, limit: int):
        super().__init__(f"files store is full: a {size}-byte file would exceed the limit of {limit} bytes "
                         f"({used} bytes in use)")
        self.size = size
        self.used = used
        self.limit = limit


def safe_child(directory: Path, filename: str) -> Path:
    """`directory / filename` if `filename` is one path component whose resolved path stays inside `directory`."""
    if not filename or filename in (".", "..") or "/" in filename or "\\" in filename or "\0" in filename:
        raise UnsafeFilenameError(f"filename must be a single path component: {filename!r}")
    try:
        encoded_length = len(os.fsencode(filename))
    except UnicodeEncodeError as exc:
        raise UnsafeFilenameError(f"filename is not encodable: {filename!r}") from exc
    # The filesystem's NAME_MAX counts bytes, so a long non-ASCII name is refused here, not at open().
    if encoded_length > MAX_FILENAME_LENGTH:
        raise UnsafeFilenameError(f"filename is longer than {MAX_FILENAME_LENGTH} bytes")
    child = directory / filename
    try:
        root = directory.resolve()
        resolved = child.resolve()
    except (OSError, RuntimeError) as exc:  # RuntimeError: a symlink loop on Python < 3.13
        # Not the exception's text: it names the server's absolute path.
        raise UnsafeFilenameError(f"filename cannot be resolved (a symbolic link loop?): {filename!r}") from exc
    # A symlink inside the directory may point anywhere; only its final target counts.
    if resolved == root or not resolved.is_relative_to(root):
        raise UnsafeFilenameError(f"filename leads outside the directory: {filename!r}")
    if resolved.is_dir():
        raise UnsafeFilenameError(f"filename names a directory: {filename!r}")
    return child


@dataclass(frozen=True, slots=True)
class StoredFile:
    """Metadata of one stored file."""

    id: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def to_openai(self) -> dict:
        """The OpenAI file object."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose}


class FilesStore:
    """Files in one directory: `<id>.data` holds the content, `<id>.json` the metadata.

    A file is listed only once its `.json` exists, and both are written to a temporary file and
    renamed into place, so a crash never leaves a half-written file visible; what a killed save
    leaves behind is removed when a store opens the directory. A disk error raises StorageError.
    """

    def __init__(self, directory: Path, max_bytes: int | None = None):
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        # Requests run in worker threads; the size check and the write must not interleave.
        self._lock = threading.Lock()
        self._last_created_ns = 0
        self._remove_leftovers()

    def new_partial_path(self) -> Path:
        """A fresh path in the store's directory for a snapshot to write and then hand to create_from_path."""
        return self.directory / f".slot-{uuid.uuid4().hex}.partial"

    def create(self, content: bytes, filename: str, purpose: str) -> StoredFile:
        """Store `content` under a new id."""
        _check_metadata_filename(filename)
        with self._lock:
            self._check_room(len(content))
            with self._storing("file upload") as file_id:
                self._write_atomically(self._data_path(file_id), content)
                return self._commit(file_id, filename, purpose, len(content))

    def create_from_path(self, source: Path, filename: str, purpose: str) -> StoredFile:
        """Move the finished file at `source` into the store under a new id.

        Slot snapshots are written by the snapshot code to a path of its choosing (new_partial_path)
        and handed over whole: a rename when `source` is on the store's filesystem, else a copy. On
        success `source` is gone; when refused (store full, not a regular file) it is untouched and
        nothing is stored; on a disk error (StorageError) nothing is stored.
        """
        _check_metadata_filename(filename)
        source = Path(source)
        with self._lock:
            # lstat: a symlink would be renamed as a link, leaving the store pointing elsewhere.
            source_stat = source.lstat()
            if not stat.S_ISREG(source_stat.st_mode):
                raise ValueError(f"not a regular file: {source}")
            self._check_room(source_stat.st_size)
            with self._storing("slot save") as file_id:
                self._move_in(source, self._data_path(file_id))
                return self._commit(file_id, filename, purpose, source_stat.st_size)

    def list(self, purpose: str | None = None) -> list[StoredFile]:
        """Stored files, newest first, optionally only those with `purpose`."""
        entries = []
        for meta_path in self.directory.glob("file-*.json"):
            entry = _read_metadata(meta_path)
            if entry is not None and (purpose is None or entry[1].purpose == purpose):
                entries.append(entry)
        entries.sort(key=lambda entry: (entry[0], entry[1].id), reverse=True)
        return [stored for _, stored in entries]

    def get(self, file_id: str) -> StoredFile:
        """The metadata of `file_id`."""
        _check_id(file_id)
        entry = _read_metadata(self._meta_path(file_id))
        if entry is None:
            raise FileNotFoundInStoreError(file_id)
        return entry[1]

    def path(self, file_id: str) -> Path:
        """The content's path on disk (read it; do not modify it)."""
        self.get(file_id)
        data_path = self._data_path(file_id)
        if not data_path.is_file():
            raise FileNotFoundInStoreError(file_id)
        return data_path

    def content(self, file_id: str) -> bytes:
        """The stored bytes of `file_id`."""
        try:
            return self.path(file_id).read_bytes()
        except FileNotFoundError as exc:  # deleted between the check and the read
            raise FileNotFoundInStoreError(file_id) from exc

    def delete(self, file_id: str) -> StoredFile:
        """Remove `file_id` and return its metadata."""
        with self._lock:
            stored = self.get(file_id)
            # Metadata first: once it is gone the file is no longer listed, whatever happens next.
            self._meta_path(file_id).unlink(missing_ok=True)
            self._data_path(file_id).unlink(missing_ok=True)
            self._fsync_directory()
            return stored

    def total_bytes(self) -> int:
        """Bytes of content held by listed files."""
        return sum(stored.bytes for stored in self.list())

    def _check_room(self, size: int) -> None:
        if self.max_bytes is None:
            return
        used = self.total_bytes()
        if used + size > self.max_bytes:
            raise StoreFullError(size, used, self.max_bytes)

    def _new_id(self) -> str:
        while True:
            file_id = "file-" + secrets.token_hex(12)
            if not self._meta_path(file_id).exists() and not self._data_path(file_id).exists():
                return file_id

    def _remove_leftovers(self) -> None:
        """Remove what killed saves left: temp files, partial snapshots, content whose metadata was never written."""
        leftovers = stale_temp_files(self.directory)
        with os.scandir(self.directory) as entries:
            for entry in entries:
                file_id = entry.name.removesuffix(".data")
                orphan = file_id != entry.name and _ID_PATTERN.fullmatch(file_id) \
                    and not self._meta_path(file_id).exists()
                if (orphan or _PARTIAL_PATTERN.fullmatch(entry.name)) and entry.is_file(follow_symlinks=False):
                    leftovers.append(self.directory / entry.name)
        remove_leftovers(leftovers, self.directory)

    @contextmanager
    def _storing(self, operation: str) -> Iterator[str]:
        """A new id whose content and metadata the block writes; if it fails, neither remains."""
        file_id = self._new_id()
        with storage_errors(operation):
            try:
                yield file_id
            except BaseException:
                self._meta_path(file_id).unlink(missing_ok=True)
                self._data_path(file_id).unlink(missing_ok=True)
                raise

    def _move_in(self, source: Path, data_path: Path) -> None:
        try:
            _fsync_file(source)
            os.replace(source, data_path)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            with open(source, "rb") as reader:
                self._write_atomically(data_path, reader)
            source.unlink()
        else:
            self._fsync_directory()

    def _commit(self, file_id: str, filename: str, purpose: str, size: int) -> StoredFile:
        # Nanoseconds, strictly increasing, so files created within one second still list newest first.
        created_ns = max(time.time_ns(), self._last_created_ns + 1)
        self._last_created_ns = created_ns
        meta = {"id": file_id, "filename": filename, "purpose": purpose, "bytes": size, "created_ns": created_ns}
        self._write_atomically(self._meta_path(file_id), json.dumps(meta).encode())
        return StoredFile(id=file_id, filename=filename, purpose=purpose, bytes=size,
                          created_at=created_ns // 1_000_000_000)

    def _write_atomically(self, target: Path, content: bytes | BinaryIO) -> None:
        """Write `content` (bytes or a binary reader) to `target` via a synced temporary file and a rename."""
        with atomic_file(target) as temp:
            if isinstance(content, bytes):
                temp.write(content)
            else:
                shutil.copyfileobj(content, temp)

    def _fsync_directory(self) -> None:
        fsync_directory(self.directory)

    def _data_path(self, file_id: str) -> Path:
        return self.directory / f"{file_id}.data"

    def _meta_path(self, file_id: str) -> Path:
        return self.directory / f"{file_id}.json"


def _check_id(file_id: str) -> None:
    # Validated before any path is built, so an id can never name anything but a store file.
    if not isinstance(file_id, str) or not _ID_PATTERN.fullmatch(file_id):
        raise FileNotFoundInStoreError(file_id)


def _check_metadata_filename(filename: str) -> None:
    if not isinstance(filename, str) or not filename:
        raise UnsafeFilenameError("filename must be a non-empty string")
    if len(filename) > MAX_FILENAME_LENGTH:
        raise UnsafeFilenameError(f"filename is longer than {MAX_FILENAME_LENGTH} characters")
    if "\0" in filename:
        raise UnsafeFilenameError("filename contains a NUL character")


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _read_metadata(meta_path: Path) -> tuple[int, StoredFile] | None:
    """`(created_ns, file)` from a metadata file, or None when it is missing or corrupt."""
    file_id = meta_path.name.removesuffix(".json")
    if not _ID_PATTERN.fullmatch(file_id):
        return None
    try:
        meta = json.loads(meta_path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("id") != file_id:
        return None
    filename, purpose, size, created_ns = (meta.get(key) for key in ("filename", "purpose", "bytes", "created_ns"))
    if not (isinstance(filename, str) and isinstance(purpose, str)):
        return None
    # bool is an int subclass; a JSON `true` is not a size.
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (size, created_ns)):
        return None
    return created_ns, StoredFile(id=file_id, filename=filename, purpose=purpose, bytes=size,
                                  created_at=created_ns // 1_000_000_000)
