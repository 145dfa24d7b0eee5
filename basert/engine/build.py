"""build_engine: everything a served model needs, wired in one place.

From a .base path and `EngineOptions` it opens the model (`ModelRunner`: weights, KV pool), its tokenizer,
the prefix cache and the path of its file, and describes the result in a `ModelInfo`. The server, the
Python API, the CLI, the tools and the tests all build engines here, so they all run the same thing.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from basert._ext.kvtypes import KVType, kv_type
from basert.engine.drafts import DEFAULT_DRAFT_MAX, MAX_DRAFT_MAX
from basert.engine.embeddings import POOLINGS
from basert.engine.engine import Engine
from basert.engine.info import ModelInfo
from basert.engine.kv import BLOCK_SIZE, blocks_for, window_pool_blocks
from basert.engine.prefix_cache import PrefixCache
from basert.engine.runner import ModelRunner
from basert.engine.saved_state import adopt_prefix_cache_file, prefix_cache_file
from basert.engine.scheduler import DEFAULT_TOKEN_BUDGET
from basert.format import BaseFile
from basert.models import read_config
from basert.models.config import DecoderConfig
from basert.tokenizer import Tokenizer

log = logging.getLogger("basert.engine")

DEFAULT_CONTEXT = 4096   # tokens per slot of a model that does not say what it was trained on
KV_MEMORY_SHARE = 0.25   # of the memory available at start, what the KV pool may take by default
GIB = 2**30


@dataclass(frozen=True, slots=True)
class EngineOptions:
    """How to load and run one model (the engine's part of `basert serve`'s flags)."""

    max_context: int | None = 4096      # tokens per slot (None: see plan_context)
    n_slots: int = 1
    continuous_batching: bool = False   # every slot generates at once; else one request at a time
    paged_kv: bool = False              # one shared pool of KV blocks; else each slot reserves max_context
    kv_cache_tokens: int | None = None  # size of the paged pool (default: n_slots x max_context)
    context_total: int | None = None    # llama.cpp's -c: tokens of context over all slots (the pool's size)
    kv_memory: int | None = None        # bytes the KV pool may take (default: KV_MEMORY_SHARE of available memory)
    fit_trained: bool = False           # cut a context beyond the model's trained one to it (a model loaded on
                                        # demand); else it is allowed, with a warning (`context_warning`)
    cache_type_k: str = "f16"           # how K and V rows are stored: a name of basert._ext.kvtypes (llama.cpp's)
    cache_type_v: str = "f16"
    threads: int | None = None          # default: every core this process may run on
    exact: bool | None = None           # quantized weights on the exact float32 path (None: BASERT_EXACT / --exact)
    prefix_cache: bool = False
    prefix_cache_file: Path | None = None  # PATH: the cache persists in PATH (PATH.<model id> for one of several)
    one_of_several: bool = False        # the server serves other models too, each with a file of its own
    replica: int | None = None          # a cluster replica's rank: `.<rank>` after the cache file's name
    verify_checksums: bool = True
    model_id: str | None = None         # default: see model_id_for
    token_budget: int = DEFAULT_TOKEN_BUDGET
    pooling: str = "mean"               # of embeddings: mean, last or cls (the first token)
    spec_draft_max: int = DEFAULT_DRAFT_MAX  # most drafted tokens per decode step; 0: no speculative decoding
    context_shift: bool = False         # a full context drops the oldest half of a slot's history after n_keep ...
    n_keep: int = 0                     # ... prompt tokens (-1: the whole prompt), by default

    def resolved(self) -> EngineOptions:
        """The options with their implications applied: a cache file implies the prefix cache; the prefix
        cache, continuous batching and a pool size imply paged KV."""
        prefix_cache = self.prefix_cache or self.prefix_cache_file is not None
        paged = (self.paged_kv or prefix_cache or self.continuous_batching or self.kv_cache_tokens is not None
                 or self.context_total is not None)
        return replace(self, prefix_cache=prefix_cache, paged_kv=paged)

    def check(self) -> None:
        """Raise ValueError naming the first option that cannot work."""
        if self.n_slots < 1:
            raise ValueError("n_slots must be at least 1")
        if self.context_total is not None:
            # Split between the slots, unless each may fill all of it (max_context = context_total: one pool).
            unified = self.max_context == self.context_total
            if (self.context_total if unified else self.context_total // self.n_slots) < 2:
                raise ValueError(f"a total context of {self.context_total} tokens (-c) leaves a slot less than 2")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError("max_context must be at least 2")
        if self.kv_memory is not None and self.kv_memory < 1:
            raise ValueError("kv_memory must be at least 1 byte")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < 16:
            raise ValueError("kv_cache_tokens must be at least 16 (one block)")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be at least 1")
        if self.token_budget < 1:
            raise ValueError("token_budget must be at least 1")
        if self.replica is not None and self.replica < 0:
            raise ValueError("replica must be >= 0")
        if self.n_keep < -1:
            raise ValueError("n_keep must be >= -1")
        if not 0 <= self.spec_draft_max <= MAX_DRAFT_MAX:
            raise ValueError(f"spec_draft_max must be in [0, {MAX_DRAFT_MAX}]")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}")


class ModelOptionsError(ValueError):
    """Options that this model or this machine cannot serve (one line, naming the flag to change)."""


class ContextSizeError(ModelOptionsError):
    """A context or KV pool that the model or the memory cannot hold."""


def kv_types(options: EngineOptions, config: DecoderConfig) -> tuple[KVType, KVType]:
    """The K and V types the options name, for this model; ModelOptionsError for a name that does not exist or a
    type that cannot hold the model's rows."""
    types = []
    for name, flag in ((options.cache_type_k, "--cache-type-k"), (options.cache_type_v, "--cache-type-v")):
        try:
            kind = kv_type(name)
            kind.require(config.head_dim)
        except ValueError as exc:
            raise ModelOptionsError(f"{exc} ({flag})") from None
        types.append(kind)
    return types[0], types[1]


