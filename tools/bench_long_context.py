"""Long agent sessions in bounded memory: -np conversations at once, each growing to about --tokens prompt tokens
over --turns turns, against `basert serve` and llama.cpp's llama-server started with the same settings.

    python tools/bench_long_context.py [--model M] [-c 131072] [-np 4] [--cache-type f16,q8_0] [--json PATH]
    LLAMA_SERVER=/path/to/llama-server python tools/bench_long_context.py --gguf M.gguf --servers both

Each run starts one server (a subprocess on a free loopback port, its output in a log file):

    python -m basert serve MODEL -c CTX -np NP -ctk T -ctv T -t THREADS
    $LLAMA_SERVER -m GGUF -c CTX -np NP -ctk T -ctv T -fa on -t THREADS -lv 4

for each KV type of --cache-type, the two servers alternating run by run. -lv 4 makes llama-server log the sizes
of its KV buffers. A GGUF without a chat template (basert's converter gives the .base its family's turn format)
gets that same template with --chat-template-file: llama-server would render its chats as ChatML.

NP conversations, one pinned to each slot with `id_slot`, then run at once: every turn appends a user message of
seeded pseudo-text (distinct per conversation, drawn from a word list committed here) sized so that the prompt grows
by --tokens / --turns tokens a turn, sends the whole history as a chat completion (temperature 0, max_tokens
--max-tokens, not streamed) and appends the reply as the next assistant message. The size of the next user message
comes from the prompt tokens the server counted (`usage.prompt_tokens`): tokens per word are measured on the turn
before, so the final prompt lands near --tokens whatever the tokenizer.

Recorded per turn and conversation: prompt tokens, cached tokens (`usage.prompt_tokens_details.cached_tokens`, else
llama.cpp's `timings.cache_n`), the server's prefill tokens and time when it reports `timings`, the client wall
time of the request (NP requests share the CPU: it is the latency under that load) and the reply. The server's
VmRSS is sampled every 0.5 s while the conversations run; peak RSS is its VmHWM at the end (the start included),
end RSS its VmRSS after the last turn. Reported KV: the sum of `basert_kv_bytes` on GET /metrics for basert, the
sum of the `KV buffer size` lines of llama-server's log (a model with sliding-window layers has two caches, SWA and
non-SWA, each with its own line).

--check-fresh: after the session, conversation 0's last request (its whole message list) goes once to a fresh
server with the same settings; its reply must equal the session's (the greedy isolation invariant: a request's
output does not depend on what the server did before).

A model given as a GGUF (or the default model, SmolLM2-135M-Instruct, which `basert serve` converts from its
package on first use) is converted before the server starts, so that neither the server's start time nor its
peak RSS includes the conversion. --gguf defaults to that GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import trio
from load_server import read_proc_status

from basert import __version__
from basert.chat.default_templates import BY_ARCH as DEFAULT_TEMPLATES
from basert.cli.bench import cpu_model
from basert.cli.generate import model_path_for
from basert.convert.gguf_reader import read_gguf
from basert.convert.gguf_source import field_value
from basert.engine.runner import default_threads
from basert.format.architectures import BY_GGUF_ARCHITECTURE
from basert.models_dir import smollm2_gguf_path
from basert.testing.launcher import free_port, wait_healthy

SERVERS = ("basert", "llama")
STARTUP_TIMEOUT_S = 600.0
STARTUP_PROGRESS_S = 15.0      # how often a waiting start says so
STOP_GRACE_S = 10.0            # SIGTERM, then SIGKILL
RSS_INTERVAL_S = 0.5
HTTP_TIMEOUT = httpx.Timeout(3600.0, connect=30.0)
FIRST_TOKENS_PER_WORD = 1.15   # the first turn's guess (SmolLM2 and Gemma 3 count about 1.1); later turns measure it
TURN_OVERHEAD_TOKENS = 8       # the chat template's tokens around one more user message
CONTEXT_MARGIN_TOKENS = 64     # what a slot keeps free beyond the final prompt and its reply
SYSTEM_PROMPT = "You are a note-taking assistant. Read each note and answer in one short sentence."

# The pseudo-text's vocabulary: common words that every tokenizer splits into a token or two.
WORDS = """
about above across after again against almost along already also always among animal answer apple area around
autumn away back basket beach bicycle bird black blue boat book bottle bread bridge bright brother brown build
button cable camera candle carbon castle center chair change cheese circle city clean clock cloud coffee cold
color corner cotton country cover crowd current daily dance dark data desert design dinner door double dream
drive early earth east engine evening every family farmer field figure final finger fire flower forest forward
frame friend garden gentle glass golden grain green ground group guitar harbor heavy history holiday honey horse
house hunter island jacket journey kitchen ladder lake language later leather letter light little local machine
market metal middle minute mirror modern moment morning mountain music narrow nature needle night north number
ocean office orange paper parent pencil people pepper piano picture planet plastic pocket police potato powder
purple quiet rabbit radio railway record river rocket rubber saddle salt sample school season second shadow ship
silver simple sister small smooth soft south space spring square station steady stone storm street summer sunny
table teacher thread ticket timber today tomato tower train travel tree under valley velvet village violet
wagon warm water weather west wheel window winter wooden yellow young
""".split()


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- servers


class BenchServer:
    """One server subprocess on a free loopback port, stdout and stderr in `log_path`; a context manager that
    always stops it (SIGTERM, SIGKILL after STOP_GRACE_S), also on Ctrl-C or an exception."""

    def __init__(self, name: str, command: list[str], log_path: Path):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [*command, "--port", str(self.port), "--host", "127.0.0.1"]
        self.log_path = log_path
        self.log = log_path.open("w")
        self.process = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self) -> BenchServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_ready(self) -> float:
        """Wait until GET /health answers 200; the seconds it took. RuntimeError if the server exits or takes over
        STARTUP_TIMEOUT_S."""
        began = time.monotonic()
        while time.monotonic() - began < STARTUP_TIMEOUT_S:
            if wait_healthy(self.url, STARTUP_PROGRESS_S, lambda: self.process.poll() is None):
                return time.monotonic() - began
            if self.process.poll() is not None:
                break
            progress(f"    {self.name}: waiting for /health, {time.monotonic() - began:.0f} s")
        self.stop()
        tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-15:])
        code = self.process.returncode
        raise RuntimeError(f"{self.name} did not become healthy (exit code {code}); log {self.log_path}:\n{tail}")

    def stop(self) -> None:
        """End the server unless it has exited already."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


