"""llama.cpp's native API (the contract of llama-server): /completion with its prompt shapes, response fields and
stream; /props; /apply-template; the prompt size of a chat request; and llama.cpp's fields of a slot.

Requests run through the same driver as the OpenAI endpoints (`engine_requests`, `ChoiceSet`, `plan_chat`): this
module only translates llama.cpp's shapes to it and back.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from basert import __version__
from basert.engine.sampler import SamplingParams, TokenLogprob
from basert.engine.types import FinishEvent, TokenEvent
from basert.server.access_log import RequestRecord
from basert.server.catalog import ServedModel
from basert.server.chat_api import plan_chat
from basert.server.errors import invalid, to_api_error
from basert.server.generation import (
    ChoiceSet,
    ServerLimits,
    check_prompt_ids,
    engine_requests,
    finite_logprob,
    new_id,
    output_grammar,
    sse,
    token_piece,
)
from basert.server.schemas import TOKEN_ID_KEY, ChatCompletionRequest, LlamaCompletionRequest

# llama.cpp reports a random seed (its default) as this value.
RANDOM_SEED = 0xFFFFFFFF
# The bias of a token llama.cpp's `false` bans: BaseRT's lowest.
BANNED = -100.0
# llama.cpp settings BaseRT has no counterpart for, at the values that turn them off: what is in effect here.
LLAMA_FEATURES_OFF = {
    "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0,
    "xtc_threshold": 0.1, "typical_p": 1.0, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
    "dry_penalty_last_n": -1, "dry_sequence_breakers": ("\n", ":", '"', "*"), "mirostat": 0, "mirostat_tau": 5.0,
    "mirostat_eta": 0.1, "min_keep": 0, "n_discard": 0, "timings_per_token": False,
    "post_sampling_probs": False,
}
# BaseRT's sampling chain in llama.cpp's sampler names, in the order the sampler applies them.
SAMPLER_CHAIN = ("penalties", "temperature", "top_k", "top_p", "min_p")

# --- prompts ------------------------------------------------------------------------------------


def llama_prompts(model: ServedModel, prompt: str | list) -> list[list[int]]:
    """The token ids of each prompt of a /completion request.

    llama.cpp's shapes: a string, token ids, or a mix of both (`[12, "text", 34]`) is one prompt; a list of
    strings, id lists or mixed lists is one prompt each.
    """
    if isinstance(prompt, str) or is_one_mixed_prompt(prompt):
        return [prompt_ids(model, prompt)]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if any(not isinstance(part, (str, list)) for part in prompt):
        raise invalid("prompt must be a string, token ids, a mix of both, or a list of those", "prompt")
    return [prompt_ids(model, part) for part in prompt]


def is_one_mixed_prompt(prompt: list) -> bool:
    """Whether a list is one prompt: it holds token ids, and text at most beside them (no nested lists)."""
    return any(isinstance(part, int) for part in prompt) and not any(isinstance(part, list) for part in prompt)


def prompt_ids(model: ServedModel, prompt: str | list[int | str]) -> list[int]:
    """One prompt's token ids: text is tokenized (special-token text becomes control tokens), ids are kept.

    As in llama.cpp, the model's BOS token (where its tokenizer adds one) comes first when the prompt starts
    with text.
    """
    parts = [prompt] if isinstance(prompt, str) else prompt
    ids: list[int] = []
    for position, part in enumerate(parts):
        if isinstance(part, str):
            ids += model.require_tokenizer().encode(part, add_special=position == 0)
        else:
            ids.append(part)
    check_prompt_ids(model, ids)
    return ids

# --- /completion --------------------------------------------------------------------------------


@dataclass(slots=True)
class PromptOutput:
    """What one prompt of a /completion request has produced so far."""

    index: int
    prompt: list[int]
    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)


class NativeCompletion:
    """One /completion request submitted to its model: `complete()` for the result objects, `stream()` for SSE."""

    def __init__(self, model: ServedModel, body: LlamaCompletionRequest, limits: ServerLimits, choices: ChoiceSet,
                 prompts: list[list[int]], record: RequestRecord):
        self.model = model
        self.body = body
        self.settings = generation_settings(model, body, limits)
        self.choices = choices
        self.outputs = [PromptOutput(index, prompt) for index, prompt in enumerate(prompts)]
        self.record = record

    async def replies(self) -> AsyncIterator[tuple[PromptOutput, TokenEvent | FinishEvent]]:
        """Each prompt's engine replies in turn, recorded in its output; an engine failure is raised. Cancels what
        is left of the request when the consumer stops early."""
        done_list: list[FinishEvent] = []
        try:
            for output in self.outputs:
                async for reply in self.choices.replies(output.index):
                    output.text += reply.text
                    if isinstance(reply, TokenEvent):
                        output.ids.append(reply.token_id)
                        if reply.logprob is not None:
                            output.logprobs.append(reply.logprob)
                    else:
                        done_list.append(reply)
                    yield output, reply
        finally:
            self.choices.close()
            self.record.absorb(done_list)

    async def complete(self) -> list[dict]:
        """Run to the end; one result object per prompt."""
        results = []
        async with aclosing(self.replies()) as replies:
            async for output, reply in replies:
                if isinstance(reply, FinishEvent):
                    results.append(self.final(output, reply, streamed=False))
        return results

    async def stream(self) -> AsyncIterator[bytes]:
        """llama.cpp's stream: a chunk per token (`stop: false`), then per prompt a final chunk with every field.

        A token whose text is held back (for a possible stop string, or an unfinished character) has no chunk of
        its own: it goes out with the chunk that releases its text, and at the end with a last one.
        A failure after the first byte is an `error:` event, as llama.cpp sends it; the stream has no [DONE].
        """
        try:
            async with aclosing(self.replies()) as replies:
                unsent = 0      # the last tokens of the output that no chunk carried yet
                async for output, reply in replies:
                    if isinstance(reply, TokenEvent):
                        unsent += 1
                    finished = isinstance(reply, FinishEvent)
                    if reply.text or (finished and unsent):
                        yield sse(self.partial(output, reply.text, unsent))
                        unsent = 0
                    if finished:
                        yield sse(self.final(output, reply, streamed=True))
        except Exception as exc:  # after the first byte: the error as an event of its own
            yield f"error: {json.dumps(to_api_error(exc).body()['error'])}\n\n".encode()

    def partial(self, output: PromptOutput, text: str, count: int) -> dict:
        """The chunk of the output's last `count` tokens, which released `text`."""
        hint = self.body.id_slot if output.index == 0 and self.body.id_slot is not None else -1
        chunk = {"index": output.index, "content": text, "tokens": output.ids[len(output.ids) - count:],
                 "stop": False, "id_slot": hint, "tokens_predicted": len(output.ids),
                 "tokens_evaluated": len(output.prompt)}
        if self.body.n_probs > 0:
            chunk["completion_probabilities"] = [token_probabilities(self.model, lp)
                                                 for lp in output.logprobs[len(output.logprobs) - count:]]
        return chunk

    def final(self, output: PromptOutput, done: FinishEvent, *, streamed: bool) -> dict:
        """The result object of one prompt. Streamed, it carries no text, token ids or probabilities (the chunks
        carried them all), as in llama.cpp."""
        usage = done.usage
        tokenizer = self.model.tokenizer
        result = {
            "index": output.index,
            "content": "" if streamed else output.text,
            "tokens": output.ids if self.body.return_tokens and not streamed else [],
            "id_slot": done.slot,
            "stop": True,
            "model": self.model.info.id,
            "tokens_predicted": usage.completion_tokens,
            "tokens_evaluated": usage.prompt_tokens,
            "tokens_cached": usage.cached_tokens,
            "generation_settings": self.settings,
            "prompt": tokenizer.decode(output.prompt) if tokenizer is not None else "",
            "has_new_line": "\n" in output.text,
            "truncated": done.truncated or (done.finish_reason == "length" and
                                            usage.prompt_tokens + usage.completion_tokens >= self.model.info.n_ctx),
            "stop_type": stop_type(done),
            "stopping_word": done.stop_word,
            "timings": llama_timings(done),
        }
        if self.body.n_probs > 0 and not streamed:
            result["completion_probabilities"] = [token_probabilities(self.model, lp) for lp in output.logprobs]
        return selected_fields(result, self.body.response_fields) if self.body.response_fields else result


