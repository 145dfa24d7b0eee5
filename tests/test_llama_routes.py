"""llama.cpp's server contract end to end: /completion and its fields, stream and probabilities, /props, /slots,
/apply-template, chat prompt sizes, the routes without /v1, and the --alias, --no-slots and --no-metrics flags."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import FIXTURES, SMOLLM2_API_FLAGS

import basert
from basert.engine.info import ModelInfo
from basert.engine.runner import engine_fingerprint
from basert.server.catalog import ModelCatalog, ServedModel
from basert.server.errors import ApiError
from basert.server.llama_api import RANDOM_SEED
from basert.testing.client import answer, error_envelope, post, sse_events
from basert.testing.launcher import ServerProcess
from basert.testing.pool import ServerPool

CAPITAL = json.loads((FIXTURES / "smollm2" / "reference.json").read_text())["prompts"][0]
GREEDY = {"prompt": CAPITAL["text"], "n_predict": 12, "temperature": 0}
TOOLS = [{"type": "function", "function": {"name": "lookup_key", "description": "Look up a key",
                                           "parameters": {"type": "object", "properties": {"key": {"type": "string"}},
                                                          "required": ["key"]}}}]
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(smollm2_base: Path, server_pool: ServerPool) -> ServerProcess:
    return server_pool.get(smollm2_base, *SMOLLM2_API_FLAGS)


@pytest.fixture(scope="module")
def flagged(smollm2_base: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server of its own for the flags under test (the pool resets servers through GET /slots, which is off)."""
    log_path = tmp_path_factory.mktemp("llama-flags") / "server.log"
    with ServerProcess(smollm2_base, "--max-context", "256", "--alias", "local-smol",
                       "--no-slots", "--no-metrics", log_path=log_path) as started:
        yield started


def model_id(server: ServerProcess) -> str:
    return answer(httpx.get(server.url + "/v1/models"))["data"][0]["id"]


def erase_slot(server: ServerProcess) -> None:
    answer(httpx.post(server.url + "/slots/0", params={"action": "erase"}))


def stream(url: str, path: str, body: dict) -> tuple[httpx.Headers, list]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        return response.headers, sse_events(response)

# --- /completion ------------------------------------------------------------------------------


def test_completion_fields_and_greedy_output(server: ServerProcess):
    result = answer(post(server.url, "/completion", {**GREEDY, "return_tokens": True}))
    assert result["tokens"] == CAPITAL["greedy"][:12]
    assert result["content"] == answer(post(server.url, "/v1/detokenize", {"tokens": result["tokens"]}))["content"]
    assert (result["stop"], result["stop_type"], result["stopping_word"], result["truncated"]) == (True, "limit", "",
                                                                                                 False)
    assert (result["tokens_predicted"], result["tokens_evaluated"]) == (12, len(CAPITAL["input_ids"]))
    assert (result["index"], result["id_slot"], result["model"]) == (0, 0, model_id(server))
    assert result["prompt"] == CAPITAL["text"] and result["has_new_line"] is True
    assert "completion_probabilities" not in result
    assert result["timings"]["predicted_n"] == 12
    assert set(result["timings"]) >= {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                                      "predicted_ms", "predicted_per_token_ms", "predicted_per_second", "cache_n"}
    settings = result["generation_settings"]
    # llama.cpp's sampling defaults, except what the request set.
    assert {k: settings[k] for k in ("n_predict", "temperature", "top_k", "top_p", "min_p", "repeat_penalty",
                                     "seed", "n_ctx", "stream", "cache_prompt")} == {
        "n_predict": 12, "temperature": 0.0, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
        "seed": RANDOM_SEED, "n_ctx": 512, "stream": False, "cache_prompt": True}
    without_tokens = answer(post(server.url, "/completions", GREEDY))
    assert (without_tokens["content"], without_tokens["tokens"]) == (result["content"], [])
    openai_style = answer(post(server.url, "/v1/completions", {**GREEDY, "n_predict": None, "max_tokens": 12}))
    assert openai_style["choices"][0]["text"] == result["content"]
    by_n_predict = answer(post(server.url, "/v1/completions", {**GREEDY, "n_predict": 3}))
    assert by_n_predict["usage"]["completion_tokens"] == 3


