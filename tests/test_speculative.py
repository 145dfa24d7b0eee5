"""Speculative decoding never changes an output: with drafts on, every request gives the same tokens and the same
logprob bits as with drafts off, on every model family (dense, Gemma 3's sliding windows, hybrid, MoE), greedy and
seeded, alone and batched, with penalties, stop strings, grammars and the prefix cache; and the drafts are really
tried and accepted. Then the drafter on its own, and the server's fields and flags."""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import SMOLLM2_CHAT_FLAGS

from basert.chat.grammar import GrammarFactory
from basert.engine.build import EngineOptions, build_engine
from basert.engine.drafts import (
    FIRST_PROBE,
    FORCED_BAND,
    MATCH_BANDS,
    NGRAM_SIZES,
    PRIOR_EXTRA_COST,
    TEXT_BAND,
    Drafter,
    SharedNgrams,
    StepCosts,
    band_of,
    draft_lengths,
)
from basert.engine.engine import Engine
from basert.engine.sampler import SamplingParams
from basert.engine.types import FailEvent, FinishEvent, GenerationRequest, TokenEvent
from basert.testing.client import error_envelope, post
from basert.testing.launcher import ServerProcess

FIXTURES_TEXT = Path(__file__).resolve().parent.parent / "basert" / "engine" / "drafts.py"


def engine_for(path: Path, draft_max: int, **options) -> Engine:
    return build_engine(path, EngineOptions(max_context=1024, spec_draft_max=draft_max, **options))


def run(engine: Engine, requests: list[GenerationRequest]) -> dict[str, tuple[list[int], list[float], FinishEvent]]:
    """Each request's tokens, their logprobs and its finish event."""
    out: dict[str, tuple[list[int], list[float], FinishEvent]] = {r.request_id: ([], [], None) for r in requests}
    for event in engine.generate(requests):
        assert not isinstance(event, FailEvent), event
        tokens, logprobs, _ = out[event.request_id]
        if isinstance(event, TokenEvent):
            tokens.append(event.token_id)
            logprobs.append(event.logprob.logprob if event.logprob is not None else 0.0)
        else:
            out[event.request_id] = (tokens, logprobs, event)
    return out


def same_outputs(off: dict, on: dict) -> None:
    for request_id, (tokens, logprobs, finish) in off.items():
        on_tokens, on_logprobs, on_finish = on[request_id]
        assert on_tokens == tokens, request_id
        # Bit for bit: the same logits give the same float64 log-softmax.
        assert np.array_equal(np.array(on_logprobs), np.array(logprobs)), request_id
        assert (on_finish.finish_reason, on_finish.text, on_finish.stop_word) == \
               (finish.finish_reason, finish.text, finish.stop_word), request_id


def teach(engine: Engine, requests: list[GenerationRequest], outputs: dict) -> None:
    """Give the engine's shared n-gram table what each request generated without drafts, its first tokens right
    and the rest wrong, as another request's output would: the drafts are then partly accepted and partly
    rejected in the middle of a chunk, whatever the model (random weights rarely repeat themselves)."""
    vocab = engine.runner.vocab_size
    for request in requests:
        tokens = outputs[request.request_id][0]
        wrong = [(token + 1) % vocab for token in tokens[8:16]]
        engine.shared_ngrams.learn([*request.prompt[-NGRAM_SIZES[0]:], *tokens[:8], *wrong])


def drafted(results: dict) -> tuple[int, int]:
    timings = [finish.timings for _, _, finish in results.values()]
    return sum(t.draft_n for t in timings), sum(t.draft_n_accepted for t in timings)


def repeating_prompt(engine: Engine, seed: int = 0) -> list[int]:
    """A prompt whose continuation repeats what it holds: a text, then the start of that text again."""
    if engine.tokenizer is not None:
        text = FIXTURES_TEXT.read_text()[:700]
        return engine.tokenizer.encode(f"Copy this text.\n\n{text}\n\nThe copy:\n\n{text[:120]}")
    rng = np.random.default_rng(seed)
    piece = rng.integers(0, engine.runner.vocab_size, 40).tolist()
    return piece + piece[:8]


