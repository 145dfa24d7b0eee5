"""`basert serve` / `basert-serve`: load models, start one actor per model, serve HTTP with hypercorn on trio."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

log = logging.getLogger("basert.serve")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_arg", nargs="?", metavar="MODEL",
                   help="a .base file, an installed id (org/name[:variant]), a .gguf file or an HF directory "
                   "(converted into the models dir on first use); default: SmolLM2-135M-Instruct")
    p.add_argument("--model", "-m", action="append", default=[], metavar="PATH_OR_ID",
                   help="another model to serve (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="bind port (default 8080)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="require Authorization: Bearer KEY or X-Api-Key: KEY (repeatable)")
    p.add_argument("--api-key-file", type=Path, help="file with one API key per line")
    p.add_argument("--max-context", type=int, default=4096, help="context window per slot (default 4096)")
    p.add_argument("--max-tokens", type=int, default=2048, help="default max_tokens (default 2048)")
    p.add_argument("--threads", "-t", type=int, help="engine threads (default: all cores)")
    p.add_argument("--kv-bits", type=int, choices=(16, 32), default=16, help="KV element width (default 16)")
    p.add_argument("--paged-kv", action="store_true",
                   help="one shared KV block pool, blocks allocated on demand (default: each slot reserves "
                   "--max-context)")
    p.add_argument("--kv-cache-tokens", type=int, metavar="N",
                   help="size of the paged KV pool in tokens (default: slots x max-context); implies --paged-kv")
    p.add_argument("--continuous-batching", type=int, nargs="?", const=8, default=0, metavar="N",
                   help="N slots (default 8) decoded together in one forward, with chunked prefill; implies "
                   "--paged-kv. Without it one request runs at a time and the others queue")
    p.add_argument("--slots", "--parallel", "-np", type=int, default=None, metavar="N",
                   help="number of slots (each keeps its own history for reuse and snapshots; default 1, or N "
                   "of --continuous-batching)")
    p.add_argument("--prefix-cache", action="store_true",
                   help="share the KV (and hybrid recurrent snapshots) of common prompt prefixes between "
                   "requests; implies --paged-kv")
    p.add_argument("--prefix-cache-file", type=Path, metavar="PATH",
                   help="persist the prefix cache per model to PATH.<model id, '/' -> '--'>: loaded at start, "
                   "saved at shutdown; implies --prefix-cache")
    p.add_argument("--prefix-cache-save-interval", type=float, default=0.0, metavar="SEC",
                   help="also save the prefix cache file every SEC seconds (default 0: only at shutdown)")
    p.add_argument("--request-timeout", type=int, default=0, metavar="MS",
                   help="stop a generation after MS milliseconds (finish_reason length); 0 = never")
    p.add_argument("--log-file", type=Path, help="access log and diagnostics (default: stderr)")
    p.add_argument("--chat-template", type=Path, metavar="FILE", help="override the model's chat template")
    p.add_argument("--files-dir", type=Path, help="enable /v1/files and BaseRT-style slot snapshots")
    p.add_argument("--files-max-bytes", type=int, help="reject uploads beyond this total size")
    p.add_argument("--slot-save-path", type=Path, help="enable llama.cpp-style slot save/restore by filename")
    p.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024,
                   help="largest request body accepted (default 32 MiB; larger is 413)")


def resolve_served_path(spec: str | None) -> Path:
    """A .base path for a model spec, converting GGUF files and HF directories on first use."""
    from basert.cli.generate import model_path_for
    from basert.cli.progress import ProgressBar
    from basert.convert import convert
    from basert.models_dir import model_path

    if spec is not None:
        candidate = Path(spec).expanduser()
        if candidate.suffix.lower() == ".gguf" or (candidate.is_dir() and (candidate / "config.json").is_file()):
            out = model_path(f"local/{candidate.stem if candidate.is_file() else candidate.name}", "default")
            if not out.is_file():
                convert(candidate, out, progress=ProgressBar(f"converting {candidate.name}"))
            return out
    return model_path_for(spec)


def apply_implied_flags(args: argparse.Namespace) -> None:
    """--prefix-cache-file implies --prefix-cache; it, --continuous-batching and --kv-cache-tokens imply --paged-kv."""
    if args.prefix_cache_file is not None:
        args.prefix_cache = True
    if args.prefix_cache or args.continuous_batching or args.kv_cache_tokens:
        args.paged_kv = True


def check_arguments(args: argparse.Namespace) -> str | None:
    """The first problem with the KV flags, as a message for the user."""
    if args.continuous_batching < 0:
        return "--continuous-batching N needs N >= 1"
    if args.slots is not None and args.slots < 1:
        return "--slots N needs N >= 1"
    if args.slots is not None and args.continuous_batching and args.slots != args.continuous_batching:
        return "--slots and --continuous-batching N disagree: continuous batching runs one request per slot"
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 16:
        return "--kv-cache-tokens must be at least 16 (one block)"
    if args.prefix_cache_save_interval < 0:
        return "--prefix-cache-save-interval must be >= 0"
    return None


def load_model(path: Path, args: argparse.Namespace):
    import numpy as np

    from basert.actor.actor import ModelActor
    from basert.chat.template import ChatTemplate
    from basert.chat.tool_calls import detect_dialect
    from basert.engine.engine import Engine
    from basert.engine.kv import blocks_for
    from basert.engine.prefix_cache import PrefixCache
    from basert.engine.prefix_store import prefix_cache_file
    from basert.engine.runner import ModelRunner
    from basert.server.catalog import ServedModel, model_id_for
    from basert.tokenizer import Tokenizer

    n_lanes = args.continuous_batching or args.slots or 1
    kv_blocks = blocks_for(args.kv_cache_tokens) if args.paged_kv and args.kv_cache_tokens else None
    runner = ModelRunner(path, max_context=args.max_context, threads=args.threads, max_sequences=n_lanes,
                         kv_blocks=kv_blocks, kv_dtype=np.float16 if args.kv_bits == 16 else np.float32)
    tokenizer_object = runner.base.tokenizer
    tokenizer = None if tokenizer_object.get("tokenizer_type") == "none" else Tokenizer.from_object(tokenizer_object)
    source = args.chat_template.read_text() if args.chat_template else (tokenizer.chat_template if tokenizer else None)
    template = None
    if source:
        template = ChatTemplate(source, bos_token=tokenizer.bos_token or "" if tokenizer else "",
                                eos_token=tokenizer.eos_token or "" if tokenizer else "")
    model_id = model_id_for(path, (runner.base.header.get("metadata") or {}).get("general.name"))
    prefix_cache = None
    if args.prefix_cache:
        state = runner.new_sequence().recurrent
        state_bytes = state.conv.nbytes + state.ssm.nbytes if state is not None else 0
        prefix_cache = PrefixCache(runner.pool, runner.fingerprint, recurrent=state is not None,
                                   snapshot_cost_blocks=-(-state_bytes // max(1, runner.kv.block_nbytes)))
    cache_file = prefix_cache_file(args.prefix_cache_file, model_id) if args.prefix_cache_file else None
    actor = ModelActor(model_id, Engine(runner, tokenizer, n_lanes=n_lanes, prefix_cache=prefix_cache),
                       max_running=n_lanes if args.continuous_batching else 1,
                       cache_file=cache_file, cache_save_interval=args.prefix_cache_save_interval)
    log.info("%s: %d slot(s), KV %s: %d blocks of 16 tokens (%.1f MiB)%s%s", model_id, n_lanes,
             "paged" if args.paged_kv else "reserved per slot", runner.pool.n_blocks, runner.kv.nbytes / 2**20,
             ", continuous batching" if args.continuous_batching else "",
             ", prefix cache" if prefix_cache is not None else "")
    actor.load_prefix_cache()
    return ServedModel(model_id=model_id, path=path, actor=actor, tokenizer=tokenizer, template=template,
                       dialect=detect_dialect(source), grammars=None, n_ctx=args.max_context)


def configure_logging(log_file: Path | None) -> None:
    handler = logging.FileHandler(log_file) if log_file else logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    logging.getLogger("hypercorn.access").disabled = True


def cmd_serve(args: argparse.Namespace) -> int:
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from basert.server.app import ServerSettings, create_app
    from basert.server.catalog import ModelCatalog
    from basert.server.files import FilesStore
    from basert.server.generation import ServerLimits

    configure_logging(args.log_file)
    apply_implied_flags(args)
    problem = check_arguments(args)
    if problem:
        log.error("%s", problem)
        return 2
    keys = list(args.api_key)
    if args.api_key_file:
        keys += [line.strip() for line in args.api_key_file.read_text().splitlines() if line.strip()]
    if args.slot_save_path:
        args.slot_save_path.mkdir(parents=True, exist_ok=True)
    specs = ([args.model_arg] if args.model_arg else []) + list(args.model)
    catalog = ModelCatalog()
    for spec in specs or [None]:
        path = resolve_served_path(spec)
        model = load_model(path, args)
        catalog.add(model)
        log.info("loaded %s from %s (%s, n_ctx %d)", model.model_id, path, model.actor.engine.runner.arch,
                 model.n_ctx)
    settings = ServerSettings(
        api_keys=keys,
        limits=ServerLimits(default_max_tokens=args.max_tokens, request_timeout_ms=args.request_timeout),
        files=FilesStore(args.files_dir, args.files_max_bytes) if args.files_dir else None,
        slot_save_path=args.slot_save_path,
        max_body_bytes=args.max_body_bytes,
    )
    app = create_app(catalog, settings)
    config = Config()
    config.bind = [f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"]
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")  # our handlers, printed once
    config.graceful_timeout = 1.0

    async def main() -> None:
        shutdown = trio.Event()

        async def watch_signals() -> None:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info("received %s: shutting down", signal.Signals(signum).name)
                    shutdown.set()
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_signals)
            for model in catalog.models:
                nursery.start_soon(model.actor.run)
            log.info("listening on http://%s:%d", args.host, args.port)
            await serve(app, config, shutdown_trigger=shutdown.wait)
            nursery.cancel_scope.cancel()

    trio.run(main)
    for model in catalog.models:
        model.actor.save_prefix_cache()  # the actor has stopped: nothing races the save
        model.actor.engine.runner.close()
    log.info("stopped")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API",
                       description="Serve one or more models over an OpenAI-compatible HTTP API "
                       "(/v1/chat/completions, /v1/completions, /v1/models, /v1/tokenize, /v1/detokenize, "
                       "/v1/files, /slots, /health, /metrics). SIGINT/SIGTERM shut down cleanly.")
    add_arguments(p)
    p.set_defaults(func=cmd_serve)
