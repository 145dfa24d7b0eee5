"""Reference outputs of a tiny, randomly initialised Qwen2ForCausalLM from Hugging Face transformers.

Builds ``Qwen2ForCausalLM`` (model_type ``qwen2``: q/k/v projection biases, no q/k norms, split-half "NEOX"
RoPE) with ``AutoModelForCausalLM.from_config`` under a fixed ``torch.manual_seed``, in float32, with eager
attention, and writes a test fixture folder in the layout of ``tests/fixtures/refdata/models/qwen3-tiny/``:

* ``config.json``, ``generation_config.json``, ``model.safetensors``: ``save_pretrained`` (safetensors,
  float32; the embeddings are tied, so there is no ``lm_head.weight`` in the file).
* ``reference.json``: the outputs below, all computed by transformers, none by BaseRT.

Shape: hidden 64, MLP 128, 3 layers, 4 heads, 2 KV heads (head_dim 16, derived, not in config.json), vocab 512,
rms eps 1e-6, rope_theta 1e6, tied embeddings, ``initializer_range`` 0.125 (about 1/sqrt(hidden), so every
layer visibly changes the residual).

transformers initialises every Linear bias to zero and every RMSNorm weight to one, which would leave a test
blind to a dropped bias or a wrong norm convention. After ``from_config`` the script therefore draws, under the
same seed: q_proj.bias ~ N(0, 0.5), k_proj.bias ~ N(0, 2.0) (real Qwen2 checkpoints have large k biases),
v_proj.bias ~ N(0, 0.5), and adds N(0, 0.1) noise to every ``*norm.weight`` (as the other tiny fixtures do).

Run it in a throwaway environment, never as a project dependency. A CPU build of torch is enough (do not let pip
pull the default CUDA wheel)::

    python3 -m venv ENV
    ENV/bin/pip install TORCH_CPU_WHEEL      # torch 2.13.0+cpu, the CPU-only build
    ENV/bin/pip install transformers==5.24.0 safetensors numpy
    ENV/bin/python tools/tiny_reference.py --out tests/fixtures/refdata/models/qwen2-tiny

The fixture in the repository was made with python 3.11, torch 2.13.0+cpu, transformers 5.24.0, safetensors
0.8.0 and numpy 2.4.6 on 2 threads (``reference.json`` records the versions). It takes a few seconds. Other
thread counts or versions may change the last bits of a float.

reference.json, top level:

* ``model``, ``hf_class``, ``model_type``, ``seed`` (the ``torch.manual_seed`` of the weights), ``vocab_size``,
  ``layer_types`` (from the config), ``n_gen`` (greedy steps), ``notes`` (these field meanings, in short).
* ``prompts``: one object per prompt, below.
* ``saved_tensors``: name -> {shape, dtype} of every tensor in model.safetensors.
* ``perturbation``: the bias standard deviations and the norm noise applied after ``from_config``, with the
  largest |bias| per projection as saved.
* ``versions``: python, torch, transformers, safetensors, numpy, torch thread count.

Each prompt (ids random in [0, vocab), from one ``torch.Generator`` seeded with PROMPT_SEED + vocab and drawn
in order of length, so the ids equal those of the other tiny fixtures; they mean nothing as text):

* ``name``, ``length``, ``input_ids``.
* ``last_logits``: float32 logits at the last prompt position, from one no-cache forward of the whole prompt.
* ``argmax_all``, ``margin_all``: argmax and top1 - top2 logit gap at every prompt position (same forward).
* ``max_logit_all``, ``logsumexp_all``: max and logsumexp of the logit row at every prompt position.
* ``greedy``: ``generate(use_cache=True, do_sample=False)``, n_gen new tokens, EOS never stops it.
* ``greedy_manual``: the same by hand with a ``DynamicCache`` (one prefill, then one token a step).
* ``greedy_step_margins``: top1 - top2 gap at each manual greedy step; a small gap can flip under rounding.
* ``prefill_with_cache_last_logits_maxabs_diff_vs_no_cache``: the cached prefill's last row against last_logits.
* ``two_piece``: the prompt fed as prompt[:split] then prompt[split:] into one cache, then greedy: ``split``,
  ``greedy``, ``equals_one_shot``, ``last_logits_maxabs_diff_vs_one_shot`` and ``step_margins``.
* ``float64_teacher_forced``: prompt + greedy[:-1] run once in float32 and once in float64 (same weights): the
  largest logit difference over all positions and over the generated steps, and how many argmaxes agree; a
  yardstick for rounding noise.

Before it exits the script loads the saved folder again with ``from_pretrained``, checks that it reproduces
every ``last_logits`` exactly and that the saved q/k/v biases are the nonzero ones, and prints the largest
|bias| per projection.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import platform
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, DynamicCache, PreTrainedModel, Qwen2Config

PROMPT_SEED = 1234
PROMPT_LENGTHS = (7, 33, 200)
# Where two_piece cuts each prompt (the same cuts as the other tiny fixtures).
SPLITS = {7: 3, 33: 16, 200: 130}
N_GEN = 16
BIAS_STD = {"q_proj": 0.5, "k_proj": 2.0, "v_proj": 0.5}
NORM_NOISE_STD = 0.1

NOTES = [
    "prompt ids are random (torch.Generator seed PROMPT_SEED+vocab); they carry no text meaning",
    "weights: from_config under torch.manual_seed(seed), then q/k/v_proj.bias ~ N(0, std) with the stds in "
    "'perturbation' (transformers initialises biases to zero) and N(0, 0.1) noise added to every *norm.weight",
    "last_logits: float32 logits at the last prompt position from one no-cache forward",
    "argmax_all / margin_all: argmax and top1-top2 logit gap at every prompt position (same forward)",
    "max_logit_all / logsumexp_all: max and logsumexp of the logit row at every prompt position",
    "greedy: HF generate(use_cache=True, greedy, no EOS); greedy_manual: same by hand with DynamicCache",
    "float64_teacher_forced: prompt+greedy run once in float32 and once in float64 (same weights): a yardstick "
    "for rounding noise",
    "two_piece: prompt fed as prompt[:split] then prompt[split:] into one cache, then greedy",
]


def f32(x: float) -> float:
    """The shortest decimal that reads back as the same float32."""
    return float(str(np.float32(float(x))))


def gap(x: float) -> float:
    return round(float(x), 6)


def make_config(args: argparse.Namespace) -> Qwen2Config:
    return Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_act="silu",
        max_position_embeddings=2048,
        initializer_range=0.125,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        dtype="float32",
    )


@torch.no_grad()
def build_model(config: Qwen2Config, seed: int) -> PreTrainedModel:
    """from_config under the seed, then random q/k/v biases and norm noise under the same generator state."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    for name, param in model.named_parameters():
        kind = name.split(".")[-2]
        if name.endswith(".bias") and kind in BIAS_STD:
            param.normal_(0.0, BIAS_STD[kind])
        elif name.endswith("norm.weight"):
            param.add_(torch.randn_like(param) * NORM_NOISE_STD)
    model.eval()
    return model