# Gemma 3 (its 262k vocabulary and sliding windows) under -m slow: the default run keeps the dense, hybrid and MoE
# families within its minutes. Qwen2.5-Coder-1.5B, a real model at a real size, under -m qwen_coder (its extra).
@pytest.fixture(params=["smollm2", pytest.param("gemma3", marks=pytest.mark.slow), "qwen3_5-tiny", "qwen3_5_moe-tiny",
                        pytest.param("qwen2.5-coder-1.5b", marks=pytest.mark.qwen_coder)])
def model_path(request, smollm2_base: Path, tiny_f32_bases: dict[str, Path]) -> Path:
    if request.param == "gemma3":
        return request.getfixturevalue("gemma3_base")
    if request.param == "qwen2.5-coder-1.5b":
        return request.getfixturevalue("qwen_coder_base")
    return smollm2_base if request.param == "smollm2" else tiny_f32_bases[request.param]


def requests_of(engine: Engine, sampling: SamplingParams, n: int = 1, max_tokens: int = 48,
                **fields) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", repeating_prompt(engine, i), max_tokens, sampling, **fields) for i in range(n)]


GREEDY = SamplingParams(temperature=0, logprobs=True)
SEEDED = SamplingParams(temperature=0.7, top_p=0.9, seed=1234, logprobs=True)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_drafts_change_nothing_on_every_family(model_path: Path, sampling: SamplingParams):
    off_engine = engine_for(model_path, 0)
    on_engine = engine_for(model_path, 8)
    try:
        off = run(off_engine, requests_of(off_engine, sampling))
        teach(on_engine, requests_of(on_engine, sampling), off)
        on = run(on_engine, requests_of(on_engine, sampling))
    finally:
        off_engine.close()
        on_engine.close()
    same_outputs(off, on)
    assert drafted(off) == (0, 0)
    n_drafted, n_accepted = drafted(on)
    # How much is drafted depends on the step costs measured while the test runs; a probe after FIRST_PROBE
    # draft-less steps always drafts, and the taught continuation's first tokens are right.
    assert n_drafted >= n_accepted >= 1


def test_drafts_are_accepted_where_text_repeats(smollm2_base: Path):
    engine = engine_for(smollm2_base, 8)
    try:
        results = run(engine, requests_of(engine, GREEDY, max_tokens=96))
    finally:
        engine.close()
    n_drafted, n_accepted = drafted(results)
    assert n_accepted > 0, (n_drafted, n_accepted)   # how many: the measured step costs decide
    finish = next(iter(results.values()))[2]
    assert finish.timings.as_dict(0)["draft_n_accepted"] == n_accepted


def test_hybrid_rejected_drafts_leave_the_state_as_without(tiny_f32_bases: dict[str, Path]):
    """A hybrid's drafts are rejected mid-chunk (random weights rarely repeat a draft to the end): the recurrent
    state goes back and the next request on the same slot continues from exactly the same history."""
    path = tiny_f32_bases["qwen3_5-tiny"]
    outputs = []
    for draft_max in (0, 8):
        engine = engine_for(path, draft_max)
        try:
            first = requests_of(engine, GREEDY, max_tokens=40)
            if draft_max:
                teach(engine, first, outputs[0][0])
            results = run(engine, first)
            tokens = next(iter(results.values()))[0]
            # The same slot continues the conversation: its history (and state) must be what it would be.
            follow = GenerationRequest("next", first[0].prompt + tokens + [7, 8, 9], 24, GREEDY)
            outputs.append((results, run(engine, [follow]), drafted(results)))
        finally:
            engine.close()
    (off, off_next, _), (on, on_next, (n_drafted, n_accepted)) = outputs
    same_outputs(off, on)
    same_outputs(off_next, on_next)
    assert n_drafted > n_accepted >= 1


