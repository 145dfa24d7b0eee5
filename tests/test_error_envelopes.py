"""Exceptions become OpenAI error envelopes: the status, the exact body bytes and the headers each one answers with."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, ValidationError

from basert.actor.actor import QueueTimeoutError, ServerBusyError, SlotNotFoundError, SlotOutOfRangeError
from basert.chat.grammar import GrammarError
from basert.chat.template import ChatTemplateError
from basert.engine.engine import KVCacheTooSmallError
from basert.engine.kv import OutOfBlocksError
from basert.engine.runner import ContextOverflowError
from basert.engine.sampler import SamplingError
from basert.engine.saved_state import SnapshotError
from basert.errors import BaseRTError, InvalidRequestError
from basert.format.atomic import StorageError
from basert.format.errors import ChecksumMismatchError, ModelValidationError
from basert.server.app import ServerSettings, create_app
from basert.server.catalog import ModelCatalog
from basert.server.errors import ApiError, to_api_error
from basert.server.files import FileNotFoundInStoreError, StoreFullError, UnsafeFilenameError
from basert.tokenizer import TokenizerError


def answer(exc: BaseException) -> tuple[int, str, dict[str, str]]:
    error = to_api_error(exc)
    return error.status, json.dumps(error.body()), error.headers


@pytest.mark.parametrize("exc", [
    SamplingError("top_k must be >= 0, got -1"), GrammarError("Invalid type: nonsense"),
    ChatTemplateError("boom is not allowed"), TokenizerError("no vocabulary"),
    UnsafeFilenameError("filename must be a single path component: '../a'"), StoreFullError(6, 2, 5),
    KVCacheTooSmallError("the prompt (100 tokens) does not fit in the KV cache (64 tokens)"),
    SnapshotError("slot snapshot is truncated (7 bytes)"),
], ids=lambda exc: type(exc).__name__)
def test_request_errors_are_400_invalid_value(exc: Exception) -> None:
    message = json.dumps(str(exc))
    assert answer(exc) == (400, '{"error": {"message": ' + message + ', "type": "invalid_request_error", '
                                '"param": null, "code": "invalid_value"}}', {})


def test_declared_errors_keep_their_python_bases() -> None:
    assert issubclass(SamplingError, ValueError) and issubclass(SamplingError, BaseRTError)
    assert issubclass(FileNotFoundInStoreError, LookupError)
    assert issubclass(OutOfBlocksError, RuntimeError)
    assert issubclass(ChecksumMismatchError, ValueError) and issubclass(ChecksumMismatchError, ModelValidationError)


def test_a_missing_file_is_404() -> None:
    assert answer(FileNotFoundInStoreError("file-x")) == (
        404, '{"error": {"message": "No such file: \'file-x\'", "type": "not_found_error", "param": null, '
             '"code": "file_not_found"}}', {})


def test_a_full_disk_is_507_naming_the_operation_but_no_path() -> None:
    exc = StorageError("slot save", OSError(28, "No space left on device", "/secret/dir/file"))
    assert answer(exc) == (507, '{"error": {"message": "slot save failed: No space left on device", '
                                '"type": "server_error", "param": null, "code": "insufficient_storage"}}', {})


def test_a_full_kv_cache_is_503_with_retry_after() -> None:
    assert answer(OutOfBlocksError("no free block")) == (
        503, '{"error": {"message": "the KV cache is full (no free block); retry when running requests finish", '
             '"type": "unavailable_error", "param": null, "code": "kv_cache_full"}}', {"Retry-After": "1"})


def test_a_model_file_fault_is_a_500_that_keeps_its_message_out_of_the_answer() -> None:
    status, body, headers = answer(ChecksumMismatchError("/models/secret.base: tensor 'x' checksum mismatch"))
    error = json.loads(body)["error"]
    assert status == 500 and headers == {}
    assert "secret" not in body
    assert error["code"] == "internal_error" and error["type"] == "server_error"
    assert error["error_id"] in error["message"]


def test_a_class_declares_status_code_param_message_and_extra_fields() -> None:
    class TooLong(InvalidRequestError):
        code = "context_length_exceeded"
        param = "messages"

        def client_message(self) -> str:
            return "too long for this model"

        def extra(self) -> dict[str, object]:
            return {"n_prompt_tokens": 9, "n_ctx": 8}

    assert answer(TooLong("9 > 8")) == (
        400, '{"error": {"message": "too long for this model", "type": "invalid_request_error", '
             '"param": "messages", "code": "context_length_exceeded", "n_prompt_tokens": 9, "n_ctx": 8}}', {})


def test_engine_and_actor_errors() -> None:
    assert answer(ContextOverflowError(300, 256)) == (
        400, '{"error": {"message": "This model\'s maximum context length is 256 tokens; the request has 300 '
             'prompt tokens.", "type": "exceed_context_size_error", "param": "messages", '
             '"code": "context_length_exceeded", "n_prompt_tokens": 300, "n_ctx": 256}}', {})
    assert answer(SlotOutOfRangeError(7, 2)) == (
        400, '{"error": {"message": "id_slot 7 is not a slot of this model (slots 0..1, or -1 for any)", '
             '"type": "invalid_request_error", "param": "id_slot", "code": "invalid_value"}}', {})
    assert answer(SlotNotFoundError(9, 2)) == (
        404, '{"error": {"message": "slot 9 not found (this model has slots 0..1)", "type": "not_found_error", '
             '"param": null, "code": "slot_not_found"}}', {})
    status, body, headers = answer(ServerBusyError(64, 3))
    assert (status, json.loads(body)["error"]["code"], headers) == (503, "server_busy", {"Retry-After": "3"})
    status, body, headers = answer(QueueTimeoutError(12.0, 5))
    assert (status, json.loads(body)["error"]["code"], headers) == (503, "queue_timeout", {"Retry-After": "5"})


def test_validation_errors_name_the_field_and_api_errors_pass_through() -> None:
    class Body(BaseModel):
        top_k: int

    with pytest.raises(ValidationError) as caught:
        Body(top_k="many")
    assert answer(caught.value) == (
        400, '{"error": {"message": "top_k: Input should be a valid integer, unable to parse string as an integer", '
             '"type": "invalid_request_error", "param": "top_k", "code": "invalid_value"}}', {})
    teapot = ApiError(418, "short and stout", code="teapot", headers={"X-Kind": "tea"})
    assert to_api_error(teapot) is teapot


def test_unknown_exceptions_are_500_with_an_error_id() -> None:
    status, body, _ = answer(KeyError("internal detail"))
    error = json.loads(body)["error"]
    assert status == 500 and "internal detail" not in body
    assert error["error_id"].startswith("err-")


@pytest.mark.parametrize("method, path, status, message", [
    ("GET", "/v1/messages", 405, "method GET not allowed on /v1/messages"),
    ("GET", "/v1/messages/count_tokens", 405, "method GET not allowed on /v1/messages/count_tokens"),
    ("POST", "/v1/messages/batches", 404, "route POST /v1/messages/batches not found"),
])
async def test_a_method_or_path_no_messages_route_has_answers_in_anthropics_envelope(method: str, path: str,
                                                                                    status: int, message: str):
    client = create_app(ModelCatalog(), ServerSettings()).test_client()
    response = await client.open(path, method=method, json={})
    kind = {404: "not_found_error", 405: "invalid_request_error"}[status]
    assert (response.status_code, await response.get_json()) == (status, {"type": "error", "error": {
        "type": kind, "message": message}})
