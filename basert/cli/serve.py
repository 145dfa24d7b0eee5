"""`basert serve` / `basert-serve`: load models, start one actor per model, serve HTTP with hypercorn on trio."""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import sys
from dataclasses import replace
from pathlib import Path

from basert._ext.kvtypes import KV_TYPES
from basert.cli.flags import add_exact_flag
from basert.engine.drafts import DEFAULT_DRAFT_MAX, MAX_DRAFT_MAX
from basert.server.logs import RepeatedWarningFilter

log = logging.getLogger("basert.serve")

DEFAULT_LANES = 4  # slots batched together when no flag says otherwise
KV_TYPE_NAMES = ", ".join(KV_TYPES)
AUTO_MEMORY_SHARE = 0.9  # --memory-budget auto: this share of the memory available at start


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of `basert serve`, in the order --help lists them (`basert cluster` takes them too)."""
    add_model_arguments(p)
    add_listen_arguments(p)
    add_context_arguments(p)
    add_slot_arguments(p)
    add_server_arguments(p)
    add_generation_arguments(p)
    add_operation_arguments(p)


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The models served, and how those loaded on demand come and go."""
    p.add_argument("model_arg", nargs="?", metavar="MODEL",
                   help="a .base file, an installed id (org/name[:variant]), a .gguf file or an HF directory "
                   "(converted into the models dir on first use); default: SmolLM2-135M-Instruct")
    p.add_argument("--model", "-m", action="append", default=[], metavar="PATH_OR_ID",
                   help="another model to serve (repeatable)")
    p.add_argument("--models-dir", type=Path, metavar="DIR",
                   help="the models directory (default $BASERT_MODELS_DIR, else ~/.cache/baseRT/models): every model "
                   "installed there (`basert list`) and every pullable one (`basert pull`) is served too, loaded "
                   "when a request names it (by id, `id:variant`, or short name such as smollm2)")
    p.add_argument("--max-loaded-models", type=int, default=3, metavar="N",
                   help="models loaded at once (default 3; 0: no limit); to load another, the least recently used "
                   "model that no request holds is unloaded first, and a request waits up to --queue-timeout for "
                   "one to become idle (then 503 with Retry-After)")
    p.add_argument("--memory-budget", type=memory_budget, default="auto", metavar="SIZE|auto",
                   help="memory the loaded models' weights and KV pools may take together, e.g. 8GiB (default auto: "
                   "90%% of the memory available at start); beyond it idle models are unloaded as above, and a model "
                   "larger than the budget is refused")
    p.add_argument("--keep-alive", type=keep_alive_flag, default="5m", metavar="DURATION",
                   help="how long a model loaded on demand stays loaded after its last request (default 5m; a "
                   "number of seconds or a duration such as 30s, 1h; negative: until unloaded); requests override "
                   "it with keep_alive. Models named on the command line stay loaded unless a request says otherwise")


def add_listen_arguments(p: argparse.ArgumentParser) -> None:
    """Where the server listens and who may call it."""
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="bind port (default 8080)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require Authorization: Bearer KEY or X-Api-Key: KEY (repeatable)")
    p.add_argument("--api-key-file", type=Path,
                   help="file with one API key per line (blank lines ignored; a file without a key is an error)")