def test_batched_requests_with_the_prefix_cache(model_path: Path):
    """Four requests at once, sharing a prefix through the cache: the same outputs with and without drafts."""
    results = []
    for draft_max in (0, 8):
        engine = engine_for(model_path, draft_max, n_slots=4, continuous_batching=True, prefix_cache=True)
        try:
            base = repeating_prompt(engine)
            requests = [GenerationRequest(f"r{i}", base + [11 + i], 32, GREEDY if i % 2 else SEEDED)
                        for i in range(4)]
            if draft_max:
                teach(engine, requests, results[0][0])
            first = run(engine, requests)
            # Again, now from the prefix cache and the slots' histories.
            again = run(engine, [GenerationRequest(f"again{i}", r.prompt, 32, r.sampling)
                                 for i, r in enumerate(requests)])
            results.append((first, again))
        finally:
            engine.close()
    (off_first, off_again), (on_first, on_again) = results
    same_outputs(off_first, on_first)
    same_outputs(off_again, on_again)


@pytest.mark.parametrize("fields", [
    {"stop": ("import",)},
    {"sampling": SamplingParams(temperature=0, repeat_penalty=1.3, repeat_last_n=32, presence_penalty=0.4,
                                frequency_penalty=0.2, logprobs=True, top_logprobs=3)},
    pytest.param({"max_tokens": 5}, marks=pytest.mark.slow),
], ids=["stop-string", "penalties", "max-tokens"])
def test_stops_limits_and_penalties_behave_as_without(smollm2_base: Path, fields: dict):
    results = []
    for draft_max in (0, 8):
        engine = engine_for(smollm2_base, draft_max)
        try:
            sampling = fields.get("sampling", GREEDY)
            extra = {k: v for k, v in fields.items() if k not in ("sampling", "max_tokens")}
            results.append(run(engine, requests_of(engine, sampling, max_tokens=fields.get("max_tokens", 64),
                                                   **extra)))
        finally:
            engine.close()
    same_outputs(*results)


def test_grammar_forbidden_drafts_end_the_accepted_run(smollm2_base: Path):
    """A JSON schema constrains the output: drafts copied from the prompt's prose are refused by the grammar,
    and the output is the same with and without drafts. The summary must be 40 characters at least, so that the
    model writes one (SmolLM2 may close an empty string at once) and drafts are proposed."""
    schema = {"type": "object", "properties": {"summary": {"type": "string", "minLength": 40}}, "required": ["summary"]}
    results = []
    for draft_max in (0, 8):
        engine = engine_for(smollm2_base, draft_max)
        try:
            factory = GrammarFactory(engine.tokenizer)
            grammar = factory.json_schema(schema)
            requests = requests_of(engine, GREEDY, max_tokens=64, constraint=factory.matcher(grammar))
            results.append(run(engine, requests))
        finally:
            engine.close()
    same_outputs(*results)
    assert drafted(results[1])[0] > 0


def test_the_text_a_grammar_forces_is_drafted(smollm2_base: Path):
    """A schema whose keys the prompt never mentions: the keys are drafted as the grammar forces them, accepted, and
    the output is the same as without drafts."""
    keys = ("customer_full_name", "shipping_address_first_line", "order_reference_number")
    schema = {"type": "object", "properties": {key: {"type": "string", "maxLength": 12} for key in keys},
              "required": list(keys)}
    results = []
    for draft_max in (0, 8):
        engine = engine_for(smollm2_base, draft_max)
        try:
            factory = GrammarFactory(engine.tokenizer)
            matcher = factory.matcher(factory.json_schema(schema))
            prompt = engine.tokenizer.encode("Write an order as JSON.\n")
            results.append(run(engine, [GenerationRequest("r0", prompt, 96, GREEDY, constraint=matcher)]))
            text = engine.tokenizer.decode(results[-1]["r0"][0])
        finally:
            engine.close()
    same_outputs(*results)
    assert all(f'"{key}":' in text for key in keys), text
    n_drafted, n_accepted = drafted(results[1])
    assert n_accepted >= len(keys)


def test_a_request_can_turn_drafts_off(smollm2_base: Path):
    engine = engine_for(smollm2_base, 8)
    try:
        plain = run(engine, requests_of(engine, GREEDY, speculative=False))
        limited = run(engine, requests_of(engine, GREEDY, draft_max=1))
    finally:
        engine.close()
    assert drafted(plain) == (0, 0)
    same_outputs(plain, limited)


