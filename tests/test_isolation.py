"""The isolation invariant over HTTP: every request's answer equals its answer on a freshly started server.

Runs the tool-call harness (sequential requests sharing a long system prompt, then 2 and 4 concurrent
requests) on SmolLM2 and on a tiny random Qwen3.5-style hybrid with the real Qwen3.5 tokenizer and chat
template, with forced tool calls and with plain chat.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES

HARNESS_PATH = Path(__file__).resolve().parent.parent / "tools" / "tool_call_harness.py"
spec = importlib.util.spec_from_file_location("tool_call_harness", HARNESS_PATH)
harness = importlib.util.module_from_spec(spec)
sys.modules["tool_call_harness"] = harness  # dataclasses look their module up while the class is built
spec.loader.exec_module(harness)


def model_and_flags(name: str, smollm2_base: Path, qwen35_chat_base: Path) -> tuple[str, list[str]]:
    if name == "smollm2":
        return str(smollm2_base), ["--max-context", "1024", "--threads", "2"]
    template = FIXTURES / "chat-templates" / "Qwen3.5-4B.jinja"
    return str(qwen35_chat_base), ["--max-context", "1024", "--chat-template", str(template)]


@pytest.mark.parametrize("name", ["smollm2", "qwen35-hybrid"])
@pytest.mark.parametrize("plain", [False, True], ids=["tool-calls", "plain-chat"])
async def test_requests_equal_their_fresh_server_answers(name: str, plain: bool, smollm2_base: Path,
                                                         qwen35_chat_base: Path, tmp_path: Path):
    model, flags = model_and_flags(name, smollm2_base, qwen35_chat_base)
    n = 8 if not plain else 4
    outcomes = await harness.run_harness(model, flags, n, [2, 4], plain, tmp_path)
    assert len(outcomes) == n + 6
    print(harness.report(outcomes))
    assert all(o.same for o in outcomes), harness.report(outcomes)
    if not plain:
        # The grammar forces a lookup_key call. SmolLM2 closes it; the random hybrid writes key text until
        # max_tokens, so its cut-off call is returned as content, never as a call.
        marker = '"lookup_key"' if name == "smollm2" else "<function=lookup_key>"
        assert all(marker in o.answer for o in outcomes), harness.report(outcomes)


@pytest.mark.parametrize("name", ["smollm2", "qwen35-hybrid"])
@pytest.mark.parametrize("plain", [False, True], ids=["tool-calls", "plain-chat"])
async def test_continuous_batching_with_prefix_cache_equals_default_mode(name: str, plain: bool, smollm2_base: Path,
                                                                         qwen35_chat_base: Path, tmp_path: Path):
    """N = 1, 2, 4, 8 concurrent requests on 8 batched slots sharing a prefix cache; every answer equals the
    answer of the default single-slot server computed from empty state."""
    model, flags = model_and_flags(name, smollm2_base, qwen35_chat_base)
    outcomes = await harness.run_harness(model, [*flags, "--continuous-batching", "8", "--prefix-cache"], 4,
                                         [1, 2, 4, 8], plain, tmp_path, reference_flags=flags)
    assert len(outcomes) == 4 + 15
    print(harness.report(outcomes))
    assert all(o.same for o in outcomes), harness.report(outcomes)