def add_context_arguments(p: argparse.ArgumentParser) -> None:
    """The context of each slot, the KV pool that holds it, and the engine's arithmetic and threads."""
    p.add_argument("--max-context", type=int, default=None, metavar="N",
                   help="context window of each slot in tokens (default: -c's share, else the context the model "
                   "was trained on; beyond it is allowed with a warning, as the model never saw those positions; "
                   "models loaded on demand are cut to it), within --kv-memory")
    p.add_argument("--ctx-size", "-c", dest="context_total", type=int, default=None, metavar="N",
                   help="tokens of context over all slots, as llama.cpp's -c: the shared KV pool holds N tokens; "
                   "with -np/--slots each slot gets N / slots, without it any slot may use all N")
    p.add_argument("--kv-memory", type=memory_size, default=None, metavar="SIZE",
                   help="memory the KV pool may take, e.g. 4GiB or 512MiB (default: a quarter of the memory "
                   "available at start); a default pool that does not fit shrinks (the slots share it), a pool or "
                   "context asked for that does not fit is refused. Sliding-window layers (Gemma 3's local "
                   "layers) keep each slot's last window only, in a small pool of their own counted here too")
    p.add_argument("--max-tokens", type=int, default=2048, help="default max_tokens (default 2048)")
    p.add_argument("--threads", "-t", type=int, help="engine threads (default: one per physical core)")
    add_exact_flag(p)
    p.add_argument("--cache-type-k", "-ctk", default="f16", metavar="TYPE",
                   help=f"how K rows are stored in the KV cache: {KV_TYPE_NAMES} (default f16); q8_0 takes about "
                   "half the memory of f16, reads half the bytes at depth, and agrees with f16 on the top token")
    p.add_argument("--cache-type-v", "-ctv", default="f16", metavar="TYPE",
                   help=f"how V rows are stored in the KV cache: {KV_TYPE_NAMES} (default f16)")
    p.add_argument("--paged-kv", action="store_true",
                   help="one shared KV block pool, blocks allocated on demand (implied by continuous batching "
                   "and the prefix cache; without both, each slot reserves --max-context)")
    p.add_argument("--kv-cache-tokens", type=int, metavar="N",
                   help="size of the paged KV pool in tokens (default: -c, else slots x max-context within "
                   "--kv-memory); implies --paged-kv")


def add_slot_arguments(p: argparse.ArgumentParser) -> None:
    """The slots that run requests together, and the prefix cache they share."""
    p.add_argument("--continuous-batching", type=int, nargs="?", const=8, default=None, metavar="N",
                   help=f"N slots decoded together in one forward, with chunked prefill; implies --paged-kv "
                   f"(default on: {DEFAULT_LANES} slots, or -np N; the flag alone means 8)")
    p.add_argument("--no-continuous-batching", dest="continuous_batching", action="store_const", const=0,
                   help="one request at a time, the others queue (with --slots N, N slots keep their histories)")
    p.add_argument("--slots", "--parallel", "-np", type=int, default=None, metavar="N",
                   help="number of slots, each keeping its own history for reuse and snapshots (default "
                   f"{DEFAULT_LANES}, 1 with --no-continuous-batching; -np/--parallel as in llama.cpp)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="share the KV (and hybrid recurrent snapshots) of common prompt prefixes between "
                   "requests; implies --paged-kv (default on)")
    p.add_argument("--prefix-cache-file", type=Path, metavar="PATH",
                   help="persist the prefix cache in the file PATH (serving several models, each in "
                   "PATH.<model id, '/' -> '--'>): loaded at start, saved at shutdown; implies --prefix-cache "
                   "(serving one model, a PATH.<model id> file that earlier versions wrote is renamed to PATH once)")
    p.add_argument("--prefix-cache-save-interval", type=float, default=0.0, metavar="SEC",
                   help="also save the prefix cache file every SEC seconds (default 0: only at shutdown)")


