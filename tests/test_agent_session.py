"""An agent session on a real model, through the `openai` client as agents run it: Qwen2.5-Coder-1.5B reads a file
through a tool call, writes it back edited through another, then answers; the tools act on real files. Run on a
server with speculative decoding (its default) and on one without: every turn gives the same tokens, and the drafts
were really accepted. Needs the qwen-coder extra (-m qwen_coder, CI's qwen-coder stage)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from openai import OpenAI

from basert.testing.launcher import ServerProcess

pytestmark = pytest.mark.qwen_coder

SOURCE = '''import math


def greedy_token(logits):
    best = 0
    for index, value in enumerate(logits):
        if value > logits[best]:
            best = index
    return best


def softmax(logits, temperature=1.0):
    top = max(logits)
    weights = [math.exp((value - top) / temperature) for value in logits]
    total = sum(weights)
    return [weight / total for weight in weights]


def pick(logits, temperature=0.0):
    if temperature == 0.0:
        return greedy_token(logits)
    probabilities = softmax(logits, temperature)
    return max(range(len(probabilities)), key=probabilities.__getitem__)
'''

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a whole file of the repository",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
]

# The user's turns, each with the tool choice of the model's answer: a tool call of its choosing (one per turn; its
# result goes back before the next turn), then a plain answer.
TURNS = [
    ("Read sampling_util.py.", "required"),
    ("Now write sampling_util.py with the function `greedy_token` renamed to `argmax_token`.", "required"),
    ("Say in one sentence what you changed.", "none"),
]


def run_tool(workdir: Path, name: str, arguments: dict) -> str:
    """The tools, on the files of `workdir`."""
    path = workdir / Path(arguments["path"]).name
    if name == "read_file":
        return path.read_text() if path.is_file() else f"error: no file {arguments['path']}"
    path.write_text(arguments["content"])
    return f"wrote {len(arguments['content'])} characters to {arguments['path']}"


def agent_session(url: str, workdir: Path) -> tuple[list[dict], int]:
    """Every turn's answer (content, tool calls, tokens, finish reason) and the draft tokens accepted in all."""
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent. Use the tools to read and write "
                                                          "the files of the repository."}]
    answers, accepted = [], 0
    for text, tool_choice in TURNS:
        messages.append({"role": "user", "content": text})
        response = client.chat.completions.create(
            model="default", messages=messages, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
            temperature=0, max_tokens=400)
        choice = response.choices[0]
        message = choice.message
        calls = [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]
        answers.append({"content": message.content, "calls": calls, "finish": choice.finish_reason,
                        "tokens": response.usage.completion_tokens})
        accepted += response.timings["draft_n_accepted"]
        messages.append(message.model_dump(exclude_none=True))
        for call, (name, arguments) in zip(message.tool_calls or [], calls):
            messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(workdir, name, arguments)})
    return answers, accepted


def test_a_read_edit_write_session_is_the_same_with_and_without_drafts(qwen_coder_base: Path, tmp_path: Path):
    sessions = {}
    for name, flags in (("off", ["--no-spec"]), ("on", [])):
        workdir = tmp_path / name
        workdir.mkdir()
        (workdir / "sampling_util.py").write_text(SOURCE)
        with ServerProcess(qwen_coder_base, "--max-context", "4096", *flags,
                           log_path=tmp_path / f"{name}.log") as server:
            answers, accepted = agent_session(server.url, workdir)
        sessions[name] = (answers, accepted, (workdir / "sampling_util.py").read_text())
    (off, off_accepted, off_file), (on, on_accepted, on_file) = sessions["off"], sessions["on"]
    assert on == off
    assert on_file == off_file
    assert off_accepted == 0 and on_accepted > 0
    # The session did the work: the file read, then written back with the definition renamed and the rest copied.
    calls = [call for answer in off for call in answer["calls"]]
    assert [name for name, _ in calls] == ["read_file", "write_file"], off
    assert calls[0][1] == {"path": "sampling_util.py"}
    assert calls[1][1]["path"] == "sampling_util.py"
    assert "def argmax_token(logits):" in off_file and "def greedy_token" not in off_file, off_file
    assert "return max(range(len(probabilities)), key=probabilities.__getitem__)" in off_file, off_file
