"""`basert slots list|save|restore|erase`: slot administration of a running server, for operators."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request


def call(url: str, method: str, path: str, api_key: str | None, body: dict | None = None) -> tuple[int, object]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url.rstrip("/") + path, data=data, method=method)
    request.add_header("Content-Type", "application/json")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        try:
            return error.code, json.loads(error.read() or b"null")
        except ValueError:
            return error.code, {"error": {"message": error.reason}}


def cmd_slots(args: argparse.Namespace) -> int:
    query = f"?model={args.model}" if args.model else ""
    if args.action == "list":
        status, body = call(args.url, "GET", f"/slots{query}", args.api_key)
    elif args.action == "erase":
        status, body = call(args.url, "POST", f"/slots/{args.slot}/erase{query}", args.api_key, {})
    elif args.filename and args.action in ("save", "restore"):
        sep = "&" if query else "?"
        status, body = call(args.url, "POST", f"/slots/{args.slot}{query}{sep}action={args.action}", args.api_key,
                            {"filename": args.filename})
    elif args.action == "save":
        status, body = call(args.url, "POST", f"/slots/{args.slot}/save{query}", args.api_key, {})
    else:
        if not args.file_id:
            print("error: restore needs --file-id (files store) or --filename (--slot-save-path)", file=sys.stderr)
            return 2
        status, body = call(args.url, "POST", f"/slots/{args.slot}/restore{query}", args.api_key,
                            {"file_id": args.file_id})
    if status >= 400:
        message = body.get("error", {}).get("message") if isinstance(body, dict) else body
        print(f"error: HTTP {status}: {message}", file=sys.stderr)
        return 1
    if args.action == "list" and not args.json:
        print(f"{'ID':>3}  {'BUSY':<5} {'TOKENS':>7} {'N_CTX':>6}  MODEL")
        for slot in body:
            print(f"{slot['id']:>3}  {str(slot['is_processing']).lower():<5} {slot['cache_tokens']:>7} "
                  f"{slot['n_ctx']:>6}  {slot['model']}")
    else:
        print(json.dumps(body, indent=2))
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("slots", help="list, save, restore or erase the slots of a running server",
                       description="Slot administration over HTTP. save/restore use the server's files store "
                       "(--files-dir) unless --filename is given (then --slot-save-path, llama.cpp style).")
    p.add_argument("action", choices=("list", "save", "restore", "erase"))
    p.add_argument("slot", nargs="?", type=int, default=0, help="slot id (default 0)")
    p.add_argument("--url", default="http://127.0.0.1:8080", help="server URL (default http://127.0.0.1:8080)")
    p.add_argument("--api-key", help="API key, if the server requires one")
    p.add_argument("--model", help="model id, when the server serves several")
    p.add_argument("--file-id", help="snapshot to restore from the files store")
    p.add_argument("--filename", help="snapshot file name under the server's --slot-save-path")
    p.add_argument("--json", action="store_true", help="print `list` as JSON")
    p.set_defaults(func=cmd_slots)