def add_server_arguments(p: argparse.ArgumentParser) -> None:
    """The HTTP server: limits, logs, files, endpoints, queues, draining and browsers."""
    p.add_argument("--request-timeout", type=int, default=0, metavar="MS",
                   help="stop a generation MS milliseconds after it arrived, in the middle of its prompt's prefill "
                   "too (finish_reason length, with the tokens so far; one still waiting for a slot gets 503 "
                   "queue_timeout); 0 = never")
    p.add_argument("--log-file", type=Path, help="access log and diagnostics (default: stderr)")
    p.add_argument("--chat-template", type=Path, metavar="FILE", help="override the model's chat template")
    p.add_argument("--files-dir", type=Path, help="enable /v1/files and BaseRT-style slot snapshots")
    p.add_argument("--files-max-bytes", type=int, help="reject uploads beyond this total size")
    p.add_argument("--slot-save-path", type=Path, help="enable llama.cpp-style slot save/restore by filename")
    p.add_argument("--alias", "-a", metavar="NAME",
                   help="the id the model is reported by (/v1/models, the responses' model, /props); with one "
                   "model loaded a request may name any model anyway")
    p.add_argument("--no-slots", dest="slots_endpoint", action="store_false",
                   help="turn GET /slots off (it answers 501); slot save, restore and erase stay available")
    p.add_argument("--no-webui", dest="webui", action="store_false",
                   help="turn the web pages off: the chat page at / and the dashboard at /dashboard (404)")
    p.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="Prometheus metrics at GET /metrics (default on; with --no-metrics it answers 501)")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024,
                   help="largest request body accepted (default 32 MiB; larger is 413)")
    p.add_argument("--max-queued", type=int, default=64, metavar="N",
                   help="requests that may wait for a slot, per model (default 64); beyond it a request gets "
                   "503 server_busy with Retry-After")
    p.add_argument("--queue-timeout", type=float, default=600.0, metavar="SEC",
                   help="a request still waiting for a slot after SEC seconds gets 503 queue_timeout (default 600)")
    p.add_argument("--rate-limit", type=int, default=0, metavar="N",
                   help="requests per minute per API key (per client address without keys); beyond it 429 with "
                   "Retry-After (default 0: no limit)")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="SEC",
                   help="on SIGTERM/SIGINT, new requests get 503 while running ones get up to SEC seconds to "
                   "finish (default 30); those still running then end with a 503 (a stream with its error event), "
                   "the caches are saved and the server exits 0")
    p.add_argument("--cors-allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="let web pages of ORIGIN (scheme://host[:port]) call the server from a browser (repeatable; "
                   "'*' any origin, 'localhost' pages served from this machine); a request from another page's "
                   "Origin is refused with 403")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="without --api-key, also answer requests whose Host header is NAME (repeatable; '*' any); "
                   "IP addresses, localhost and --host are always answered, other names get 403 (a page could "
                   "rebind its own name to this server's address)")


def add_generation_arguments(p: argparse.ArgumentParser) -> None:
    """How requests are answered: pooled embeddings, speculative decoding, a full context."""
    p.add_argument("--pooling", choices=("mean", "last", "cls"), default="mean",
                   help="how /v1/embeddings pools the last hidden states of an input: mean, last token, or cls "
                   "(first token); the vector is L2-normalised (default mean)")
    p.add_argument("--spec-draft-max", type=int, default=DEFAULT_DRAFT_MAX, metavar="K",
                   help="speculative decoding: a decoding request may feed up to K drafted tokens after its next "
                   "token in the same forward, drafted from what followed its last few tokens earlier in its "
                   "prompt and output (and in other requests' outputs); the sampler's own picks decide, so the "
                   "output is exactly the same as without, only faster where text repeats. Each request adapts "
                   f"its K to how its drafts fare (default {DEFAULT_DRAFT_MAX}, at most {MAX_DRAFT_MAX})")
    p.add_argument("--no-spec", dest="spec_draft_max", action="store_const", const=0,
                   help="no speculative decoding (same as --spec-draft-max 0); a request can also turn it off "
                   "with \"speculative\": false")
    p.add_argument("--context-shift", action="store_true",
                   help="when a slot's context is full, keep the first --keep tokens of its history, drop the oldest "
                   "half of the rest and go on generating (the response says \"truncated\"); a prompt longer than "
                   "the context is cut the same way. Without it a prompt beyond the context is refused (400) and "
                   "generation stops there (finish reason length)")
    p.add_argument("--keep", dest="n_keep", type=int, default=0, metavar="N",
                   help="with --context-shift: the prompt tokens a shift keeps, -1 all of them (default 0; a request "
                   "sets its own with n_keep)")


def add_operation_arguments(p: argparse.ArgumentParser) -> None:
    """Running as a cluster replica, and the checks at load."""
    p.add_argument("--replica", type=int, metavar="K",
                   help="serve as replica K of a cluster (`basert cluster` sets it): the prefix cache file becomes "
                   "PATH.<K> (PATH.<model id>.<K> with several models), so a restarted replica warms from its own "
                   "cache")
    p.add_argument("--exit-with-parent", action="store_true",
                   help="drain and stop, as on SIGTERM, when the process that started this one exits (a cluster "
                   "replica's server must not outlive its replica)")
    p.add_argument("--no-verify-checksums", dest="verify_checksums", action="store_false",
                   help="skip the check of every tensor's checksum at load (faster start, no protection "
                   "against a damaged file)")


