"""`basert inspect`: a .base file's architecture, config, tensor table and totals, and whether it would load."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from basert.cli.progress import ProgressBar
from basert.format import BaseFile, ModelValidationError

CONFIG_SUMMARY_KEYS = (
    "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta",
    "rotary_dim", "rope_style", "rms_norm_eps", "tie_word_embeddings", "norm_plus_one_folded",
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "full_attention_interval",
)


def validation_problem(base: BaseFile) -> str | None:
    """Why loading the model would refuse it (one line), or None: building the model is what checks it."""
    from basert.models import build_model

    try:
        build_model(base, max_pos=1)
    except ModelValidationError as error:
        return str(error)
    return None


def inspect_file(path: Path, *, verify: bool, as_json: bool) -> int:
    """Print the summary of one .base file; returns the exit code (1 when the model would be refused)."""
    with BaseFile(path) as base:
        tensors = list(base.tensors.values())
        by_dtype: dict[str, list[int]] = {}
        for info in tensors:
            entry = by_dtype.setdefault(info.storage, [0, 0, 0])
            entry[0] += 1
            entry[1] += math.prod(info.array_shape)
            entry[2] += info.length
        n_params = sum(v[1] for v in by_dtype.values())
        if verify:
            base.verify_checksums(progress=ProgressBar("verify", width=30) if not as_json else None)
        problem = validation_problem(base)
        if as_json:
            print(json.dumps({
                "file": str(path),
                "file_size": base.file_size,
                "arch": base.arch,
                "source": base.header.get("source"),
                "config": base.config,
                "tensors": [
                    {"name": t.name, "dtype": t.dtype, "shape": list(t.shape), "bytes": t.length,
                     "checksum_xxh64": t.checksum,
                     **({"source_ggml_type": t.block_type.name} if t.block_type is not None else {})}
                    for t in tensors
                ],
                "totals": {"tensors": len(tensors), "parameters": n_params,
                           "by_dtype": {k: {"tensors": v[0], "parameters": v[1], "bytes": v[2]}
                                        for k, v in sorted(by_dtype.items())}},
                "checksums_verified": verify,
                "validation_error": problem,
            }, indent=2))
            return 1 if problem else 0
        source = base.header.get("source") or {}
        print(f"file:     {path} ({base.file_size:,} bytes)")
        print(f"arch:     {base.arch}")
        print(f"source:   {source.get('format')} {source.get('filename', '')}")
        print(f"quant:    {base.header.get('quant_scheme')}   created by basert {base.header.get('baserT_version')}")
        print("config:")
        for key in CONFIG_SUMMARY_KEYS:
            if key in base.config:
                print(f"  {key}: {base.config[key]}")
        print()
        rows = [("name", "dtype", "shape", "bytes")] + [
            (t.name, t.storage + (f"/g{t.group_size}" if t.is_quantized else ""), "x".join(map(str, t.shape)),
             f"{t.length:,}")
            for t in tensors
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for row in rows:
            print(f"  {row[0]:<{widths[0]}}  {row[1]:<{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]:>{widths[3]}}")
        print()
        print(f"totals:   {len(tensors)} tensors, {n_params:,} parameters, "
              f"{sum(v[2] for v in by_dtype.values()):,} tensor bytes")
        for dtype, (count, params, nbytes) in sorted(by_dtype.items()):
            print(f"  {dtype:<8} {count:4d} tensors {params:>14,} parameters {nbytes:>14,} bytes")
        if verify:
            print(f"checksums: OK ({len(tensors)} tensors verified)")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 1
    return 0
