"""Saved engine state: slot snapshots and prefix cache files. No other module writes or reads either.

Both are framed files (`basert.format.framed`: magic, u32 version, u32 header length, UTF-8 JSON header),
the payload little-endian after the header. Both headers hold the `StateLayout` of the model that wrote
them (keys fingerprint, k_type, v_type, n_attention_layers, n_kv_heads, head_dim, conv_shape, ssm_shape; the
KV types are names of basert._ext.kvtypes, the shapes null for a model without linear-attention layers; a header
of an earlier version names one `kv_dtype`, "float16" or "float32", for both). Both are written atomically (temp
file, fsync, rename): a disk error raises StorageError and leaves the previous file as it was. A file is read
only into a model of the same layout, and only once every length in it has been checked against the
file's size: a refused file changes nothing.

Slot snapshot, magic `BSLT`, version 2: one slot's tokens, the KV of its used positions and its
recurrent states. Header: the layout, arch, n_tokens, window_start (the first position whose KV the
sliding-window layers' rows hold, a multiple of the block size; a model without such layers writes none: 0),
and checkpoints (the token counts of the slot's checkpoints, ascending; hybrids only). Payload: int32
tokens[n_tokens]; per attention layer K then V as [n, n_kv_heads, row] rows as the cache stores them (their KV
type's storage), n = n_tokens, or n_tokens - window_start for a sliding-window layer (its window is all that a
continuation reads); then (hybrids) the float32 conv and ssm states of the slot, then the conv and ssm states
of each checkpoint in order.

Prefix cache file, magic `BPXC`, version 1: one model's cached blocks and hybrid snapshots, beside the
configured path as `PATH.<model id with "/" replaced by "--">`. Header: block_size, the layout, n_blocks,
n_window_blocks (a model without sliding-window layers writes none: 0) and n_snapshots. Payload: u64
keys[n_blocks], u64 parents[n_blocks], int32 tokens[n_blocks, block_size]; int32 window_entries[n_window_blocks]
(the blocks, by index, whose sliding-window layers' KV is cached too); per attention layer K then V as
[n, n_kv_heads, block_size, row] (rows as stored), n = n_blocks, or n_window_blocks for a sliding-window layer;
then u64 snapshot_keys[n_snapshots], float32 conv[n_snapshots, ...] and float32 ssm[n_snapshots, ...]. A load
first removes the temp files of killed saves and checks every block against its key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from basert._ext.kvtypes import KVType
from basert.engine.kv import BLOCK_SIZE, NO_BLOCK, blocks_for, window_start
from basert.engine.prefix_cache import PrefixCache
from basert.engine.runner import ModelRunner
from basert.engine.sequence import RECURRENT_DTYPE, RecurrentState
from basert.engine.slots import MAX_SLOT_CHECKPOINTS, Checkpoint, Slot, Slots
from basert.errors import InvalidRequestError
from basert.format.atomic import atomic_file, remove_stale_temp_files, storage_errors
from basert.format.framed import read_frame, write_frame

TOKEN_DTYPE = np.dtype(np.int32)
KEY_DTYPE = np.dtype(np.uint64)
# The KV types of the files of earlier versions, which named one element type for K and V.
_EARLIER_KV_DTYPES = {"float16": "f16", "float32": "f32"}


class SnapshotError(InvalidRequestError, ValueError):
    """A snapshot file cannot be restored into this model: the message says why."""


class PrefixCacheFileError(ValueError):
    """A prefix cache file cannot be loaded into this model: the message says why."""


@dataclass(frozen=True, slots=True)
class SnapshotInfo:
    """What a slot save wrote or a restore read: tokens, and the file's size."""

    n_tokens: int
    n_bytes: int


@dataclass(frozen=True, slots=True)
class _FileKind:
    magic: bytes
    version: int
    name: str                       # as messages name a file of this kind
    error: type[ValueError]


SLOT_SNAPSHOT = _FileKind(b"BSLT", 2, "slot snapshot", SnapshotError)
PREFIX_CACHE_FILE = _FileKind(b"BPXC", 1, "prefix cache file", PrefixCacheFileError)