async def native_completion(model: ServedModel, body: LlamaCompletionRequest, limits: ServerLimits,
                            record: RequestRecord) -> dict | list[dict] | AsyncIterator[bytes]:
    """llama.cpp's /completion: the result object (a list of them for several prompts), or the SSE stream.

    `cache_prompt` is accepted and reported, but a slot's cached prefix is always reused: reuse never changes
    the output here (a request's output equals its output on a fresh server).
    """
    prompts = llama_prompts(model, body.prompt)
    body = body.model_copy(update={"logit_bias": token_biases(model, body.logit_bias)})
    grammar = output_grammar(model, body)
    constraint_factory = (lambda: model.grammar_factory().matcher(grammar)) if grammar is not None else None
    response_id = new_id("cmpl")
    requests = []
    for index, prompt in enumerate(prompts):
        requests += engine_requests(model, body, prompt, body.token_budget(), limits, logprobs=body.n_probs > 0,
                                    top_logprobs=body.n_probs, constraint_factory=constraint_factory,
                                    id_prefix=f"{response_id}-{index}")
    record.prompt_tokens = sum(len(prompt) for prompt in prompts)
    choices = ChoiceSet(model, requests)
    run = NativeCompletion(model, body, limits, choices, prompts, record)
    await choices.submit(body.id_slot)
    if body.stream:
        await choices.started()
        return run.stream()
    results = await run.complete()
    return results[0] if len(results) == 1 else results