@dataclass(frozen=True)
class Settings:
    """What both servers are started with."""

    model: Path           # basert's .base
    gguf: Path | None     # llama-server's
    llama_server: str | None
    llama_chat_template: Path | None   # a template file for llama-server (see `fallback_chat_template`)
    context: int
    slots: int
    threads: int

    def command(self, server: str, kv_type: str) -> list[str]:
        common = ["-c", str(self.context), "-np", str(self.slots), "-ctk", kv_type, "-ctv", kv_type]
        if server == "basert":
            return [sys.executable, "-m", "basert", "serve", str(self.model), *common, "-t", str(self.threads)]
        assert self.llama_server is not None and self.gguf is not None
        template = [] if self.llama_chat_template is None else ["--chat-template-file", str(self.llama_chat_template)]
        return [self.llama_server, "-m", str(self.gguf), *common, "-fa", "on", "-t", str(self.threads), "-lv", "4",
                *template]


def fallback_chat_template(gguf: Path) -> str | None:
    """The chat template basert's converter writes into the .base of a GGUF that brings none (its family's turn
    format), None where the GGUF has one or basert knows none. Given to llama-server too, which would render such a
    model's chats as ChatML: both servers then see the same prompt."""
    reader = read_gguf(gguf)
    if field_value(reader, "tokenizer.chat_template"):
        return None
    arch = BY_GGUF_ARCHITECTURE.get(field_value(reader, "general.architecture"))
    return None if arch is None else DEFAULT_TEMPLATES.get(arch.name)


def proc_status_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process in MiB (empty once it is gone)."""
    return {key: value / 2**20 for key, value in read_proc_status(pid).items()}


# llama_kv_cache_iswa: creating non-SWA KV cache, size = 32768 cells
# llama_kv_cache:        CPU KV buffer size =   384.00 MiB
KV_CACHE_KIND = re.compile(r"creating\s+(.*?)\s*KV cache")
KV_BUFFER = re.compile(r"(\S+) KV buffer size\s*=\s*([\d.]+) MiB")


def llama_kv_buffers(log_text: str) -> list[dict]:
    """The KV buffers llama-server's log reports: kind (SWA, non-SWA or empty), device, MiB and the line."""
    buffers = []
    kind = ""
    for line in log_text.splitlines():
        if found := KV_CACHE_KIND.search(line):
            kind = found.group(1)
        elif found := KV_BUFFER.search(line):
            buffers.append({"kind": kind, "device": found.group(1), "mib": float(found.group(2)),
                            "line": line.strip()})
            kind = ""
    return buffers


