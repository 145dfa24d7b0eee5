"""Models loaded on demand by real `basert serve` processes on loopback, over a real models directory: SmolLM2
(named on the command line), the tiny Qwen3.5-style hybrid and a damaged file, loaded when a request names them,
within --max-loaded-models / --memory-budget, unloaded by LRU and by keep-alive; /models/load, /models/unload and
`basert ps`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from basert.testing.client import answer, post
from basert.testing.launcher import ServerProcess

SMOLLM2 = "test/smollm2"
HYBRID = "test/hybrid"
BROKEN = "test/broken"
FLAGS = ("-c", "1024", "-np", "2")
GREEDY = {"temperature": 0, "max_tokens": 12}


def install(models: Path, model_id: str, source: Path | None) -> Path:
    """`source` as `<models>/<model_id>/default/model.base` (None: a damaged file of random bytes)."""
    out = models / model_id / "default" / "model.base"
    out.parent.mkdir(parents=True)
    if source is None:
        out.write_bytes(b"BASE" + bytes(range(256)) * 64)
    else:
        shutil.copyfile(source, out)
    return out


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_base: Path, qwen35_chat_base: Path) -> Path:
    models = tmp_path_factory.mktemp("on-demand") / "models"
    install(models, SMOLLM2, smollm2_base)
    install(models, HYBRID, qwen35_chat_base)
    install(models, BROKEN, None)
    return models


@pytest.fixture(scope="module")
def one_at_a_time(models_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A server of the models directory that keeps one model loaded at a time (SmolLM2 loaded at start)."""
    log = tmp_path_factory.mktemp("one-at-a-time") / "server.log"
    with ServerProcess(models_dir / SMOLLM2 / "default" / "model.base", *FLAGS, "--models-dir", str(models_dir),
                       "--max-loaded-models", "1", log_path=log, env={"BASERT_MODELS_DIR": str(models_dir)}) as server:
        yield server


def complete(url: str, model: str, prompt: str = "The capital of France is", **extra) -> dict:
    return answer(post(url, "/v1/completions", {"model": model, "prompt": prompt, **GREEDY, **extra}, timeout=300))


def states(url: str) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in answer(httpx.get(url + "/v1/models", timeout=30))["data"]}


def rss(server: ServerProcess) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def loads_of(server: ServerProcess, model_id: str) -> int:
    return len(re.findall(rf"INFO basert\.models: loading {re.escape(model_id)}\n", server.log_text()))


def test_every_model_of_the_directory_is_listed_and_the_named_one_loaded(one_at_a_time: ServerProcess):
    listed = states(one_at_a_time.url)
    assert listed[SMOLLM2] == "loaded"
    assert listed[HYBRID] == listed[BROKEN] == "unloaded"
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in listed     # the pullable models, by id
    aliases = {m["id"]: m["aliases"] for m in answer(httpx.get(one_at_a_time.url + "/v1/models"))["data"]}
    assert "smollm2" in aliases["HuggingFaceTB/SmolLM2-135M-Instruct"]


@pytest.mark.slow
def test_alternating_requests_load_and_unload_without_mixing_models(one_at_a_time: ServerProcess):
    url = one_at_a_time.url
    first = {model: complete(url, model) for model in (SMOLLM2, HYBRID)}
    assert first[SMOLLM2]["model"] == SMOLLM2 and first[HYBRID]["model"] == HYBRID
    assert first[SMOLLM2]["choices"][0]["text"] != first[HYBRID]["choices"][0]["text"]
    for _ in range(2):
        for model in (SMOLLM2, HYBRID):
            again = complete(url, model)
            assert again["choices"][0]["text"] == first[model]["choices"][0]["text"]
            loaded = [name for name, state in states(url).items() if state == "loaded"]
            assert loaded == [model]