def check_arguments(args: argparse.Namespace) -> str | None:
    """The first problem with the KV flags, as a message for the user."""
    if args.continuous_batching is not None and args.continuous_batching < 0:
        return "--continuous-batching N needs N >= 1"
    if args.slots is not None and args.slots < 1:
        return "--slots N needs N >= 1"
    if args.slots is not None and args.continuous_batching and args.slots != args.continuous_batching:
        return "--slots and --continuous-batching N disagree: continuous batching runs one request per slot"
    if args.prefix_cache is False and args.prefix_cache_file is not None:
        return "--no-prefix-cache and --prefix-cache-file disagree: the file persists the prefix cache"
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 16:
        return "--kv-cache-tokens must be at least 16 (one block)"
    if args.prefix_cache_save_interval < 0:
        return "--prefix-cache-save-interval must be >= 0"
    if args.max_queued < 0:
        return "--max-queued must be >= 0"
    if args.queue_timeout <= 0:
        return "--queue-timeout must be > 0"
    if args.rate_limit < 0:
        return "--rate-limit must be >= 0"
    if args.drain_timeout < 0:
        return "--drain-timeout must be >= 0"
    if not 0 <= args.spec_draft_max <= MAX_DRAFT_MAX:
        return f"--spec-draft-max must be in [0, {MAX_DRAFT_MAX}]"
    if args.max_loaded_models < 0:
        return "--max-loaded-models N needs N >= 0 (0: no limit)"
    if args.n_keep < -1:
        return "--keep N needs N >= -1 (-1: the whole prompt)"
    if args.alias and len(model_specs(args)) > 1:
        return "--alias names the one served model: it cannot be used with several models"
    return None


