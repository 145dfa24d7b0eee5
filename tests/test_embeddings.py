"""Embeddings: the last hidden states pooled and L2-normalised, on SmolLM2 and the tiny Qwen3.5-style hybrid.

The engine's hidden states are checked against the generation path (pushed through the model's own head they
give its logits, bit for bit) and against causality (a position's state equals the last state of the prefix
run alone); an embedding must not depend on its neighbours in a batch, on chunking, on the KV mode, or on
what the slots hold, and must leave every slot, cached block and recurrent state as it found them. Then the
HTTP routes on real servers: shapes, encodings, usage, errors, the `openai` SDK, and chat traffic around them.
"""

from __future__ import annotations

import base64
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import trio
from conftest import HYBRID_CHAT_FLAGS, SMOLLM2_CHAT_FLAGS

from basert import Model
from basert._ext import matmul as mm
from basert.engine import EngineOptions, build_engine
from basert.engine.embeddings import hidden_states, input_batches, pooled
from basert.engine.engine import Engine
from basert.engine.runner import ForwardRequest
from basert.engine.sampler import SamplingParams
from basert.engine.types import FailEvent, FinishEvent, GenerationRequest, TokenEvent
from basert.errors import InvalidRequestError
from basert.testing.client import answer, error_envelope, post
from basert.testing.launcher import ServerProcess
from basert.testing.pool import ServerPool

TEXT = "The quick brown fox jumps over the lazy dog, then naps in the warm afternoon sun."
OTHER = "Embeddings map text to vectors."
LONG = " ".join(f"word{i}" for i in range(40))        # about 110 tokens: more than the test engines' budget
TEST_BUDGET = 64                                       # tokens per forward of the test engines (servers: 512)
# The engines here run on one thread: the servers beside them have the cores, and the kernels give the same
# bits on any number of threads (the servers' vectors are compared with these engines').
THREADS = 1
SERVER_BUDGET = 512
QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]
# The one server started for this module: the hybrid with the other pooling, continuous batching and the
# prefix cache (paged KV); the engine tests cover every KV mode on both models.
LAST_POOLING_FLAGS = (*HYBRID_CHAT_FLAGS, "--pooling", "last", "--continuous-batching", "2", "--prefix-cache")
KV_MODES = {
    "contiguous": {},
    "paged": {"paged_kv": True, "n_slots": 2},
    "continuous-batching": {"continuous_batching": True, "n_slots": 2},
    "prefix-cache": {"prefix_cache": True},
}


# --- engines ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(smollm2_base: Path, qwen35_chat_base: Path):
    """Engines with the KV options of the chat servers (max context 1024, 16-bit KV), by model name; their
    smaller token budget makes a short text span several forwards."""
    options = EngineOptions(max_context=1024, threads=THREADS, token_budget=TEST_BUDGET)
    built = {"smollm2": build_engine(smollm2_base, options), "hybrid": build_engine(qwen35_chat_base, options)}
    yield built
    for engine in built.values():
        engine.close()


@pytest.fixture(scope="module")
def paths(smollm2_base: Path, qwen35_chat_base: Path) -> dict[str, Path]:
    return {"smollm2": smollm2_base, "hybrid": qwen35_chat_base}


