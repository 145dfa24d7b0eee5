"""ModelRunner: opens a .base file, owns the KV blocks and workspaces, and runs forwards over batches of sequences.

It only computes: callers (the Python API, later the actor's scheduler) decide what to run.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import xxhash

from basert._ext import matmul as mm
from basert._ext.kvtypes import kv_type
from basert.engine.kv import (
    BLOCK_SIZE,
    WINDOW_SLACK,
    BlockPool,
    BlockTable,
    KVCache,
    KVSpace,
    blocks_for,
    window_blocks,
    window_start,
)
from basert.engine.sequence import RECURRENT_DTYPE, RecurrentState, SequenceState
from basert.errors import InvalidRequestError
from basert.format import BaseFile
from basert.models import build_model
from basert.models.layers import Batch, BatchItem, Workspace
from basert.models.transformer import INTEGER_ARITHMETIC

LogitsWanted = Literal["last", "all", "none"]


class ContextOverflowError(InvalidRequestError, ValueError):
    """A sequence would grow past the context window.

    The envelope carries llama.cpp's type and OpenAI's code, so clients of either recognise it.
    """

    error_type = "exceed_context_size_error"
    code = "context_length_exceeded"
    param = "messages"

    def __init__(self, n_tokens: int, n_ctx: int):
        super().__init__(f"{n_tokens} tokens exceed the context window of {n_ctx}")
        self.n_tokens = n_tokens
        self.n_ctx = n_ctx

    def client_message(self) -> str:
        return (f"This model's maximum context length is {self.n_ctx} tokens; the request has "
                f"{self.n_tokens} prompt tokens.")

    def extra(self) -> dict[str, object]:
        return {"n_prompt_tokens": self.n_tokens, "n_ctx": self.n_ctx}


@dataclass(slots=True)
class ForwardRequest:
    """New tokens for one sequence, and which of their positions need logits."""

    sequence: SequenceState
    tokens: Sequence[int]
    logits: LogitsWanted = "last"


def model_fingerprint(path: Path) -> str:
    """xxh64 of the .base header: it names the architecture, config and every tensor's checksum."""
    with path.open("rb") as handle:
        prefix = handle.read(16)
        header_len = int.from_bytes(prefix[8:16], "little")
        return xxhash.xxh64(prefix + handle.read(header_len)).hexdigest()


def engine_fingerprint(path: Path, exact: bool) -> str:
    """What a model's logits depend on: its file (model_fingerprint) and the arithmetic of its path, exact or integer
    (the activation widths). Prefix-cache keys, cache files and saved slots carry it."""
    return model_fingerprint(path) + ("-exact" if exact else f"-{INTEGER_ARITHMETIC}")