@dataclass(frozen=True, slots=True)
class StateLayout:
    """What the bytes of saved state depend on: the model, and the element type and shapes of its KV and
    recurrent state. A file is readable by a model of the same layout (the KV element type aside when the
    model has no attention layer)."""

    fingerprint: str
    k_type: KVType
    v_type: KVType
    n_attention_layers: int
    n_kv_heads: int
    head_dim: int
    conv_shape: tuple[int, ...] | None
    ssm_shape: tuple[int, ...] | None
    windowed: tuple[bool, ...]          # per attention layer: a sliding-window layer (the model's, not in headers)

    @classmethod
    def of(cls, runner: ModelRunner) -> StateLayout:
        """The layout of the state this runner computes."""
        conv_shape, ssm_shape = runner.recurrent_shapes or (None, None)
        return cls(runner.fingerprint, runner.kv.k_type, runner.kv.v_type, runner.n_attention_layers,
                   runner.config.num_key_value_heads, runner.config.head_dim, conv_shape, ssm_shape,
                   tuple(window > 0 for window in runner.kv.windows))

    def as_header(self) -> dict:
        """The layout as JSON header fields."""
        return {
            "fingerprint": self.fingerprint,
            "k_type": self.k_type.name,
            "v_type": self.v_type.name,
            "n_attention_layers": self.n_attention_layers,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "conv_shape": list(self.conv_shape) if self.conv_shape is not None else None,
            "ssm_shape": list(self.ssm_shape) if self.ssm_shape is not None else None,
        }

    def check(self, header: dict, error_type: type[ValueError], name: str) -> None:
        """Raise error_type unless the header (of a file called `name` in messages) holds this layout."""
        if header.get("fingerprint") != self.fingerprint:
            raise error_type(f"{name} was saved from a different model")
        expected = self.as_header()
        if "k_type" not in header and header.get("kv_dtype") in _EARLIER_KV_DTYPES:
            header = {**header, "k_type": _EARLIER_KV_DTYPES[header["kv_dtype"]],
                      "v_type": _EARLIER_KV_DTYPES[header["kv_dtype"]]}
        if not self.n_attention_layers:
            # Without attention layers a file holds no KV values, whatever types it names.
            del expected["k_type"], expected["v_type"]
        for key, value in expected.items():
            if header.get(key) != value:
                raise error_type(f"{name} {key} {header.get(key)!r} does not match this server's {value!r}")

    def kv_nbytes(self, n: int, n_window: int) -> int:
        """Bytes of K and V rows over all attention layers: n positions' in each layer that sees every position,
        n_window positions' in each sliding-window layer."""
        row = self.n_kv_heads * (self.k_type.row_bytes(self.head_dim) + self.v_type.row_bytes(self.head_dim))
        return row * sum(n_window if windowed else n for windowed in self.windowed)

    def take_kv(self, payload: _Reader, n: int, n_window: int, *shape: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each attention layer's K and V from the payload, [n (n_window in a sliding-window layer), *shape, row]."""
        k_row, v_row = self.k_type.row_units(self.head_dim), self.v_type.row_units(self.head_dim)
        taken = []
        for windowed in self.windowed:
            rows = n_window if windowed else n
            taken.append((payload.take(self.k_type.storage, (rows, *shape, k_row)),
                          payload.take(self.v_type.storage, (rows, *shape, v_row))))
        return taken


@dataclass(slots=True)
class _Reader:
    """A checked file's payload, taken front to back as arrays that view the file's bytes."""

    data: bytes
    offset: int
    kind: _FileKind

    def expect(self, n_bytes: int) -> None:
        """Refuse a payload of any other size, so that the takes that follow stay inside the file."""
        if len(self.data) - self.offset != n_bytes:
            raise self.kind.error(f"{self.kind.name} payload is {len(self.data) - self.offset} bytes; "
                                  f"{n_bytes} expected")

    def take(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape))
        array = np.frombuffer(self.data, dtype=dtype, count=count, offset=self.offset).reshape(shape)
        self.offset += count * np.dtype(dtype).itemsize
        return array

    def take_tokens(self, shape: tuple[int, ...], vocab_size: int) -> np.ndarray:
        tokens = self.take(TOKEN_DTYPE, shape)
        if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
            raise self.kind.error(f"{self.kind.name} token ids are outside the vocabulary")
        return tokens


def _open_checked(kind: _FileKind, layout: StateLayout, data: bytes,
                  count_keys: tuple[str, ...]) -> tuple[dict, list[int], _Reader]:
    """A saved file's header, its counts (non-negative ints under count_keys) and a reader of its payload,
    once the frame and the layout are known to be this model's."""
    header, offset = read_frame(data, kind.magic, kind.version, kind.name, kind.error)
    layout.check(header, kind.error, kind.name)
    try:
        counts = [int(header[key]) for key in count_keys]
    except (ValueError, KeyError, TypeError) as exc:
        raise kind.error(f"{kind.name} header is invalid: {exc}") from exc
    if min(counts) < 0:
        raise kind.error(f"{kind.name} header is invalid: a negative count")
    return header, counts, _Reader(data, offset, kind)


