"""The cluster's routing decisions, prompt keys, flag pass-through and metrics merge (no Ray needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from basert.cluster.app import CLUSTER_SET, ClusterConfig, cluster_config, serve_flags, serve_parser
from basert.cluster.metrics import merge_replica_metrics
from basert.cluster.prompts import PromptKeys, PromptModel
from basert.cluster.routing import PrefixTable, Route, RoutingPolicy
from basert.engine.build import EngineOptions, build_engine
from basert.engine.prefix_cache import chain_keys
from basert.engine.sampler import SamplingParams
from basert.engine.types import GenerationRequest

SYSTEM = "You are a careful assistant for the accounts team. " * 12


def keys_of(start: int, n: int) -> tuple[int, ...]:
    return tuple(range(start, start + n))


# --- the prefix table and the policy ----------------------------------------------------------------------------


def test_the_table_finds_the_replica_of_the_longest_remembered_prefix():
    table = PrefixTable()
    table.record(keys_of(100, 4), replica=0)
    table.record(keys_of(100, 2) + keys_of(200, 3), replica=1)   # shares two blocks, then its own
    assert table.longest(keys_of(100, 4) + (999,)) == (0, 4)
    assert table.longest(keys_of(100, 2) + keys_of(200, 3)) == (1, 5)
    assert table.longest(keys_of(100, 2)) == (1, 2)               # the newer server of the shared blocks
    assert table.longest((5, 6)) == (None, 0)
    assert table.longest(()) == (None, 0)


def test_the_table_forgets_its_oldest_keys_beyond_its_capacity():
    table = PrefixTable(capacity=3)
    table.record((1, 2), replica=0)
    table.record((3, 4), replica=1)
    assert len(table) == 3
    assert table.longest((1,)) == (None, 0)
    assert table.longest((1, 2)) == (0, 2)
    assert table.blocks_of(1) == 2
    with pytest.raises(ValueError):
        PrefixTable(capacity=0)


def test_a_known_prefix_goes_to_its_replica_a_new_one_to_the_least_loaded():
    policy = RoutingPolicy()
    route = Route(keys_of(10, 8))
    assert policy.rank_replicas(route, {0: 1, 1: 0, 2: 3}) == [[1], [0], [2]]
    policy.served(route, 2)
    assert policy.rank_replicas(route, {0: 1, 1: 0, 2: 3}) == [[2], [1], [0]]
    # a longer prompt of the same conversation follows it
    assert policy.rank_replicas(Route(keys_of(10, 12)), {0: 0, 1: 0, 2: 1})[0] == [2]


def test_an_overloaded_owner_gives_way_to_the_least_loaded_replica():
    policy = RoutingPolicy(overload=4)
    route = Route(keys_of(10, 8))
    policy.served(route, 0)
    assert policy.rank_replicas(route, {0: 3, 1: 0})[0] == [0]     # below the threshold
    assert policy.rank_replicas(route, {0: 5, 1: 2})[0] == [0]     # busy, but the others nearly as busy
    assert policy.rank_replicas(route, {0: 5, 1: 1})[0] == [1]     # 4 more than the least loaded
    assert policy.rank_replicas(route, {1: 0, 2: 0})[0] == [1]     # its owner is gone


def test_a_named_replica_is_the_only_choice_and_none_when_it_is_down():
    policy = RoutingPolicy()
    assert policy.rank_replicas(Route(keys_of(1, 3), replica=1), {0: 0, 1: 9}) == [[1]]
    assert policy.rank_replicas(Route(replica=2), {0: 0, 1: 0}) == []
    assert policy.rank_replicas(Route(), {}) == []


def test_round_robin_ignores_prefixes():
    policy = RoutingPolicy(policy="round-robin")
    route = Route(keys_of(10, 8))
    firsts = []
    for _ in range(4):
        firsts.append(policy.rank_replicas(route, {0: 0, 1: 0})[0][0])
        policy.served(route, firsts[-1])
    assert firsts == [0, 1, 0, 1]
    assert len(policy.table) == 0
    with pytest.raises(ValueError):
        RoutingPolicy(policy="random")


# --- the replicas' flags ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv", [
    [],
    ["--max-context", "8192", "--no-prefix-cache", "--api-key", "a", "--api-key", "b", "--slots", "2"],
    ["--prefix-cache-file", "/tmp/pc", "--no-continuous-batching", "-ctk", "f32", "--no-metrics"],
    ["--continuous-batching", "--alias", "agent", "--chat-template", "/tmp/t.jinja", "--rate-limit", "10"],
    ["-c", "2048", "-np", "3", "--no-slots", "--cors-allow-origin", "*", "--no-verify-checksums"],
])
def test_the_replicas_flags_parse_back_to_the_same_settings(argv):
    parser = serve_parser()
    args = parser.parse_args(argv)
    again = parser.parse_args(serve_flags(args, parser))
    for name, value in vars(args).items():
        if name not in CLUSTER_SET:
            assert getattr(again, name) == value, name


def test_the_cluster_config_reads_the_replicas_limits_and_template_from_the_serve_flags():
    parser = serve_parser()
    config = cluster_config(parser.parse_args(["-np", "3", "--max-queued", "10", "--alias", "a", "--chat-template",
                                               "/tmp/t.jinja"]), replicas=2, threads_per_replica=1, routing="prefix")
    assert (config.max_ongoing_requests, config.overload) == (13, 6)
    assert (config.alias, config.chat_template) == ("a", "/tmp/t.jinja")
    assert config.allowed_hosts == ("127.0.0.1",)     # the ingress's --host, and --allowed-host names
    named = cluster_config(parser.parse_args(["--host", "0.0.0.0", "--allowed-host", "box.lan"]), replicas=2,
                           threads_per_replica=1, routing="prefix")
    assert named.allowed_hosts == ("0.0.0.0", "box.lan")
    assert "--port" not in config.serve_args and "--threads" not in config.serve_args
    with pytest.raises(ValueError, match="--slots"):
        cluster_config(parser.parse_args(["--slots", "0"]), replicas=2, threads_per_replica=1, routing="prefix")
    with pytest.raises(ValueError, match="--replicas"):
        ClusterConfig(models=("m.base",), replicas=0).check()


# --- prompt keys ------------------------------------------------------------------------------------------------


def chat_body(user: str) -> bytes:
    return json.dumps({"model": "smollm2", "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}).encode()


def test_the_ingress_names_a_prompt_with_the_keys_the_replicas_cache_holds(smollm2_base: Path):
    prompts = PromptKeys([PromptModel.open(smollm2_base)])
    keys = prompts.keys("/v1/chat/completions", chat_body("Which invoices are overdue?"))
    assert len(keys) >= 8
    # The engine caches the same prompt under exactly these keys.
    model = prompts.models[0]
    from basert.server.chat_api import render_chat
    from basert.server.schemas import ChatCompletionRequest

    tokens = render_chat(model.template, model.tokenizer,
                         ChatCompletionRequest.model_validate_json(chat_body("Which invoices are overdue?"))).prompt
    engine = build_engine(smollm2_base, EngineOptions(prefix_cache=True, max_context=1024, threads=1))
    try:
        list(engine.generate(GenerationRequest("r", tokens, 1, SamplingParams(temperature=0.0))))
        assert set(keys) <= set(engine.prefix_cache.entries)
        assert engine.prefix_cache.lookup(tokens, len(tokens), count=False).keys == list(keys[:len(tokens) // 16])
    finally:
        engine.close()
    # Two questions after one system prompt share the keys of the system prompt's blocks.
    other = prompts.keys("/v1/chat/completions", chat_body(
        "Who approved the last refund to the northern region's largest customer, and was it within policy?"))
    shared = 0
    while shared < min(len(keys), len(other)) and keys[shared] == other[shared]:
        shared += 1
    assert shared >= len(SYSTEM) // 4 // 16 - 2
    assert shared < len(other)     # then the question's blocks


def test_completion_prompts_are_keyed_and_unreadable_requests_are_not(smollm2_base: Path):
    prompts = PromptKeys([PromptModel.open(smollm2_base)])
    model = prompts.models[0]
    text = "The history of the printing press begins " * 8
    tokens = model.tokenizer.encode(text, add_special=True)
    expected = tuple(chain_keys(tokens, model.fingerprint))
    assert expected and prompts.keys("/v1/completions", json.dumps({"prompt": text}).encode()) == expected
    assert prompts.keys("/completion", json.dumps({"prompt": tokens}).encode()) == expected
    for path, body in [("/v1/chat/completions", b"{not json"), ("/v1/chat/completions", b"[1, 2]"),
                       ("/v1/chat/completions", b'{"messages": "nope"}'), ("/v1/completions", b'{"prompt": 5}'),
                       ("/v1/models", b""), ("/v1/completions", b'{"prompt": "short"}')]:
        assert prompts.keys(path, body) == ()


# --- metrics ----------------------------------------------------------------------------------------------------


def exposition(requests: float, queued: float) -> str:
    registry = CollectorRegistry()
    Counter("basert_requests", "Requests served", ["model"], registry=registry).labels("m").inc(requests)
    Gauge("basert_queued", "Requests waiting", registry=registry).set(queued)
    return generate_latest(registry).decode()


def test_the_cluster_metrics_hold_every_replicas_samples_labelled_by_replica():
    merged = merge_replica_metrics({1: exposition(5, 2), 0: exposition(3, 0)})
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(merged) for s in family.samples}
    assert samples[("basert_requests_total", (("model", "m"), ("replica", "0")))] == 3
    assert samples[("basert_requests_total", (("model", "m"), ("replica", "1")))] == 5
    assert samples[("basert_queued", (("replica", "1"),))] == 2
    assert merged.count("# TYPE basert_requests_total counter") == 1


def test_serve_refuses_a_negative_replica_rank():
    done = subprocess.run([sys.executable, "-m", "basert", "serve", "--replica", "-1"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "replica must be >= 0" in done.stderr, done.stderr
