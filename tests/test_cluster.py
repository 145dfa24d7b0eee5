"""`basert cluster` on a local Ray: 2 SmolLM2 replicas (1 thread each) behind Ray Serve's proxy.

The same requests answered by the cluster and by one `basert serve` give the same outputs; conversations stay on
their replica and find their prefix cached; slot admin and metrics address replicas; a killed replica's requests
fail with a 503 while the other replica serves on, and Ray brings the killed one back.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("ray.serve", reason="the cluster tests need Ray Serve (pip install 'basert[cluster]')")

from conftest import HYBRID_CHAT_FLAGS
from openai import OpenAI

from basert.testing.client import error_envelope
from basert.testing.cluster import ClusterProcess

# Listening beyond loopback too, so that a test can reach it from a non-loopback address.
CLUSTER_FLAGS = ("--threads-per-replica", "1", "--max-context", "1024", "--host", "0.0.0.0")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SUBJECTS = ["invoices", "rockets", "gardens", "violins", "glaciers", "trains", "bees", "lighthouses"]


@pytest.fixture(scope="module")
def cluster(smollm2_base: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("cluster")
    started = ClusterProcess(smollm2_base, *CLUSTER_FLAGS, "--prefix-cache-file", str(root / "pc"), replicas=2,
                             log_path=root / "cluster.log")
    yield started
    code = started.stop()
    assert code == 0, started.log_text()[-4000:]
    # Each replica of a one-model cluster saved its prefix cache in PATH.<K> as it stopped.
    assert sorted(p.name for p in root.glob("pc*")) == ["pc.0", "pc.1"]


def client_of(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def chats(url: str) -> dict:
    """A plain chat, the same chat streamed, and a chat offered a tool, greedy."""
    client = client_of(url)
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    plain = client.chat.completions.create(model="smollm2", messages=messages, max_tokens=24, temperature=0)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model="smollm2", messages=messages, max_tokens=24, temperature=0, stream=True) if chunk.choices)
    tooled = client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=TOOLS,
        max_tokens=40, temperature=0)
    calls = [(c.function.name, c.function.arguments) for c in tooled.choices[0].message.tool_calls or []]
    return {"plain": plain.choices[0].message.content, "streamed": streamed,
            "tooled": (tooled.choices[0].message.content, calls, tooled.choices[0].finish_reason)}


def test_the_openai_sdk_through_the_cluster_gets_what_one_server_answers(cluster, smollm2_server):
    through_cluster = chats(cluster.url)
    assert through_cluster == chats(smollm2_server.url)
    assert through_cluster["plain"] and through_cluster["plain"] == through_cluster["streamed"]


def conversation(url: str, index: int, turns: int) -> list[dict]:
    """One conversation of `turns` turns after its own long system prompt: per turn, its replica (None from a
    single server), usage, answer and the previous prompt's length."""
    subject = SUBJECTS[index]
    system = (f"You are the assistant of the {subject} desk. Answer questions about {subject} briefly and "
              f"politely, and never discuss anything but {subject}. ") * 8
    messages = [{"role": "system", "content": system}]
    seen = []
    with httpx.Client(base_url=url, timeout=120) as http:
        for turn in range(turns):
            messages.append({"role": "user", "content": f"Question {turn + 1} about {subject}: what matters most?"})
            response = http.post("/v1/chat/completions", json={"model": "smollm2", "messages": messages,
                                                               "max_tokens": 8, "temperature": 0})
            assert response.status_code == 200, response.text
            body = response.json()
            previous = 0
            if turn:
                previous = http.post("/v1/chat/completions/input_tokens",
                                     json={"model": "smollm2", "messages": messages[:-1]}).json()["input_tokens"]
            answer = body["choices"][0]["message"]["content"]
            replica = response.headers.get("x-basert-replica")
            seen.append({"replica": None if replica is None else int(replica), "usage": body["usage"],
                         "answer": answer, "previous_prompt": previous})
            messages.append({"role": "assistant", "content": answer})
    return seen


