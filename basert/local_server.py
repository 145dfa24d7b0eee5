"""A `basert serve` on a loopback port, seen from the process that starts it: a free port, and waiting until the
server answers. The cluster's replicas and the test launcher both start servers this way."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, timeout: float, still_running: Callable[[], bool] = lambda: True) -> bool:
    """Poll GET `url`/health until it answers 200 (True), `still_running()` turns false or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and still_running():
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1.0) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False
