"""`basert chat`: a conversation piped through stdin (history, commands, replies equal to `Model.chat`'s, reasoning
shown apart from the answer) and one on a terminal (the prompt, Ctrl-C during a reply and at the prompt)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import pty
import re
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from conftest import QWEN35_TEMPLATE

import basert
from basert.cli.chat import COMMANDS
from basert.cli.main import build_parser, subcommand_parsers

FLAGS = ("--max-tokens", "16", "--max-context", "1024")
FRANCE = "What is the capital of France?"
GERMANY = "And of Germany?"
TERSE = "You are terse."
SPEED_LINE = re.compile(r"\[prefill (\d+) tok(?:, (\d+) cached)? @ \d+ tok/s · "
                        r"decode (\d+) tok @ [\d.]+ tok/s( · cut at the token limit)?\]\n")


def run_chat(*args: str, lines: list[str]) -> subprocess.CompletedProcess:
    """`basert chat ARGS` with `lines` piped into it."""
    result = subprocess.run([sys.executable, "-m", "basert", "chat", *args], capture_output=True, text=True,
                            input="".join(f"{line}\n" for line in lines), timeout=300)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def speeds(stdout: str) -> str:
    """The output with each speed line reduced to what must match exactly: the token counts and the finish."""
    return SPEED_LINE.sub(lambda m: f"[prompt {m[1]}, generated {m[3]}{', cut' if m[4] else ''}]\n", stdout)


def reply_text(reply: basert.ChatReply) -> str:
    """What `basert chat` prints for a reply without a terminal: reasoning, a blank line, the answer, the speeds."""
    parts = [text if text.endswith("\n") else f"{text}\n" for text in (reply.reasoning, reply.content) if text]
    stats = reply.stats
    cut = ", cut" if stats.finish_reason == "length" else ""
    return "\n".join(parts) + f"[prompt {stats.prompt_tokens}, generated {stats.generated_tokens}{cut}]\n"


@pytest.fixture(scope="module")
def smollm2(smollm2_base: Path):
    """SmolLM2 loaded as `basert chat` loads it with FLAGS."""
    with basert.Model(smollm2_base, max_context=1024, threads=2) as model:
        yield model


def test_help_explains_the_commands_and_flags():
    text = subcommand_parsers(build_parser())["chat"].format_help()
    for word in ("/clear", "/system TEXT", "/help", "/exit", "/quit", "Ctrl-D", "Ctrl-C", "130", "--system",
                 "--no-think", "enable_thinking", "--max-tokens", "--temperature", "--max-context",
                 "--threads", "--chat-template", "prefill", "decode", "smollm2", "bracketed paste", "backslash",
                 '"""'):
        assert word in text, word


def test_a_piped_conversation_keeps_its_history_and_obeys_commands(smollm2_base: Path, smollm2):
    lines = [FRANCE, GERMANY, f"/system {TERSE}", "/system", "/nope", "/clear", FRANCE, "/help", "/exit", "unread"]
    result = run_chat(str(smollm2_base), *FLAGS, lines=lines)
    assert result.returncode == 0, result.stderr

    user = [{"role": "user", "content": FRANCE}]
    first = smollm2.chat(user, max_tokens=16)
    second = smollm2.chat([*user, first.message(), {"role": "user", "content": GERMANY}], max_tokens=16)
    third = smollm2.chat([{"role": "system", "content": TERSE}, *user], max_tokens=16)
    expected = (reply_text(first) + reply_text(second)
                + f"system prompt set; conversation cleared\nsystem prompt: {TERSE}\n"
                + "unknown command /nope (/help lists the commands)\nconversation cleared\n"
                + reply_text(third) + f"{COMMANDS}\n")
    assert speeds(result.stdout) == expected
    # The second turn sent the first one again, and reused its computation.
    first_line, second_line, _ = SPEED_LINE.findall(result.stdout)
    assert int(second_line[0]) > int(first_line[0]) and int(second_line[1]) > 0


def test_a_message_goes_on_after_a_backslash_and_inside_triple_quotes(smollm2_base: Path, smollm2):
    lines = ["Complete this list:   \\", "- apples", '"""Explain this code:', "    def f(x):", "        return 2 * x",
             '"""', "/exit"]
    result = run_chat(str(smollm2_base), *FLAGS, lines=lines)
    assert result.returncode == 0, result.stderr

    first = [{"role": "user", "content": "Complete this list:\n- apples"}]
    first_reply = smollm2.chat(first, max_tokens=16)
    second = [*first, first_reply.message(),
              {"role": "user", "content": "Explain this code:\n    def f(x):\n        return 2 * x"}]
    assert speeds(result.stdout) == reply_text(first_reply) + reply_text(smollm2.chat(second, max_tokens=16))


