"""Disk errors made real: code run in a fresh interpreter whose file size limit (RLIMIT_FSIZE) makes the kernel
refuse its writes with EFBIG (Python ignores SIGXFSZ), as a full disk would."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

DISK_ERROR = "failed: File too large"     # the end of a StorageError's message for such a write


def storage_error_message(limit: int, code: str, *args: str, cwd: Path | None = None) -> str:
    """Run `code` (with `args` in sys.argv[1:]) where writes beyond `limit` bytes fail; its StorageError's message."""
    script = (f"import resource, sys\nfrom basert.format.atomic import StorageError\n"
              f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\ntry:\n"
              f"{textwrap.indent(textwrap.dedent(code), '    ')}\n"
              f"except StorageError as exc:\n    print(exc)\nelse:\n    sys.exit('no StorageError')\n")
    result = subprocess.run([sys.executable, "-c", script, *args], cwd=cwd, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()
