"""Ollama's API on the chat driver: /api/chat becomes a `ChatCompletionRequest` (the same prompt, tool-call parsers
and grammars as /v1/chat/completions), /api/generate a one-turn chat or a raw prompt, and the driver's events become
Ollama's objects and newline-delimited stream. Also what /api/tags, /api/show and /api/ps say about a model.

Mapping choices:
- Sampling: Ollama's defaults (temperature 0.8, top_k 40, top_p 0.9, repeat_penalty 1.1 over the last 64 tokens)
  unless `options` says otherwise; `num_predict` -1 or -2 means the server's --max-tokens; `num_ctx` may not exceed
  the context the model was loaded with (the model is not reloaded for it).
- `think`: unset leaves the template's default, and thinking the model writes goes to `thinking` as OpenAI's
  `reasoning_content` does; true on a model whose template does not think is a 400, as in Ollama; with `format`
  it is a 400 (the grammar starts the answer at once, which leaves no room for thinking first).
- Tool calls go out whole (arguments as an object): in a stream, in one message after the text, before the final one.
- /api/generate: `context` (token ids of an earlier answer's prompt and output) is put before the new prompt, as
  token ids; `raw` tokenizes the prompt as it is (the tokenizer's BOS first, where it adds one).
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

import trio

from basert import __version__
from basert.actor.messages import Embed
from basert.chat.prompt import ChatPlan
from basert.format import BaseFile
from basert.format.errors import ModelValidationError
from basert.server.access_log import RequestRecord
from basert.server.catalog import ModelCatalog, ModelEntry, ServedModel
from basert.server.chat_api import ChatRun, ChoiceDelta, ChoiceEnd, constraint_factory_for, plan_chat, start_chat
from basert.server.errors import invalid, not_found, to_api_error
from basert.server.generation import (
    ChoiceSet,
    ServerLimits,
    chat_logprobs,
    check_prompt_ids,
    engine_requests,
    max_tokens_of,
    new_id,
)
from basert.server.ollama_schemas import ChatMessage, ChatRequest, GenerateRequest, GenerationFields, Options
from basert.server.schemas import ChatCompletionRequest, JsonSchemaFormat, Message, ResponseFormat

# Ollama's sampling defaults (its DefaultOptions), where a request's `options` leave a field out.
OLLAMA_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1}
OPTION_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")
# How /api/ps says that a model stays loaded until it is unloaded: a deadline this far away (`ollama ps`: "Forever").
FOREVER = timedelta(days=100 * 365)
NANOSECONDS = 1_000_000_000

# --- names --------------------------------------------------------------------------------------


def find_entry(catalog: ModelCatalog, name: str) -> ModelEntry:
    """The model an Ollama client names: as it is, else without a ":latest" tag; a 404 for any other name."""
    for candidate in dict.fromkeys((name, name.removesuffix(":latest"))):
        for entry in catalog.entries:
            if candidate in entry.aliases:
                return entry
    raise not_found(f"model {name!r} not found", "model_not_found")


def tagged(name: str) -> str:
    """A model's name as Ollama lists it: with a tag (":latest" unless the name has one)."""
    return name if ":" in name.rpartition("/")[2] else f"{name}:latest"

# --- request: Ollama's fields to a chat request -------------------------------------------------


def sampling_fields(model: ServedModel, options: Options | None) -> dict:
    """The ChatCompletionRequest sampling fields of Ollama's `options`, on Ollama's defaults."""
    options = options or Options()
    if options.num_ctx is not None and options.num_ctx > model.info.n_ctx:
        raise invalid(f"num_ctx {options.num_ctx} is beyond the context of {model.info.id} ({model.info.n_ctx} "
                      "tokens, set when it was loaded: start the server with a larger --max-context)",
                      "options.num_ctx")
    fields = dict(OLLAMA_SAMPLING)
    fields.update({name: getattr(options, name) for name in OPTION_FIELDS if getattr(options, name) is not None})
    predict = options.num_predict
    return {**fields, "seed": options.seed if options.seed is not None and options.seed >= 0 else None,
            "max_tokens": predict if predict is not None and predict > 0 else None, "stop": options.stop}


def response_format(value: str | dict | None) -> ResponseFormat | None:
    """`format` as OpenAI's response_format: "json" any JSON object, a dict that JSON schema, "" or none nothing."""
    if not value:
        return None
    if value == "json":
        return ResponseFormat(type="json_object")
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(schema=value))