# --- the drafter --------------------------------------------------------------------------------------------------
def step_costs(extra: float, most: int = 16) -> StepCosts:
    """Measured costs: a step of n tokens takes 1 + extra * (n - 1) seconds."""
    costs = StepCosts()
    for n in range(1, most + 1):
        costs.observe(n, 1 + extra * (n - 1))
    return costs


def test_drafter_proposes_what_followed_the_longest_suffix():
    drafter = Drafter(8, None, step_costs(0.0))        # extra tokens cost nothing: the whole continuation
    history = [1, 2, 3, 4, 5, 6, 9, 2, 3, 4]
    # The last four tokens 9 2 3 4 never occurred before; 2 3 4 did, followed by 5 6 9 2 3 4.
    assert drafter.propose(history[:-1], history[-1], room=8) == [5, 6, 9, 2, 3, 4]
    assert drafter.propose(history + [5, 6, 9, 2], 3, room=8) == [4, 5, 6, 9, 2, 3]
    assert drafter.propose(history + [5, 6, 9, 2, 3], 4, room=2) == [5, 6]


def test_forced_tokens_are_drafted_unless_the_history_offers_them_and_more():
    history = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    # The history continues 4 5 6 7 ...; the grammar forces 4 5: the history's longer draft, which agrees.
    drafter = Drafter(8, None, step_costs(0.0))
    assert drafter.candidate(history[:-1], history[-1], room=8, forced=[4, 5]) == [4, 5, 6, 7, 8, 1, 2, 3]
    assert drafter.rate == drafter.acceptance(band_of(3))
    # The grammar forces 9 9: those, counted in their own band.
    drafter = Drafter(8, None, step_costs(0.0))
    assert drafter.candidate(history[:-1], history[-1], room=8, forced=[9, 9, 9]) == [9, 9, 9]
    assert drafter.rate == drafter.acceptance(FORCED_BAND) > drafter.acceptance(0)
    assert Drafter(8, None, step_costs(0.0)).candidate([7], 6, room=2, forced=[9, 9, 9]) == [9, 9]
    assert Drafter(8, None, step_costs(0.0)).candidate([7], 6, room=-1, forced=[9, 9, 9]) == []


def test_text_the_token_ngrams_miss_is_drafted_from_the_history_text(smollm2_tokenizer):
    """A name copied from prose into a JSON string starts with other tokens than in the prose (`"Marg` against
    ` Marg`): where no n-gram of the history offers a draft, the bytes that followed the text's last bytes before
    are drafted, tokenized; counted in a band of their own."""
    encode = smollm2_tokenizer.encode
    prose = encode("The parcel goes to Marguerite Okonkwo-Villanueva, Port Townsend. Reply in JSON.\n")
    history = prose + encode('{"name": "Marg')
    assert Drafter(8, None, step_costs(0.0)).candidate(history[:-1], history[-1], room=8) == []   # no n-gram matches
    drafter = Drafter(8, None, step_costs(0.0), smollm2_tokenizer)
    copied = encode("uerite Okonkwo-Villanueva, Port")
    assert drafter.candidate(history[:-1], history[-1], room=8) == copied[:8]
    # Its acceptance is counted apart: a rejected text draft lowers the text band's rate, not the n-grams'.
    assert drafter.rate == drafter.acceptance(TEXT_BAND)
    drafter.update(drafted=8, accepted=0)
    assert drafter.acceptance(TEXT_BAND) < drafter.acceptance(0) == 0.5
    assert drafter.candidate(history, copied[0], room=3) == copied[1:4]
    # Text that never occurred before offers nothing.
    fresh = encode("Zyzzyva quokka")
    assert Drafter(8, None, step_costs(0.0), smollm2_tokenizer).candidate(fresh[:-1], fresh[-1], room=8) == []