def test_stream_and_non_stream_agree_with_probabilities(server: ServerProcess):
    body = {**GREEDY, "n_probs": 2, "return_tokens": True, "id_slot": 0}
    whole = answer(post(server.url, "/completion", body))
    headers, events = stream(server.url, "/completion", body)
    assert headers["content-type"].startswith("text/event-stream")
    assert "[DONE]" not in events
    *chunks, last = events
    assert all(chunk["stop"] is False and len(chunk["tokens"]) == 1 and chunk["id_slot"] == 0 for chunk in chunks)
    assert [chunk["tokens"][0] for chunk in chunks] == whole["tokens"]
    assert "".join(chunk["content"] for chunk in events) == whole["content"]
    assert [chunk["tokens_predicted"] for chunk in chunks] == list(range(1, 13))
    assert [chunk["completion_probabilities"] for chunk in chunks] == [[p] for p in whole["completion_probabilities"]]
    assert (last["stop"], last["stop_type"], last["tokens"], last["tokens_predicted"]) == (True, "limit", [], 12)
    assert last["generation_settings"]["stream"] is True and "completion_probabilities" not in last
    probabilities = whole["completion_probabilities"]
    assert [p["id"] for p in probabilities] == whole["tokens"]
    for entry in probabilities:
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["id"] == entry["id"]        # greedy: the chosen token is the best one
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"] <= 0
        assert bytes(entry["bytes"]).decode() == entry["token"]


def test_stop_word_and_grammar_end(server: ServerProcess):
    full = answer(post(server.url, "/completion", GREEDY))["content"]
    stopped = answer(post(server.url, "/completion", {**GREEDY, "stop": ["answer"]}))
    assert stopped["content"] == full[: full.index("answer")]
    assert (stopped["stop_type"], stopped["stopping_word"]) == ("word", "answer")
    constrained = answer(post(server.url, "/completion", {**GREEDY, "grammar": 'root ::= "yes" | "no"'}))
    assert constrained["content"] in ("yes", "no") and constrained["stop_type"] == "eos"
    assert constrained["generation_settings"]["grammar"] == 'root ::= "yes" | "no"'
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    shaped = answer(post(server.url, "/completion", {**GREEDY, "n_predict": 16, "json_schema": schema}))
    assert isinstance(json.loads(shaped["content"])["ok"], bool) and shaped["stop_type"] == "eos"


def test_logit_bias_forms_and_response_fields(server: ServerProcess):
    paris = CAPITAL["greedy"][0]                 # the greedy first token, " Paris"
    body = {**GREEDY, "n_predict": 3, "return_tokens": True}
    answers = [answer(post(server.url, "/completion", {**body, "logit_bias": bias}))
               for bias in ([[paris, -100]], [[" Paris", False]], {str(paris): -100}, {" Paris": -100})]
    assert answers[0]["tokens"][0] != paris
    assert [a["tokens"] for a in answers[1:]] == [answers[0]["tokens"]] * 3
    assert answers[1]["generation_settings"]["logit_bias"] == [[paris, -100.0]]
    selected = answer(post(server.url, "/completion", {**body, "response_fields": [
        "content", "generation_settings/n_predict", "no/such"]}))
    assert selected == {"content": answer(post(server.url, "/completion", body))["content"],
                        "generation_settings/n_predict": 3}


@pytest.mark.parametrize("body, param", [
    ({"grammar": "root ::= ("}, None),
    ({"json_schema": {"type": "nonsense"}}, None),
    ({"grammar": 'root ::= "a"', "json_schema": {}}, None),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": [5, [6]]}, "prompt"),
    ({"n": 2}, "n"),
    ({"n_probs": 21}, "n_probs"),
    ({"logit_bias": [[5, 101]]}, "logit_bias"),
    ({"id_slot": 4}, "id_slot"),  # the default 4 slots are 0 to 3
], ids=["bad-gbnf", "bad-schema", "two-constraints", "empty", "unknown-id", "nested-in-mixed", "n", "n_probs",
        "bias", "id_slot"])
