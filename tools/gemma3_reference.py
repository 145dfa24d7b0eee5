"""Reference outputs of Gemma 3 270M (base) from Hugging Face transformers, plus SentencePiece tokenizations.

Writes two fixtures from a Gemma 3 GGUF file:

* ``reference.json``: for each prompt (prose, code, a list, French, Japanese, German, numbers and one
  ~2,000-token prompt that is longer than the 512-token sliding window) the prompt ids (with ``<bos>``),
  32 greedy tokens, and the top-20 float32 logits at the last prompt position (and after 16 generated
  tokens). transformers de-quantizes every GGUF tensor to float32 and runs its own Gemma 3 code (eager
  attention), so this is an implementation independent of BaseRT.
* ``tokenizer-vectors.json``: varied texts encoded by the ``sentencepiece`` library, from a ModelProto
  rebuilt out of the GGUF vocabulary, and by the transformers tokenizer built from the same GGUF.

Run it in a throwaway environment, never as a project dependency (CPU torch is enough)::

    python3 -m venv ENV
    ENV/bin/pip install torch==2.13.0 transformers==5.24.0 accelerate gguf sentencepiece protobuf numpy
    ENV/bin/python tools/gemma3_reference.py --gguf gemma-3-270m-q4_k_m.gguf [--out tests/fixtures/gemma3]

It takes a few minutes on two cores (loading and de-quantizing dominate) and about 3 GB of memory.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import sys
from pathlib import Path

import numpy as np
import sentencepiece as spm
import torch
import transformers
from gguf import GGUFReader
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from transformers import AutoModelForCausalLM, AutoTokenizer

N_GEN = 32
MID = 16
TOP_K = 20
BOS_ID = 2

# GGUF norm tensor suffix -> transformers parameter suffix (per layer); output_norm is model.norm.
NORM_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}

# ---------------------------------------------------------------------------------------------------------------
# Prompts


def long_prompt() -> str:
    """About 2,000 tokens of numbered, distinct sentences; the answer sits before the last 512 tokens."""
    names = (
        "Amara Bastian Chiara Dmitri Elif Farid Greta Hiroshi Ines Jonas Kalani Leif Mireille Nadia "
        "Oskar Priya Quentin Rosalind Sven Tamsin Ulrich Valentina Wen Xavier Yusuf Zofia Abebe Brigid "
        "Cosimo"
    ).split()
    places = (
        "Lisbon Oslo Nairobi Kyoto Valparaiso Tbilisi Quebec Hobart Tromso Cusco Marrakesh Tallinn "
        "Hanoi Galway Bergen Porto Zanzibar Reykjavik Ushuaia Salzburg Cartagena Mandalay Dunedin"
    ).split()
    months = "January February March April May June July August September October November December".split()
    things = (
        "a brass telescope|a cedar canoe|a hand-drawn map of the coast|a violin with a cracked scroll|"
        "a jar of saffron|a clockwork bird|a ledger of ship arrivals|a wool blanket dyed with indigo|"
        "a set of surveying chains|a porcelain teapot|a box of glass negatives|a copper kettle|"
        "a folding bicycle|a weather balloon|a stone mortar|a carved chess set|a tin of maps|"
        "an oak writing desk|a lantern with green glass"
    ).split("|")
    plants = "tomatoes|lavender|garlic|runner beans|basil|rhubarb|sunflowers|kale|thyme|strawberries|leeks".split("|")
    topics = (
        "tidal patterns|bird migration|bread fermentation|glacier retreat|bridge corrosion|"
        "river sediment|solar eclipses|bee foraging|soil acidity|coral bleaching|wind erosion|"
        "volcanic ash|moss growth"
    ).split("|")
    templates = [
        "{n} spent the winter of {y} in {p}, repairing {t} for the harbour office.",
        "In {m} {y}, engineers in {p} tested {t} during a week of heavy rain.",
        "The small museum in {p} keeps {t} that once belonged to {n}.",
        "{n} measured the river temperature near {p} every morning and logged {k} readings in {m}.",
        "A recipe from {p} calls for {k} grams of flour, two eggs, and a spoonful of honey.",
        "The night train from {p} to {q} takes {k} minutes and crosses {j} bridges.",
        "Gardening note: {n} plants {g} in late {m} and waters them every {j} days.",
        "A lecture in {p} by {n} explained how {s} changed between {y} and {z}.",
        "Chess club report: {n} won the {m} tournament in {p} after {k} moves in the final game.",
        "Astronomy log: on {m} {j}, {n} watched a meteor shower from a hill above {p}.",
        "The bakery on the corner of the square in {p} sold {k} loaves on the first day of {m}.",
        "Survey entry: {n} counted {k} houses with red roofs between {p} and {q}.",
        "Software changelog {j}.{k}: {n} fixed a crash that happened when {t} was listed twice.",
        "A letter from {n} to a cousin in {q} describes {s} seen from a ferry near {p}.",
    ]
    lines = []
    for i in range(76):
        values = {
            "n": names[(7 * i + 3) % len(names)],
            "p": places[(5 * i + 1) % len(places)],
            "q": places[(5 * i + 2 + i % 7) % len(places)],
            "t": things[(3 * i + 2) % len(things)],
            "m": months[(5 * i) % len(months)],
            "g": plants[(7 * i) % len(plants)],
            "s": topics[(3 * i + 1) % len(topics)],
            "y": 1820 + (37 * i) % 190,
            "z": 1830 + (37 * i) % 190 + 3 + i % 17,
            "k": 12 + (53 * i) % 480,
            "j": 2 + (13 * i) % 27,
        }
        lines.append(f"{i + 1}. " + templates[i % len(templates)].format(**values))
    head = (
        "Archive notes, volume three. The code word for this archive is MARIGOLD, and the keeper of the "
        "archive is Wilhelmina Okafor. Both will be asked for at the end of these notes.\n\n"
    )
    tail = (
        "\n\nQuestion: What is the code word for this archive, given at the very beginning of these notes?\n"
        "Answer: The code word is"
    )
    return head + "\n".join(lines) + tail


PROMPTS = [
    ("prose", "The history of the printing press began"),
    ("code", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'),
    ("list", "Ingredients for pancakes:\n1."),
    ("french", "La capitale de la France est Paris. Elle est connue pour"),
    ("japanese", "日本の首都は東京です。東京は"),
    ("german", "Es war einmal ein kleines Dorf am Rande eines großen Waldes, in dem"),
    ("numbers", "1, 1, 2, 3, 5, 8, 13,"),
    ("long", long_prompt()),
]

TOKENIZER_TEXTS = [
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n\n",
    " \n \t ",
    "Hello world",
    " Hello world",
    "Hello world ",
    "   three leading spaces",
    "trailing spaces   ",
    "a  b   c    d     e",
    "tab\tseparated\tvalues\nnext line\r\nwindows line",
    "Hello, world! How's it going? (Fine.) [ok] {yes}; -- \"quoted\" 'single' ... !!!",
    "0123456789",
    "3.14159265358979323846264338327950288419716939937510",
    "Order #42 costs $1,299.99 (15% off) on 2024-03-15 at 09:30.",
    "😀🎉👍🏽 emoji and 👨‍👩‍👧‍👦 family",
    "日本語のテキストです。東京は大きい都市です。",
    "中文测试：你好，世界！",
    "한국어 문장입니다.",
    "مرحبا بالعالم، كيف حالك؟",
    "नमस्ते दुनिया, आप कैसे हैं?",
    "Ça va? Élève naïve au café, Größe, Straße, ñandú, Ångström, Dvořák",
    "Здравствуй, мир! Γειά σου Κόσμε!",
    "def foo(x):\n    if x > 0:\n        return x * 2\n    return -x\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
    "https://example.com/path/to-page?query=1&lang=en#section",
    "mail me at first.last+tag@example.org",
    "<table><tr><td>cell</td></tr></table>",
    "[multimodal] marker",
    "\u00a0non-breaking\u00a0space and zero\u200bwidth",
    "NFKC-sensitive: ǅ ﬁ ① ＡＢＣ ½ ㎏",
    "rare: 𠀀 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U000f0000",
    "ALLCAPS CamelCaseWords snake_case_names kebab-case",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos>",
    "<unused0> and <mask> and <pad>",
    "a<start_of_turn>b",
]

# ---------------------------------------------------------------------------------------------------------------
# Helpers


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def f32(x: float) -> float:
    """The shortest decimal that reads back as the same float32."""
    return float(str(np.float32(float(x))))


def field_array(reader: GGUFReader, key: str) -> list:
    field = reader.fields[key]
    return [field.parts[i] for i in field.data]


def gguf_vocab(reader: GGUFReader) -> tuple[list[str], list[float], list[int]]:
    tokens = [bytes(p).decode("utf-8") for p in field_array(reader, "tokenizer.ggml.tokens")]
    scores = [float(p[0]) for p in field_array(reader, "tokenizer.ggml.scores")]
    types = [int(p[0]) for p in field_array(reader, "tokenizer.ggml.token_type")]
    return tokens, scores, types


def sentencepiece_from_gguf(reader: GGUFReader) -> spm.SentencePieceProcessor:
    """Rebuild Gemma's SentencePiece model (BPE, byte fallback, identity normalizer) from GGUF metadata.

    llama.cpp's converter writes user-defined pieces with U+2581 turned into real spaces ("pre-normalize
    user-defined spaces"), so the whitespace-run pieces (ids 138..) are spelled back with U+2581 here, as the
    original tokenizer.model has them; otherwise sentencepiece could never match them.
    """
    tokens, scores, types = gguf_vocab(reader)
    piece_type = sp_pb2.ModelProto.SentencePiece
    type_map = {
        1: piece_type.NORMAL,
        2: piece_type.UNKNOWN,
        3: piece_type.CONTROL,
        4: piece_type.USER_DEFINED,
        5: piece_type.UNUSED,
        6: piece_type.BYTE,
    }
    unk_id = int(reader.fields["tokenizer.ggml.unknown_token_id"].parts[-1][0])
    model = sp_pb2.ModelProto()
    for index, (token, score, kind) in enumerate(zip(tokens, scores, types)):
        piece = model.pieces.add()
        piece.piece = token.replace(" ", "\u2581") if kind == 4 else token
        piece.score = score
        piece.type = piece_type.UNKNOWN if index == unk_id else type_map[kind]
    add_space_prefix = bool(reader.fields["tokenizer.ggml.add_space_prefix"].parts[-1][0])
    trainer = model.trainer_spec
    trainer.model_type = sp_pb2.TrainerSpec.BPE
    trainer.vocab_size = len(tokens)
    trainer.byte_fallback = True
    trainer.unk_id = unk_id
    trainer.bos_id = int(reader.fields["tokenizer.ggml.bos_token_id"].parts[-1][0])
    trainer.eos_id = int(reader.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    trainer.pad_id = int(reader.fields["tokenizer.ggml.padding_token_id"].parts[-1][0])
    normalizer = model.normalizer_spec
    normalizer.name = "identity"
    normalizer.add_dummy_prefix = add_space_prefix
    normalizer.remove_extra_whitespaces = False
    normalizer.escape_whitespaces = True
    processor = spm.SentencePieceProcessor()
    processor.LoadFromSerializedProto(model.SerializeToString())
    return processor


def check_config(config) -> dict:
    n_layers = config.num_hidden_layers
    expected_types = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(n_layers)]
    rope = config.rope_parameters
    derived = {
        "num_hidden_layers": n_layers,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "vocab_size": config.vocab_size,
        "rms_norm_eps": config.rms_norm_eps,
        "sliding_window": config.sliding_window,
        "full_attention_layers": [i for i, kind in enumerate(config.layer_types) if kind == "full_attention"],
        "rope_theta_global": rope["full_attention"]["rope_theta"],
        "rope_type_global": rope["full_attention"]["rope_type"],
        "rope_theta_local": rope["sliding_attention"]["rope_theta"],
        "rope_type_local": rope["sliding_attention"]["rope_type"],
        "query_pre_attn_scalar": config.query_pre_attn_scalar,
        "attn_logit_softcapping": getattr(config, "attn_logit_softcapping", None),
        "final_logit_softcapping": getattr(config, "final_logit_softcapping", None),
        "hidden_activation": config.hidden_activation,
        "tie_word_embeddings": config.tie_word_embeddings,
        "embed_scale": f32(math.sqrt(config.hidden_size)),
        "attn_implementation": config._attn_implementation,
    }
    problems = []
    if config.sliding_window != 512:
        problems.append(f"sliding_window {config.sliding_window}")
    if list(config.layer_types) != expected_types:
        problems.append(f"layer_types {config.layer_types}")
    if derived["rope_theta_global"] != 1e6 or derived["rope_theta_local"] != 1e4:
        problems.append(f"rope {rope}")
    if "default" not in (derived["rope_type_global"], derived["rope_type_local"]):
        problems.append(f"rope type {rope}")
    if config.query_pre_attn_scalar != 256:
        problems.append(f"query_pre_attn_scalar {config.query_pre_attn_scalar}")
    if derived["final_logit_softcapping"] is not None or derived["attn_logit_softcapping"] is not None:
        problems.append("softcapping set")
    if config.hidden_activation != "gelu_pytorch_tanh":
        problems.append(f"hidden_activation {config.hidden_activation}")
    if problems:
        raise SystemExit("unexpected config: " + "; ".join(problems))
    return derived


def check_norms(model, reader: GGUFReader) -> dict:
    """transformers must store Gemma norms as w where llama.cpp stored 1 + w; fix them up if it did not."""
    params = dict(model.named_parameters())
    fixed = 0
    worst = 0.0
    count = 0
    for tensor in reader.tensors:
        if not tensor.name.endswith("norm.weight"):
            continue
        parts = tensor.name.split(".")
        if parts[0] == "output_norm":
            hf_name = "model.norm.weight"
        else:
            hf_name = f"model.layers.{parts[1]}.{NORM_NAMES[parts[2]]}.weight"
        stored = torch.from_numpy(np.array(tensor.data, dtype=np.float32)).reshape(-1)
        loaded = params[hf_name].data
        count += 1
        if torch.equal(loaded, stored):
            loaded.sub_(1.0)
            fixed += 1
        worst = max(worst, float((loaded - (stored - 1.0)).abs().max()))
    if worst != 0.0:
        raise SystemExit(f"norm weights differ from GGUF - 1 by {worst}")
    return {"norm_tensors": count, "fixed_up_by_script": fixed, "max_abs_diff_vs_gguf_minus_1": worst}


def top_k(row: torch.Tensor, k: int = TOP_K) -> tuple[list[int], list[float]]:
    values, indices = torch.topk(row, k)
    return [int(i) for i in indices], [f32(v) for v in values]


@torch.no_grad()
def greedy(model, prompt_ids: list[int]) -> list[int]:
    """N_GEN argmax steps with a KV cache; no logits processors, EOS does not stop it."""
    cache = transformers.DynamicCache(config=model.config)
    ids = torch.tensor([prompt_ids])
    out = []
    for _ in range(N_GEN):
        result = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = result.past_key_values
        token = int(torch.argmax(result.logits[0, -1]))
        out.append(token)
        ids = torch.tensor([[token]])
    return out


@torch.no_grad()
def teacher_forced(model, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """No-cache forward of prompt + generated[:-1]; logits rows predicting generated[0..N_GEN-1]."""
    ids = torch.tensor([prompt_ids + generated[:-1]])
    return model(input_ids=ids, use_cache=False, logits_to_keep=N_GEN).logits[0]


# ---------------------------------------------------------------------------------------------------------------
# Output


def dump_objects(header_key: str, header: dict, list_key: str, items: list[dict], path: Path) -> None:
    """One object per line after the header, so diffs stay readable."""
    lines = [
        "{",
        f"  {json.dumps(header_key)}: {json.dumps(header, ensure_ascii=False)},",
        f"  {json.dumps(list_key)}: [",
    ]
    for index, item in enumerate(items):
        comma = "," if index + 1 < len(items) else ""
        lines.append("    " + json.dumps(item, ensure_ascii=False) + comma)
    lines += ["  ]", "}"]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True, help="Gemma 3 270M GGUF file")
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures/gemma3"), help="output folder")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gguf_path = args.gguf.resolve()
    args.out.mkdir(parents=True, exist_ok=True)

    digest = sha256(gguf_path)
    print(f"gguf {gguf_path.name} sha256 {digest}", flush=True)
    reader = GGUFReader(str(gguf_path))
    sp = sentencepiece_from_gguf(reader)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, attn_implementation="eager"
    )
    model.eval()
    derived = check_config(model.config)
    norms = check_norms(model, reader)
    print("derived config:", json.dumps(derived), flush=True)
    print("norms:", json.dumps(norms), flush=True)

    # Tokenizer vectors.
    tokens, _, types = gguf_vocab(reader)
    control_texts = [t for t, kind in zip(tokens, types) if kind == 3]
    vectors = []
    disagreements = []
    for text in TOKENIZER_TEXTS:
        sp_ids = [int(i) for i in sp.encode(text)]
        hf_ids = tokenizer(text, add_special_tokens=False).input_ids
        has_control = any(c in text for c in control_texts)
        vectors.append(
            {
                "text": text,
                "contains_control_token_text": has_control,
                "sentencepiece_ids": sp_ids,
                "transformers_ids": hf_ids,
            }
        )
        if sp_ids != hf_ids:
            disagreements.append(text)
            print(
                f"tokenizers differ{' (control text)' if has_control else ''}: {text!r}\n  sp {sp_ids}\n  hf {hf_ids}"
            )
    unexpected = [v["text"] for v in vectors if v["text"] in disagreements and not v["contains_control_token_text"]]
    print(f"tokenizer vectors: {len(vectors)}, disagreements {len(disagreements)}, unexpected {len(unexpected)}")

    # Model references.
    records = []
    long_check = {}
    for name, text in PROMPTS:
        prompt_ids = tokenizer(text, add_special_tokens=True).input_ids
        if prompt_ids[0] != BOS_ID or prompt_ids[1:] != [int(i) for i in sp.encode(text)]:
            raise SystemExit(f"{name}: transformers prompt ids are not <bos> + sentencepiece ids")
        generated = greedy(model, prompt_ids)
        rows = teacher_forced(model, prompt_ids, generated)
        forced = [int(i) for i in torch.argmax(rows, dim=-1)]
        if forced != generated:
            raise SystemExit(f"{name}: cached greedy {generated} != no-cache teacher-forced argmax {forced}")
        top2 = torch.topk(rows, 2, dim=-1).values
        ids20, logits20 = top_k(rows[0])
        mid_ids20, mid_logits20 = top_k(rows[MID])
        record = {
            "name": name,
            "text": text,
            "n_prompt_tokens": len(prompt_ids),
            "prompt_ids": prompt_ids,
            "generated_ids": generated,
            "generated_text": tokenizer.decode(generated),
            "top20_ids": ids20,
            "top20_logits": logits20,
            "last_logsumexp": f32(torch.logsumexp(rows[0], dim=-1)),
            "mid_top20_ids": mid_ids20,
            "mid_top20_logits": mid_logits20,
            "step_margins": [round(float(a - b), 4) for a, b in top2.tolist()],
        }
        records.append(record)
        print(f"[{name}] {len(prompt_ids)} tokens -> {record['generated_text']!r}", flush=True)
        if len(prompt_ids) > derived["sliding_window"]:
            # The same forward with the window opened up must differ, or the window was not applied.
            model.config.sliding_window = 1 << 20
            with torch.no_grad():
                wide = model(input_ids=torch.tensor([prompt_ids]), use_cache=False, logits_to_keep=1).logits[0, -1]
            model.config.sliding_window = derived["sliding_window"]
            diff = float((wide - rows[0]).abs().max())
            long_check = {
                "prompt": name,
                "max_abs_logit_change_without_window": round(diff, 4),
                "argmax_with_window": int(torch.argmax(rows[0])),
                "argmax_without_window": int(torch.argmax(wide)),
            }
            print("sliding window check:", json.dumps(long_check), flush=True)
            if diff < 1e-3:
                raise SystemExit("sliding window had no effect on the long prompt")

    versions = {name: importlib.metadata.version(name) for name in ("transformers", "torch", "gguf", "sentencepiece")}
    header = {
        "model": "Gemma 3 270M (base)",
        "gguf_file": gguf_path.name,
        "gguf_sha256": digest,
        "versions": versions,
        "derived_config": derived,
        "norm_weights": norms,
        "sliding_window_check": long_check,
        "n_gen": N_GEN,
        "notes": [
            "weights: transformers de-quantizes every GGUF tensor to float32 and subtracts 1 from the *norm.weight "
            "tensors (llama.cpp stores Gemma's RMSNorm weight as 1 + w); attention is eager",
            "read from the GGUF: layers, widths, heads, head_dim, rms eps, rope.freq_base (global), sliding_window; "
            "defaulted by Gemma3TextConfig: layer pattern (every 6th full), local rope base 10000, "
            "query_pre_attn_scalar 256, no softcapping, gelu_pytorch_tanh",
            "sliding window: a query at position q sees keys k with q - 512 < k <= q",
            "prompt_ids: transformers tokenizer with add_special_tokens=True (<bos> = 2, no EOS); equals "
            "[2] + sentencepiece ids",
            "generated_ids: 32 raw argmax steps with a KV cache, no logits processors, not stopped by EOS; "
            "confirmed by a no-cache teacher-forced forward of prompt + generated[:-1]",
            "top20_ids/top20_logits: the 20 largest float32 logits at the last prompt position (predicting "
            "generated_ids[0]); last_logsumexp is the logsumexp of that row",
            "mid_top20_*: the same after prompt + generated_ids[:16] (predicting generated_ids[16])",
            "step_margins: top1 - top2 logit gap at each greedy step; a small gap can flip under rounding",
        ],
    }
    dump_objects("header", header, "prompts", records, args.out / "reference.json")
    tok_header = {
        "gguf_file": gguf_path.name,
        "gguf_sha256": digest,
        "versions": versions,
        "disagreements": disagreements,
        "notes": [
            "sentencepiece_ids: sentencepiece.encode(text) with a ModelProto built from the GGUF vocabulary: BPE, "
            "piece scores from tokenizer.ggml.scores, byte_fallback, identity normalizer, no dummy prefix "
            "(tokenizer.ggml.add_space_prefix is false), whitespace escaped to U+2581, extra whitespace kept; "
            "user-defined pieces get U+2581 back where llama.cpp wrote real spaces",
            "sentencepiece never matches control tokens (<start_of_turn>, <bos>, ...) in plain text; "
            "transformers_ids (add_special_tokens=False) does, so the two differ where "
            "contains_control_token_text is true",
        ],
    }
    dump_objects("header", tok_header, "vectors", vectors, args.out / "tokenizer-vectors.json")
    for path in (args.out / "reference.json", args.out / "tokenizer-vectors.json"):
        print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