def token_biases(model: ServedModel, logit_bias: dict | list | None) -> dict[str, float]:
    """A /completion `logit_bias` as {token id: bias}.

    llama.cpp's forms: an object or [[token, bias], ...] pairs, where a token is an id or a text that stands for
    each of its tokens; a bias of false bans the token (here the lowest bias, -100) and true is ignored.
    """
    pairs = logit_bias.items() if isinstance(logit_bias, dict) else logit_bias or ()
    biases: dict[str, float] = {}
    for token, bias in pairs:
        if bias is True:
            continue
        for token_id in bias_targets(model, token):
            biases[str(token_id)] = BANNED if bias is False else float(bias)
    return biases


def bias_targets(model: ServedModel, token: int | str) -> list[int]:
    """The token ids a logit_bias key stands for: the id itself, or the tokens of a text."""
    if isinstance(token, int):
        return [token]
    if TOKEN_ID_KEY.fullmatch(token):
        return [int(token)]
    return model.require_tokenizer().encode(token, parse_special=False)


def selected_fields(result: dict, paths: list[str]) -> dict:
    """llama.cpp's `response_fields`: only the named fields, a nested one ("a/b") under its path as the key;
    paths that name nothing are left out."""
    selected = {}
    for path in paths:
        value: object = result
        for key in path.split("/"):
            if not isinstance(value, dict) or key not in value:
                break
            value = value[key]
        else:
            selected[path] = value
    return selected


def stop_type(done: FinishEvent) -> str:
    """Why a generation ended, in llama.cpp's words: "eos", "word" (a stop string), "limit" or "none"."""
    if done.finish_reason == "length":
        return "limit"
    if done.finish_reason == "stop":
        return "word" if done.stop_word else "eos"
    return "none"


def llama_timings(done: FinishEvent) -> dict:
    """The timings object with llama.cpp's per-token fields beside BaseRT's."""
    timings = done.timings
    body = timings.as_dict(done.usage.cached_tokens)
    body["prompt_per_token_ms"] = timings.prompt_ms / timings.prompt_n if timings.prompt_n else 0.0
    body["predicted_per_token_ms"] = timings.predicted_ms / timings.decode_steps if timings.decode_steps else 0.0
    return body


def token_probabilities(model: ServedModel, logprob: TokenLogprob) -> dict:
    """One entry of `completion_probabilities`: the chosen token and the best alternatives, with log-probabilities."""
    return {**token_entry(model, logprob.token_id, logprob.logprob),
            "top_logprobs": [token_entry(model, token_id, value) for token_id, value in logprob.top]}


def token_entry(model: ServedModel, token_id: int, logprob: float) -> dict:
    text, raw = token_piece(model, token_id)
    return {"id": token_id, "token": text, "bytes": raw, "logprob": finite_logprob(logprob)}