def test_weights_are_freed_when_a_model_is_unloaded(one_at_a_time: ServerProcess, models_dir: Path):
    url = one_at_a_time.url
    complete(url, HYBRID)
    assert answer(post(url, "/models/unload", {"model": HYBRID}))["unloaded"] is True
    complete(url, SMOLLM2)
    with_model = rss(one_at_a_time)
    answer(post(url, "/models/unload", {"model": SMOLLM2}))
    after_first_unload = rss(one_at_a_time)
    weights = (models_dir / SMOLLM2 / "default" / "model.base").stat().st_size
    assert with_model - after_first_unload > weights // 2
    for _ in range(3):
        for model in (HYBRID, SMOLLM2):
            complete(url, model)
            answer(post(url, "/models/unload", {"model": model}))
    assert rss(one_at_a_time) < 1.1 * after_first_unload
    assert set(states(url).values()) == {"unloaded"}


def test_concurrent_first_requests_share_one_load(one_at_a_time: ServerProcess):
    url = one_at_a_time.url
    answer(post(url, "/models/unload", {"model": HYBRID}))
    before = loads_of(one_at_a_time, HYBRID)
    with ThreadPoolExecutor(8) as pool:
        texts = list(pool.map(lambda _: complete(url, HYBRID)["choices"][0]["text"], range(8)))
    assert len(set(texts)) == 1
    assert loads_of(one_at_a_time, HYBRID) == before + 1


