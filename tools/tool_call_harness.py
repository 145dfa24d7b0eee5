"""Shared-prefix tool-call isolation harness (trio + httpx) against `basert serve`.

    python tools/tool_call_harness.py [MODEL] [-n 8] [--concurrency 2 4] [--serve-flag=--chat-template=FILE ...]

Starts a server, sends N sequential requests "Call lookup_key with key seq-i." (tool lookup_key(key:
string), tool_choice "required", temperature 0), then groups of 2 and 4 concurrent requests with
distinct keys. Each request is then sent alone to a freshly started server; the report says, per
request, the tool call returned and whether it equals the fresh-server answer. With --plain, the
requests are plain chat turns under a shared long system prompt instead (the answer is the text).

With --reference-flags, the answers are compared with one reference server started with those flags
instead (e.g. none: the default single-slot mode), whose slots are all erased before each request, so
every reference answer is computed from an empty server just as on a fresh one.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import trio

from basert.testing.isolation import report, run_harness


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default="smollm2", help=".base file or model id (default smollm2)")
    parser.add_argument("-n", type=int, default=8, help="sequential requests (default 8)")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[2, 4], help="concurrent group sizes")
    parser.add_argument("--plain", action="store_true", help="plain chat with a shared system prompt, no tools")
    parser.add_argument("--serve-flag", action="append", default=[], help="extra flag for basert serve (repeatable)")
    parser.add_argument("--reference-flag", action="append", default=None,
                        help="compare with one reference server started with these flags (repeatable; "
                        "--reference-flag= for none), slots erased before each request, instead of a fresh "
                        "server per request")
    parser.add_argument("--json", type=Path, help="also write the outcomes as JSON here")
    args = parser.parse_args()
    flags = [part for flag in args.serve_flag for part in flag.split("=", 1)]
    reference = None
    if args.reference_flag is not None:
        reference = [part for flag in args.reference_flag if flag for part in flag.split("=", 1)]
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = trio.run(run_harness, args.model, flags, args.n, args.concurrency, args.plain, Path(tmp),
                            reference)
    print(report(outcomes))
    if args.json:
        args.json.write_text(json.dumps([{"label": o.label, "key": o.key, "answer": o.answer, "fresh": o.fresh,
                                          "same": o.same} for o in outcomes], indent=2) + "\n")
    return 0 if all(o.same for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