def encode(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def greedy(engine: Engine, prompt: list[int], max_tokens: int = 4) -> tuple[list[int], int]:
    """A greedy generation's tokens and cached prompt tokens."""
    request = GenerationRequest(f"r{len(prompt)}", prompt, max_tokens, SamplingParams(temperature=0.0),
                                ignore_eos=True)
    tokens, cached = [], -1
    for event in engine.generate(request):
        if isinstance(event, FailEvent):
            raise event.error
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
        elif isinstance(event, FinishEvent):
            cached = event.usage.cached_tokens
    return tokens, cached


def engine_state(engine: Engine) -> dict:
    """Everything an embedding must leave as it was: the pool's bookkeeping, the KV of every held or cached
    block, each slot's history, block table and recurrent state, and the prefix cache's entries and snapshots."""
    runner, pool = engine.runner, engine.runner.pool
    kept = sorted(set(np.flatnonzero(pool.ref_counts).tolist()) | pool.cached)
    state = {
        "ref_counts": pool.ref_counts.tobytes(), "free": sorted(pool.free_ids), "cached": sorted(pool.cached),
        "evictable": list(pool.evictable),
        "kv": b"".join(cache[kept].tobytes() for cache in (*runner.kv.k, *runner.kv.v)),
        "slots": [(list(slot.sequence.tokens), slot.sequence.block_table.view().tolist(),
                   list(slot.sequence.block_keys), recurrent_bytes(slot.sequence.recurrent),
                   [(c.n_tokens, recurrent_bytes(c.state)) for c in slot.checkpoints]) for slot in engine.slots],
    }
    cache = engine.prefix_cache
    if cache is not None:
        state["cache"] = (sorted(cache.entries), {key: (recurrent_bytes(s.state), s.charged_blocks)
                                                  for key, s in cache.snapshots.items()})
    return state


def recurrent_bytes(state) -> bytes:
    return b"" if state is None else state.conv.tobytes() + state.ssm.tobytes()


@pytest.mark.parametrize("name", ["smollm2", "hybrid"])
def test_hidden_states_are_what_the_head_reads(name: str, engines: dict[str, Engine]):
    """The scratch sequence's hidden states, through the model's own head kernel, are bit for bit the logits the
    generation path computes for every position of the same tokens."""
    engine = engines[name]
    runner = engine.runner
    tokens = encode(engine, TEXT)
    states = hidden_states(runner, [tokens], engine.token_budget)[0]
    sequence = runner.new_sequence()
    logits = runner.forward([ForwardRequest(sequence, tokens, "all")])[0].copy()
    runner.release(sequence)
    through_head = np.empty((len(tokens), runner.vocab_size), dtype=np.float32)
    mm.matmul(states, runner.model.head, through_head)
    assert states.shape == (len(tokens), runner.hidden_size)
    assert np.array_equal(through_head, logits)


@pytest.mark.parametrize("name", ["smollm2", "hybrid"])
def test_a_position_state_equals_the_last_state_of_its_prefix(name: str, engines: dict[str, Engine]):
    """Causality, and chunking: the state at position k-1 of the whole text is the last state of its first k
    tokens run alone, and feeding the text 5 tokens per forward changes no state."""
    engine = engines[name]
    tokens = encode(engine, TEXT)
    whole = hidden_states(engine.runner, [tokens], engine.token_budget)[0]
    for k in (1, 7, len(tokens) - 1):
        assert np.array_equal(hidden_states(engine.runner, [tokens[:k]], engine.token_budget)[0][-1], whole[k - 1])
    assert np.array_equal(hidden_states(engine.runner, [tokens], 5)[0], whole)


@pytest.mark.parametrize("name", ["smollm2", "hybrid"])
def test_pooling_follows_its_definition(name: str, engines: dict[str, Engine]):
    """mean, last and cls (first token) of the hidden states, each L2-normalised, and all three different."""
    engine = engines[name]
    tokens = encode(engine, TEXT)
    states = hidden_states(engine.runner, [tokens], engine.token_budget)[0].astype(np.float64)
    references = {"mean": states.sum(axis=0) / len(tokens), "last": states[-1], "cls": states[0]}
    vectors = {}
    for pooling, reference in references.items():
        vector = engine.embed([tokens], pooling)[0]
        assert vector.dtype == np.float32
        assert abs(np.linalg.norm(vector.astype(np.float64)) - 1.0) < 1e-6
        assert np.allclose(vector, reference / np.linalg.norm(reference), rtol=0, atol=1e-6)
        vectors[pooling] = vector
    assert not np.allclose(vectors["mean"], vectors["last"], atol=1e-3)
    assert not np.allclose(vectors["mean"], vectors["cls"], atol=1e-3)
    assert not np.allclose(vectors["last"], vectors["cls"], atol=1e-3)
    assert np.array_equal(engine.embed([tokens]), engine.embed([tokens], "mean"))  # the model's default


@pytest.mark.parametrize("name", ["smollm2", "hybrid"])
def test_an_embedding_is_the_same_alone_and_in_a_batch(name: str, engines: dict[str, Engine]):
    """An input's vector is bit-identical alone, among other inputs (one forward), with a long input split
    over several forwards, and with every input fed in chunks of 7 tokens."""
    engine = engines[name]
    text, other, long = encode(engine, TEXT), encode(engine, OTHER), encode(engine, LONG)
    assert len(long) > engine.token_budget
    alone = [engine.embed([tokens])[0] for tokens in (text, other, long)]
    together = engine.embed([other, text, long, text])
    assert input_batches([len(t) for t in (other, text, long, text)], engine.token_budget) == [[0, 1], [2], [3]]
    for got, expected in zip(together, [alone[1], alone[0], alone[2], alone[0]]):
        assert np.array_equal(got, expected)
    chunked = [pooled(s, "mean") for s in hidden_states(engine.runner, [long, text], 7)]
    assert np.array_equal(chunked[0], alone[2]) and np.array_equal(chunked[1], alone[0])


@pytest.mark.parametrize("name", ["smollm2", "hybrid"])
def test_a_long_embedding_runs_a_forward_at_a_time_between_generation_steps(name: str, paths: dict[str, Path],
                                                                            engines: dict[str, Engine]):
    """A job started with `start_embedding` feeds one token budget per step: generation steps run between its
    steps (a long input never holds the model for its whole prefill), the vectors are the reference engine's, and
    the generation's tokens are those it gives alone."""
    engine = build_engine(paths[name], EngineOptions(max_context=1024, threads=THREADS, continuous_batching=True,
                                                     n_slots=2, token_budget=TEST_BUDGET))
    try:
        prompt = encode(engine, TEXT)
        alone, _ = greedy(engine, prompt, max_tokens=6)
        inputs = [encode(engine, LONG) * 3, encode(engine, OTHER)]
        assert len(inputs[0]) > 3 * TEST_BUDGET
        job = engine.start_embedding(inputs)
        request = GenerationRequest("beside", prompt, 6, SamplingParams(temperature=0.0), ignore_eos=True)
        engine.admit(request, engine.slot_for(request))
        tokens, job_steps, done = [], 0, False
        while not done or engine.has_work:
            if not done:
                done = job.step()
                job_steps += 1
            if engine.has_work:
                tokens += [e.token_id for e in engine.step(engine.plan()) if isinstance(e, TokenEvent)]
        assert job_steps >= 4 and tokens == alone
        assert np.array_equal(job.vectors, engines[name].embed(inputs))
    finally:
        engine.close()


# Each KV mode on one of the two models by default (the prefix cache on the hybrid, whose recurrent states it keeps
# too); `-m slow` runs each mode on the other model as well.
FAST_KV_MODES = {("smollm2", "contiguous"), ("smollm2", "continuous-batching"), ("hybrid", "paged"),
                 ("hybrid", "prefix-cache")}


@pytest.mark.parametrize(("name", "mode"), [
    pytest.param(name, mode, marks=() if (name, mode) in FAST_KV_MODES else pytest.mark.slow, id=f"{name}-{mode}")
    for name in ("smollm2", "hybrid") for mode in KV_MODES])
def test_embedding_leaves_every_kv_mode_untouched(name: str, mode: str, paths: dict[str, Path],
                                                  engines: dict[str, Engine]):
    """After a generation, an embedding changes no slot, block, cached prefix or recurrent state, gives the
    vectors of the reference engine, and the generation resent reuses its whole prompt but the last token."""
    engine = build_engine(paths[name], EngineOptions(max_context=128, threads=THREADS, **KV_MODES[mode]))
    try:
        prompt = encode(engine, TEXT + " " + OTHER)
        tokens, _ = greedy(engine, prompt)
        before = engine_state(engine)
        inputs = [encode(engine, OTHER), encode(engine, TEXT)]
        vectors = engine.embed(inputs)
        assert engine_state(engine) == before
        assert np.array_equal(vectors, engines[name].embed(inputs))
        assert greedy(engine, prompt) == (tokens, len(prompt) - 1)
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["smollm2", "hybrid"])
def test_a_full_contiguous_pool_embeds_in_a_private_space(name: str, paths: dict[str, Path],
                                                           engines: dict[str, Engine]):
    """When the slots' histories hold every block, the scratch sequence gets blocks of its own: the slot keeps its
    history and the vectors equal the reference engine's."""
    engine = build_engine(paths[name], EngineOptions(max_context=64, threads=THREADS))
    try:
        prompt = encode(engine, LONG)[:60]
        assert len(prompt) == 60
        greedy(engine, prompt, max_tokens=3)
        assert engine.runner.pool.n_free == 0
        before = engine_state(engine)
        inputs = [encode(engine, TEXT), encode(engine, LONG)[:64]]   # the second fills the whole context
        assert engine.runner.scratch_space(1).pool is not engine.runner.pool
        vectors = engine.embed(inputs)
        assert engine_state(engine) == before
        assert np.array_equal(vectors, engines[name].embed(inputs))
    finally:
        engine.close()