# --- slot snapshots -------------------------------------------------------------------------------------

def _kv_positions(cache: np.ndarray, blocks: np.ndarray, start: int, n: int) -> np.ndarray:
    """[n - start, n_kv_heads, row] rows of positions start..n-1 (start a multiple of the block size) gathered
    through a block table."""
    gathered = cache[blocks[start // BLOCK_SIZE: blocks_for(n)]]     # [nb, H, 16, d]
    return gathered.transpose(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[: n - start]


def _put_kv_positions(cache: np.ndarray, blocks: np.ndarray, start: int, values: np.ndarray) -> None:
    """Write [n, n_kv_heads, row] rows to positions start..start+n-1 (start a multiple of the block size) through
    a block table (the rest of the last block is zeroed)."""
    n, n_heads, row = values.shape
    blocks = blocks[start // BLOCK_SIZE: blocks_for(start + n)]
    padded = np.zeros((len(blocks) * BLOCK_SIZE, n_heads, row), dtype=cache.dtype)
    padded[:n] = values
    cache[blocks] = padded.reshape(len(blocks), BLOCK_SIZE, n_heads, row).transpose(0, 2, 1, 3)


def _layer_tables(runner: ModelRunner, seq, window_from: int) -> list[tuple[np.ndarray, int]]:
    """Per attention layer, the block table its rows go through and the first position it keeps."""
    tables = []
    for window in runner.kv.windows:
        tables.append((seq.window_table.view(), window_from) if window else (seq.block_table.view(), 0))
    return tables


def save_slot(runner: ModelRunner, slot: Slot, path: Path) -> SnapshotInfo:
    """Write the slot's history to `path` atomically; returns what was written. A disk error raises StorageError."""
    seq = slot.sequence
    n = seq.n_past
    window_from = window_start(n, runner.window) * BLOCK_SIZE if runner.window else 0
    states = [seq.recurrent, *(c.state for c in slot.checkpoints)] if seq.recurrent is not None else []
    header = {**StateLayout.of(runner).as_header(), "arch": runner.arch, "n_tokens": n,
              "checkpoints": [c.n_tokens for c in slot.checkpoints] if states else []}
    if runner.window:
        header["window_start"] = window_from
    with storage_errors("slot save"), atomic_file(path) as out:
        write_frame(out, SLOT_SNAPSHOT.magic, SLOT_SNAPSHOT.version, header)
        out.write(np.asarray(seq.tokens, dtype=TOKEN_DTYPE).tobytes())
        for layer, (blocks, start) in enumerate(_layer_tables(runner, seq, window_from)):
            out.write(np.ascontiguousarray(_kv_positions(runner.kv.k[layer], blocks, start, n)).tobytes())
            out.write(np.ascontiguousarray(_kv_positions(runner.kv.v[layer], blocks, start, n)).tobytes())
        for state in states:
            out.write(state.conv.tobytes())
            out.write(state.ssm.tobytes())
        n_bytes = out.tell()
    return SnapshotInfo(n, n_bytes)


def restore_slot(runner: ModelRunner, slots: Slots, slot: Slot, path: Path) -> SnapshotInfo:
    """Replace the slot's history with a snapshot; the file is fully validated first.

    The restored full blocks join the prefix cache (when there is one), so other slots can share them.
    """
    layout = StateLayout.of(runner)
    data = path.read_bytes()
    header, (n,), payload = _open_checked(SLOT_SNAPSHOT, layout, data, ("n_tokens",))
    if n > runner.max_context:
        raise SnapshotError(f"slot snapshot holds {n} tokens; the context window is {runner.max_context}")
    checkpoints = header.get("checkpoints")
    if not isinstance(checkpoints, list) or not all(isinstance(c, int) and 0 <= c <= n for c in checkpoints) \
            or (checkpoints and layout.conv_shape is None) or len(checkpoints) > MAX_SLOT_CHECKPOINTS:
        raise SnapshotError("slot snapshot checkpoint positions are invalid")
    saved_from = header.get("window_start", 0)
    if not isinstance(saved_from, int) or not 0 <= saved_from <= n or saved_from % BLOCK_SIZE:
        raise SnapshotError("slot snapshot window_start is invalid")
    n_states = 1 + len(checkpoints) if layout.conv_shape is not None else 0
    payload.expect(TOKEN_DTYPE.itemsize * n + layout.kv_nbytes(n, n - saved_from)
                   + runner.recurrent_state_nbytes * n_states)
    tokens = payload.take_tokens((n,), runner.vocab_size)
    kv = layout.take_kv(payload, n, n - saved_from, layout.n_kv_heads)
    states = [(payload.take(RECURRENT_DTYPE, layout.conv_shape), payload.take(RECURRENT_DTYPE, layout.ssm_shape))
              for _ in range(n_states)]

    seq = slot.sequence
    slots.forget(slot)
    slots.make_room(blocks_for(n))
    seq.block_table.ensure(n, runner.pool)
    # The window layers get the blocks of their window only (a file may hold more of their rows).
    window_from = max(saved_from, window_start(n, runner.window) * BLOCK_SIZE) if runner.window else 0
    if seq.window_table is not None:
        seq.window_table.start_at(window_from // BLOCK_SIZE)
        seq.window_table.ensure(n, runner.window_pool)
    for layer, (blocks, start) in enumerate(_layer_tables(runner, seq, window_from)):
        k, v = kv[layer]
        skip = start - saved_from if layout.windowed[layer] else 0
        _put_kv_positions(runner.kv.k[layer], blocks, start, k[skip:])
        _put_kv_positions(runner.kv.v[layer], blocks, start, v[skip:])
    if states:
        seq.recurrent.assign(*states[0])
        for n_tokens, (conv, ssm) in zip(checkpoints, states[1:]):
            state = RecurrentState.zeros(layout.conv_shape, layout.ssm_shape)
            state.assign(conv, ssm)
            slot.checkpoints.append(Checkpoint(n_tokens, state))
    seq.tokens[:] = tokens.tolist()
    slots.register_blocks(seq)
    return SnapshotInfo(n, len(data))


# --- prefix cache files ---------------------------------------------------------------------------------

def prefix_cache_file(base: Path, model_id: str | None, replica: int | None = None) -> Path:
    """The cache file of a server's model: `base` itself when it serves one model (model_id None), else
    `base.<model id>` ("/" in the id becomes "--"); a cluster's replica K adds `.<K>`. One flat file beside `base`."""
    name = base.name if model_id is None else f"{base.name}.{model_id.replace('/', '--')}"
    return base.with_name(name if replica is None else f"{name}.{replica}")


def adopt_prefix_cache_file(old: Path, path: Path) -> bool:
    """Rename the file a server of one model kept its cache in before (`base.<model id>`) to its name now, once:
    only while `path` does not exist. Whether it did; raises OSError when the rename fails."""
    if path.exists() or not old.is_file():
        return False
    old.replace(path)
    return True


def save_prefix_cache(runner: ModelRunner, cache: PrefixCache, path: Path) -> int:
    """Write every cached block and snapshot to `path` atomically; the number of blocks written.

    A disk error raises StorageError and leaves the previous file as it was.
    """
    entries = list(cache.entries.items())
    blocks = np.array([entry.block for _, entry in entries], dtype=np.int64)
    windowed = [i for i, (key, _) in enumerate(entries) if key in cache.window_block_of]
    window_blocks = np.array([cache.window_block_of[entries[i][0]] for i in windowed], dtype=np.int64)
    snapshots = [(key, stored.state) for key, stored in cache.snapshots.items() if key in cache.entries]
    header = {"block_size": BLOCK_SIZE, **StateLayout.of(runner).as_header(),
              "n_blocks": len(entries), "n_snapshots": len(snapshots)}
    if runner.window:
        header["n_window_blocks"] = len(windowed)
    with storage_errors("prefix cache save"):
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path) as out:
            write_frame(out, PREFIX_CACHE_FILE.magic, PREFIX_CACHE_FILE.version, header)
            out.write(np.array([key for key, _ in entries], dtype=KEY_DTYPE).tobytes())
            out.write(np.array([entry.parent for _, entry in entries], dtype=KEY_DTYPE).tobytes())
            out.write(np.array([entry.tokens for _, entry in entries], dtype=TOKEN_DTYPE).reshape(-1).tobytes())
            out.write(np.array(windowed, dtype=TOKEN_DTYPE).tobytes())
            for layer, window in enumerate(runner.kv.windows):
                rows = window_blocks if window else blocks
                out.write(np.ascontiguousarray(runner.kv.k[layer][rows]).tobytes())
                out.write(np.ascontiguousarray(runner.kv.v[layer][rows]).tobytes())
            out.write(np.array([key for key, _ in snapshots], dtype=KEY_DTYPE).tobytes())
            for _, state in snapshots:
                out.write(state.conv.tobytes())
            for _, state in snapshots:
                out.write(state.ssm.tobytes())
    return len(entries)


def load_prefix_cache(runner: ModelRunner, cache: PrefixCache, path: Path) -> int:
    """Fill an empty cache from `path` (as many blocks as the pool has free); the number of blocks loaded.

    Temp files that killed saves left beside `path` are removed first, so call this before any save.
    Raises PrefixCacheFileError (or OSError, FileNotFoundError when there is no file yet) without changing
    the cache when the file is unusable.
    """
    remove_stale_temp_files(path.parent, path.name)
    layout = StateLayout.of(runner)
    data = path.read_bytes()
    header, (n_blocks, n_snapshots), payload = _open_checked(PREFIX_CACHE_FILE, layout, data,
                                                             ("n_blocks", "n_snapshots"))
    if header.get("block_size") != BLOCK_SIZE:
        raise PrefixCacheFileError(f"prefix cache file block_size {header.get('block_size')!r} does not match "
                                   f"this server's {BLOCK_SIZE}")
    if n_snapshots and layout.conv_shape is None:
        raise PrefixCacheFileError("prefix cache file holds recurrent-state snapshots; this model has none")
    n_window = header.get("n_window_blocks", 0)
    if not isinstance(n_window, int) or not 0 <= n_window <= n_blocks:
        raise PrefixCacheFileError("prefix cache file header is invalid: n_window_blocks")
    block_nbytes = 2 * KEY_DTYPE.itemsize + TOKEN_DTYPE.itemsize * BLOCK_SIZE
    payload.expect(n_blocks * block_nbytes + n_window * TOKEN_DTYPE.itemsize
                   + layout.kv_nbytes(n_blocks, n_window) * BLOCK_SIZE
                   + n_snapshots * (KEY_DTYPE.itemsize + runner.recurrent_state_nbytes))
    keys = payload.take(KEY_DTYPE, (n_blocks,))
    parents = payload.take(KEY_DTYPE, (n_blocks,))
    tokens = payload.take_tokens((n_blocks, BLOCK_SIZE), runner.vocab_size)
    window_entries = payload.take(TOKEN_DTYPE, (n_window,))
    if n_window and (window_entries.min() < 0 or window_entries.max() >= n_blocks
                     or np.any(np.diff(window_entries) <= 0)):
        raise PrefixCacheFileError("prefix cache file window entries are invalid")
    kv = layout.take_kv(payload, n_blocks, n_window, layout.n_kv_heads, BLOCK_SIZE)
    snapshot_keys = payload.take(KEY_DTYPE, (n_snapshots,))
    if n_snapshots:
        convs = payload.take(RECURRENT_DTYPE, (n_snapshots, *layout.conv_shape))
        ssms = payload.take(RECURRENT_DTYPE, (n_snapshots, *layout.ssm_shape))
    for i in range(n_blocks):
        if cache.key(int(parents[i]), tokens[i]) != int(keys[i]):
            raise PrefixCacheFileError(f"prefix cache file block {i} does not match its key (corrupt file)")

    pool, window_pool = runner.pool, runner.window_pool
    room = pool.n_free - n_snapshots * cache.snapshot_cost_blocks  # snapshots must not evict loaded blocks
    window_row = {int(entry): row for row, entry in enumerate(window_entries)} if window_pool is not None else {}
    loaded, window_loaded = [], []
    for i in range(max(0, min(n_blocks, room))):
        block = pool.allocate()
        window_block = NO_BLOCK
        row = window_row.get(i)
        if row is not None and window_pool.n_free:
            window_block = window_pool.allocate()
            window_loaded.append(window_block)
        for layer, (k, v) in enumerate(kv):
            if not layout.windowed[layer]:
                runner.kv.k[layer][block], runner.kv.v[layer][block] = k[i], v[i]
            elif window_block != NO_BLOCK:
                runner.kv.k[layer][window_block], runner.kv.v[layer][window_block] = k[row], v[row]
        cache.register(int(parents[i]), tokens[i].tolist(), block, window_block)
        loaded.append(block)
    # Cached and unreferenced, the blocks wait in the LRU queues for a hit. Parents come before their
    # children in the file: releasing in reverse makes chains lose their tails before their heads.
    for block in reversed(loaded):
        pool.release(block)
    for block in reversed(window_loaded):
        window_pool.release(block)
    if n_snapshots:
        state = RecurrentState.zeros(layout.conv_shape, layout.ssm_shape)
        for j in range(n_snapshots):
            state.assign(convs[j], ssms[j])
            cache.add_snapshot(int(snapshot_keys[j]), state)    # keeps a copy
    return len(loaded)
