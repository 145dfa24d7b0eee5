"""`basert complete`: generate a completion for a prompt (optionally through the chat template)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from basert.cli.flags import add_exact_flag


def model_path_for(spec: str | None) -> Path:
    """Resolve a model spec (see `locate_model`); a conversion on first use shows a progress bar."""
    from basert.cli.progress import ProgressBar
    from basert.convert.default_model import locate_model

    path, converted = locate_model(spec, progress=ProgressBar(f"converting {spec or 'the default model'}"))
    if converted:
        print(f"installed {spec or 'the default model'} at {path}", file=sys.stderr)
    return path


def cmd_complete(args: argparse.Namespace) -> int:
    import basert
    from basert.chat.prompt import plan_chat_prompt

    with basert.Model(model_path_for(args.model), max_context=args.max_context, threads=args.threads) as model:
        prompt = args.prompt
        if args.chat:
            if model.chat_template is None:
                print("error: this model has no chat template", file=sys.stderr)
                return 1
            messages = ([{"role": "system", "content": args.system}] if args.system else [])
            messages.append({"role": "user", "content": prompt})
            prompt = plan_chat_prompt(model.chat_template, model.tokenizer, messages, None).prompt

        printed = 0

        def show(token_id: int, text: str) -> bool:
            nonlocal printed
            sys.stdout.write(text)
            sys.stdout.flush()
            printed += len(text)
            return True

        stats = model.generate(prompt, max_tokens=args.max_tokens, temperature=args.temp, top_k=args.top_k,
                               top_p=args.top_p, min_p=args.min_p, repeat_penalty=args.repeat_penalty,
                               seed=args.seed, callback=show)
        sys.stdout.write(stats.text[printed:])  # text the end released (held for stop strings, a split character)
        if stats.text and not stats.text.endswith("\n"):
            sys.stdout.write("\n")
        print(
            f"[{stats.prompt_tokens} prompt tokens, {stats.prefill_tokens_per_second:.1f} t/s prefill; "
            f"{stats.generated_tokens} generated, {stats.decode_tokens_per_second:.1f} t/s decode; "
            f"finish: {stats.finish_reason}]",
            file=sys.stderr,
        )
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("complete", help="generate a completion for a prompt",
                       description="Generate text for a prompt with a .base model. MODEL is a .base "
                       "file, an installed id (org/name[:variant]) or 'smollm2' (the default, "
                       "converted on first use). Sampling is greedy unless --temp > 0.")
    p.add_argument("model", nargs="?", help="a .base file or installed model id (default: smollm2)")
    p.add_argument("--prompt", "-p", required=True, help="the prompt text")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn with the chat template")
    p.add_argument("--system", help="system message for --chat")
    p.add_argument("--max-tokens", "-n", type=int, default=128, help="tokens to generate at most (default 128)")
    p.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default 0)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    p.add_argument("--repeat-penalty", type=float, default=1.0, help="llama.cpp-style repetition penalty")
    p.add_argument("--seed", type=int, help="random seed for reproducible sampling")
    p.add_argument("--max-context", type=int, default=4096, help="context window (default 4096)")
    p.add_argument("--threads", "-t", type=int, help="engine threads (default: one per physical core)")
    add_exact_flag(p)
    p.set_defaults(func=cmd_complete)