def test_bad_completion_requests_are_400(server: ServerProcess, body: dict, param: str | None):
    error = error_envelope(post(server.url, "/completion", {**GREEDY, **body}), 400)
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_mixed_and_several_prompts(server: ServerProcess):
    ids = CAPITAL["input_ids"]
    middle = answer(post(server.url, "/detokenize", {"tokens": ids[1:-1]}))["content"]
    expected = answer(post(server.url, "/completion", {**GREEDY, "n_predict": 4}))["content"]
    mixed = answer(post(server.url, "/completion", {**GREEDY, "n_predict": 4, "prompt": [ids[0], middle, ids[-1]]}))
    assert (mixed["content"], mixed["tokens_evaluated"]) == (expected, len(ids))
    several = answer(post(server.url, "/completion", {**GREEDY, "n_predict": 4, "prompt": [CAPITAL["text"], ids]}))
    assert [(r["index"], r["content"], r["tokens_evaluated"]) for r in several] == [(0, expected, len(ids)),
                                                                                     (1, expected, len(ids))]


def test_id_slot_cache_prompt_and_slots_listing(server: ServerProcess):
    erase_slot(server)
    body = {**GREEDY, "n_predict": 2, "id_slot": 0}
    first = answer(post(server.url, "/completion", body))
    again = answer(post(server.url, "/completion", body))
    assert (first["tokens_cached"], first["timings"]["prompt_n"]) == (0, len(CAPITAL["input_ids"]))
    # The repeated prompt reuses all but its last token, which is computed again for its logits.
    assert (again["tokens_cached"], again["timings"]["prompt_n"]) == (len(CAPITAL["input_ids"]) - 1, 1)
    uncached = answer(post(server.url, "/completion", {**body, "cache_prompt": False}))
    assert (uncached["content"], uncached["id_slot"]) == (first["content"], 0)
    assert uncached["generation_settings"]["cache_prompt"] is False
    slots = answer(httpx.get(server.url + "/slots"))
    assert [s["id"] for s in slots] == [0, 1, 2, 3]
    slot = slots[0]
    assert {k: slot[k] for k in ("id", "model", "is_processing", "n_ctx", "request_id", "id_task", "speculative")} == {
        "id": 0, "model": model_id(server), "is_processing": False, "n_ctx": 512, "request_id": None,
        "id_task": -1, "speculative": False}
    assert slot["cache_tokens"] == slot["cache_position"] == len(CAPITAL["input_ids"]) + 1
    assert slot["params"]["temperature"] == 0.8
    # llama.cpp lists next_token as a one-element array.
    assert slot["next_token"] == [{"has_next_token": False, "has_new_line": False, "n_remain": -1, "n_decoded": 0,
                                   "stopping_word": ""}]
    assert httpx.get(server.url + "/slots", params={"fail_on_no_slot": 1}).status_code == 200


def test_slots_that_never_ran_a_request_have_no_task_fields(smollm2_base: Path, tmp_path: Path):
    # A fresh server of its own: the pool's servers keep the slots earlier modules used.
    task_fields = {"id_task", "params", "next_token"}
    with ServerProcess(smollm2_base, "--max-context", "256", "--slots", "2",
                       log_path=tmp_path / "server.log") as fresh:
        assert [task_fields & set(slot) for slot in answer(httpx.get(fresh.url + "/slots"))] == [set(), set()]
        answer(post(fresh.url, "/completion", {**GREEDY, "n_predict": 1, "id_slot": 1}))
        unused, used = answer(httpx.get(fresh.url + "/slots"))
        assert (task_fields & set(unused), unused["has_run"], used["has_run"]) == (set(), False, True)
        assert used["params"] == answer(httpx.get(fresh.url + "/props"))["default_generation_settings"]["params"]
        assert (used["id_task"], used["next_token"][0]["has_next_token"]) == (-1, False)


def test_decode_rate_is_over_the_decode_steps(server: ServerProcess):
    # n generated tokens take n - 1 decode steps (the first comes from the prefill's logits), and predicted_ms
    # runs from the first token to the last, whether generation ends at the limit or at the end of sequence.
    one = answer(post(server.url, "/completion", {**GREEDY, "n_predict": 1}))["timings"]
    assert [one[k] for k in ("predicted_n", "predicted_ms", "predicted_per_second", "predicted_per_token_ms")] == [
        1, 0.0, 0.0, 0.0]
    limit = answer(post(server.url, "/completion", GREEDY))
    prompt = answer(post(server.url, "/apply-template", {"messages": HELLO}))["prompt"]
    eos = answer(post(server.url, "/completion", {"prompt": prompt, "n_predict": 64, "temperature": 0}))
    assert (limit["stop_type"], eos["stop_type"]) == ("limit", "eos")
    for timings in (limit["timings"], eos["timings"]):
        steps = timings["predicted_n"] - 1
        assert timings["predicted_per_second"] == 1000 * steps / timings["predicted_ms"]
        assert timings["predicted_per_token_ms"] == timings["predicted_ms"] / steps


