#!/usr/bin/env python3
"""A `llama-server` command line for `basert serve`: translates llama.cpp's server flags and runs BaseRT in its place,
so that scripts and test suites written for llama.cpp's server start BaseRT unchanged.

    python tools/llama_server_shim.py -m model.gguf -c 4096 -np 2 --port 8080 --alias my-model
    LLAMA_SERVER_BIN_PATH=tools/llama_server_shim.py pytest ...   # llama.cpp's server tests

Flags without a BaseRT counterpart (server-wide sampling defaults, GPU and batch sizes, downloads) are ignored,
each with a note on stderr. Without -m/--model it serves $BASERT_SHIM_MODEL, else BaseRT's default model.
Browser origins follow llama-server's defaults: any origin, or only pages served from this machine when its
server tools are on (--tools), unless --cors-origins lists them.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

# llama.cpp flag -> basert serve flag, for flags whose value passes through unchanged.
SAME_VALUE = {
    "--host": "--host", "--port": "--port", "-t": "--threads", "--threads": "--threads",
    "-a": "--alias", "--alias": "--alias", "--api-key": "--api-key", "--api-key-file": "--api-key-file",
    "--slot-save-path": "--slot-save-path", "--log-file": "--log-file",
    "--chat-template-file": "--chat-template",
    "-ctk": "--cache-type-k", "--cache-type-k": "--cache-type-k",
    "-ctv": "--cache-type-v", "--cache-type-v": "--cache-type-v",
}
# llama.cpp switches (no value) and BaseRT's.
SAME_SWITCH = {"--no-slots": "--no-slots", "--metrics": "--metrics", "-nocb": "--no-continuous-batching",
               "--no-cont-batching": "--no-continuous-batching", "--context-shift": "--context-shift",
               "--no-webui": "--no-webui"}
# llama.cpp switches that take no value and need nothing here (BaseRT's default already behaves so).
NO_VALUE = {
    "--slots", "--jinja", "-cb", "--cont-batching", "-fa", "--flash-attn",
    "--embedding", "--embeddings", "--reranking", "--rerank", "--verbose", "-v", "--log-verbose",
    "--no-context-shift", "--no-mmap", "--mlock", "--no-warmup", "--props", "--no-perf",
    "--log-disable", "--log-colors", "--log-prefix", "--log-timestamps", "--no-mmproj", "--no-prefill-assistant",
    "--ignore-eos", "-sp", "--special", "--check-tensors", "--no-kv-offload", "-nkvo",
}
MODEL_FLAGS = {"-m", "--model"}
CONTEXT_FLAGS = {"-c", "--ctx-size"}
PARALLEL_FLAGS = {"-np", "--parallel"}
PREDICT_FLAGS = {"-n", "--predict", "--n-predict"}
CORS_FLAGS = {"--cors-origins"}   # a comma-separated list; 'localhost' means pages served from this machine
TOOLS_FLAGS = {"--tools"}         # llama-server's own tools: BaseRT has none, but they narrow the default origins


@dataclass(slots=True)
class Translation:
    """What the llama.cpp command line asked for, as BaseRT understands it."""

    model: str | None = None
    context: int = 0            # llama.cpp's total context (0: the model's default)
    parallel: int = 1
    cors_origins: list[str] = field(default_factory=list)   # empty: llama-server's default
    server_tools: bool = False
    flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def serve_arguments(self) -> list[str]:
        """The `basert serve` arguments (-c means what it means to llama-server: the context over all slots)."""
        arguments = [self.model] if self.model else []
        if self.context > 0:
            arguments += ["-c", str(max(self.context, 2 * self.parallel))]
        if self.parallel > 1:
            arguments += ["--slots", str(self.parallel)]
        for origin in self.cors_origins or ["localhost" if self.server_tools else "*"]:
            arguments += ["--cors-allow-origin", origin]
        return arguments + self.flags


def takes_value(arguments: list[str], at: int) -> bool:
    """Whether the argument after a flag unknown here is its value: anything but another flag (numbers included)."""
    if at + 1 >= len(arguments):
        return False
    following = arguments[at + 1]
    return not following.startswith("-") or following.lstrip("-").replace(".", "", 1).isdigit()


def split_assignments(arguments: list[str]) -> list[str]:
    """The arguments with each `--flag=value` as two."""
    split: list[str] = []
    for argument in arguments:
        split += argument.split("=", 1) if argument.startswith("--") and "=" in argument else [argument]
    return split


def translate(arguments: list[str]) -> Translation:
    """Read a llama-server command line."""
    result = Translation(model=os.environ.get("BASERT_SHIM_MODEL"))
    arguments = split_assignments(arguments)
    at = 0
    while at < len(arguments):
        flag, value = arguments[at], arguments[at + 1] if at + 1 < len(arguments) else None
        step = 2
        if flag in MODEL_FLAGS:
            result.model = value
        elif flag in CONTEXT_FLAGS:
            result.context = int(value)
        elif flag in PARALLEL_FLAGS:
            result.parallel = max(int(value), 1)
        elif flag in PREDICT_FLAGS:
            if int(value) > 0:
                result.flags += ["--max-tokens", value]
        elif flag in CORS_FLAGS:
            result.cors_origins += [origin.strip() for origin in value.split(",") if origin.strip()]
        elif flag in TOOLS_FLAGS:
            result.server_tools = True
            result.notes.append(f"ignoring {flag} {value}")
        elif flag in SAME_VALUE:
            result.flags += [SAME_VALUE[flag], value]
        elif flag in SAME_SWITCH:
            result.flags.append(SAME_SWITCH[flag])
            step = 1
        elif flag in NO_VALUE:
            step = 1
        elif takes_value(arguments, at):
            result.notes.append(f"ignoring {flag} {value}")
        else:
            result.notes.append(f"ignoring {flag}")
            step = 1
        at += step
    return result


def main(arguments: list[str]) -> None:
    translation = translate(arguments)
    for note in translation.notes:
        print(f"llama_server_shim: {note} (no BaseRT counterpart)", file=sys.stderr)
    command = [sys.executable, "-m", "basert", "serve", *translation.serve_arguments()]
    print(f"llama_server_shim: {' '.join(command)}", file=sys.stderr, flush=True)
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main(sys.argv[1:])
