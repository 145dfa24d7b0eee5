"""Requests to a server under test, with the checks their callers repeat: a 200 answer, the OpenAI error envelope,
server-sent events, and the reset of a server's state through the API."""

from __future__ import annotations

import json
from typing import Any

import httpx

ERROR_FIELDS = {"message", "type", "param", "code"}


def post(url: str, path: str, body: Any, *, timeout: float = 120, **kwargs: Any) -> httpx.Response:
    """POST `body` to `url` + `path`: bytes or str as they are, anything else as JSON."""
    if isinstance(body, (bytes, str)):
        return httpx.post(url + path, content=body, timeout=timeout, **kwargs)
    return httpx.post(url + path, json=body, timeout=timeout, **kwargs)


def answer(response: httpx.Response) -> dict:
    """The JSON body of a 200 answer."""
    assert response.status_code == 200, response.text
    return response.json()


def error_envelope(response: httpx.Response, status: int, code: str | None = None) -> dict:
    """The `error` object of an OpenAI error envelope, after checking the status, its fields and `code`."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= ERROR_FIELDS, error
    if code is not None:
        assert error["code"] == code, error
    return error


def sse_events(response: httpx.Response) -> list:
    """The `data:` payloads of a streamed answer: each event parsed, and the final "[DONE]" as it is."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def reset_state(url: str) -> None:
    """Erase every slot and delete every stored file (where the server has a files store), so the next request
    finds no history."""
    with httpx.Client(base_url=url, timeout=60) as client:
        for slot in answer(client.get("/slots")):
            answer(client.post(f"/slots/{slot['id']}", params={"action": "erase"}))
        listed = client.get("/v1/files")
        if listed.status_code == 501:      # started without --files-dir
            return
        for stored in answer(listed)["data"]:
            answer(client.delete(f"/v1/files/{stored['id']}"))
