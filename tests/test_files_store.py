"""The files store and the slot filename check, on real files in a temporary directory."""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import time
from pathlib import Path

import pytest

from basert.server.files import (
    FileNotFoundInStoreError,
    FilesStore,
    StoredFile,
    StoreFullError,
    UnsafeFilenameError,
    safe_child,
)
from basert.testing.disk import DISK_ERROR, storage_error_message

ID_RE = re.compile(r"file-[0-9a-f]{24}")


def store_entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


# safe_child


def test_safe_child_accepts_a_plain_name(tmp_path: Path) -> None:
    assert safe_child(tmp_path, "snap.bin") == tmp_path / "snap.bin"


@pytest.mark.parametrize("filename", ["../x", "a/b", "..", ".", "", "a\\b", "a\0b", "x" * 300, "/etc/passwd"])
def test_safe_child_refuses_names_that_are_not_one_component(tmp_path: Path, filename: str) -> None:
    with pytest.raises(UnsafeFilenameError):
        safe_child(tmp_path, filename)


def test_safe_child_length_limit_is_255_bytes(tmp_path: Path) -> None:
    assert safe_child(tmp_path, "x" * 255) == tmp_path / ("x" * 255)
    # 128 two-byte characters: under 255 characters, over 255 bytes.
    with pytest.raises(UnsafeFilenameError):
        safe_child(tmp_path, "é" * 128)