def thinks(model: ServedModel) -> bool:
    """Whether the model's template thinks (writes `<think>` blocks), the reasoning the chat driver splits off."""
    sources = [model.template.source if model.template else None,
               model.tokenizer.chat_template if model.tokenizer else None]
    return any("<think>" in source for source in sources if source)


def template_kwargs(model: ServedModel, body: GenerationFields) -> dict | None:
    """The chat template variables of `think`: enable_thinking, and a reasoning effort given as its value."""
    if body.think is None:
        return None
    enabled = body.think is not False
    if enabled and not thinks(model):
        raise invalid(f"{body.model!r} does not support thinking", "think")
    if enabled and body.format:
        raise invalid("think cannot be combined with format: the format's grammar starts the answer at once",
                      "think")
    kwargs: dict = {"enable_thinking": enabled}
    if isinstance(body.think, str):
        kwargs["reasoning_effort"] = body.think
    return kwargs


def request_fields(model: ServedModel, body: GenerationFields) -> dict:
    """The ChatCompletionRequest fields /api/chat and /api/generate share."""
    return {"response_format": response_format(body.format), "chat_template_kwargs": template_kwargs(model, body),
            "logprobs": body.logprobs, "top_logprobs": body.top_logprobs, "stream": body.stream,
            **sampling_fields(model, body.options)}


def chat_messages(messages: list[ChatMessage]) -> list[Message]:
    """Ollama's messages as chat messages: tool calls with their arguments as JSON text (a call without an id gets
    one), thinking as reasoning_content, and a tool result without `tool_call_id` answering the first unanswered
    call of the last assistant turn with its `tool_name` (or the first one)."""
    chat: list[Message] = []
    unanswered: list[tuple[str, str]] = []      # (id, name) of the last assistant turn's calls
    for index, message in enumerate(messages):
        if message.role == "assistant":
            calls = [{"id": call.id or f"call_{index}_{number}", "type": "function",
                      "function": {"name": call.function.name,
                                   "arguments": json.dumps(call.function.arguments, ensure_ascii=False)}}
                     for number, call in enumerate(message.tool_calls or [])]
            unanswered = [(call["id"], call["function"]["name"]) for call in calls]
            chat.append(Message(role="assistant", content=message.content or (None if calls else ""),
                                tool_calls=calls or None, reasoning_content=message.thinking or None))
        elif message.role == "tool":
            call_id = message.tool_call_id or answered_call(unanswered, message.tool_name)
            chat.append(Message(role="tool", content=message.content or "", tool_call_id=call_id,
                                name=message.tool_name))
        else:
            chat.append(Message(role=message.role, content=message.content or ""))
    return chat


def answered_call(unanswered: list[tuple[str, str]], name: str | None) -> str | None:
    """The id of the call a tool result answers (taken off `unanswered`), or None."""
    for position, (call_id, call_name) in enumerate(unanswered):
        if name is None or call_name == name:
            del unanswered[position]
            return call_id
    return None


def chat_request(model: ServedModel, body: ChatRequest) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=model.info.id, messages=chat_messages(body.messages), tools=body.tools,
                                 **request_fields(model, body))


def generate_request(model: ServedModel, body: GenerateRequest) -> ChatCompletionRequest:
    """A one-turn chat: the system prompt, when given, then the prompt as the user's message."""
    messages = [Message(role="system", content=body.system)] if body.system else []
    return ChatCompletionRequest(model=model.info.id, messages=[*messages, Message(role="user", content=body.prompt)],
                                 **request_fields(model, body))

# --- response: chat events to Ollama's objects --------------------------------------------------


def timestamp() -> str:
    """Now, as Ollama's `created_at`: RFC 3339 in UTC."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def ndjson(value: dict) -> bytes:
    """One line of a newline-delimited JSON stream."""
    return json.dumps(value, ensure_ascii=False).encode() + b"\n"


@dataclass(frozen=True, slots=True)
class Clock:
    """When the request arrived (time.monotonic) and the seconds it waited for its model to load."""

    started: float
    load: float


def done_fields(run: ChatRun, end: ChoiceEnd, clock: Clock) -> dict:
    """The fields of a final object: why it ended, and Ollama's counts and durations (nanoseconds)."""
    done = end.done
    return {"done": True, "done_reason": "length" if end.finish_reason == "length" else "stop",
            "total_duration": int((time.monotonic() - clock.started) * NANOSECONDS),
            "load_duration": int(clock.load * NANOSECONDS), "prompt_eval_count": len(run.plan.prompt),
            "prompt_eval_duration": int(done.timings.prompt_ms * 1e6), "eval_count": done.usage.completion_tokens,
            "eval_duration": int(done.timings.predicted_ms * 1e6)}