def test_reasoning_is_shown_before_the_answer(qwen35_chat_base: Path):
    question = [{"role": "user", "content": "Name a colour of the sky."}]
    with basert.Model(qwen35_chat_base, max_context=256, chat_template=QWEN35_TEMPLATE.read_text()) as model:
        replies = [model.chat(question, max_tokens=8, enable_thinking=thinking) for thinking in (None, False)]
    assert replies[0].reasoning and replies[1].content
    for reply, flags in zip(replies, ([], ["--no-think"])):
        result = run_chat(str(qwen35_chat_base), "--chat-template", str(QWEN35_TEMPLATE), "-n", "8", "-c", "256",
                          *flags, lines=[question[0]["content"]])  # then the end of the input
        assert result.returncode == 0, result.stderr
        assert speeds(result.stdout) == reply_text(reply)


class Terminal:
    """`basert chat` on a pseudo-terminal that is its controlling terminal, so Ctrl-C is a SIGINT."""

    def __init__(self, *args: str):
        self.fd, child = pty.openpty()
        self.process = subprocess.Popen([sys.executable, "-m", "basert", "chat", *args], stdin=child, stdout=child,
                                        stderr=child, start_new_session=True,
                                        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
        os.close(child)
        self.pending = b""

    def read_until(self, marker: bytes, timeout: float = 120) -> bytes:
        """Everything up to and including `marker`."""
        deadline = time.monotonic() + timeout
        while marker not in self.pending:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, deadline - time.monotonic()))
            assert ready, f"no {marker!r} in {self.pending!r}"
            self.pending += os.read(self.fd, 4096)
        end = self.pending.index(marker) + len(marker)
        text, self.pending = self.pending[:end], self.pending[end:]
        return text

    def type(self, text: bytes) -> None:
        os.write(self.fd, text)

    def close(self) -> bytes:
        """Stop the chat if it still runs; the output not read yet."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        with contextlib.suppress(OSError):  # the terminal is gone once the chat has exited
            while select.select([self.fd], [], [], 0)[0]:
                self.pending += os.read(self.fd, 4096)
        os.close(self.fd)
        return self.pending


def test_on_a_terminal_ctrl_c_stops_a_reply_and_ctrl_d_leaves(smollm2_base: Path):
    terminal = Terminal(str(smollm2_base), "--max-tokens", "1000")
    try:
        assert b"/help for commands" in terminal.read_until(b">>> ")
        terminal.type(b"Tell me a long story about a dragon.\n")
        terminal.read_until(b"dragon.\r\n")
        terminal.read_until(b" ")                           # the reply has begun
        terminal.type(b"\x03")
        stopped = terminal.read_until(b">>> ")
        assert b"[interrupted: this turn is not kept]" in stopped and b"[prefill" not in stopped
        assert b"\x1b[2m" in stopped                        # dim on a terminal
        terminal.type(b"/system\n")
        assert b"no system prompt" in terminal.read_until(b">>> ")
        terminal.type(b"\x04")                              # Ctrl-D
        assert terminal.process.wait(timeout=60) == 0
    finally:
        rest = terminal.close()
    assert b"Traceback" not in rest


def test_on_a_terminal_pasted_lines_are_one_message(smollm2_base: Path, smollm2):
    pasted = "Translate to French:\nGood morning\nGood night"
    prompt_tokens = smollm2.chat([{"role": "user", "content": pasted}], max_tokens=4).stats.prompt_tokens
    terminal = Terminal(str(smollm2_base), "--max-tokens", "4")
    try:
        terminal.read_until(b">>> ")
        # A terminal wraps a paste in bracketed-paste marks when the program asks for them.
        terminal.type(b"\x1b[200~" + pasted.encode() + b"\x1b[201~")
        terminal.type(b"\r")
        reply = terminal.read_until(b">>> ")
        assert reply.count(b"[prefill") == 1 and f"[prefill {prompt_tokens} tok @".encode() in reply, reply
        terminal.type(b"Say \\\r")
        assert terminal.read_until(b"... ")              # the line goes on
        terminal.type(b"hi\r")
        assert terminal.read_until(b">>> ").count(b"[prefill") == 1
        terminal.type(b"\x04")
        assert terminal.process.wait(timeout=60) == 0
    finally:
        rest = terminal.close()
    assert b"Traceback" not in rest
