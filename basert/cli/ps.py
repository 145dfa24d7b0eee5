"""`basert ps`: the models a running server has loaded (or, with --all, every model it serves)."""

from __future__ import annotations

import argparse
import json
import sys
import time

from basert.cli.slots import call


def until(expires_at: float | None, now: float) -> str:
    """When a loaded model will be unloaded, as `ollama ps` says it."""
    if expires_at is None:
        return "forever"
    left = max(0, int(expires_at - now))
    return f"{left // 60} minutes from now" if left >= 120 else f"{left} seconds from now"


def cmd_ps(args: argparse.Namespace) -> int:
    status, body = call(args.url, "GET", "/v1/models", args.api_key)
    if status >= 400 or not isinstance(body, dict):
        message = body.get("error", {}).get("message") if isinstance(body, dict) else body
        print(f"error: HTTP {status}: {message}", file=sys.stderr)
        return 1
    models = [m for m in body.get("data", []) if args.all or m.get("status", {}).get("value") == "loaded"]
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    now = time.time()
    print(f"{'NAME':<40} {'STATE':<10} {'SIZE':>10} {'SLOTS':>5}  UNTIL")
    for model in models:
        state = model.get("status", {})
        loaded = state.get("value") == "loaded"
        size = f"{state.get('memory_bytes', 0) / 2**20:.0f} MiB" if loaded else "-"
        slots = str(model.get("meta", {}).get("slots", "-"))
        print(f"{model['id']:<40} {state.get('value', '?'):<10} {size:>10} {slots:>5}  "
              f"{until(state.get('expires_at'), now) if loaded else '-'}")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("ps", help="list the models a running server has loaded",
                       description="The models a running `basert serve` has loaded: their memory (weights and KV "
                       "pool), slots, and when they will be unloaded if no request uses them.")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server URL (default http://127.0.0.1:8080)")
    p.add_argument("--api-key", help="API key, if the server requires one")
    p.add_argument("--all", action="store_true", help="every servable model, loaded or not")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_ps)