def ollama_tool_calls(end: ChoiceEnd) -> list[dict]:
    """The calls a choice made, as Ollama returns them: arguments as an object."""
    return [{"id": call.id, "function": {"index": index, "name": call.name, "arguments": call.parsed_arguments}}
            for index, call in enumerate(end.state.tool_calls)]


class OllamaAnswer:
    """One answer of /api/chat (a `message`) or /api/generate (`response`, `thinking` and `context`), complete or
    streamed, from the chat driver's events."""

    def __init__(self, run: ChatRun, body: GenerationFields, clock: Clock, *, chat: bool, context: bool = False):
        self.run = run
        self.body = body
        self.clock = clock
        self.chat = chat
        self.context = context      # the final object carries the prompt and output token ids

    def part(self, content: str, thinking: str = "", calls: list[dict] | None = None) -> dict:
        """An object with the answer's text (or a piece of it), not yet done."""
        base = {"model": self.body.model, "created_at": timestamp()}
        if not self.chat:
            return {**base, "response": content, **({"thinking": thinking} if thinking else {}), "done": False}
        message = {"role": "assistant", "content": content}
        if thinking:
            message["thinking"] = thinking
        if calls:
            message["tool_calls"] = calls
        return {**base, "message": message, "done": False}

    def final(self, end: ChoiceEnd, *, streamed: bool) -> dict:
        """The final object: complete, all the answer; streamed, no text (the parts carried it)."""
        state = end.state
        if streamed:
            answer = self.part("")
        else:
            answer = self.part(state.content, state.reasoning_text, ollama_tool_calls(end))
            if self.run.want_logprobs:
                answer["logprobs"] = chat_logprobs(self.run.model, state.ids, state.logprobs)["content"]
        answer.update(done_fields(self.run, end, self.clock))
        if self.context:
            answer["context"] = [*self.run.plan.prompt, *state.ids]
        return answer

    async def complete(self) -> dict:
        [end] = await self.run.results()
        return self.final(end, streamed=False)

    async def stream(self) -> AsyncIterator[bytes]:
        """The parts as they come, the calls, then the final object; a failure after the first byte is an
        {"error": …} line, as Ollama ends a stream that fails."""
        try:
            async with aclosing(self.run.events()) as events:
                async for event in events:
                    if isinstance(event, ChoiceDelta):
                        if event.content or event.reasoning or event.logprobs:
                            part = self.part(event.content, event.reasoning)
                            if event.logprobs:
                                part["logprobs"] = event.logprobs["content"]
                            yield ndjson(part)
                        continue
                    if end_calls := ollama_tool_calls(event):
                        yield ndjson(self.part("", calls=end_calls))
                    yield ndjson(self.final(event, streamed=True))
        except Exception as exc:
            yield ndjson({"error": to_api_error(exc).message})

    async def result(self) -> dict | AsyncIterator[bytes]:
        return self.stream() if self.body.stream else await self.complete()


async def chat(model: ServedModel, body: ChatRequest, limits: ServerLimits, record: RequestRecord, clock: Clock):
    """/api/chat: the answer object, or an async iterator of its NDJSON lines when streaming."""
    run = await start_chat(model, chat_request(model, body), limits, record)
    return await OllamaAnswer(run, body, clock, chat=True).result()


async def generate(model: ServedModel, body: GenerateRequest, limits: ServerLimits, record: RequestRecord,
                   clock: Clock):
    """/api/generate: the answer object, or an async iterator of its NDJSON lines when streaming."""
    run = await start_generation(model, body, limits, record)
    return await OllamaAnswer(run, body, clock, chat=False, context=not body.raw).result()


