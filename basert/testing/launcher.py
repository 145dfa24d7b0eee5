"""Start a real `basert serve` subprocess on a free loopback port (for integration tests and tools)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from basert.local_server import free_port, wait_healthy

__all__ = ["ServerProcess", "free_port", "limit_file_size", "start_servers", "stop_servers", "wait_healthy"]


def limit_file_size(n_bytes: int) -> None:
    """RLIMIT_FSIZE for this process: writes beyond `n_bytes` fail with EFBIG (Python ignores SIGXFSZ), as a
    full disk would fail them."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, n_bytes))


class ServerProcess:
    """Starts `python -m basert serve MODEL --port P ...`; `stop()` sends SIGTERM and returns the exit code."""

    def __init__(self, model: Path | str, *flags: str, log_path: Path, env: dict | None = None,
                 startup_timeout: float = 120.0, file_size_limit: int | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = log_path.open("w")
        full_env = dict(os.environ, **(env or {}))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "basert", "serve", str(model), "--port", str(self.port), *flags],
            stdout=self.log, stderr=subprocess.STDOUT, env=full_env,
            preexec_fn=None if file_size_limit is None else lambda: limit_file_size(file_size_limit),
        )
        if wait_healthy(self.url, startup_timeout, lambda: self.process.poll() is None):
            return
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
            problem = "did not become healthy"
        else:
            problem = f"exited with {self.process.returncode}"
        self.log.close()
        raise RuntimeError(f"server {problem}:\n{self.log_text()}")

    @property
    def root(self) -> Path:
        """The folder of the server's log (a ServerPool keeps the server's files there too)."""
        return self.log_path.parent

    def log_text(self) -> str:
        """Everything the server printed so far."""
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        """Stop the server; a server that exits with a status other than 0 fails the block that used it."""
        code = self.stop()
        if code != 0 and exc_type is None:
            raise RuntimeError(f"server exited with {code}:\n{self.log_text()[-4000:]}")

    def terminate(self) -> None:
        """Send SIGTERM (the server drains and exits) unless it has exited already."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 30.0) -> int:
        """Wait for the exit (SIGKILL after `timeout` seconds) and return the exit code."""
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        return self.process.returncode

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait for the exit; the exit code."""
        self.terminate()
        return self.wait(timeout)


def start_servers(*starts: Callable[[], ServerProcess]) -> list[ServerProcess]:
    """Run the `starts` (each returns a started server) at the same time: a start keeps about one core busy.

    Returns every server, or raises the first failure after stopping those that did start.
    """
    with ThreadPoolExecutor(len(starts)) as pool:
        futures = [pool.submit(start) for start in starts]
    servers = [future.result() for future in futures if future.exception() is None]
    failures = [future.exception() for future in futures if future.exception() is not None]
    if failures:
        stop_servers(*servers)
        raise failures[0]
    return servers


def stop_servers(*servers: ServerProcess) -> list[int]:
    """Stop the servers at the same time (each exit runs on about one core); their exit codes."""
    for server in servers:
        server.terminate()
    return [server.wait() for server in servers]