def basert_kv_bytes(url: str) -> float | None:
    """The sum over labels of the `basert_kv_bytes` gauge on GET /metrics (None without it)."""
    response = httpx.get(f"{url}/metrics", timeout=30)
    if response.status_code != 200:
        return None
    values = [float(line.rsplit(" ", 1)[1]) for line in response.text.splitlines()
              if re.match(r"basert_kv_bytes[ {]", line)]
    return sum(values) if values else None


# ---------------------------------------------------------------------------------------------- conversations


@dataclass
class Turn:
    conversation: int
    turn: int
    user_words: int
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    prefill_tokens: int | None    # the server's timings.prompt_n (tokens computed, the cached ones excluded)
    prefill_ms: float | None
    seconds: float                # client wall time of the request
    finish_reason: str
    reply: str


@dataclass
class Conversation:
    """One growing chat pinned to one slot: its history and seeded source of words."""

    index: int
    rng: random.Random
    messages: list[dict] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)

    def user_message(self, turn: int, words: int) -> str:
        """About `words` words of pseudo-text in sentences, headed by the note's number, ending in a question."""
        sentences = [f"Note {self.index}.{turn}."]
        left = words
        while left > 0:
            length = min(left, self.rng.randint(6, 16))
            picked = [self.rng.choice(WORDS) for _ in range(length)]
            sentences.append(" ".join(picked).capitalize() + ".")
            left -= length
        sentences.append(f"Which word of note {self.index}.{turn} do you like best?")
        return " ".join(sentences)


def chat_body(messages: list[dict], slot: int, max_tokens: int) -> dict:
    return {"messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": False, "id_slot": slot}


async def send_chat(client: httpx.AsyncClient, url: str, body: dict) -> tuple[dict, float]:
    """POST a chat completion; its JSON answer and the seconds it took."""
    start = time.perf_counter()
    response = await client.post(f"{url}/v1/chat/completions", json=body)
    seconds = time.perf_counter() - start
    if response.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {response.status_code}: {response.text[:1000]}")
    return response.json(), seconds


def cached_tokens(answer: dict) -> int | None:
    details = answer.get("usage", {}).get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        return details["cached_tokens"]
    return (answer.get("timings") or {}).get("cache_n")


async def converse(client: httpx.AsyncClient, url: str, conversation: Conversation, target_tokens: int,
                   turns: int, max_tokens: int) -> None:
    """Run the conversation's turns one after another, each user message sized to reach the turn's target."""
    tokens_per_word = FIRST_TOKENS_PER_WORD
    expected = 0          # prompt tokens before the new user message: the last prompt plus its reply
    for turn in range(turns):
        goal = target_tokens * (turn + 1) // turns
        words = max(1, round((goal - expected - TURN_OVERHEAD_TOKENS) / tokens_per_word))
        conversation.messages.append({"role": "user", "content": conversation.user_message(turn, words)})
        answer, seconds = await send_chat(client, url, chat_body(conversation.messages, conversation.index,
                                                                 max_tokens))
        choice = answer["choices"][0]
        reply = choice["message"].get("content") or ""
        usage = answer["usage"]
        timings = answer.get("timings") or {}
        conversation.turns.append(Turn(
            conversation=conversation.index, turn=turn + 1, user_words=words, prompt_tokens=usage["prompt_tokens"],
            cached_tokens=cached_tokens(answer), completion_tokens=usage["completion_tokens"],
            prefill_tokens=timings.get("prompt_n"), prefill_ms=timings.get("prompt_ms"), seconds=seconds,
            finish_reason=choice.get("finish_reason") or "", reply=reply))
        added = usage["prompt_tokens"] - expected - TURN_OVERHEAD_TOKENS
        if added > 0:
            tokens_per_word = added / words
        expected = usage["prompt_tokens"] + usage["completion_tokens"]
        conversation.messages.append({"role": "assistant", "content": reply})
        progress(f"    conversation {conversation.index} turn {turn + 1}/{turns}: {usage['prompt_tokens']} prompt "
                 f"tokens ({cached_tokens(answer)} cached) in {seconds:.1f} s")


@dataclass
class RssLog:
    samples: list[tuple[float, float]] = field(default_factory=list)   # (seconds since the start, VmRSS MiB)


async def sample_rss(pid: int, log: RssLog) -> None:
    began = time.monotonic()
    while True:
        rss = proc_status_mib(pid).get("VmRSS")
        if rss is not None:
            log.samples.append((round(time.monotonic() - began, 2), rss))
        await trio.sleep(RSS_INTERVAL_S)


