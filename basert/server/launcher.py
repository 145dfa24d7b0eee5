"""Start a real `basert serve` subprocess on a free loopback port (for integration tests and tools)."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log_text()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=1.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.process.kill()
        raise RuntimeError(f"server did not become healthy:\n{self.log_text()}")

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def stop(self, timeout: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()
        return self.process.returncode