def default_threads() -> int:
    """One thread per physical core this process may run on (as llama.cpp counts): SMT siblings share a core's
    vector units and memory bandwidth, and a second thread on them only adds synchronisation."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            cores.add((package, (topology / "core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))   # no topology: count the logical CPU
    return max(len(cores), 1)


class ModelRunner:
    """Weights (mmap), forward pass, KV pool; one instance per loaded model."""

    def __init__(
        self,
        path: str | Path,
        *,
        max_context: int = 4096,
        max_sequences: int = 1,
        cache_type_k: str = "f32",
        cache_type_v: str = "f32",
        kv_blocks: int | None = None,
        window_kv_blocks: int | None = None,
        window_slack: int = WINDOW_SLACK,
        threads: int | None = None,
        verify_checksums: bool = True,
        exact: bool | None = None,
    ):
        """Open and validate the model; raises ModelValidationError (one line) for a file that cannot serve:
        malformed, a header that contradicts its tensors, or (with verify_checksums) a corrupted payload.
        exact: quantized weights take the exact float32 path instead of quantized activations and integer dot products
        (None: the process default, BASERT_EXACT or `--exact`).
        kv_blocks: blocks of the KV pool (default: a full context per sequence); window_kv_blocks: blocks of the
        sliding-window layers' pool, for models that have such layers (default: enough for max_sequences
        sequences that feed a whole context in one forward); window_slack: the positions before a window whose
        window-layer KV a sequence keeps (max_context: all of them)."""
        self.exact = mm.get_exact() if exact is None else exact
        self.base = BaseFile(path, verify_checksums=verify_checksums)
        self.base.pop_tokenizer()   # the runner computes; the engine builds its tokenizer from a read of its own
        default = mm.get_exact()
        mm.set_exact(self.exact)
        try:
            self.model = build_model(self.base, max_context)
        except BaseException:
            self.base.close()
            raise
        finally:
            mm.set_exact(default)
        self.fingerprint = engine_fingerprint(Path(path), self.exact)
        self.arch = self.base.arch
        self.config = self.model.config   # typed (models/config.py)
        self.max_context = max_context
        self.threads = threads or default_threads()
        mm.set_num_threads(self.threads)
        self.n_attention_layers = self.model.n_attention_layers
        self.n_linear_layers = self.model.n_linear_layers
        self.max_blocks_per_sequence = blocks_for(max_context)
        n_blocks = kv_blocks if kv_blocks is not None else max_sequences * self.max_blocks_per_sequence
        windows = self.model.kv_windows
        self.window = max(windows, default=0)   # the widest sliding window (0: every layer sees every position)
        self.window_slack = window_slack
        n_window_blocks = 0
        if self.window:
            n_window_blocks = window_kv_blocks if window_kv_blocks is not None else max_sequences * min(
                self.max_blocks_per_sequence, window_blocks(self.window, max_context))
        self.pool = BlockPool(n_blocks)
        self.window_pool = BlockPool(n_window_blocks) if self.window else None
        self.kv = KVCache(windows, n_blocks, n_window_blocks, self.config.num_key_value_heads,
                          self.config.head_dim, kv_type(cache_type_k), kv_type(cache_type_v))
        self.workspace = Workspace()

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def recurrent_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Shapes of a sequence's recurrent state, (conv, ssm); None for a model without linear-attention layers.

        conv is [n_linear_layers, conv_dim, K-1], ssm is [n_linear_layers, n_v, d_k, d_v] (see RecurrentState).
        """
        linear = self.model.linear_attention
        if linear is None or not self.n_linear_layers:
            return None
        n = self.n_linear_layers
        return ((n, linear.conv_dim, linear.conv_kernel_dim - 1),
                (n, linear.num_value_heads, linear.key_head_dim, linear.value_head_dim))

    @property
    def recurrent_state_nbytes(self) -> int:
        """Bytes of one sequence's recurrent state (conv and ssm); 0 for a model without linear-attention layers."""
        shapes = self.recurrent_shapes
        if shapes is None:
            return 0
        conv_shape, ssm_shape = shapes
        return RECURRENT_DTYPE.itemsize * (math.prod(conv_shape) + math.prod(ssm_shape))

    def new_sequence(self) -> SequenceState:
        """An empty sequence with its own block table and (for hybrids) recurrent state."""
        shapes = self.recurrent_shapes
        recurrent = RecurrentState.zeros(*shapes) if shapes is not None else None
        window_table = BlockTable(self.max_blocks_per_sequence) if self.window else None
        return SequenceState(BlockTable(self.max_blocks_per_sequence), recurrent, [], window_table=window_table)

    def resumable(self, sequence: SequenceState, n_tokens: int) -> bool:
        """Whether the sequence still holds the KV that continuing after its first n_tokens reads: its window
        layers' blocks from the window of position n_tokens on (the others keep every position)."""
        table = sequence.window_table
        return n_tokens <= sequence.n_past and (table is None or table.first <= window_start(n_tokens, self.window))

    def rewind(self, sequence: SequenceState, n_tokens: int) -> None:
        """Keep only the first n_tokens of a sequence (attention-only models: KV can be truncated)."""
        if sequence.recurrent is not None and n_tokens != sequence.n_past:
            raise ValueError("a recurrent (DeltaNet) state cannot be rewound; reset the sequence instead")
        self.truncate_kv(sequence, n_tokens)

    def truncate_kv(self, sequence: SequenceState, n_tokens: int) -> None:
        """Keep the KV and tokens of the first n_tokens positions (the recurrent state is the caller's); a
        ValueError when the sequence cannot continue from there (see `resumable`).

        The block that will be written next must be the sequence's own: a shared or cached one is copied.
        """
        if not self.resumable(sequence, n_tokens):
            raise ValueError(f"the sequence no longer holds the sliding-window KV before position {n_tokens}")
        del sequence.tokens[n_tokens:]
        del sequence.block_keys[n_tokens // BLOCK_SIZE:]
        tables = [(sequence.block_table, self.pool, False)]
        if sequence.window_table is not None:
            tables.append((sequence.window_table, self.window_pool, True))
        for table, pool, windowed in tables:
            table.truncate(n_tokens, pool)
            if n_tokens % BLOCK_SIZE:
                last = int(table.ids[table.n_blocks - 1])
                if pool.is_shared(last):
                    private = pool.allocate()
                    self.kv.copy_block(last, private, windowed=windowed)
                    table.ids[table.n_blocks - 1] = private
                    pool.release(last)

    def release(self, sequence: SequenceState) -> None:
        """Return a sequence's blocks to the pool and clear its state."""
        sequence.reset(self.pool, self.window_pool)

    def space(self) -> KVSpace:
        """The shared pools and KV tensors."""
        return KVSpace(self.pool, self.window_pool, self.kv)

    def scratch_space(self, n_blocks: int, n_window_blocks: int = 0, *, private: bool = False) -> KVSpace:
        """Where scratch sequences of n_blocks blocks in all (and n_window_blocks of the window pool) may keep
        their KV without disturbing anyone: the shared pools when their free lists hold them (never an evicted
        cached block, never an idle slot's history) unless `private`, else private pools of exactly that many,
        dropped with the space."""
        window_free = self.window_pool.n_free if self.window_pool is not None else 0
        if not private and self.pool.n_free >= n_blocks and window_free >= n_window_blocks:
            return self.space()
        n_window_blocks = n_window_blocks if self.window else 0
        return KVSpace(BlockPool(n_blocks), BlockPool(n_window_blocks) if self.window else None,
                       KVCache(self.kv.windows, n_blocks, n_window_blocks, self.config.num_key_value_heads,
                               self.config.head_dim, self.kv.k_type, self.kv.v_type))

    def window_blocks_for(self, n_tokens: int, chunk: int) -> int:
        """Window-pool blocks a sequence of n_tokens fed in chunks of at most `chunk` tokens holds at most."""
        return min(blocks_for(n_tokens), window_blocks(self.window, chunk)) if self.window else 0

    def forward(self, requests: list[ForwardRequest], *, hidden: bool = False,
                space: KVSpace | None = None) -> list[np.ndarray | None]:
        """Append each request's tokens to its sequence; logits [n, vocab] per request as asked, or with
        `hidden` the final norm's output [n, hidden] at those positions (the last hidden states).

        The sequences' blocks come from `space` (default: the shared pools). A sequence's window table then
        lets go of the blocks before what its next window reads (less window_slack positions). The results are
        views of a scratch array, valid until the next forward: copy what you keep. On an exception the
        sequences in this call are left inconsistent: reset them.
        """
        space = space or self.space()
        pool, window_pool, kv = space.pool, space.window_pool, space.cache
        if mm.get_num_threads() != self.threads:
            # OpenMP's thread count is per calling thread: the server steps in a worker thread.
            mm.set_num_threads(self.threads)
        n_rows = 0
        n_logits = 0
        for request in requests:
            n_new = len(request.tokens)
            if n_new == 0:
                raise ValueError("a forward request needs at least one token")
            end = request.sequence.n_past + n_new
            if end > self.max_context:
                raise ContextOverflowError(end, self.max_context)
            if min(request.tokens) < 0 or max(request.tokens) >= self.vocab_size:
                raise ValueError(f"token ids must be in [0, {self.vocab_size})")
            n_rows += n_new
            n_logits += {"last": 1, "all": n_new, "none": 0}[request.logits]
        # Every array of the batch lives in the workspace: a decode step allocates no array data.
        ws = self.workspace
        n_items = len(requests)
        tokens = ws.get("batch.tokens", n_rows, dtype=np.int32)
        positions = ws.get("batch.positions", n_rows, dtype=np.int32)
        logit_rows = ws.get("batch.logit_rows", n_logits, dtype=np.int64)
        rows = ws.get("batch.rows", n_items, dtype=np.int32)
        lengths = ws.get("batch.lengths", n_items, dtype=np.int32)
        starts = ws.get("batch.starts", n_items, dtype=np.int32)
        tables = ws.get("batch.tables", n_items, self.max_blocks_per_sequence, dtype=np.int32)
        window_tables = tables
        if self.window:
            window_tables = ws.get("batch.window_tables", n_items, self.max_blocks_per_sequence, dtype=np.int32)
        items = []
        row = 0
        picked = 0
        for i, request in enumerate(requests):
            seq = request.sequence
            n_new = len(request.tokens)
            end = seq.n_past + n_new
            own = [(seq.block_table, pool)]
            if self.window:
                own.append((seq.window_table, window_pool))
            for table, table_pool in own:
                if seq.n_past % BLOCK_SIZE and table_pool.is_shared(int(table.ids[seq.n_past // BLOCK_SIZE])):
                    raise RuntimeError("a sequence would write into a shared KV block")
                table.ensure(end, table_pool)
            recurrent = seq.recurrent
            items.append(BatchItem(row, n_new, seq.n_past, seq.block_table.view(),
                                   recurrent.conv if recurrent else None,
                                   recurrent.ssm if recurrent else None))
            if n_new == 1:
                tokens[row] = request.tokens[0]
                positions[row] = seq.n_past
            else:
                tokens[row: row + n_new] = request.tokens
                positions[row: row + n_new] = np.arange(seq.n_past, end, dtype=np.int32)
            if request.logits == "last":
                logit_rows[picked] = row + n_new - 1
                picked += 1
            elif request.logits == "all":
                logit_rows[picked: picked + n_new] = np.arange(row, row + n_new)
                picked += n_new
            rows[i], lengths[i], starts[i] = row, n_new, seq.n_past
            tables[i, : seq.block_table.n_blocks] = seq.block_table.view()
            if self.window:
                window_tables[i, : seq.window_table.n_blocks] = seq.window_table.view()
            row += n_new
        batch = Batch(items, tokens, positions, rows, lengths, starts, tables, window_tables)
        rows_out = self.model.forward(batch, kv, self.workspace, logit_rows, head=not hidden)
        results: list[np.ndarray | None] = []
        used = 0
        for request in requests:
            seq = request.sequence
            seq.tokens.extend(int(t) for t in request.tokens)
            if self.window:
                seq.window_table.release_before(window_start(max(0, seq.n_past - self.window_slack), self.window),
                                                window_pool)
            count = {"last": 1, "all": len(request.tokens), "none": 0}[request.logits]
            results.append(rows_out[used: used + count] if count else None)
            used += count
        return results

    def close(self) -> None:
        self.base.close()