def test_inputs_that_cannot_be_embedded_are_refused(engines: dict[str, Engine]):
    engine = engines["smollm2"]
    vocab = engine.runner.vocab_size
    cases = {"no input": [], "an empty input": [[1, 2], []], "a token id past the vocabulary": [[1, vocab]],
             "a negative token id": [[-1]], "too many tokens": [[1] * 1025]}
    for case, inputs in cases.items():
        with pytest.raises(InvalidRequestError) as refused:
            engine.embed(inputs)
        assert refused.value.status == 400 and refused.value.param == "input", case
    with pytest.raises(InvalidRequestError) as refused:
        engine.embed([[1] * 1025])
    assert refused.value.code == "context_length_exceeded"


def test_python_api_embeds_text_and_ids_and_keeps_its_history(smollm2_base: Path):
    with Model(smollm2_base, max_context=256, threads=THREADS) as model:
        ids = model.encode(TEXT)
        vectors = model.embed([TEXT, ids])
        assert vectors.shape == (2, model.info.hidden_size)
        assert np.array_equal(vectors[0], vectors[1])
        model.prefill(ids)
        expected = model.decode_step(5)
        model.prefill(ids)      # resumes from the history: only the last token is recomputed
        model.embed([OTHER])
        assert np.array_equal(model.decode_step(5), expected)