async def run_session(url: str, pid: int, conversations: list[Conversation], target_tokens: int, turns: int,
                      max_tokens: int, rss: RssLog) -> None:
    """All conversations at once, the server's RSS sampled meanwhile; the first failure ends them all."""
    errors: list[Exception] = []

    async def one(client: httpx.AsyncClient, conversation: Conversation, scope: trio.CancelScope) -> None:
        try:
            await converse(client, url, conversation, target_tokens, turns, max_tokens)
        except (RuntimeError, httpx.HTTPError) as exc:  # raised below as it is, not in an exception group
            errors.append(exc)
            scope.cancel()

    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client, trio.open_nursery() as outer:
        outer.start_soon(sample_rss, pid, rss)
        async with trio.open_nursery() as nursery:
            for conversation in conversations:
                nursery.start_soon(one, client, conversation, nursery.cancel_scope)
        outer.cancel_scope.cancel()
    if errors:
        raise errors[0]


async def send_once(url: str, body: dict) -> tuple[dict, float]:
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client:
        return await send_chat(client, url, body)


# ---------------------------------------------------------------------------------------------- runs


@dataclass
class Run:
    server: str
    kv_type: str
    command: list[str]
    log: str
    startup_s: float
    session_s: float
    reported_kv_mib: float | None
    kv_buffers: list[dict]
    peak_rss_mib: float | None      # VmHWM after the session
    end_rss_mib: float | None       # VmRSS after the session
    sampled_peak_rss_mib: float | None
    rss_samples: list[tuple[float, float]]
    load_average: tuple[float, float]   # 1-minute load average of the machine as the session began and ended
    turns: list[Turn]
    fresh: dict | None = None

    def medians(self, turn: int) -> dict:
        rows = [t for t in self.turns if t.turn == turn]
        cached = [t.cached_tokens for t in rows if t.cached_tokens is not None]
        return {"prompt_tokens": statistics.median(t.prompt_tokens for t in rows),
                "cached_tokens": statistics.median(cached) if cached else None,
                "seconds": statistics.median(t.seconds for t in rows)}


def server_log_path(log_dir: Path, server: str, kv_type: str, label: str) -> Path:
    return log_dir / f"{server}-{kv_type}-{label}.log"


def start(settings: Settings, server: str, kv_type: str, log_path: Path) -> BenchServer:
    """The server started (not yet ready): use it in a `with` block, which stops it."""
    command = settings.command(server, kv_type)
    progress(f"[{server} {kv_type}] starting: {' '.join(command)}")
    return BenchServer(server, command, log_path)


def run_once(settings: Settings, server: str, kv_type: str, args: argparse.Namespace, log_dir: Path) -> Run:
    """One server, the whole session, then (with --check-fresh) conversation 0's last request on a fresh one."""
    log_path = server_log_path(log_dir, server, kv_type, "session")
    conversations = [Conversation(i, random.Random(f"{args.seed}-{i}"),
                                  [{"role": "system", "content": SYSTEM_PROMPT}]) for i in range(settings.slots)]
    rss = RssLog()
    with start(settings, server, kv_type, log_path) as bench_server:
        startup_s = bench_server.wait_ready()
        progress(f"    healthy after {startup_s:.1f} s; {settings.slots} conversations of {args.turns} turns")
        began, load_before = time.monotonic(), os.getloadavg()[0]
        trio.run(run_session, bench_server.url, bench_server.process.pid, conversations, args.tokens, args.turns,
                 args.max_tokens, rss)
        session_s, load_after = time.monotonic() - began, os.getloadavg()[0]
        memory = proc_status_mib(bench_server.process.pid)
        if server == "basert":
            kv_bytes = basert_kv_bytes(bench_server.url)
            reported = None if kv_bytes is None else kv_bytes / 2**20
            buffers = [] if kv_bytes is None else [{"kind": "basert_kv_bytes", "mib": reported}]
        else:
            buffers = llama_kv_buffers(log_path.read_text(errors="replace"))
            reported = sum(b["mib"] for b in buffers) if buffers else None
    run = Run(server=server, kv_type=kv_type, command=bench_server.command, log=str(log_path), startup_s=startup_s,
              session_s=session_s, reported_kv_mib=reported, kv_buffers=buffers,
              peak_rss_mib=memory.get("VmHWM"), end_rss_mib=memory.get("VmRSS"),
              sampled_peak_rss_mib=max((mib for _, mib in rss.samples), default=None), rss_samples=rss.samples,
              load_average=(load_before, load_after),
              turns=sorted((t for c in conversations for t in c.turns), key=lambda t: (t.turn, t.conversation)))
    progress(f"    session {session_s:.1f} s, peak RSS {fmt(run.peak_rss_mib)} MiB, reported KV "
             f"{fmt(run.reported_kv_mib)} MiB, load average {run.load_average[0]:.1f} -> {run.load_average[1]:.1f}")
    if args.check_fresh:
        run.fresh = check_fresh(settings, server, kv_type, conversations[0], args.max_tokens, log_dir)
    return run