def test_a_long_request_is_not_cut_by_a_request_for_another_model(one_at_a_time: ServerProcess):
    url = one_at_a_time.url
    complete(url, SMOLLM2)
    chunks: list[dict] = []
    started = threading.Event()
    finished_at: list[float] = []

    def long_stream() -> None:
        body = {"model": SMOLLM2, "prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()
        finished_at.append(time.monotonic())

    thread = threading.Thread(target=long_stream)
    thread.start()
    assert started.wait(120)
    other = complete(url, HYBRID)
    answered_at = time.monotonic()
    thread.join(300)
    assert other["model"] == HYBRID
    text = "".join(chunk["choices"][0]["text"] for chunk in chunks if chunk.get("choices"))
    assert [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")][-1] == "length"
    assert text == complete(url, SMOLLM2, "Once upon a time", max_tokens=200, ignore_eos=True)["choices"][0]["text"]
    assert finished_at[0] <= answered_at   # the other model waited for the long request to end


def test_a_damaged_model_fails_its_requests_only(one_at_a_time: ServerProcess):
    url = one_at_a_time.url
    for _ in range(2):
        refused = post(url, "/v1/completions", {"model": BROKEN, "prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 500
        error = refused.json()["error"]
        assert error["code"] == "model_load_failed" and BROKEN in error["message"]
        assert "Traceback" not in error["message"]
    assert states(url)[BROKEN] == "unloaded"
    assert complete(url, SMOLLM2)["model"] == SMOLLM2


def test_unknown_models_and_bad_admin_bodies_are_4xx(one_at_a_time: ServerProcess):
    url = one_at_a_time.url
    for body, status in [({"model": "no/such-model"}, 404), ({}, 400), ({"model": 3}, 400), ({"model": ""}, 400),
                         ({"model": SMOLLM2, "keep_alive": "forever"}, 400),
                         ({"model": SMOLLM2, "keep_alive": "99999h"}, 400)]:
        for route in ("/models/load", "/models/unload"):
            if route == "/models/unload" and "keep_alive" in body:
                continue
            response = post(url, route, body)
            assert response.status_code == status, (route, body, response.text)
            assert "error" in response.json()
    assert httpx.get(url + "/v1/models/no-such-model").status_code == 404


def test_load_unload_and_basert_ps(one_at_a_time: ServerProcess):
    url = one_at_a_time.url
    loaded = answer(post(url, "/models/load", {"model": HYBRID, "keep_alive": "-1"}))
    assert loaded["model"]["status"]["value"] == "loaded"
    table = subprocess.run([sys.executable, "-m", "basert", "ps", "--url", url], capture_output=True, text=True,
                           timeout=60, check=True).stdout
    rows = table.splitlines()
    assert rows[0].split()[:2] == ["NAME", "STATE"] and len(rows) == 2
    assert rows[1].split()[0] == HYBRID and "forever" in rows[1] and "MiB" in rows[1]
    answer(post(url, "/models/unload", {"model": HYBRID}))
    everything = subprocess.run([sys.executable, "-m", "basert", "ps", "--all", "--url", url], capture_output=True,
                                text=True, timeout=60, check=True).stdout
    assert re.search(rf"^{re.escape(HYBRID)}\s+unloaded", everything, re.M)


@pytest.mark.slow
def test_a_busy_server_refuses_after_the_queue_timeout_and_idle_models_expire(
        models_dir: Path, tmp_path: Path):
    """One model at a time, a 2 s queue timeout and a 1 s keep-alive: a request for another model while a long one
    runs gets 503 with Retry-After; a model loaded on demand is unloaded a second after its last request."""
    with ServerProcess(models_dir / SMOLLM2 / "default" / "model.base", "-c", "8192", "-np", "2", "--models-dir",
                       str(models_dir), "--max-loaded-models", "1", "--queue-timeout", "2", "--keep-alive", "1s",
                       log_path=tmp_path / "server.log", env={"BASERT_MODELS_DIR": str(models_dir)}) as server:
        url = server.url
        # Long enough to outlast the queue timeout on any machine; the client closes it once it has its answer.
        body = {"model": SMOLLM2, "prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
            lines = response.iter_lines()   # kept: a dropped iterator would close the stream
            assert next(lines).startswith("data: ")
            refused = post(url, "/v1/completions", {"model": HYBRID, "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503 and refused.headers["Retry-After"]
            assert refused.json()["error"]["code"] == "model_busy"
        assert complete(url, HYBRID)["model"] == HYBRID
        deadline = time.monotonic() + 60
        while states(url)[HYBRID] != "unloaded":
            assert time.monotonic() < deadline, "the keep-alive did not unload the model"
            time.sleep(0.2)


@pytest.mark.slow
def test_the_memory_budget_unloads_idle_models_and_refuses_one_that_cannot_fit(
        one_at_a_time: ServerProcess, models_dir: Path, tmp_path: Path):
    """With no limit on the count, a budget that holds either model but not both: loading one unloads the other;
    a budget below a model's size refuses it with the reason."""
    size = {}
    for model in (SMOLLM2, HYBRID):
        loaded = answer(post(one_at_a_time.url, "/models/load", {"model": model}))["model"]
        size[model] = loaded["status"]["memory_bytes"]
    budget = max(size.values()) + min(size.values()) // 2
    with ServerProcess(models_dir / SMOLLM2 / "default" / "model.base", *FLAGS, "--models-dir", str(models_dir),
                       "--max-loaded-models", "0", "--memory-budget", str(budget),
                       log_path=tmp_path / "budget.log", env={"BASERT_MODELS_DIR": str(models_dir)}) as server:
        for model in (HYBRID, SMOLLM2, HYBRID):
            assert complete(server.url, model)["model"] == model
            assert [name for name, state in states(server.url).items() if state == "loaded"] == [model]
    small = min(size.values()) - 1
    with ServerProcess(models_dir / HYBRID / "default" / "model.base", *FLAGS, "--models-dir", str(models_dir),
                       "--memory-budget", str(small), log_path=tmp_path / "small.log",
                       env={"BASERT_MODELS_DIR": str(models_dir)}) as server:
        refused = post(server.url, "/v1/completions", {"model": SMOLLM2, "prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 500 and "--memory-budget" in refused.json()["error"]["message"]
        assert complete(server.url, HYBRID)["model"] == HYBRID


def test_an_unloaded_model_comes_back_with_its_prefix_cache(models_dir: Path, tmp_path: Path):
    prompt = "A prompt long enough to fill a few blocks of the prefix cache. " * 8
    with ServerProcess(models_dir / SMOLLM2 / "default" / "model.base", *FLAGS, "--models-dir", str(models_dir),
                       "--prefix-cache-file", str(tmp_path / "prefix.cache"), log_path=tmp_path / "server.log",
                       env={"BASERT_MODELS_DIR": str(models_dir)}) as server:
        first = complete(server.url, HYBRID, prompt)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        answer(post(server.url, "/models/unload", {"model": HYBRID}))
        assert (tmp_path / f"prefix.cache.{HYBRID.replace('/', '--')}").is_file()
        again = complete(server.url, HYBRID, prompt)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
        assert again["choices"][0]["text"] == first["choices"][0]["text"]


def test_metrics_say_which_models_are_loaded(one_at_a_time: ServerProcess):
    url = one_at_a_time.url
    complete(url, SMOLLM2)
    assert f'basert_busy_slots{{model="{SMOLLM2}"}}' in httpx.get(url + "/metrics").text
    complete(url, HYBRID)
    text = httpx.get(url + "/metrics").text
    assert f'basert_model_loaded{{model="{HYBRID}"}} 1.0' in text
    assert f'basert_model_loaded{{model="{SMOLLM2}"}} 0.0' in text
    assert re.search(rf'basert_model_memory_bytes{{model="{re.escape(HYBRID)}"}} [1-9]', text)
    assert f'basert_busy_slots{{model="{SMOLLM2}"}}' not in text


@pytest.mark.slow
def test_concurrent_requests_for_two_models_all_succeed_unmixed(one_at_a_time: ServerProcess):
    """Eight clients at once, each alternating between the two models, with one model loaded at a time: every
    request succeeds with its own model's answer (loads and unloads happen between the requests that hold them)."""
    url = one_at_a_time.url
    expected = {model: complete(url, model)["choices"][0]["text"] for model in (SMOLLM2, HYBRID)}

    def client(index: int) -> list[tuple[str, str]]:
        order = (SMOLLM2, HYBRID) if index % 2 else (HYBRID, SMOLLM2)
        return [(model, complete(url, model)["choices"][0]["text"]) for model in order * 2]

    with ThreadPoolExecutor(8) as pool:
        answers = [pair for pairs in pool.map(client, range(8)) for pair in pairs]
    assert len(answers) == 32
    assert all(text == expected[model] for model, text in answers)


@pytest.mark.slow
def test_a_waiting_load_is_not_starved_by_new_requests_for_the_loaded_model(one_at_a_time: ServerProcess):
    """While a load waits for the loaded model to become idle, later requests for the loaded model queue behind it:
    the model asked for first is answered first."""
    url = one_at_a_time.url
    complete(url, SMOLLM2)
    answered: dict[str, float] = {}
    streaming = threading.Event()

    def long_request() -> None:
        body = {"model": SMOLLM2, "prompt": "Once upon a time", "max_tokens": 150, "ignore_eos": True,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as response:
            for _ in response.iter_lines():
                streaming.set()

    def timed(label: str, model: str) -> None:
        complete(url, model)
        answered[label] = time.monotonic()

    long = threading.Thread(target=long_request)
    long.start()
    assert streaming.wait(120)
    other = threading.Thread(target=timed, args=("other model", HYBRID))
    other.start()
    time.sleep(0.5)   # the other model's load is waiting for room by now
    later = threading.Thread(target=timed, args=("loaded model, later", SMOLLM2))
    later.start()
    for thread in (long, other, later):
        thread.join(300)
    assert answered["other model"] < answered["loaded model, later"]


def test_listing_slots_neither_loads_nor_keeps_a_model(one_at_a_time: ServerProcess):
    url = one_at_a_time.url
    answer(post(url, "/models/unload", {"model": HYBRID}))
    assert answer(httpx.get(url + "/slots", params={"model": HYBRID})) == []
    assert states(url)[HYBRID] == "unloaded"
    complete(url, HYBRID)
    slots = answer(httpx.get(url + "/slots", params={"model": HYBRID}))
    assert len(slots) == 2 and states(url)[HYBRID] == "loaded"
