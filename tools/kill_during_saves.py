"""Kill -9 `basert serve` in the middle of its saves, restart it, and check what the restart finds.

    python tools/kill_during_saves.py [--model M] [--runs 10] [--threads N] [--seed S] [--keep DIR]

Each run starts a server on the same directories, with --prefix-cache-file (saved every 0.2 s),
--files-dir and --slot-save-path. It sends one completion prompt (cached after the first run) to fill
slot 0, then saves the slot over and over, into the files store (POST /slots/0/save) and by filename
(?action=save). The run picks a target (the prefix cache file, the files store or the slot directory),
waits until a temp or partial file of that target appears and sends SIGKILL a random 0-8 ms later (a
save takes about 10-40 ms). A second server then starts on the same directories without periodic saves:
before it answers /health it must have removed every temp and partial file, the files store must hold
only complete files (content and metadata), and its prefix cache must have loaded the last complete
cache file (a corrupt file would be a "starting cold" warning). Prints one row per run; exits 1 if any
run failed a check.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from basert.testing.launcher import ServerProcess

TARGETS = ("cache", "files", "slots")
# About 210 tokens (13 prefix cache blocks), computed in the first run and served from the cache after.
PROMPT = "Describe, step by step, how a lighthouse keeper prepares the lamp for a stormy night. " * 10


@dataclass(frozen=True, slots=True)
class KillRun:
    """What one kill left behind and what the restarted server made of it."""

    target: str
    delay_ms: float
    left_at_kill: int          # temp and partial files present right after the kill
    removed: int               # files the restarted server reported removing
    left_after_restart: int    # temp and partial files once the restarted server is healthy (must be 0)
    incomplete_files: int      # store entries with content but no metadata or the reverse (must be 0)
    warmed_blocks: int | None  # blocks the restarted server loaded from the cache file; None: it refused it

    @property
    def ok(self) -> bool:
        return self.left_after_restart == 0 and self.incomplete_files == 0 and self.warmed_blocks is not None


def leftovers(root: Path) -> dict[str, list[str]]:
    """Names that look like an unfinished save (`*.tmp`, `*.partial`) in each target's directory."""
    found = {}
    for target in TARGETS:
        directory = root / target
        names = [p.name for p in directory.iterdir()] if directory.is_dir() else []
        found[target] = sorted(n for n in names if n.endswith((".tmp", ".partial")))
    return found


def incomplete_store_files(files_dir: Path) -> int:
    """Ids with a content file but no metadata file, or the reverse."""
    data = {p.name.removesuffix(".data") for p in files_dir.glob("file-*.data")}
    meta = {p.name.removesuffix(".json") for p in files_dir.glob("file-*.json")}
    return len(data ^ meta)


def server_flags(root: Path, threads: int) -> list[str]:
    return ["--max-context", "1024", "--threads", str(threads), "--prefix-cache-file", str(root / "cache" / "pc"),
            "--files-dir", str(root / "files"), "--slot-save-path", str(root / "slots")]


def save_slots_until(stop: threading.Event, url: str) -> None:
    """Slot saves of both kinds, back to back, until `stop` (or the server dies)."""
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            try:
                saved = client.post("/slots/0/save", json={})
                if saved.status_code == 200:
                    client.delete(f"/v1/files/{saved.json()['file_id']}")  # keep the disk use small
                client.post("/slots/0", params={"action": "save"}, json={"filename": "slot0.bin"})
            except httpx.HTTPError:
                return


def kill_once(model: Path, root: Path, target: str, delay: float, threads: int, run: int) -> KillRun:
    """Start a saving server, kill -9 it `delay` seconds after a temp file of `target` appears, restart, check."""
    saver = ServerProcess(model, *server_flags(root, threads), "--prefix-cache-save-interval", "0.2",
                          log_path=root / f"run{run}-killed.log")
    stop = threading.Event()
    traffic = threading.Thread(target=save_slots_until, args=(stop, saver.url))
    try:
        response = httpx.post(f"{saver.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}, timeout=300)
        response.raise_for_status()
        traffic.start()
        deadline = time.monotonic() + 30
        while not leftovers(root)[target] and time.monotonic() < deadline:
            time.sleep(0.0005)
        time.sleep(delay)
        saver.process.send_signal(signal.SIGKILL)
        saver.process.wait()
    finally:
        stop.set()
        if traffic.is_alive():
            traffic.join()
        saver.stop()
    left_at_kill = sum(len(names) for names in leftovers(root).values())

    checker = ServerProcess(model, *server_flags(root, threads), log_path=root / f"run{run}-restarted.log")
    try:
        left_after_restart = sum(len(names) for names in leftovers(root).values())
        incomplete = incomplete_store_files(root / "files")
        log = checker.log_text()
    finally:
        checker.stop()
    removed = sum(int(n) for n in re.findall(r"Removed (\d+) files", log))
    match = re.search(r"warmed (\d+) blocks", log)
    warmed = int(match.group(1)) if match else (0 if "no file at" in log else None)
    return KillRun(target, 1000 * delay, left_at_kill, removed, left_after_restart, incomplete, warmed)


def kill_during_saves(model: Path, root: Path, runs: int, *, threads: int = 2, seed: int = 0) -> list[KillRun]:
    """`runs` kills on the same directories, cycling through the targets with random delays."""
    rng = random.Random(seed)
    return [kill_once(model, root, TARGETS[run % len(TARGETS)], rng.uniform(0.0, 0.008), threads, run)
            for run in range(runs)]


def print_table(results: list[KillRun]) -> None:
    print(f"{'run':>3} {'target':>6} {'delay ms':>8} {'left at kill':>12} {'removed':>7} {'left after restart':>18} "
          f"{'incomplete':>10} {'warmed':>6}  ok")
    for run, r in enumerate(results):
        warmed = "refused" if r.warmed_blocks is None else str(r.warmed_blocks)
        print(f"{run:>3} {r.target:>6} {r.delay_ms:8.1f} {r.left_at_kill:>12} {r.removed:>7} "
              f"{r.left_after_restart:>18} {r.incomplete_files:>10} {warmed:>6}  {'yes' if r.ok else 'NO'}")


def main() -> int:
    from basert.cli.generate import model_path_for

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", "-m", help=".base file or installed model id (default: smollm2)")
    parser.add_argument("--runs", type=int, default=10, help="kills (default 10)")
    parser.add_argument("--threads", "-t", type=int, default=2, help="server threads (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill delays (default 0)")
    parser.add_argument("--keep", type=Path, help="work in this directory and keep it (default: a temporary one)")
    args = parser.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="kill-during-saves-"))
    root.mkdir(parents=True, exist_ok=True)
    results = kill_during_saves(model_path_for(args.model), root, args.runs, threads=args.threads, seed=args.seed)
    print_table(results)
    failed = not all(r.ok for r in results)
    if failed or args.keep:
        print(f"logs and files: {root}")
    else:
        shutil.rmtree(root)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