def test_drafts_are_as_long_as_they_pay():
    # The last four tokens occurred once before, after another token than now: a match of four.
    history = [100, *range(20), 200, 0, 1, 2, 3]

    def first_draft(extra: float, accepted: int, rejected: int) -> list[int]:
        drafter = Drafter(8, None, step_costs(extra))
        for _ in range(accepted):
            drafter.update(drafted=3, accepted=3)
        for _ in range(rejected):
            drafter.update(drafted=8, accepted=0)
        return drafter.propose(history[:-1], history[-1], room=8)

    # An even chance per token at first: the length where (1 + 1/2 + 1/4 ...) / (1 + 0.05 k) is largest; then
    # as long as the room allows once drafts are accepted, and short once they are not.
    assert len(first_draft(0.05, 0, 0)) == 3
    assert len(first_draft(0.05, 4, 0)) == 8
    assert len(first_draft(0.05, 0, 6)) == 1
    # Each extra token costs a whole step: no draft pays, until the probe after FIRST_PROBE steps.
    dear = Drafter(8, None, step_costs(1.0))
    proposals = []
    for _ in range(FIRST_PROBE):
        proposals.append(dear.propose(history[:-1], history[-1], room=8))
        history.append(history[-1] + 1)           # the copy goes on (a match still under 8 tokens)
    assert proposals[:-1] == [[]] * (FIRST_PROBE - 1) and len(proposals[-1]) >= 1


def test_a_longer_match_drafts_more():
    """The same costs and no history of acceptance: a draft whose source matches the last 16 tokens is trusted
    further than one that matches just the n-gram looked up; each band learns from its own drafts."""
    copy = [*range(40), *range(16)]                 # copying: the last 16 tokens match
    phrase = [*range(40), 500, *range(3)]           # a common phrase: 4 tokens match
    assert band_of(16) == len(MATCH_BANDS) - 1 and band_of(4) == 0
    long_draft = Drafter(8, None, step_costs(0.3)).propose(copy[:-1], copy[-1], room=8)
    short_draft = Drafter(8, None, step_costs(0.3)).propose(phrase[:-1], phrase[-1], room=8)
    assert long_draft == list(range(16, 16 + len(long_draft)))
    assert short_draft[:1] == [3] and len(short_draft) < len(long_draft)
    drafter = Drafter(8, None, step_costs(0.3))
    assert drafter.propose(copy[:-1], copy[-1], room=8)
    for _ in range(6):
        drafter.update(drafted=8, accepted=0)      # the long matches failed: that band learns it
    assert drafter.acceptance(len(MATCH_BANDS) - 1) < 0.5 and drafter.acceptance(0) == 0.5


def test_a_steps_drafts_are_the_most_tokens_per_cost():
    """draft_lengths against every choice of lengths: the same expected tokens per cost as the best of them, and
    no draft where none pays."""
    rng = np.random.default_rng(7)

    def per_cost(rates, lengths, lanes, costs):
        expected = lanes + sum(sum(rate ** j for j in range(1, k + 1)) for rate, k in zip(rates, lengths))
        return expected / lanes / costs.ratio(lanes + sum(lengths), lanes)

    for _ in range(40):
        n = int(rng.integers(1, 4))
        lanes = n + int(rng.integers(0, 3))
        rates = [float(rate) for rate in rng.uniform(0.05, 0.99, n)]
        most = [int(m) for m in rng.integers(0, 5, n)]
        costs = step_costs(float(rng.uniform(0.02, 0.8)), most=lanes + sum(most))
        lengths = draft_lengths(list(zip(rates, most)), lanes, costs)
        assert all(0 <= k <= m for k, m in zip(lengths, most))
        best = max(itertools.product(*(range(m + 1) for m in most)), key=lambda ks: per_cost(rates, ks, lanes, costs))
        assert per_cost(rates, lengths, lanes, costs) == pytest.approx(max(1.0, per_cost(rates, best, lanes, costs)))
        if per_cost(rates, best, lanes, costs) <= 1.0:
            assert lengths == [0] * n
    # Four decoding slots, one copying (accepted 19 times in 20) and three not: the drafts go to the copy.
    assert draft_lengths([(0.95, 8), (0.2, 8), (0.2, 8), (0.2, 8)], 4, step_costs(0.1)) == [8, 0, 0, 0]