def test_context_overflow_has_both_error_types(server: ServerProcess):
    error = error_envelope(post(server.url, "/completion", {"prompt": "word " * 600}), 400, "context_length_exceeded")
    assert error["type"] == "exceed_context_size_error"
    assert error["n_ctx"] == 512 and error["n_prompt_tokens"] > 512

# --- /props, chat prompts, routes -------------------------------------------------------------


def test_props(server: ServerProcess, smollm2_tokenizer_object: dict):
    props = answer(httpx.get(server.url + "/props"))
    assert (props["total_slots"], props["model_alias"]) == (4, model_id(server))
    assert props["model_path"].endswith(".base")
    assert props["chat_template"] == smollm2_tokenizer_object["tokenizer.chat_template"]
    assert (props["bos_token"], props["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert props["modalities"] == {"vision": False, "audio": False}
    assert props["build_info"].startswith("basert-")
    defaults = props["default_generation_settings"]
    assert (defaults["n_ctx"], defaults["is_processing"], defaults["id_task"]) == (512, False, -1)
    assert {k: defaults["params"][k] for k in ("temperature", "top_k", "top_p", "min_p", "seed", "n_predict")} == {
        "temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "seed": RANDOM_SEED, "n_predict": 2048}
    assert error_envelope(post(server.url, "/props", {}), 501)["type"] == "not_supported_error"


def test_apply_template_and_input_tokens(server: ServerProcess):
    body = {"messages": HELLO}
    prompt = answer(post(server.url, "/apply-template", body))["prompt"]
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                      "<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n")
    ids = answer(post(server.url, "/tokenize", {"content": prompt}))["tokens"]
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        assert answer(post(server.url, path, body)) == {"object": "response.input_tokens", "input_tokens": len(ids)}
    chat = answer(post(server.url, "/chat/completions", {**body, "model": "gpt-4o", "max_tokens": 3,
                                                         "temperature": 0}))
    assert (chat["usage"]["prompt_tokens"], chat["model"]) == (len(ids), model_id(server))
    rendered = answer(post(server.url, "/completion", {"prompt": prompt, "n_predict": 3, "temperature": 0}))
    assert rendered["content"] == chat["choices"][0]["message"]["content"]


def test_continuing_a_message_and_opening_a_turn_is_400(server: ServerProcess):
    body = {"messages": [*HELLO, {"role": "assistant", "content": "Hi"}], "continue_final_message": True}
    for path in ("/apply-template", "/v1/chat/completions"):
        error = error_envelope(post(server.url, path, {**body, "add_generation_prompt": True}), 400)
        assert (error["type"], error["param"]) == ("invalid_request_error", "continue_final_message")
    # Either one alone is fine: continuing the message is the default.
    continued = answer(post(server.url, "/apply-template", body))["prompt"]
    assert continued.endswith("<|im_start|>assistant\nHi")
    assert answer(post(server.url, "/apply-template", {**body, "add_generation_prompt": False}))["prompt"] == continued
    opened = answer(post(server.url, "/apply-template", {**body, "continue_final_message": False,
                                                         "add_generation_prompt": True}))["prompt"]
    assert opened.endswith("<|im_start|>assistant\n") and opened != continued


def test_system_fingerprint_in_llamas_build_tag_form(server: ServerProcess, smollm2_base: Path):
    expected = f"b{basert.__version__}-{engine_fingerprint(smollm2_base, exact=False)}"
    chat = {"messages": HELLO, "max_tokens": 1}
    assert answer(post(server.url, "/v1/chat/completions", chat))["system_fingerprint"] == expected
    assert answer(post(server.url, "/v1/completions", {"prompt": "Hi", "max_tokens": 1}))["system_fingerprint"] == \
        expected
    _, events = stream(server.url, "/v1/chat/completions", chat)
    assert {event["system_fingerprint"] for event in events if event != "[DONE]"} == {expected}


def test_routes_without_v1_and_any_model_name(server: ServerProcess):
    assert answer(httpx.get(server.url + "/models")) == answer(httpx.get(server.url + "/v1/models"))
    text = {"content": "Hello world"}
    assert answer(post(server.url, "/tokenize", text)) == answer(post(server.url, "/v1/tokenize", text))
    ids = answer(post(server.url, "/tokenize", text))["tokens"]
    assert answer(post(server.url, "/detokenize", {"tokens": ids})) == {"content": "Hello world"}
    named = answer(post(server.url, "/completion", {**GREEDY, "n_predict": 1, "model": "some/other-model"}))
    assert named["model"] == model_id(server)
    error_envelope(httpx.get(server.url + "/v1/models/some/other-model"), 404, "model_not_found")


def test_hybrid_chat_prompt_and_completion(hybrid_server: ServerProcess):
    body = {"messages": [{"role": "user", "content": "What is seq-1?"}], "tools": TOOLS}
    prompt = answer(post(hybrid_server.url, "/apply-template", body))["prompt"]
    assert "lookup_key" in prompt and prompt.endswith("<|im_start|>assistant\n<think>\n")
    ids = answer(post(hybrid_server.url, "/tokenize", {"content": prompt}))["tokens"]
    assert answer(post(hybrid_server.url, "/chat/completions/input_tokens", body))["input_tokens"] == len(ids)
    request = {"prompt": ids, "n_predict": 6, "temperature": 0, "return_tokens": True, "ignore_eos": True}
    whole = answer(post(hybrid_server.url, "/completion", request))
    _, events = stream(hybrid_server.url, "/completion", request)
    assert [chunk["tokens"][0] for chunk in events[:-1]] == whole["tokens"]
    assert "".join(chunk["content"] for chunk in events) == whole["content"]
    # The hybrid resumes from the state it kept just before the repeated prompt's last token.
    assert events[-1]["tokens_cached"] == len(ids) - 1

# --- flags ------------------------------------------------------------------------------------


def test_alias_no_slots_and_no_metrics(flagged: ServerProcess):
    served = answer(httpx.get(flagged.url + "/models"))["data"]   # the models directory's models follow, unloaded
    assert (served[0]["id"], served[0]["status"]["value"]) == ("local-smol", "loaded")
    assert all(model["status"]["value"] == "unloaded" for model in served[1:])
    assert answer(httpx.get(flagged.url + "/props"))["model_alias"] == "local-smol"
    result = answer(post(flagged.url, "/completion", {**GREEDY, "n_predict": 1, "model": "whatever"}))
    assert result["model"] == "local-smol" and result["generation_settings"]["n_ctx"] == 256
    for path in ("/slots", "/metrics"):
        assert error_envelope(httpx.get(flagged.url + path), 501)["type"] == "not_supported_error"
    assert answer(httpx.post(flagged.url + "/slots/0", params={"action": "erase"}))["id_slot"] == 0


def test_alias_needs_a_single_model():
    result = subprocess.run([sys.executable, "-m", "basert", "serve", "a.base", "--model", "b.base", "--alias", "x",
                             "--port", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--alias names the one served model" in result.stderr and "Traceback" not in result.stderr


def test_catalog_resolves_any_name_only_with_one_model(tmp_path: Path):
    def served(name: str) -> ServedModel:
        info = ModelInfo(id=name, path=tmp_path / f"{name}.base", arch="llama", vocab_size=8, n_ctx=16,
                         fingerprint="0", hybrid=False, n_slots=1, hidden_size=4)
        return ServedModel(info=info, actor=None, tokenizer=None, template=None, dialect="")

    single = ModelCatalog()
    single.add(served("org/one"), alias="short")
    assert single.entry_for("anything").name == "short"
    assert single.entry_for(None).aliases >= {"org/one", "short"}
    assert single.entry("org/one") is single.entry("short")
    with pytest.raises(ApiError) as unknown:
        single.entry("anything")          # looking a model up by its name stays exact
    assert unknown.value.status == 404
    with pytest.raises(ApiError) as strict:
        single.entry_for("anything", strict=True)   # Ollama's routes: no fallback
    assert strict.value.status == 404
    several = ModelCatalog()
    several.add(served("a"))
    several.add(served("b"))
    assert several.entry_for("b").name == "b"
    with pytest.raises(ApiError) as missing:
        several.entry_for("c")
    assert (missing.value.status, missing.value.code) == (404, "model_not_found")
    with pytest.raises(ApiError) as unnamed:
        several.entry_for(None)
    assert unnamed.value.status == 400