SIZE_UNITS = {"": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
              "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def memory_size(text: str) -> int:
    """Bytes of a size such as 4GiB, 512MiB, 1.5G or 1000000 (argparse type)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = SIZE_UNITS.get(match.group(2).lower()) if match else None
    if unit is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 4GiB, 512MiB, 1.5G or a number of bytes)")
    size = int(float(match.group(1)) * unit)
    if size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size")
    return size


def memory_budget(text: str) -> int | str:
    """--memory-budget: "auto" or a size (argparse type)."""
    return "auto" if text.strip().lower() == "auto" else memory_size(text)


def keep_alive_flag(text: str) -> float:
    """--keep-alive: seconds (argparse type)."""
    from basert.server.catalog import parse_keep_alive

    try:
        return parse_keep_alive(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class StartupError(Exception):
    """A problem that stops the server before it serves: reported as one line, exit code 1."""


def read_api_keys(args: argparse.Namespace) -> list[str]:
    """The keys of --api-key and --api-key-file; a key file that yields no key is refused, never ignored."""
    keys = [key.strip() for key in args.api_key]
    if any(not key for key in keys):
        raise StartupError("--api-key must not be empty")
    if args.api_key_file:
        try:
            lines = args.api_key_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise StartupError(f"cannot read --api-key-file {args.api_key_file}: {exc}") from None
        from_file = [line.strip() for line in lines if line.strip()]
        if not from_file:
            raise StartupError(f"--api-key-file {args.api_key_file} has no key (one key per line); refusing to "
                               "start without authentication")
        keys += from_file
    return keys


def model_specs(args: argparse.Namespace) -> list[str]:
    """The models to serve as the command line names them: MODEL, then each --model."""
    return ([args.model_arg] if args.model_arg else []) + list(args.model)


def engine_options(args: argparse.Namespace):
    """The engine's part of the flags."""
    from basert.engine.build import EngineOptions

    lanes = args.continuous_batching
    if lanes is None:  # batched by default, as many lanes as -np asks for
        lanes = args.slots or DEFAULT_LANES
    max_context = args.max_context
    if max_context is None and args.context_total and args.slots is None:
        # As llama-server without -np: one unified pool of -c tokens that any slot may fill.
        max_context = args.context_total
    return EngineOptions(
        max_context=max_context,
        n_slots=lanes or args.slots or 1,
        continuous_batching=bool(lanes),
        paged_kv=args.paged_kv,
        kv_cache_tokens=args.kv_cache_tokens,
        context_total=args.context_total,
        kv_memory=args.kv_memory,
        cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v,
        threads=args.threads,
        prefix_cache=args.prefix_cache is not False,
        prefix_cache_file=args.prefix_cache_file,
        one_of_several=len(model_specs(args)) > 1,
        replica=args.replica,
        verify_checksums=args.verify_checksums,
        pooling=args.pooling,
        spec_draft_max=args.spec_draft_max,
        context_shift=args.context_shift,
        n_keep=args.n_keep,
    ).resolved()


def load_model(path: Path, args: argparse.Namespace, *, on_demand: bool = False):
    """Build the model's engine, its actor, and what the server needs to render its chats (`on_demand`: a model
    of the models directory, loaded when a request names it)."""
    from basert.actor.actor import ModelActor
    from basert.chat.template import model_chat_template
    from basert.chat.tool_calls import detect_dialect
    from basert.engine.build import build_engine
    from basert.server.catalog import ServedModel

    options = model_options(args, on_demand)
    engine = build_engine(path, options)
    tokenizer = engine.tokenizer
    template = model_chat_template(tokenizer, None if on_demand else args.chat_template)
    actor = ModelActor(engine, cache_save_interval=args.prefix_cache_save_interval,
                       max_queued=args.max_queued, queue_timeout=args.queue_timeout)
    info = engine.info
    stats = engine.stats()
    window = (f" + {stats['kv_window_blocks_total']} blocks for the sliding-window layers' windows"
              if stats["kv_window_blocks_total"] else "")
    log.info("%s: %d slot(s), KV %s: %d blocks of 16 tokens%s (%.1f MiB)%s%s", info.id, info.n_slots,
             "paged" if info.has("paged_kv") else "reserved per slot", stats["kv_blocks_total"], window,
             stats["kv_bytes"] / 2**20,
             ", continuous batching" if info.has("continuous_batching") else "",
             ", prefix cache" if info.has("prefix_cache") else "")
    actor.load_prefix_cache()
    return ServedModel(info=info, actor=actor, tokenizer=tokenizer, template=template,
                       dialect=detect_dialect(template.source if template else None), grammars=None)


def model_options(args: argparse.Namespace, on_demand: bool):
    """The engine options of a model named on the command line, or of one loaded on demand (which keeps its own
    prefix cache file, PATH.<model id>, and whose context per slot is at most the one it was trained on)."""
    options = engine_options(args)
    return replace(options, one_of_several=True, fit_trained=True) if on_demand else options


def servable_entries(args: argparse.Namespace) -> list:
    """A catalog entry for each model of the models directory and each pullable model whose packages are here."""
    from basert.convert.default_model import PULLABLE
    from basert.engine.build import model_id_for, planned_memory
    from basert.models_dir import ModelPackageError, installed_models
    from basert.server.catalog import ModelEntry

    def estimate(entry: ModelEntry):
        return lambda: planned_memory(entry.path, model_options(args, True)) if entry.path else 0

    entries: dict[str, ModelEntry] = {}
    for model in installed_models():
        name = model_id_for(model.path)
        key = name if name not in entries else f"{name}:{model.variant}"
        entries[key] = ModelEntry(name=key, aliases={key, f"{name}:{model.variant}"}, path=model.path,
                                  spec=str(model.path))
    for pullable in PULLABLE.values():
        try:
            pullable.gguf.part_paths()
            available = True
        except ModelPackageError:
            available = False
        installed = next((e for e in entries.values() if e.path == pullable.path()), None)
        if installed is not None:
            installed.aliases |= {pullable.alias, pullable.model_id}
            installed.spec = pullable.alias
        elif available:
            entries[pullable.model_id] = ModelEntry(
                name=pullable.model_id, path=None, spec=pullable.alias,
                aliases={pullable.alias, pullable.model_id, f"{pullable.model_id}:{pullable.variant}"})
    for entry in entries.values():
        entry.estimate = estimate(entry)
    return list(entries.values())


def model_loader(args: argparse.Namespace):
    """The catalog's loader: a model of the models directory (a pullable one installed first), built and wrapped."""
    from basert.convert.default_model import locate_model
    from basert.engine.build import ModelOptionsError
    from basert.format.errors import ModelValidationError
    from basert.models_dir import ModelPackageError
    from basert.server.catalog import ModelLoadError

    def load(entry):
        try:
            if entry.path is None or not entry.path.is_file():
                entry.path, _ = locate_model(entry.spec or entry.name)
            return load_model(entry.path, args, on_demand=True)
        except (ModelValidationError, ModelOptionsError, ModelPackageError, OSError) as exc:
            raise ModelLoadError(str(exc)) from None

    return load


def configure_logging(log_file: Path | None) -> None:
    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.addFilter(RepeatedWarningFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("hypercorn.access").disabled = True


def check_port_free(host: str, port: int) -> None:
    """Refuse a port that is already in use before the (slow) model load, not after it. For a server that binds
    the port itself later (Ray Serve's proxy); `basert serve` holds its socket from the start (`listen_now`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def listen_now(config, host: str, port: int) -> None:
    """Bind and listen on the server's address before any model is converted or loaded, and hand the sockets to
    hypercorn through `config`: a port in use is refused at once, and no other process can take it while the
    models load (two servers started together would both pass a mere check). Connections that arrive meanwhile
    wait in the backlog and are answered once the server runs."""
    try:
        sockets = config.create_sockets()
    except OSError as exc:
        raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    for sock in sockets.insecure_sockets:
        sock.listen(config.backlog)
    config.bind = [f"fd://{sock.detach()}" for sock in sockets.insecure_sockets]


def cmd_serve(args: argparse.Namespace) -> int:
    configure_logging(args.log_file)
    problem = check_arguments(args)
    if problem is None:
        try:
            engine_options(args).check()
        except ValueError as exc:
            problem = str(exc)
    if problem:
        log.error("%s", problem)
        return 2
    try:
        return serve(args)
    except StartupError as exc:
        log.error("%s", exc)
        return 1


def serve(args: argparse.Namespace) -> int:
    """Start as plan -> build -> listen: check the keys and hold the port, load the models into a catalog and wrap
    it in the HTTP app, then serve until a signal drains the server; the caches are saved last."""
    parent = os.getppid()   # before the (slow) load: a parent that dies meanwhile is noticed too
    keys = read_api_keys(args)
    config = bound_config(args, keys)
    budget = args.memory_budget
    if budget == "auto":
        from basert.engine.build import available_memory

        budget = int(available_memory() * AUTO_MEMORY_SHARE)
    catalog = build_catalog(args, budget)
    app = build_app(args, catalog, keys)
    run_server(args, app, catalog, config, parent)
    catalog.close()  # the actors have stopped: nothing races the prefix cache saves
    log.info("stopped")
    return 0


def bound_config(args: argparse.Namespace, keys: list[str]):
    """Hypercorn's config, its socket already listening; the directories the flags name, prepared."""
    from hypercorn.config import Config

    from basert.format.atomic import remove_stale_temp_files
    from basert.server.app import is_loopback

    config = Config()
    config.bind = [f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # our handlers, printed once
    config.graceful_timeout = 1.0
    listen_now(config, args.host, args.port)
    if not keys and not is_loopback(args.host):
        log.warning("listening on %s without --api-key: any client that reaches this address can generate; "
                    "slot and file endpoints stay loopback-only", args.host)
    if args.slot_save_path:
        args.slot_save_path.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(args.slot_save_path)
    if args.models_dir is not None:
        os.environ["BASERT_MODELS_DIR"] = str(args.models_dir.expanduser())
    return config


def build_catalog(args: argparse.Namespace, budget: int):
    """The catalog: the models the command line names, loaded now, and every other servable one, on demand."""
    from basert.cli.generate import model_path_for
    from basert.engine.build import ModelOptionsError
    from basert.format.errors import ModelValidationError
    from basert.server.catalog import LoadPolicy, ModelCatalog

    catalog = ModelCatalog(model_loader(args), LoadPolicy(max_loaded=args.max_loaded_models, memory_budget=budget,
                                                         keep_alive=args.keep_alive,
                                                         queue_timeout=args.queue_timeout))
    for spec in model_specs(args) or [None]:
        path = model_path_for(spec)
        try:
            model = load_model(path, args)
        except (ModelValidationError, ModelOptionsError) as exc:
            raise StartupError(str(exc)) from None
        catalog.add(model, alias=args.alias)
        log.info("loaded %s from %s (%s, n_ctx %d)", model.info.id, path, model.info.arch, model.info.n_ctx)
    for entry in servable_entries(args):
        catalog.add_entry(entry)
    log.info("serving %d model(s): %s loaded, the others on demand (at most %s loaded, memory budget %s)",
             len(catalog.entries), ", ".join(m.info.id for m in catalog.models), args.max_loaded_models or "any",
             f"{budget / 2**30:.1f} GiB" if budget else "none")
    return catalog


def build_app(args: argparse.Namespace, catalog, keys: list[str]):
    """The quart-trio app over the catalog, with the flags' settings."""
    from basert.server.app import ServerSettings, create_app
    from basert.server.files import FilesStore
    from basert.server.generation import ServerLimits

    settings = ServerSettings(
        api_keys=keys,
        limits=ServerLimits(default_max_tokens=args.max_tokens, request_timeout_ms=args.request_timeout),
        files=FilesStore(args.files_dir, args.files_max_bytes) if args.files_dir else None,
        slot_save_path=args.slot_save_path,
        max_body_bytes=args.max_body_bytes,
        cors_origins=list(args.cors_allow_origin),
        allowed_hosts=[args.host, *args.allowed_host],
        rate_limit=args.rate_limit,
        slots_endpoint=args.slots_endpoint,
        metrics_endpoint=args.metrics,
        webui=args.webui,
    )
    return create_app(catalog, settings)


def run_server(args: argparse.Namespace, app, catalog, config, parent: int) -> None:
    """Serve HTTP and run the catalog's actors on trio until a signal (or the parent's exit) has drained them."""
    import trio
    from hypercorn.trio import serve as hypercorn_serve

    from basert.server.asgi import RequestGuard, use_envelope_protocol_errors
    from basert.server.lifetime import ServerLifetime

    guarded = RequestGuard(app)
    use_envelope_protocol_errors()
    # Until trio's receiver takes over (and again after it hands back, while the caches are saved) a signal is
    # only noted: the process must not die between loading and serving, nor in the middle of the final save.
    early_signals: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda received, _frame: early_signals.append(received))

    async def main() -> None:
        lifetime = ServerLifetime(app, guarded, catalog, args.drain_timeout)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lifetime.handle_signals, nursery, early_signals)
            if args.exit_with_parent:
                nursery.start_soon(lifetime.watch_parent, nursery, parent)
            await nursery.start(catalog.run)
            log.info("listening on http://%s:%d", args.host, args.port)
            await hypercorn_serve(guarded, config, shutdown_trigger=lifetime.shutdown.wait)
            nursery.cancel_scope.cancel()

    trio.run(main)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API",
                       usage="basert serve [MODEL] [--model PATH_OR_ID ...] [options]",
                       description="Serve models over HTTP: OpenAI's API (/v1/chat/completions, /v1/completions, "
                       "/v1/responses, /v1/embeddings, /v1/models, /v1/files), Anthropic's /v1/messages, llama.cpp's "
                       "(/completion, /props, /slots) and Ollama's (/api/chat, /api/generate, /api/tags, ...), a chat "
                       "page at / and a dashboard at /dashboard, /health and /metrics. The models named here are "
                       "loaded at start; every other model of the models directory, and every pullable one, is "
                       "loaded when a request names it (--max-loaded-models, --memory-budget, --keep-alive). "
                       "SIGINT/SIGTERM drain: new requests get 503, running ones finish (up to --drain-timeout), the "
                       "prefix caches are saved, exit code 0.")
    add_arguments(p)
    p.set_defaults(func=cmd_serve)