async def start_generation(model: ServedModel, body: GenerateRequest, limits: ServerLimits,
                           record: RequestRecord) -> ChatRun:
    """Submit a generate request as `start_chat` submits a chat: its prompt is the one-turn chat's (or the raw
    prompt's tokens), after the `context` token ids when given."""
    request = generate_request(model, body)
    if body.raw:
        plan = ChatPlan(model.require_tokenizer().encode(body.prompt, add_special=True), None, False, False)
    else:
        plan = plan_chat(model, request)
    if body.context:
        check_prompt_ids(model, body.context)
        shift = len(body.context)
        plan = replace(plan, prompt=[*body.context, *plan.prompt],
                       segment_ends=tuple(end + shift for end in plan.segment_ends))
    want_logprobs = request.logprobs or request.top_logprobs > 0
    response_id = new_id("gen")
    requests = engine_requests(model, request, plan.prompt, max_tokens_of(request), limits, logprobs=want_logprobs,
                               top_logprobs=request.top_logprobs,
                               constraint_factory=constraint_factory_for(model, request, None),
                               id_prefix=response_id, segment_ends=plan.segment_ends)
    record.prompt_tokens = len(plan.prompt)
    choices = ChoiceSet(model, requests)
    await choices.submit(None)
    await choices.started()
    return ChatRun(model, request, plan, choices, record, response_id)


def loaded_answer(body: GenerationFields, reason: str, *, chat: bool) -> dict:
    """The answer to a request without a prompt: the model was loaded ("load") or unloaded ("unload")."""
    answer = {"model": body.model, "created_at": timestamp()}
    if chat:
        answer["message"] = {"role": "assistant", "content": ""}
    else:
        answer["response"] = ""
    return {**answer, "done": True, "done_reason": reason}

# --- embeddings ---------------------------------------------------------------------------------


async def embed(model: ServedModel, token_lists: list[list[int]], *, truncate: bool,
                dimensions: int | None) -> list[list[float]]:
    """The vectors of /v1/embeddings for token lists; `truncate`: inputs longer than the context are cut to it."""
    if dimensions is not None and dimensions != model.info.hidden_size:
        raise invalid(f"dimensions must be {model.info.hidden_size}, the width of {model.info.id}'s hidden "
                      "states (they are not truncated)", "dimensions")
    if not token_lists:
        return []
    if truncate:
        token_lists = [tokens[: model.info.n_ctx] for tokens in token_lists]
    return [vector.tolist() for vector in await model.ask(Embed, token_lists, model.info.pooling)]

# --- what a model is: /api/tags, /api/show, /api/ps ---------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelFacts:
    """What Ollama's listings say about a model file, read from its .base header."""

    arch: str
    parameters: int
    quantization: str           # the storage of most of its weights, e.g. "BASE_Q4", "Q4_K", "F16"
    template: str | None        # the chat template the file brings
    has_tokenizer: bool
    config: dict
    metadata: dict


@functools.lru_cache(maxsize=64)
def read_facts(path: str, size: int, mtime_ns: int) -> ModelFacts:
    """The facts of the file at `path`; `size` and `mtime_ns` key the cache, so a replaced file is read again."""
    with BaseFile(path) as base:
        elements: Counter[str] = Counter()
        for tensor in base.tensors.values():
            elements[tensor.storage] += tensor.n_elements
        metadata = base.header.get("metadata")
        return ModelFacts(arch=base.arch, parameters=sum(elements.values()),
                          quantization=elements.most_common(1)[0][0].upper() if elements else "",
                          template=base.tokenizer.get("tokenizer.chat_template"),
                          has_tokenizer=base.tokenizer.get("tokenizer_type") != "none", config=dict(base.config),
                          metadata=metadata if isinstance(metadata, dict) else {})


async def facts_of(entry: ModelEntry) -> ModelFacts | None:
    """The facts of an installed model (read in a worker thread, then cached); None for a model not installed yet
    or a file that cannot be read."""
    if entry.path is None:
        return None
    try:
        stat = entry.path.stat()
        return await trio.to_thread.run_sync(read_facts, str(entry.path), stat.st_size, stat.st_mtime_ns)
    except (OSError, ModelValidationError):
        return None


def parameter_size(count: int) -> str:
    """A parameter count as Ollama writes it: "134.52M", "7.6B"."""
    for unit, scale, digits in (("B", 10**9, 1), ("M", 10**6, 2), ("K", 10**3, 2)):
        if count >= scale:
            return f"{count / scale:.{digits}f}{unit}"
    return str(count)