def generation_settings(model: ServedModel, body: LlamaCompletionRequest, limits: ServerLimits) -> dict:
    """The settings a /completion request runs with, in llama.cpp's `generation_settings` shape."""
    budget = body.token_budget() or limits.default_max_tokens
    return {
        "n_ctx": model.info.n_ctx,
        "n_predict": budget,
        "max_tokens": budget,
        "seed": body.seed if body.seed is not None and body.seed >= 0 else RANDOM_SEED,
        "temperature": body.temperature,
        "top_k": body.top_k,
        "top_p": body.top_p,
        "min_p": body.min_p,
        "repeat_last_n": SamplingParams().repeat_last_n,
        "repeat_penalty": body.repeat_penalty,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        **LLAMA_FEATURES_OFF,
        "n_keep": model.info.n_keep if body.n_keep is None else body.n_keep,
        "stop": body.stop or [],
        "ignore_eos": body.ignore_eos,
        "stream": body.stream,
        "logit_bias": [[int(token), bias] for token, bias in (body.logit_bias or {}).items()],
        "n_probs": body.n_probs,
        "grammar": body.grammar or "",
        "samplers": SAMPLER_CHAIN,
        "cache_prompt": body.cache_prompt,
        "return_tokens": body.return_tokens,
    }


def default_generation_settings(model: ServedModel, limits: ServerLimits) -> dict:
    """The settings of a /completion request that sets nothing but its prompt."""
    return generation_settings(model, LlamaCompletionRequest(prompt=""), limits)

# --- /props, /slots -----------------------------------------------------------------------------


def props(model: ServedModel, limits: ServerLimits) -> dict:
    """GET /props: the served model, its context and slots, its chat template and special tokens, and the warnings
    of its start (a context beyond the trained one)."""
    tokenizer = model.tokenizer
    idle = {"id": 0, "model": model.info.id, "is_processing": False, "n_ctx": model.info.n_ctx, "request_id": None}
    return {
        "default_generation_settings": llama_slot(model, idle, default_generation_settings(model, limits)),
        "total_slots": model.info.n_slots,
        "model_alias": model.info.id,
        "model_path": str(model.info.path),
        "modalities": {"vision": False, "audio": False},
        "chat_template": model.template.source if model.template is not None else "",
        "bos_token": (tokenizer.bos_token or "") if tokenizer is not None else "",
        "eos_token": (tokenizer.eos_token or "") if tokenizer is not None else "",
        "build_info": f"basert-{__version__}",
        "n_ctx_train": model.info.n_ctx_train,
        "warnings": list(model.info.warnings),
    }


def llama_slot(model: ServedModel, slot: dict, params: dict | None) -> dict:
    """A slot as GET /slots lists it: BaseRT's fields, then llama.cpp's.

    `params` None: the slot has never run a request, and like llama.cpp it lists no task fields (`id_task`,
    `params`, `next_token`). llama.cpp's integer task id is derived from BaseRT's `request_id` (-1 while the slot
    is idle); `params` are the default settings; `next_token` is llama.cpp's one-element list saying whether the
    slot is generating (BaseRT does not report its token counts: `n_decoded` 0, `n_remain` -1).
    """
    listed = {**slot, "model": model.info.id, "speculative": False}
    if params is None:
        return listed
    busy = slot["is_processing"]
    return {
        **listed,
        "id_task": zlib.crc32(slot["request_id"].encode()) & 0x7FFFFFFF if busy and slot["request_id"] else -1,
        "params": params,
        "next_token": [{"has_next_token": busy, "has_new_line": False, "n_remain": -1, "n_decoded": 0,
                        "stopping_word": ""}],
    }

# --- chat prompts -------------------------------------------------------------------------------


def rendered_chat(model: ServedModel, body: ChatCompletionRequest) -> dict:
    """POST /apply-template: the prompt text a chat request becomes (what /completion would then take)."""
    return {"prompt": model.require_tokenizer().decode(plan_chat(model, body).prompt)}


def chat_input_tokens(model: ServedModel, body: ChatCompletionRequest) -> dict:
    """POST /chat/completions/input_tokens: how many prompt tokens a chat request becomes."""
    return {"object": "response.input_tokens", "input_tokens": len(plan_chat(model, body).prompt)}