def check_fresh(settings: Settings, server: str, kv_type: str, conversation: Conversation, max_tokens: int,
                log_dir: Path) -> dict:
    """Conversation 0's last request on a fresh server: its reply, and whether it equals the session's."""
    last_request = conversation.messages[:-1]      # the history without the reply it got
    session_reply = conversation.turns[-1].reply
    with start(settings, server, kv_type, server_log_path(log_dir, server, kv_type, "fresh")) as bench_server:
        startup_s = bench_server.wait_ready()
        answer, seconds = trio.run(send_once, bench_server.url, chat_body(last_request, 0, max_tokens))
    reply = answer["choices"][0]["message"].get("content") or ""
    progress(f"    fresh server: reply {'equal' if reply == session_reply else 'DIFFERENT'} "
             f"({answer['usage']['prompt_tokens']} prompt tokens in {seconds:.1f} s)")
    return {"equal": reply == session_reply, "reply": reply, "session_reply": session_reply,
            "prompt_tokens": answer["usage"]["prompt_tokens"], "seconds": seconds, "startup_s": startup_s}


# ---------------------------------------------------------------------------------------------- report


def fmt(value: float | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}"


def table(runs: list[Run], turns: int) -> str:
    header = ["server", "KV type", "reported KV MiB", "peak RSS MiB", "end RSS MiB"]
    header += [f"turn {k}: prompt tok / s" for k in range(1, turns + 1)]
    header += ["last turn cached tok", "session s", "fresh equal"]
    lines = ["| " + " | ".join(header) + " |", "| --- | --- |" + " ---: |" * (len(header) - 3) + " --- |"]
    for run in runs:
        cells = [run.server, run.kv_type, fmt(run.reported_kv_mib), fmt(run.peak_rss_mib), fmt(run.end_rss_mib)]
        for k in range(1, turns + 1):
            medians = run.medians(k)
            cells.append(f"{medians['prompt_tokens']:.0f} / {medians['seconds']:.1f}")
        cached = run.medians(turns)["cached_tokens"]
        cells.append("-" if cached is None else f"{cached:.0f}")
        cells.append(f"{run.session_s:.1f}")
        cells.append("-" if run.fresh is None else ("yes" if run.fresh["equal"] else "NO"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", "-m",
                        help="basert's model: a .base file, an installed id, a .gguf (converted on first use) "
                        "(default: SmolLM2-135M-Instruct, as `basert serve` without a model)")
    parser.add_argument("--gguf", type=Path,
                        help="llama-server's model (default: --model when it is a .gguf; the packaged "
                        "SmolLM2-135M-Instruct GGUF when --model is not given)")
    parser.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"),
                        help="path of llama-server (default: $LLAMA_SERVER)")
    parser.add_argument("--servers", choices=("basert", "llama", "both"), default=None,
                        help="which servers to run (default: both when a llama-server is given, else basert)")
    parser.add_argument("-c", "--ctx-size", dest="context", type=int, default=131072,
                        help="tokens of context over all slots, each slot gets c / np (default 131072)")
    parser.add_argument("-np", "--parallel", dest="slots", type=int, default=4,
                        help="slots, one conversation each, all at once (default 4)")
    parser.add_argument("--cache-type", action="append", default=None, metavar="TYPE[,TYPE]",
                        help="KV type for K and V (-ctk, -ctv), repeatable or comma-separated: one run per type "
                        "and server (default f16)")
    parser.add_argument("--tokens", type=int, default=30000,
                        help="prompt tokens of each conversation's last turn, about (default 30000)")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation (default 3)")
    parser.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each reply (default 16)")
    parser.add_argument("--threads", "-t", type=int, default=default_threads(),
                        help="threads of both servers (default: one per physical core)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the pseudo-text (default 0)")
    parser.add_argument("--check-fresh", action="store_true",
                        help="send conversation 0's last request to a fresh server too and compare the replies")
    parser.add_argument("--json", type=Path, help="write everything measured to this file")
    parser.add_argument("--keep-logs", action="store_true", help="keep the server logs (kept anyway on failure)")
    args = parser.parse_args()
    args.cache_types = [t for value in (args.cache_type or ["f16"]) for t in value.split(",") if t]
    args.servers = args.servers or ("both" if args.llama_server else "basert")
    if args.servers != "basert" and not args.llama_server:
        parser.error("--servers llama or both needs llama-server: set LLAMA_SERVER or --llama-server")
    if args.turns < 1 or args.slots < 1:
        parser.error("--turns and -np must be at least 1")
    per_slot = args.context // args.slots
    if args.tokens + args.max_tokens + CONTEXT_MARGIN_TOKENS > per_slot:
        parser.error(f"--tokens {args.tokens} + --max-tokens {args.max_tokens} do not fit a slot's "
                     f"{per_slot} tokens (-c / -np) with {CONTEXT_MARGIN_TOKENS} to spare")
    return args