def test_step_costs_fall_back_to_a_prior_until_measured():
    costs = StepCosts()
    assert costs.ratio(3, 1) == pytest.approx(1 + 2 * PRIOR_EXTRA_COST)
    costs.observe(1, 0.010)
    costs.observe(3, 0.030)
    assert costs.ratio(3, 1) == pytest.approx(3.0)
    costs.observe(3, 0.020)       # a running average
    assert 2.0 < costs.ratio(3, 1) < 3.0
    assert costs.ratio(1, 3) == 1.0
    # Two tokens measured slower than three (at a slow moment of the machine): no dearer than three.
    costs.observe(2, 0.050)
    assert costs.ratio(2, 1) == costs.ratio(3, 1)
    slow_first = StepCosts()
    slow_first.observe(1, 0.050)
    slow_first.observe(4, 0.030)
    assert slow_first.ratio(4, 1) == 1.0


def test_shared_ngrams_carry_one_requests_output_to_another():
    shared = SharedNgrams(draft_max=8, capacity=4)
    shared.learn([1, 2, 3, 4, 5, 6, 7])
    drafter = Drafter(8, shared, step_costs(0.0))
    assert drafter.propose([9, 1, 2, 3], 4, room=8) == [5, 6, 7]
    n = NGRAM_SIZES[0]
    assert len(shared) == 3 == len(range(n, 7))
    shared.learn(list(range(100, 110)))
    assert len(shared) == 4      # bounded: the least recently used went first
    assert shared.follow((1, 2, 3, 4)) == ()


# --- slots and the server ---------------------------------------------------------------------------------------
def test_a_restored_slot_continues_as_without(smollm2_base: Path, tmp_path: Path):
    """A slot saved after a request with drafts, restored into a fresh engine, continues exactly as one that never
    drafted."""
    continuations = []
    for draft_max in (0, 8):
        engine = engine_for(smollm2_base, draft_max)
        try:
            first = requests_of(engine, GREEDY, max_tokens=40)
            tokens = next(iter(run(engine, first).values()))[0]
            engine.save_slot(0, tmp_path / f"slot{draft_max}.bin")
        finally:
            engine.close()
        fresh = engine_for(smollm2_base, draft_max)
        try:
            fresh.restore_slot(0, tmp_path / f"slot{draft_max}.bin")
            follow = GenerationRequest("next", first[0].prompt + tokens + [28, 29], 40, GREEDY)
            continuations.append(run(fresh, [follow]))
        finally:
            fresh.close()
    same_outputs(*continuations)


@pytest.fixture(scope="module")
def server(smollm2_base: Path, server_pool) -> ServerProcess:
    return server_pool.get(smollm2_base, *SMOLLM2_CHAT_FLAGS)


def test_server_fields_and_logprobs(server: ServerProcess):
    text = FIXTURES_TEXT.read_text()[:1200]
    chat = {"messages": [{"role": "user", "content": f"Repeat this text exactly:\n\n{text}"}], "temperature": 0,
            "max_tokens": 48, "logprobs": True, "top_logprobs": 2}
    on = post(server.url, "/v1/chat/completions", chat).json()
    off = post(server.url, "/v1/chat/completions", {**chat, "speculative": False}).json()
    assert on["choices"][0]["message"]["content"] == off["choices"][0]["message"]["content"]
    # Every token has its logprobs, drafted or not, and the same bits.
    assert on["choices"][0]["logprobs"] == off["choices"][0]["logprobs"]
    assert len(on["choices"][0]["logprobs"]["content"]) == on["usage"]["completion_tokens"]
    assert off["timings"]["draft_n"] == 0
    llama = post(server.url, "/completion", {"prompt": f"Copy: {text}\nCopy: {text[:80]}", "n_predict": 32,
                                             "temperature": 0, "n_probs": 3, "speculative.n_max": 4}).json()
    assert len(llama["completion_probabilities"]) == llama["tokens_predicted"]
    assert 0 < llama["timings"]["draft_n"]
    for bad in ({"speculative": "yes"}, {"speculative": 1}, {"speculative.n_max": 65}, {"speculative.n_max": -1},
                {"speculative.n_max": "4"}):
        error_envelope(post(server.url, "/v1/chat/completions", {**chat, **bad}), 400)
    metrics = httpx.get(server.url + "/metrics", timeout=30).text
    assert "basert_draft_tokens_total" in metrics and "basert_draft_accepted_tokens_total" in metrics

