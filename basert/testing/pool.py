"""Servers shared by the tests of a session: one `basert serve` per model, flags and environment, started on first
use and reset through the API (every slot erased, every stored file deleted) each time it is handed out again."""

from __future__ import annotations

from pathlib import Path

from basert.testing.client import reset_state
from basert.testing.launcher import ServerProcess, stop_servers

ROOT = "{root}"     # in a flag: the server's own folder (for --files-dir, --slot-save-path and the like)


class ServerPool:
    """Started servers by (model, flags, environment); each keeps its log and files in a folder of `root`."""

    def __init__(self, root: Path):
        self.root = root
        self.servers: dict[tuple, ServerProcess] = {}

    def get(self, model: Path | str, *flags: str, env: dict[str, str] | None = None) -> ServerProcess:
        """The server for these arguments: started now, or reset when an earlier caller already used it."""
        key = (str(model), flags, tuple(sorted((env or {}).items())))
        server = self.servers.get(key)
        if server is None:
            folder = self.root / f"server-{len(self.servers)}"
            folder.mkdir(parents=True)
            server = ServerProcess(model, *(flag.replace(ROOT, str(folder)) for flag in flags),
                                   log_path=folder / "server.log", env=env)
            self.servers[key] = server
            return server
        if server.process.poll() is not None:
            raise RuntimeError(f"the shared server exited with {server.process.returncode}:\n"
                               f"{server.log_text()[-4000:]}")
        reset_state(server.url)
        return server

    def close(self) -> list[tuple[ServerProcess, int]]:
        """Stop every server; each with its exit status."""
        servers = list(self.servers.values())
        self.servers.clear()
        return list(zip(servers, stop_servers(*servers)))