def llama_gguf(args: argparse.Namespace) -> Path:
    if args.gguf is not None:
        return args.gguf
    if args.model is None:
        return smollm2_gguf_path()
    if args.model.lower().endswith(".gguf"):
        return Path(args.model)
    raise SystemExit("llama-server needs --gguf: the model as a GGUF")


def interrupted(exc: BaseException) -> bool:
    """Whether `exc` is Ctrl-C (or SIGTERM), alone or in the exception groups trio's nurseries wrap it in."""
    inner = getattr(exc, "exceptions", None)    # an exception group (Python 3.10 has no builtin class to name)
    if inner is not None:
        return all(interrupted(e) for e in inner)
    return isinstance(exc, KeyboardInterrupt)


def main() -> int:
    args = parse_args()
    servers = list(SERVERS) if args.servers == "both" else [args.servers]
    gguf = llama_gguf(args) if "llama" in servers else None
    model = model_path_for(args.model) if "basert" in servers else Path()
    log_dir = Path(tempfile.mkdtemp(prefix="bench_long_context-"))
    template = fallback_chat_template(gguf) if gguf is not None else None
    template_file = None
    if template is not None:
        template_file = log_dir / "chat_template.jinja"
        template_file.write_text(template)
        progress(f"{gguf.name} has no chat template: llama-server gets basert's ({template_file})")
    settings = Settings(model=model, gguf=gguf, llama_server=args.llama_server, llama_chat_template=template_file,
                        context=args.context, slots=args.slots, threads=args.threads)
    # Ctrl-C (even where the shell started this with SIGINT ignored) and SIGTERM end this process through the
    # `with` blocks that stop the servers; SIGTERM passes through SIGINT, which trio delivers at a safe point.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    runs: list[Run] = []
    try:
        for kv_type in args.cache_types:
            for server in servers:
                runs.append(run_once(settings, server, kv_type, args, log_dir))
    except (RuntimeError, httpx.HTTPError) as exc:
        progress(f"error: {exc}\nserver logs kept in {log_dir}")
        return 1
    except BaseException as exc:
        if not interrupted(exc):
            raise
        progress(f"interrupted; server logs kept in {log_dir}")
        return 130
    print(f"{cpu_model()}, {args.threads} threads; -c {args.context} -np {args.slots}; {args.slots} conversations "
          f"x {args.turns} turns to about {args.tokens} prompt tokens, max_tokens {args.max_tokens}; "
          f"basert {model.name if 'basert' in servers else '-'}, llama-server {gguf.name if gguf else '-'}\n")
    print(table(runs, args.turns))
    print("\nper turn: median over the conversations of the prompt tokens and the request's wall time; peak RSS is "
          "VmHWM after the session, end RSS VmRSS after it")
    if args.json:
        report = {"basert_version": __version__, "cpu": cpu_model(), "machine": platform.machine(),
                  "settings": {"context": args.context, "slots": args.slots, "threads": args.threads,
                               "tokens": args.tokens, "turns": args.turns, "max_tokens": args.max_tokens,
                               "seed": args.seed, "model": str(model) if "basert" in servers else None,
                               "gguf": str(gguf) if gguf else None, "llama_server": args.llama_server,
                               "llama_chat_template": template},
                  "runs": [asdict(run) for run in runs]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        progress(f"wrote {args.json}")
    if args.keep_logs:
        progress(f"server logs in {log_dir}")
    else:
        shutil.rmtree(log_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