def make_prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(PROMPT_SEED + vocab)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def top2_gaps(logits: torch.Tensor) -> torch.Tensor:
    values = torch.topk(logits, 2, dim=-1).values
    return values[..., 0] - values[..., 1]


@torch.no_grad()
def full_logits(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] logits from one no-cache forward."""
    return model(input_ids=torch.tensor([ids]), use_cache=False).logits[0].float()


@torch.no_grad()
def hf_generate(model: PreTrainedModel, ids: list[int]) -> list[int]:
    out = model.generate(
        input_ids=torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=N_GEN,
        min_new_tokens=N_GEN,
        do_sample=False,
        use_cache=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


@torch.no_grad()
def greedy_from(model: PreTrainedModel, cache: DynamicCache, last: torch.Tensor) -> tuple[list[int], list[float]]:
    """N_GEN argmax steps continuing a filled cache from the logits row `last`."""
    tokens: list[int] = []
    margins: list[float] = []
    logits = last
    for step in range(N_GEN):
        token = int(torch.argmax(logits))
        tokens.append(token)
        margins.append(gap(top2_gaps(logits)))
        if step + 1 == N_GEN:
            break
        out = model(input_ids=torch.tensor([[token]]), cache=cache, use_cache=True)
        logits = out.logits[0, -1].float()
    return tokens, margins


@torch.no_grad()
def cached_prefill(model: PreTrainedModel, pieces: list[list[int]]) -> tuple[DynamicCache, torch.Tensor]:
    """Feed the pieces one after another into one DynamicCache; the last row of the last piece."""
    cache = DynamicCache(config=model.config)
    logits = None
    for piece in pieces:
        out = model(input_ids=torch.tensor([piece]), cache=cache, use_cache=True)
        logits = out.logits[0, -1].float()
    return cache, logits


@torch.no_grad()
def float64_check(model64: PreTrainedModel, model: PreTrainedModel, ids: list[int], greedy: list[int]) -> dict:
    seq = ids + greedy[:-1]
    lo = full_logits(model, seq).double()
    hi = model64(input_ids=torch.tensor([seq]), use_cache=False).logits[0]
    diff = (lo - hi).abs().max(dim=-1).values
    return {
        "max_abs_logit_diff_all_positions": f32(diff.max()),
        "max_abs_logit_diff_generated_steps": f32(diff[len(ids) - 1 :].max()),
        "argmax_agree": int((lo.argmax(-1) == hi.argmax(-1)).sum()),
        "positions": len(seq),
    }


def prompt_record(model: PreTrainedModel, model64: PreTrainedModel, name: str, ids: list[int]) -> dict:
    rows = full_logits(model, ids)
    last = rows[-1]
    greedy = hf_generate(model, ids)
    cache, prefill_last = cached_prefill(model, [ids])
    manual, step_margins = greedy_from(model, cache, prefill_last)
    split = SPLITS[len(ids)]
    cache2, two_last = cached_prefill(model, [ids[:split], ids[split:]])
    two_greedy, two_margins = greedy_from(model, cache2, two_last)
    return {
        "name": name,
        "length": len(ids),
        "input_ids": ids,
        "last_logits": [f32(v) for v in last],
        "argmax_all": rows.argmax(-1).tolist(),
        "margin_all": [gap(v) for v in top2_gaps(rows)],
        "max_logit_all": [f32(v) for v in rows.max(-1).values],
        "logsumexp_all": [f32(v) for v in torch.logsumexp(rows, -1)],
        "greedy": greedy,
        "greedy_manual": manual,
        "greedy_step_margins": step_margins,
        "prefill_with_cache_last_logits_maxabs_diff_vs_no_cache": f32((prefill_last - last).abs().max()),
        "two_piece": {
            "split": split,
            "greedy": two_greedy,
            "equals_one_shot": two_greedy == greedy,
            "last_logits_maxabs_diff_vs_one_shot": f32((two_last - last).abs().max()),
            "step_margins": two_margins,
        },
        "float64_teacher_forced": float64_check(model64, model, ids, greedy),
    }


def saved_tensors(path: Path) -> dict:
    out = {}
    with safe_open(str(path), framework="pt") as fh:
        for key in sorted(fh.keys()):
            meta = fh.get_slice(key)
            out[key] = {"shape": list(meta.get_shape()), "dtype": meta.get_dtype()}
    return out


def bias_maxima(path: Path) -> dict[str, float]:
    """Largest |bias| per projection kind over all layers, read back from the safetensors file."""
    maxima = {kind: 0.0 for kind in BIAS_STD}
    with safe_open(str(path), framework="pt") as fh:
        for key in fh.keys():
            kind = key.split(".")[-2]
            if key.endswith(".bias") and kind in maxima:
                maxima[kind] = max(maxima[kind], float(fh.get_tensor(key).abs().max()))
    return maxima


def check_saved(out: Path, records: list[dict], n_layers: int) -> dict[str, float]:
    """Reload the folder; every last_logits must come back exactly and the q/k/v biases must be nonzero."""
    tensors = saved_tensors(out / "model.safetensors")
    for layer in range(n_layers):
        for kind in BIAS_STD:
            key = f"model.layers.{layer}.self_attn.{kind}.bias"
            if key not in tensors:
                raise SystemExit(f"{key} missing from model.safetensors")
    maxima = bias_maxima(out / "model.safetensors")
    if min(maxima.values()) == 0.0:
        raise SystemExit(f"a saved bias is all zero: {maxima}")
    reloaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, attn_implementation="eager")
    reloaded.eval()
    for record in records:
        last = full_logits(reloaded, record["input_ids"])[-1]
        diff = float(np.max(np.abs(last.numpy() - np.asarray(record["last_logits"], dtype=np.float32))))
        print(f"reload {record['name']}: max |last_logits diff| {diff}", flush=True)
        if diff != 0.0:
            raise SystemExit(f"{record['name']}: reloaded model does not reproduce last_logits")
    return maxima


def versions(threads: int) -> dict:
    found = {"python": platform.python_version()}
    found.update({name: importlib.metadata.version(name) for name in ("torch", "transformers", "safetensors", "numpy")})
    found["torch_num_threads"] = threads
    return found


def build_reference(args: argparse.Namespace, model: PreTrainedModel, records: list[dict], maxima: dict) -> dict:
    return {
        "model": args.out.name,
        "hf_class": type(model).__name__,
        "model_type": model.config.model_type,
        "seed": args.seed,
        "vocab_size": model.config.vocab_size,
        "layer_types": list(model.config.layer_types),
        "n_gen": N_GEN,
        "notes": NOTES,
        "prompts": records,
        "saved_tensors": saved_tensors(args.out / "model.safetensors"),
        "perturbation": {
            "bias_std": BIAS_STD,
            "norm_weight_noise_std": NORM_NOISE_STD,
            "max_abs_bias_saved": {kind: f32(v) for kind, v in maxima.items()},
        },
        "versions": versions(args.threads),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/refdata/models/qwen2-tiny"), help="folder")
    parser.add_argument("--seed", type=int, default=202, help="torch.manual_seed of the weights and biases")
    parser.add_argument("--vocab", type=int, default=512, help="vocabulary size (prompt ids are drawn below it)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(make_config(args), args.seed)
    model64 = copy.deepcopy(model).to(torch.float64)
    records = [prompt_record(model, model64, f"p{len(ids)}", ids) for ids in make_prompts(args.vocab)]
    for record in records:
        if record["greedy"] != record["greedy_manual"]:
            raise SystemExit(f"{record['name']}: generate {record['greedy']} != manual {record['greedy_manual']}")
        print(
            f"[{record['name']}] greedy {record['greedy']} two_piece equal {record['two_piece']['equals_one_shot']} "
            f"min step margin {min(record['greedy_step_margins'])}",
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(args.out), safe_serialization=True)
    maxima = check_saved(args.out, records, model.config.num_hidden_layers)
    print("max |bias| per projection:", json.dumps(maxima), flush=True)
    reference = build_reference(args, model, records, maxima)
    path = args.out / "reference.json"
    path.write_text(json.dumps(reference, separators=(",", ":")), encoding="utf-8")
    for item in sorted(args.out.iterdir()):
        print(f"wrote {item} ({item.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