def details(facts: ModelFacts | None) -> dict:
    if facts is None:
        return {"parent_model": "", "format": "base", "family": "", "families": None, "parameter_size": "",
                "quantization_level": ""}
    return {"parent_model": "", "format": "base", "family": facts.arch, "families": [facts.arch],
            "parameter_size": parameter_size(facts.parameters), "quantization_level": facts.quantization}


def digest(entry: ModelEntry) -> str:
    """A digest that changes when the installed file does (of its path, size and time, not of its bytes: hashing
    gigabytes per listing is too slow); empty for a model not installed yet."""
    if entry.path is None:
        return ""
    try:
        stat = entry.path.stat()
    except OSError:
        return ""
    return hashlib.sha256(f"{entry.path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()


def modified_at(entry: ModelEntry) -> str | None:
    try:
        mtime = entry.path.stat().st_mtime if entry.path is not None else None
    except OSError:
        mtime = None
    return None if mtime is None else datetime.fromtimestamp(mtime, UTC).isoformat().replace("+00:00", "Z")


async def tag(entry: ModelEntry) -> dict:
    """A model as /api/tags lists it."""
    return {"name": tagged(entry.name), "model": tagged(entry.name), "modified_at": modified_at(entry),
            "size": entry.file_bytes, "digest": digest(entry), "details": details(await facts_of(entry))}


async def process(entry: ModelEntry) -> dict:
    """A loaded model as /api/ps lists it: its memory (weights and KV, all in RAM) and when it will be unloaded."""
    expires = entry.expires_at_wall()
    until = datetime.fromtimestamp(expires, UTC) if expires is not None else datetime.now(UTC) + FOREVER
    listed = {**await tag(entry), "size": entry.memory_bytes, "size_vram": 0,
              "expires_at": until.isoformat().replace("+00:00", "Z")}
    listed.pop("modified_at")
    if entry.served is not None:
        listed["context_length"] = entry.served.info.n_ctx
    return listed


def capabilities(has_tokenizer: bool, template: str | None, thinking: bool) -> list[str]:
    """What the model can do here: complete text (it has a tokenizer), call tools (it has a chat template: one without
    tool support gets a tool prompt), think (its template writes `<think>`), and embed (every model)."""
    found = ["completion"] if has_tokenizer else []
    found += ["tools"] if template else []
    found += ["thinking"] if thinking else []
    return [*found, "embedding"]


def model_info(facts: ModelFacts, n_ctx: int | None) -> dict:
    """GGUF-style keys of the model's architecture; the context is the loaded one, else the trained one."""
    config, arch = facts.config, facts.arch
    info = {"general.architecture": arch, "general.parameter_count": facts.parameters}
    info.update({key: value for key, value in facts.metadata.items() if key.startswith("general.")})
    keys = {"context_length": n_ctx or config.get("max_position_embeddings"),
            "embedding_length": config.get("hidden_size"), "block_count": config.get("num_hidden_layers"),
            "attention.head_count": config.get("num_attention_heads"),
            "attention.head_count_kv": config.get("num_key_value_heads"), "vocab_size": config.get("vocab_size")}
    info.update({f"{arch}.{key}": value for key, value in keys.items() if isinstance(value, int)})
    return info


async def show(entry: ModelEntry) -> dict:
    """/api/show: the chat template, the sampling defaults, the architecture and the capabilities; a model not loaded
    is described from its file's header (it is not loaded for this)."""
    facts = await facts_of(entry)
    if facts is None:
        raise not_found(f"model {entry.name!r} is not installed: pull it first (POST /api/pull), or send it a "
                        "request (it is pulled on first use)", "model_not_found")
    served = entry.served if entry.state == "loaded" else None
    template, thinking = facts.template, "<think>" in (facts.template or "")
    if served is not None:
        template, thinking = (served.template.source if served.template else None), thinks(served)
    parameters = "\n".join(f"{name} {value}" for name, value in OLLAMA_SAMPLING.items())
    return {"license": "", "modelfile": "", "parameters": parameters, "template": template or "",
            "details": details(facts), "model_info": model_info(facts, served.info.n_ctx if served else None),
            "capabilities": capabilities(facts.has_tokenizer, template, thinking), "modified_at": modified_at(entry)}


def version() -> dict:
    return {"version": __version__}

# --- errors -------------------------------------------------------------------------------------


def error_body(message: str) -> dict:
    """Ollama's error object."""
    return {"error": message}