# --- HTTP ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(smollm2_base: Path, qwen35_chat_base: Path, server_pool: ServerPool) -> dict[str, ServerProcess]:
    return {"smollm2": server_pool.get(smollm2_base, *SMOLLM2_CHAT_FLAGS),
            "hybrid": server_pool.get(qwen35_chat_base, *HYBRID_CHAT_FLAGS)}


def embed(server: ServerProcess, inputs, path: str = "/v1/embeddings", **fields) -> dict:
    return answer(post(server.url, path, {"input": inputs, **fields}))


def vectors_of(body: dict) -> np.ndarray:
    assert body["object"] == "list"
    assert [item["index"] for item in body["data"]] == list(range(len(body["data"])))
    assert all(item["object"] == "embedding" for item in body["data"])
    return np.array([item["embedding"] for item in body["data"]], dtype=np.float32)


def chat(server: ServerProcess) -> tuple[str, dict]:
    body = answer(post(server.url, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 6,
                                                            "temperature": 0}))
    return body["choices"][0]["message"]["content"], body["usage"]


@pytest.mark.parametrize("name", ["smollm2", "hybrid"])
def test_server_vectors_equal_the_engine(name: str, servers: dict[str, ServerProcess], engines: dict[str, Engine]):
    """Text, token ids, base64 and the llama.cpp path all give the engine's vectors, bit for bit, with usage."""
    server, engine = servers[name], engines[name]
    expected = engine.embed([encode(engine, TEXT), encode(engine, OTHER)])
    body = embed(server, [TEXT, OTHER])
    assert np.array_equal(vectors_of(body), expected)
    n_tokens = len(encode(engine, TEXT)) + len(encode(engine, OTHER))
    assert body["usage"] == {"prompt_tokens": n_tokens, "total_tokens": n_tokens}
    assert body["model"] == engine.info.id
    ids = answer(post(server.url, "/v1/tokenize", {"content": TEXT}))["tokens"]
    assert np.array_equal(vectors_of(embed(server, ids))[0], expected[0])
    assert np.array_equal(vectors_of(embed(server, [ids, ids]))[1], expected[0])
    assert np.array_equal(vectors_of(embed(server, TEXT, "/embeddings"))[0], expected[0])
    encoded = embed(server, [TEXT, OTHER], encoding_format="base64", dimensions=engine.info.hidden_size)
    decoded = np.array([np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4")
                        for item in encoded["data"]])
    assert np.array_equal(decoded, expected)


@pytest.mark.parametrize("name", ["smollm2", "hybrid"])
def test_chat_traffic_and_embeddings_leave_each_other_alone(name: str, servers: dict[str, ServerProcess]):
    """An embedding is the same before and after chats; a chat resent after an embedding has the same answer and
    reuses its slot's whole prompt but the last token."""
    server = servers[name]
    first = vectors_of(embed(server, [TEXT]))
    content, usage = chat(server)
    again = vectors_of(embed(server, [OTHER, TEXT]))
    resent, resent_usage = chat(server)
    assert resent == content
    assert resent_usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert np.array_equal(again[1], first[0])
    assert np.array_equal(vectors_of(embed(server, TEXT))[0], first[0])