def test_conversations_stay_on_their_replica_and_find_their_prefix_cached(cluster):
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        runs = list(pool.map(lambda i: conversation(cluster.url, i, 4), range(8)))
    for run in runs:
        assert len({turn["replica"] for turn in run}) == 1, run
        for turn in run[1:]:
            # everything before the new user message was this conversation's previous prompt or answer
            shared = turn["previous_prompt"]
            cached = turn["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 0.9 * shared, (cached, shared, run)
    replicas = [run[0]["replica"] for run in runs]
    assert sorted(set(replicas)) == [0, 1], replicas


@pytest.fixture(scope="module")
def hybrid_cluster(qwen35_chat_base: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("hybrid-cluster")
    started = ClusterProcess(qwen35_chat_base, *HYBRID_CHAT_FLAGS, "--threads-per-replica", "1", replicas=2,
                             log_path=root / "cluster.log")
    yield started
    assert started.stop() == 0, started.log_text()[-4000:]


def test_hybrid_conversations_through_the_cluster_equal_one_servers(hybrid_cluster, hybrid_server):
    """Prefix reuse on the replicas (recurrent snapshots included) changes no answer of a hybrid model."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        through_cluster = list(pool.map(lambda i: conversation(hybrid_cluster.url, i, 3), range(4)))
    alone = [conversation(hybrid_server.url, i, 3) for i in range(4)]
    for run, single in zip(through_cluster, alone):
        assert [turn["answer"] for turn in run] == [turn["answer"] for turn in single]
        assert len({turn["replica"] for turn in run}) == 1
        assert all(turn["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for turn in run[1:]), run


def test_slots_and_metrics_name_their_replica(cluster):
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        slots = http.get("/slots").json()
        assert {slot["replica"] for slot in slots} == {0, 1}
        only = http.get("/slots", params={"replica": 1})
        assert only.status_code == 200 and only.headers["x-basert-replica"] == "1"
        assert len(only.json()) == len([slot for slot in slots if slot["replica"] == 1])
        erase = http.post("/slots/0", params={"action": "erase"})
        assert error_envelope(erase, 400)["param"] == "replica"
        assert http.post("/slots/0", params={"action": "erase", "replica": 1}).status_code == 200
        assert error_envelope(http.get("/slots", params={"replica": 7}), 400)["param"] == "replica"
        assert error_envelope(http.get("/slots", headers={"X-BaseRT-Replica": "x"}), 400)
        for bad in ("-1", "99999999999999999999", "1.5", ""):
            assert error_envelope(http.get("/slots", params={"replica": bad}), 400)["param"] == "replica"
        # malformed bodies reach a replica's server, whose 400 comes back as it is
        assert error_envelope(http.post("/v1/chat/completions", content=b'{"messages": [',
                                        headers={"content-type": "application/json"}), 400)
        assert error_envelope(http.post("/v1/chat/completions", json={"messages": 5, "max_tokens": "many"}), 400)
        assert error_envelope(http.post("/v1/completions", json={"prompt": "hi", "temperature": "hot"}), 400)
        too_large = http.post("/v1/completions", content=b'{"prompt": "' + b"a" * (33 * 1024 * 1024) + b'"}')
        assert error_envelope(too_large, 413, "request_too_large")
        metrics = http.get("/metrics")
        assert metrics.status_code == 200
        assert 'replica="0"' in metrics.text and 'replica="1"' in metrics.text
        status = http.get("/cluster").json()["replicas"]
        assert [(r["replica"], r["state"]) for r in status] == [(0, "serving"), (1, "serving")]


def local_address() -> str | None:
    """This machine's address on its default route, unless that is loopback or there is none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("192.0.2.1", 9))     # no packet is sent: this only picks the outgoing interface
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def test_slots_and_files_stay_loopback_only_without_api_keys(cluster):
    """The replicas see every request come from loopback; the ingress keeps their rule for remote clients."""
    address = local_address()
    if address is None:
        pytest.skip("this machine has no address beyond loopback")
    with httpx.Client(base_url=f"http://{address}:{cluster.port}", timeout=60) as remote:
        assert error_envelope(remote.get("/slots"), 401, "invalid_api_key")
        assert error_envelope(remote.post("/slots/0", params={"action": "erase", "replica": 0}), 401,
                              "invalid_api_key")
        assert error_envelope(remote.get("/v1/files"), 401, "invalid_api_key")
        assert remote.get("/v1/models").status_code == 200      # the rest is open, as on one server
    assert httpx.get(f"{cluster.url}/slots", timeout=60).status_code == 200


def test_a_page_rebound_to_the_cluster_by_dns_reads_nothing_without_api_keys(cluster):
    """The replicas see their own address as every request's Host; the ingress checks the client's for them."""
    rebound = {"Host": f"rebound.example:{cluster.port}"}
    with httpx.Client(base_url=cluster.url, timeout=60) as http:
        for path in ("/slots", "/v1/files", "/v1/models"):
            assert error_envelope(http.get(path, headers=rebound), 403, "host_not_allowed"), path
        assert http.get("/v1/models", headers={"Host": f"localhost:{cluster.port}"}).status_code == 200


def test_a_killed_replica_fails_its_requests_cleanly_and_comes_back(cluster):
    victim = {r["replica"]: r["pid"] for r in cluster.replicas()}[0]
    long_chat = {"model": "smollm2", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                 "messages": [{"role": "user", "content": "Tell a very long story about a lighthouse keeper."}]}
    outcomes: dict[str, object] = {}

    def whole() -> None:
        with httpx.Client(base_url=cluster.url, timeout=120) as http:
            outcomes["whole"] = http.post("/v1/chat/completions", params={"replica": 0}, json=long_chat)

    streaming = threading.Event()

    def streamed() -> None:
        with httpx.Client(base_url=cluster.url, timeout=120) as http:
            with http.stream("POST", "/v1/chat/completions", params={"replica": 0},
                             json={**long_chat, "stream": True}) as response:
                lines = []
                for line in response.iter_lines():
                    lines.append(line)
                    streaming.set()
            outcomes["streamed"] = lines

    threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
    for thread in threads:
        thread.start()
    assert streaming.wait(60)           # both requests run on replica 0 (the whole one was sent first)
    time.sleep(0.5)
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    for thread in threads:
        thread.join(120)
    assert error_envelope(outcomes["whole"], 503, "replica_failed")
    events = [json.loads(line[6:]) for line in outcomes["streamed"] if line.startswith("data: {")]
    assert events and "error" in events[-1], events[-3:]
    assert "[DONE]" not in "".join(outcomes["streamed"])
    # the other replica serves on, and requests not pinned anywhere find it
    with httpx.Client(base_url=cluster.url, timeout=120) as http:
        for params in ({"replica": 1}, {}):
            answer = http.post("/v1/chat/completions", params=params, json={**long_chat, "max_tokens": 4})
            assert answer.status_code == 200, answer.text
    assert cluster.wait_serving(60 - (time.monotonic() - killed_at), unlike={0: victim}), cluster.log_text()[-4000:]
    with httpx.Client(base_url=cluster.url, timeout=120) as http:
        again = http.post("/v1/chat/completions", params={"replica": 0}, json={**long_chat, "max_tokens": 4})
        assert again.status_code == 200 and again.headers["x-basert-replica"] == "0"
        assert json.loads(again.text)["usage"]["completion_tokens"] == 4


def test_the_serve_run_entry_point_builds_the_same_application(smollm2_base: Path):
    from basert.cluster.app import build, serve_parser

    app = build({"model": str(smollm2_base), "replicas": "3", "threads_per_replica": "2",
                 "serve_args": "--max-context 2048 --slots 2 --prefix-cache-file /var/cache/pc --alias agent"})
    ingress = app._bound_deployment
    replica = ingress.init_args[0]._bound_deployment
    assert ingress.init_args[1:] == ([str(smollm2_base)], 3, None, "agent", 32 * 1024 * 1024, False, ["127.0.0.1"])
    assert (replica.num_replicas, replica.max_ongoing_requests) == (3, 2 + 64)
    models, flags, threads = replica.init_args
    assert (models, threads) == ([str(smollm2_base)], 2)
    passed = serve_parser().parse_args(flags)
    assert (passed.max_context, passed.slots, str(passed.prefix_cache_file), passed.alias) == (
        2048, 2, "/var/cache/pc", "agent")
    assert passed.prefix_cache_save_interval == 60.0    # a killed replica's restart stays warm


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--threads-per-replica", "0"], "--threads-per-replica must be at least 1"),
    (["--slots", "0"], "--slots N needs N >= 1"),
    (["--replica", "1"], "set by basert cluster"),
])
def test_the_cluster_command_refuses_flags_that_cannot_work(flags, message):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "basert", "cluster", *flags], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