def available_memory() -> int:
    """Bytes of memory available to a new allocation without swapping (Linux: MemAvailable)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def plan_context(options: EngineOptions, config: DecoderConfig, available: int | None = None) -> tuple[int, int]:
    """(tokens of context per slot, tokens of the KV pool) for options that are resolved and checked.

    The context per slot is --max-context, else -c's share (context_total / n_slots), else the model's trained
    context (DEFAULT_CONTEXT when the model does not say); one asked for beyond the trained context is allowed (as
    llama-server does; see `context_warning`) unless options.fit_trained cuts it. The pool is --kv-cache-tokens,
    else -c, else one full context per slot, and its bytes must fit the memory budget (kv_memory, default
    KV_MEMORY_SHARE of `available` memory): a pool that was asked for and does not fit is a ContextSizeError; a
    default pool shrinks to what fits, shared by paged slots (a default context no larger than it) or split between
    slots that reserve their context."""
    per_token, window_bytes = kv_bytes(options, config)
    trained = config.trained_context
    asked = asked_context(options)
    max_context = asked or trained or DEFAULT_CONTEXT
    if trained and max_context > trained and options.fit_trained:
        max_context = trained
    pool_asked = options.kv_cache_tokens or options.context_total
    pool = pool_asked or options.n_slots * max_context
    if not asked:   # a default context is never larger than the pool asked for
        max_context = min(max_context, pool)
    if available is None:
        available = available_memory()
    # The sliding-window layers' pool has a fixed size; the rest of the budget holds the other layers' KV.
    budget = (options.kv_memory or int(available * KV_MEMORY_SHARE)) - window_bytes
    where = (f"the --kv-memory budget of {budget / GIB:.2f} GiB" if options.kv_memory else
             f"{KV_MEMORY_SHARE:.0%} of the {available / GIB:.1f} GiB of memory available (--kv-memory)")
    fits = budget // max(per_token, 1) // BLOCK_SIZE * BLOCK_SIZE
    if pool > fits:
        if pool_asked or (asked and max_context > fits):
            tokens = pool if pool_asked else max_context
            raise ContextSizeError(f"a KV pool of {tokens} tokens needs {tokens * per_token / GIB:.2f} GiB, more "
                                   f"than {where}: lower -c, --max-context or --slots, or raise --kv-memory")
        if fits < BLOCK_SIZE:
            raise ContextSizeError(f"not one block of the KV pool ({BLOCK_SIZE * per_token} bytes) fits in {where}")
        # Slots that share a paged pool each may fill it; slots that each reserve their context split it.
        share = fits if options.paged_kv else fits // options.n_slots // BLOCK_SIZE * BLOCK_SIZE
        if share < 2:
            raise ContextSizeError(f"{options.n_slots} slots that each reserve their context do not fit in {where}: "
                                   "use fewer --slots or --paged-kv")
        log.info("KV pool of %d tokens (%.2f GiB) for %d slot(s) of %d tokens does not fit in %s: %d tokens%s",
                 pool, pool * per_token / GIB, options.n_slots, max_context, where, fits,
                 ", shared" if options.paged_kv else f", {share} per slot")
        pool, max_context = fits, min(max_context, share)
    return max_context, pool


def asked_context(options: EngineOptions) -> int | None:
    """The context per slot that the options ask for: --max-context, else -c's share; None for the default."""
    return options.max_context or (options.context_total // options.n_slots if options.context_total else None)


def context_warning(options: EngineOptions, config: DecoderConfig, max_context: int) -> str | None:
    """The one-line warning for a context per slot beyond the one the model was trained on (None within it):
    positions past the trained context are served, but the model never saw them and may answer poorly."""
    trained = config.trained_context
    if not trained or max_context <= trained:
        return None
    flag = ("-c/--ctx-size" if options.max_context == options.context_total else
            "--max-context" if options.max_context else "-c/--ctx-size over the slots")
    return (f"a context of {max_context} tokens per slot ({flag}) is beyond the {trained} tokens the model was "
            f"trained on: output past position {trained} may degrade")


def kv_bytes(options: EngineOptions, config: DecoderConfig) -> tuple[int, int]:
    """(KV bytes per token of context of the layers that keep every position, bytes of the sliding-window layers'
    pool) for resolved options."""
    k_type, v_type = kv_types(options, config)
    row_bytes = config.num_key_value_heads * (k_type.row_bytes(config.head_dim) + v_type.row_bytes(config.head_dim))
    max_context = asked_context(options) or config.trained_context or DEFAULT_CONTEXT
    window_bytes = config.window_layers * row_bytes * BLOCK_SIZE * window_pool_blocks(
        config.window, options.n_slots, options.token_budget, max_context)
    return config.kv_layers * row_bytes, window_bytes


def planned_memory(path: str | Path, options: EngineOptions = EngineOptions()) -> int:
    """Bytes a model will hold once built with `options`: its .base file (the weights, mapped whole) and the KV
    pools `plan_context` gives it now. For deciding, before a load, whether it fits a memory budget."""
    options = options.resolved()
    with BaseFile(path, verify_checksums=False) as base:
        config = read_config(base)
    _, pool = plan_context(options, config)
    per_token, window_bytes = kv_bytes(options, config)
    return Path(path).stat().st_size + pool * per_token + window_bytes


def build_engine(path: str | Path, options: EngineOptions = EngineOptions()) -> Engine:
    """Open a .base model and wire its engine; raises ModelValidationError for a file that cannot serve,
    ContextSizeError for a context or pool the memory cannot hold, ValueError for options that cannot
    work."""
    options = options.resolved()
    options.check()
    path = Path(path)
    map_large_blocks()
    with BaseFile(path, verify_checksums=False) as base:
        config = read_config(base)
        max_context, pool = plan_context(options, config)
        warning = context_warning(options, config, max_context)
        if warning:
            log.warning("%s", warning)
        # Before the weights: building a vocabulary of 150k pieces passes through three times the memory the
        # tokenizer keeps, and what it frees is handed back before the weights are loaded beside it.
        tokenizer = tokenizer_of(base.pop_tokenizer())
    release_free_memory()
    options = replace(options, max_context=max_context)
    kv_blocks = blocks_for(pool) if options.paged_kv else None
    runner = ModelRunner(path, max_context=options.max_context, threads=options.threads,
                         max_sequences=options.n_slots, kv_blocks=kv_blocks,
                         window_kv_blocks=window_pool_blocks(config.window, options.n_slots, options.token_budget,
                                                             options.max_context),
                         cache_type_k=options.cache_type_k,
                         cache_type_v=options.cache_type_v,
                         verify_checksums=options.verify_checksums, exact=options.exact)
    try:
        model_id = options.model_id or model_id_for(path)
        prefix_cache = None
        if options.prefix_cache:
            # A hybrid's state snapshot is charged against the pool as the blocks its bytes would fill (one
            # block when the blocks hold no KV: a model without attention layers).
            block_nbytes = runner.kv.block_nbytes
            snapshot_cost = -(-runner.recurrent_state_nbytes // block_nbytes) if block_nbytes else 1
            prefix_cache = PrefixCache(runner.pool, runner.fingerprint, recurrent=runner.n_linear_layers > 0,
                                       snapshot_cost_blocks=snapshot_cost, window_pool=runner.window_pool,
                                       window=runner.window)
        features = {name for name, on in (("continuous_batching", options.continuous_batching),
                                          ("paged_kv", options.paged_kv),
                                          ("prefix_cache", options.prefix_cache),
                                          ("prefix_cache_file", options.prefix_cache_file is not None),
                                          ("context_shift", options.context_shift)) if on}
        info = ModelInfo(id=model_id, path=path, arch=runner.arch, vocab_size=runner.vocab_size,
                         n_ctx=options.max_context, n_ctx_train=config.trained_context,
                         warnings=(warning,) if warning else (), fingerprint=runner.fingerprint,
                         hybrid=runner.n_linear_layers > 0, n_slots=options.n_slots,
                         hidden_size=runner.hidden_size, n_keep=options.n_keep, pooling=options.pooling,
                         features=frozenset(features))
        cache_file = None
        if options.prefix_cache_file:
            cache_file = cache_file_of(options, model_id)
        return Engine(runner, tokenizer, info, prefix_cache=prefix_cache, prefix_cache_file=cache_file,
                      max_running=options.n_slots if options.continuous_batching else 1,
                      token_budget=options.token_budget, draft_max=options.spec_draft_max,
                      context_shift=options.context_shift, n_keep=options.n_keep)
    except BaseException:
        runner.close()
        raise


def cache_file_of(options: EngineOptions, model_id: str) -> Path:
    """The model's prefix cache file; a server of one model adopts the file it kept under its old name."""
    base = options.prefix_cache_file
    if options.one_of_several:
        return prefix_cache_file(base, model_id, options.replica)
    path = prefix_cache_file(base, None, options.replica)
    old = prefix_cache_file(base, model_id, options.replica)
    try:
        if adopt_prefix_cache_file(old, path):
            log.info("Prefix cache: renamed %s to %s (a server of one model keeps its cache in the file named)",
                     old, path)
    except OSError as exc:
        log.warning("Prefix cache: could not rename %s to %s: %s", old, path, exc)
    return path


M_MMAP_THRESHOLD = -3          # glibc's mallopt parameter: blocks of at least this many bytes get their own mapping
LARGE_BLOCK_BYTES = 128 * 1024  # glibc's initial threshold, kept fixed


def c_library_call(name: str) -> Callable[..., int] | None:
    """A function of the process's C library by name; None where the library has none of that name."""
    try:
        return getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None


def map_large_blocks() -> None:
    """Every block of LARGE_BLOCK_BYTES or more in a mapping of its own, returned to the system when freed. glibc
    otherwise raises that threshold each time a mapped block is freed, up to 32 MiB, after which the weights, the
    workspace and every growing scratch array come from the heap, whose holes stay resident: a prefill that grows
    the workspace from 128 to 256 rows kept both sizes (12 MiB of a 1.5B model's working memory), and an unloaded
    model's weights could stay resident."""
    mallopt = c_library_call("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES)


def release_free_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim): what a large build freed would
    otherwise stay resident beside what comes next."""
    trim = c_library_call("malloc_trim")
    if trim is not None:
        trim(0)


def tokenizer_of(tokenizer_object: dict) -> Tokenizer | None:
    """The tokenizer a .base file's `tokenizer` object describes; None for a model stored without one."""
    if tokenizer_object.get("tokenizer_type") == "none":
        return None
    return Tokenizer.from_object(tokenizer_object)


def model_id_for(path: Path) -> str:
    """A model's id: `org/name` for `<models dir>/<org>/<name>/<variant>/model.base` (`name` for a file converted
    on first use, kept under the `local` org), else the file's stem."""
    from basert.models_dir import LOCAL_ORG, MODEL_FILE_NAME, models_dir

    try:
        relative = path.resolve().relative_to(models_dir().resolve())
    except ValueError:
        relative = None
    if relative is not None and len(relative.parts) == 4 and relative.name == MODEL_FILE_NAME:
        org, name = relative.parts[:2]
        return name if org == LOCAL_ORG else f"{org}/{name}"
    return path.stem