@pytest.mark.parametrize("body, status, code, param", [
    ({"input": ""}, 400, "invalid_value", "input"),
    ({"input": []}, 400, "invalid_value", "input"),
    ({"input": ["fine", ""]}, 400, "invalid_value", "input"),
    ({"input": [[1, 2], []]}, 400, "invalid_value", "input"),
    ({"input": [1, 49152]}, 400, "invalid_value", "input"),
    ({"input": [[-3]]}, 400, "invalid_value", "input"),
    ({"input": [7] * 1025}, 400, "context_length_exceeded", "input"),
    ({"input": "word " * 1100}, 400, "context_length_exceeded", "input"),
    ({"input": [[1]] * 2049}, 400, "invalid_value", "input"),
    ({"input": [True]}, 400, "invalid_value", None),
    ({"input": "x", "dimensions": 3}, 400, "invalid_value", "dimensions"),
    ({"input": "x", "encoding_format": "int8"}, 400, "invalid_value", "encoding_format"),
    ({}, 400, "invalid_value", "input"),
], ids=["empty-text", "no-input", "one-empty-text", "one-empty-id-list", "id-past-vocab", "negative-id",
        "ids-past-context", "text-past-context", "too-many-inputs", "booleans", "dimensions", "encoding",
        "missing-input"])
def test_bad_requests_get_the_error_envelope(body: dict, status: int, code: str, param: str | None,
                                             servers: dict[str, ServerProcess]):
    error = error_envelope(post(servers["smollm2"].url, "/v1/embeddings", body), status, code)
    if param is not None:
        assert error["param"] == param
    if code == "context_length_exceeded":
        assert error["n_ctx"] == 1024 and error["n_prompt_tokens"] > 1024


def test_openai_sdk_creates_embeddings(servers: dict[str, ServerProcess], engines: dict[str, Engine]):
    """The SDK asks for base64 unless told otherwise and decodes it itself; both forms give the engine's vectors."""
    engine = engines["smollm2"]
    expected = engine.embed([encode(engine, TEXT), encode(engine, OTHER)])
    client = openai.OpenAI(base_url=f"{servers['smollm2'].url}/v1", api_key="unused")
    for encoding in ("base64", "float"):
        kwargs = {"encoding_format": encoding} if encoding == "float" else {}
        result = client.embeddings.create(model=engine.info.id, input=[TEXT, OTHER], **kwargs)
        assert np.array_equal(np.array([d.embedding for d in result.data], dtype=np.float32), expected)
        assert result.usage.prompt_tokens == result.usage.total_tokens == sum(len(encode(engine, t))
                                                                              for t in (TEXT, OTHER))


@pytest.fixture(scope="module")
def last_pooling_server(qwen35_chat_base: Path, server_pool: ServerPool) -> ServerProcess:
    return server_pool.get(qwen35_chat_base, *LAST_POOLING_FLAGS)


async def test_last_pooling_server_with_concurrent_chats(last_pooling_server: ServerProcess,
                                                         servers: dict[str, ServerProcess],
                                                         engines: dict[str, Engine]):
    """--pooling last with continuous batching and the prefix cache: while chats run beside them, embedding
    requests larger than one batch (the actor runs them in pieces between steps) give the engine's last-token
    vectors, and the chats answer as they do alone; a one-token input is pooled alike by mean and last."""
    engine = engines["hybrid"]
    copies = SERVER_BUDGET // len(encode(engine, TEXT)) + 1
    inputs = [OTHER, LONG] + [TEXT] * copies
    unique = engine.embed([encode(engine, text) for text in (OTHER, LONG, TEXT)], "last")
    expected = np.stack([unique[0], unique[1]] + [unique[2]] * copies)
    alone, _ = chat(last_pooling_server)
    vectors, answers = [], []
    async with httpx.AsyncClient(base_url=last_pooling_server.url, timeout=120) as client:
        async def embed_once() -> None:
            response = await client.post("/v1/embeddings", json={"input": inputs})
            vectors.append(vectors_of(answer(response)))

        async def chat_once() -> None:
            response = await client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 6,
                                                                        "temperature": 0})
            answers.append(answer(response)["choices"][0]["message"]["content"])

        async with trio.open_nursery() as nursery:
            for task in (embed_once, chat_once, embed_once, chat_once):
                nursery.start_soon(task)
    assert answers == [alone, alone]
    assert len(vectors) == 2 and all(np.array_equal(v, expected) for v in vectors)
    one_token = [encode(engine, "Hello")[:1]]
    assert np.array_equal(vectors_of(embed(last_pooling_server, one_token)),
                          vectors_of(embed(servers["hybrid"], one_token)))