def test_safe_child_refuses_a_directory(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    with pytest.raises(UnsafeFilenameError, match="directory"):
        safe_child(tmp_path, "folder")


def test_safe_child_refuses_a_symlink_pointing_outside(tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    slots.mkdir()
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"secret")
    os.symlink(outside, slots / "escape.bin")
    with pytest.raises(UnsafeFilenameError):
        safe_child(slots, "escape.bin")


def test_safe_child_refuses_a_dangling_symlink_pointing_outside(tmp_path: Path) -> None:
    slots = tmp_path / "slots"
    slots.mkdir()
    # A save would write through this link to a file that does not exist yet.
    os.symlink(tmp_path / "not-yet.bin", slots / "escape.bin")
    with pytest.raises(UnsafeFilenameError):
        safe_child(slots, "escape.bin")


def test_safe_child_refuses_a_symlink_to_the_directory_itself(tmp_path: Path) -> None:
    os.symlink(".", tmp_path / "self")
    with pytest.raises(UnsafeFilenameError):
        safe_child(tmp_path, "self")


def test_safe_child_refuses_a_symlink_loop(tmp_path: Path) -> None:
    os.symlink("loop-b", tmp_path / "loop-a")
    os.symlink("loop-a", tmp_path / "loop-b")
    with pytest.raises(UnsafeFilenameError):
        safe_child(tmp_path, "loop-a")


def test_safe_child_accepts_a_symlink_pointing_inside(tmp_path: Path) -> None:
    (tmp_path / "real.bin").write_bytes(b"data")
    os.symlink("real.bin", tmp_path / "alias.bin")
    assert safe_child(tmp_path, "alias.bin") == tmp_path / "alias.bin"


def test_safe_child_works_when_the_directory_itself_is_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real-slots"
    real.mkdir()
    os.symlink(real, tmp_path / "slots")
    assert safe_child(tmp_path / "slots", "snap.bin") == tmp_path / "slots" / "snap.bin"


# FilesStore


def test_round_trip(tmp_path: Path) -> None:
    store = FilesStore(tmp_path / "files")
    stored = store.create(b"hello\nworld\n", "input.jsonl", "batch")
    assert ID_RE.fullmatch(stored.id)
    assert (stored.filename, stored.purpose, stored.bytes) == ("input.jsonl", "batch", 12)
    assert store.list() == [stored]
    assert store.get(stored.id) == stored
    assert store.content(stored.id) == b"hello\nworld\n"
    assert store.path(stored.id) == tmp_path / "files" / f"{stored.id}.data"
    assert store.total_bytes() == 12
    assert store.delete(stored.id) == stored
    assert store.list() == []
    assert store.total_bytes() == 0
    assert store_entries(tmp_path / "files") == []
    with pytest.raises(FileNotFoundInStoreError):
        store.get(stored.id)
    with pytest.raises(FileNotFoundInStoreError):
        store.delete(stored.id)


def test_to_openai_is_the_openai_file_object() -> None:
    stored = StoredFile(id="file-" + "0" * 24, filename="a.jsonl", purpose="batch", bytes=3, created_at=1700000000)
    assert stored.to_openai() == {"id": "file-" + "0" * 24, "object": "file", "bytes": 3,
                                  "created_at": 1700000000, "filename": "a.jsonl", "purpose": "batch"}


def test_created_at_is_now_in_epoch_seconds(tmp_path: Path) -> None:
    before = int(time.time())
    stored = FilesStore(tmp_path).create(b"x", "x", "batch")
    assert before <= stored.created_at <= int(time.time())
    assert isinstance(stored.created_at, int)


def test_ids_are_unique_and_well_formed(tmp_path: Path) -> None:
    store = FilesStore(tmp_path)
    ids = [store.create(b"x", "x", "batch").id for _ in range(50)]
    assert len(set(ids)) == 50
    assert all(ID_RE.fullmatch(file_id) for file_id in ids)


def test_list_is_newest_first_and_filters_by_purpose(tmp_path: Path) -> None:
    store = FilesStore(tmp_path)
    first = store.create(b"1", "one", "batch")
    second = store.create(b"22", "two", "slot_snapshot")
    third = store.create(b"333", "three", "batch")
    assert store.list() == [third, second, first]
    assert store.list("batch") == [third, first]
    assert store.list("slot_snapshot") == [second]
    assert store.list("fine-tune") == []


@pytest.mark.parametrize("file_id", ["file-" + "0" * 24, "file-abc", "../etc/passwd", "file-" + "A" * 24,
                                     "file-" + "0" * 24 + "/../x", "", "file-" + "0" * 25])
def test_unknown_or_malformed_ids_are_not_found(tmp_path: Path, file_id: str) -> None:
    store = FilesStore(tmp_path)
    store.create(b"x", "x", "batch")
    for method in (store.get, store.path, store.content, store.delete):
        with pytest.raises(FileNotFoundInStoreError, match=re.escape(repr(file_id))):
            method(file_id)
    assert len(store.list()) == 1


def test_metadata_filename_is_checked(tmp_path: Path) -> None:
    store = FilesStore(tmp_path)
    # Only metadata: path separators are fine, emptiness, NUL and length are not.
    assert store.create(b"x", "dir/name.jsonl", "batch").filename == "dir/name.jsonl"
    assert store.create(b"x", "y" * 255, "batch").filename == "y" * 255
    for bad in ("", "a\0b", "y" * 256):
        with pytest.raises(UnsafeFilenameError):
            store.create(b"x", bad, "batch")
    assert len(store.list()) == 2


def test_max_bytes_is_enforced_and_a_refused_upload_leaves_nothing(tmp_path: Path) -> None:
    store = FilesStore(tmp_path, max_bytes=10)
    store.create(b"123456", "a", "batch")
    before = store_entries(tmp_path)
    with pytest.raises(StoreFullError, match=r"limit of 10 bytes \(6 bytes in use\)"):
        store.create(b"12345", "b", "batch")
    assert store_entries(tmp_path) == before
    assert store.total_bytes() == 6
    # Exactly at the limit is allowed; one byte more is not.
    store.create(b"1234", "c", "batch")
    assert store.total_bytes() == 10
    with pytest.raises(StoreFullError):
        store.create(b"1", "d", "batch")


def test_deleting_frees_room(tmp_path: Path) -> None:
    store = FilesStore(tmp_path, max_bytes=4)
    stored = store.create(b"1234", "a", "batch")
    with pytest.raises(StoreFullError):
        store.create(b"5", "b", "batch")
    store.delete(stored.id)
    assert store.create(b"5678", "b", "batch").bytes == 4


def test_a_new_store_over_the_same_directory_sees_the_same_files(tmp_path: Path) -> None:
    store = FilesStore(tmp_path / "files")
    first = store.create(b"first", "one", "batch")
    second = store.create(b"second", "two", "batch")
    reopened = FilesStore(tmp_path / "files", max_bytes=12)
    assert reopened.list() == [second, first]
    assert reopened.content(first.id) == b"first"
    assert reopened.total_bytes() == 11
    with pytest.raises(StoreFullError):
        reopened.create(b"xx", "three", "batch")


@pytest.mark.parametrize("corrupt", [b"{not json", b"", b"\xff\xfe", b"[]", b'{"id": "file-000000000000000000000000"}',
                                     b"null", "wrong-types"])
def test_corrupt_metadata_is_skipped(tmp_path: Path, corrupt: bytes | str) -> None:
    store = FilesStore(tmp_path)
    good = store.create(b"good", "good", "batch")
    bad = store.create(b"bad", "bad", "batch")
    meta_path = tmp_path / f"{bad.id}.json"
    if corrupt == "wrong-types":
        meta = json.loads(meta_path.read_text())
        meta["bytes"] = True
        corrupt = json.dumps(meta).encode()
    meta_path.write_bytes(corrupt)
    assert store.list() == [good]
    assert store.total_bytes() == 4
    with pytest.raises(FileNotFoundInStoreError):
        store.get(bad.id)


def test_metadata_whose_id_does_not_match_its_name_is_skipped(tmp_path: Path) -> None:
    store = FilesStore(tmp_path)
    good = store.create(b"good", "good", "batch")
    # A copy under another id must not make the same file appear twice.
    (tmp_path / ("file-" + "f" * 24 + ".json")).write_bytes((tmp_path / f"{good.id}.json").read_bytes())
    assert store.list() == [good]


def test_no_temp_files_are_left_behind(tmp_path: Path) -> None:
    store = FilesStore(tmp_path / "files", max_bytes=100)
    kept = store.create(b"kept", "kept", "batch")
    removed = store.create(b"removed", "removed", "batch")
    store.delete(removed.id)
    with pytest.raises(StoreFullError):
        store.create(b"x" * 200, "big", "batch")
    with pytest.raises(UnsafeFilenameError):
        store.create(b"x", "", "batch")
    source = tmp_path / "snapshot.partial"
    source.write_bytes(b"snapshot")
    snap = store.create_from_path(source, "snap.bin", "slot_snapshot")
    assert store_entries(tmp_path / "files") == sorted([f"{kept.id}.data", f"{kept.id}.json",
                                              f"{snap.id}.data", f"{snap.id}.json"])


def test_create_from_path_moves_the_file_in(tmp_path: Path) -> None:
    store = FilesStore(tmp_path / "files")
    source = tmp_path / "snapshot.partial"
    source.write_bytes(b"\x00slot state\x01")
    stored = store.create_from_path(source, "slot0.bin", "slot_snapshot")
    assert ID_RE.fullmatch(stored.id)
    assert (stored.filename, stored.purpose, stored.bytes) == ("slot0.bin", "slot_snapshot", 12)
    assert not source.exists()
    assert store.content(stored.id) == b"\x00slot state\x01"
    assert store.list() == [stored]


def test_create_from_path_copies_across_filesystems(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a filesystem other than tmp_path's")
    store = FilesStore(tmp_path)
    fd, name = tempfile.mkstemp(dir=shm)
    os.write(fd, b"across")
    os.close(fd)
    stored = store.create_from_path(Path(name), "x.bin", "slot_snapshot")
    assert not Path(name).exists()
    assert store.content(stored.id) == b"across"
    assert store_entries(tmp_path) == sorted([f"{stored.id}.data", f"{stored.id}.json"])


def test_create_from_path_over_the_limit_keeps_the_source_and_stores_nothing(tmp_path: Path) -> None:
    store = FilesStore(tmp_path / "files", max_bytes=4)
    source = tmp_path / "snapshot.partial"
    source.write_bytes(b"12345")
    with pytest.raises(StoreFullError):
        store.create_from_path(source, "slot0.bin", "slot_snapshot")
    assert source.read_bytes() == b"12345"
    assert store_entries(tmp_path / "files") == []


def test_create_from_path_refuses_a_symlink_source(tmp_path: Path) -> None:
    store = FilesStore(tmp_path / "files")
    target = tmp_path / "target.bin"
    target.write_bytes(b"target")
    os.symlink(target, tmp_path / "link.bin")
    with pytest.raises(ValueError, match="not a regular file"):
        store.create_from_path(tmp_path / "link.bin", "x", "slot_snapshot")
    assert store_entries(tmp_path / "files") == []
    assert (tmp_path / "link.bin").is_symlink()


# Saves interrupted by a kill or a disk error


def test_files_left_by_killed_saves_are_removed_at_start_and_look_alikes_kept(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = FilesStore(tmp_path)
    kept = store.create(b"kept", "kept", "batch")
    partial = store.new_partial_path().name
    orphan = "file-" + "a" * 24
    left = [f".{orphan}.data.k3y_9abc.tmp", f".{kept.id}.json.a1b2c3d4.tmp", partial, f".{partial}.qwertyui.tmp",
            f"{orphan}.data"]
    look_alikes = [".slot-123.partial", "slot-" + "0" * 32 + ".partial", ".slot-" + "0" * 32 + ".partial.bak",
                   "file-abc.data", f"{orphan}.data.tmp", ".notes.tmp", "notes.txt"]
    for name in left + look_alikes:
        (tmp_path / name).write_bytes(b"left")
    (tmp_path / ("file-" + "b" * 24 + ".data")).mkdir()                              # a folder
    os.symlink(tmp_path / "notes.txt", tmp_path / (".slot-" + "c" * 32 + ".partial"))  # a link
    with caplog.at_level(logging.INFO, logger="basert.storage"):
        reopened = FilesStore(tmp_path)
    assert "Removed 5 files" in caplog.text
    not_files = ["file-" + "b" * 24 + ".data", ".slot-" + "c" * 32 + ".partial"]
    assert store_entries(tmp_path) == sorted(look_alikes + not_files + [f"{kept.id}.data", f"{kept.id}.json"])
    assert reopened.list() == [kept] and reopened.content(kept.id) == b"kept"


def test_an_upload_that_hits_a_disk_error_raises_storage_error_and_stores_nothing(tmp_path: Path) -> None:
    store = FilesStore(tmp_path, max_bytes=1_000_000)
    kept = store.create(b"kept", "kept", "batch")
    message = storage_error_message(65536, """
        from basert.server.files import FilesStore
        FilesStore(sys.argv[1], max_bytes=1_000_000).create(b"x" * 100_000, "big.bin", "user_data")
    """, str(tmp_path))
    assert message == f"file upload {DISK_ERROR}"
    assert store_entries(tmp_path) == sorted([f"{kept.id}.data", f"{kept.id}.json"])
    assert store.list() == [kept] and store.total_bytes() == 4


def test_a_slot_handover_that_hits_a_disk_error_raises_storage_error_and_stores_nothing(tmp_path: Path) -> None:
    store = FilesStore(tmp_path / "files")
    kept = store.create(b"kept", "kept", "batch")
    source = tmp_path / "snapshot.partial"
    source.write_bytes(b"s" * 100)
    # The rename succeeds; writing the metadata (over 100 bytes) fails, so the moved content goes too.
    message = storage_error_message(100, """
        from pathlib import Path
        from basert.server.files import FilesStore
        FilesStore(sys.argv[1]).create_from_path(Path(sys.argv[2]), "slot0.bin", "slot_snapshot")
    """, str(tmp_path / "files"), str(source))
    assert message == f"slot save {DISK_ERROR}"
    assert store_entries(tmp_path / "files") == sorted([f"{kept.id}.data", f"{kept.id}.json"])
    assert store.list() == [kept]


def test_a_slot_copy_across_filesystems_that_hits_a_disk_error_stores_nothing(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on a filesystem other than tmp_path's")
    FilesStore(tmp_path)  # the store's folders exist before the copy
    fd, name = tempfile.mkstemp(dir=shm)
    os.write(fd, b"s" * 10_000)
    os.close(fd)
    try:
        message = storage_error_message(4096, """
            from pathlib import Path
            from basert.server.files import FilesStore
            FilesStore(sys.argv[1]).create_from_path(Path(sys.argv[2]), "slot0.bin", "slot_snapshot")
        """, str(tmp_path), name)
        assert Path(name).stat().st_size == 10_000
    finally:
        Path(name).unlink(missing_ok=True)
    assert message == f"slot save {DISK_ERROR}"
    assert store_entries(tmp_path) == []
