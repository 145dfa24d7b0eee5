"""Start a real `basert cluster` (local Ray, replicas, ingress) on a free loopback port, for tests and tools."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from basert.testing.launcher import free_port


class ClusterProcess:
    """`python -m basert cluster MODEL --port P --replicas N ...`; `stop()` sends SIGTERM and returns the exit code."""

    def __init__(self, model: Path | str, *flags: str, replicas: int, log_path: Path, startup_timeout: float = 300.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.n_replicas = replicas
        self.log_path = log_path
        self.log = log_path.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "basert", "cluster", str(model), "--port", str(self.port),
             "--replicas", str(replicas), *flags],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        if not self.wait_serving(startup_timeout):
            code = self.stop(timeout=60)
            raise RuntimeError(f"cluster did not start (exit status {code}):\n{self.log_text()[-6000:]}")

    def log_text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text(errors="replace")

    def replicas(self) -> list[dict]:
        """GET /cluster's replicas (raises while the cluster does not answer)."""
        response = httpx.get(f"{self.url}/cluster", timeout=30)
        response.raise_for_status()
        return response.json()["replicas"]

    def wait_serving(self, timeout: float, *, unlike: dict[int, int] | None = None) -> bool:
        """Wait until every replica serves (and, for ranks in `unlike`, with another pid than the one given)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                replicas = self.replicas()
            except httpx.HTTPError:
                replicas = []
            if len(replicas) == self.n_replicas and all(
                    r["state"] == "serving" and (unlike or {}).get(r["replica"]) != r["pid"] for r in replicas):
                return True
            time.sleep(0.5)
        return False

    def stop(self, timeout: float = 120.0) -> int:
        """SIGTERM (replicas drain, caches are saved, Ray stops); SIGKILL to the whole group after `timeout`."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.log.close()
        return self.process.returncode
