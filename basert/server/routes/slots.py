"""Slot admin: list slots, and save, restore or erase one (BaseRT style through the files store, or
llama.cpp style by filename under --slot-save-path)."""

from __future__ import annotations

import re

import trio
from quart import Blueprint, request

from basert.actor.messages import SlotErase, SlotList, SlotRestore, SlotSave
from basert.server.catalog import ServedModel
from basert.server.errors import invalid, not_found, not_supported, unavailable
from basert.server.files import safe_child
from basert.server.json_input import optional_request_json, request_json
from basert.server.llama_api import default_generation_settings, llama_slot
from basert.server.logs import printable
from basert.server.schemas import SlotFileRequest
from basert.server.state import server_state

SNAPSHOT_PURPOSE = "slot_snapshot"
SLOT_ID = re.compile(r"-?[0-9]{1,9}")

slots = Blueprint("slots", __name__)


async def slot_model() -> ServedModel:
    return await server_state().catalog.acquire(request.args.get("model"))


def slot_id(raw: str) -> int:
    # ASCII digits only: int() also reads "٣" and " 3 " as 3.
    if not SLOT_ID.fullmatch(raw):
        raise invalid(f"slot id must be an integer, got {printable(raw, 32)!r}", "id_slot")
    value = int(raw)
    if value < 0:
        raise not_found(f"slot {value} not found", "slot_not_found")
    return value


@slots.get("/slots")
async def list_slots():
    """Every slot of the model, with BaseRT's and llama.cpp's fields; with `?fail_on_no_slot`, a 503 when all are
    busy (as llama.cpp answers)."""
    state = server_state()
    if not state.settings.slots_endpoint:
        raise not_supported("the slots endpoint is off: the server was started with --no-slots")
    # Listing looks, it does not use: a model that is not loaded has no slot in use, and one that is loaded is
    # neither loaded for this nor kept loaded by it (a dashboard polls this every second).
    model = state.catalog.hold_loaded(state.catalog.entry_for(request.args.get("model")))
    if model is None:
        return []
    params = default_generation_settings(model, state.settings.limits)
    listed = [llama_slot(model, slot, params if slot["has_run"] else None) for slot in await model.ask(SlotList)]
    if "fail_on_no_slot" in request.args and all(slot["is_processing"] for slot in listed):
        raise unavailable("no slot is available", "no_slot_available", retry_after=1)
    return listed


@slots.post("/slots/<raw_id>/save")
async def slot_save(raw_id: str):
    slot = slot_id(raw_id)
    model = await slot_model()
    files = server_state().files()
    body = SlotFileRequest.model_validate(await optional_request_json())
    filename = body.filename or f"slot-{slot}.bin"
    # Written inside the store's directory, so handing it to the store is a rename.
    path = files.new_partial_path()
    try:
        result = await model.ask(SlotSave, slot, path)
        stored = await trio.to_thread.run_sync(files.create_from_path, path, filename, SNAPSHOT_PURPOSE)
    finally:
        path.unlink(missing_ok=True)
    return {"object": "slot.snapshot", "id_slot": slot, "file_id": stored.id, "filename": filename,
            "n_saved": result.n_tokens, "n_written": result.n_bytes, "timings": {"save_ms": result.milliseconds}}


@slots.post("/slots/<raw_id>/restore")
async def slot_restore(raw_id: str):
    slot = slot_id(raw_id)
    model = await slot_model()
    files = server_state().files()
    body = SlotFileRequest.model_validate(await request_json())
    if not body.file_id:
        raise invalid("file_id is required", "file_id")
    path = files.path(body.file_id)
    result = await model.ask(SlotRestore, slot, path)
    return {"object": "slot.snapshot", "id_slot": slot, "file_id": body.file_id, "n_restored": result.n_tokens,
            "n_read": result.n_bytes, "timings": {"restore_ms": result.milliseconds}}


@slots.post("/slots/<raw_id>/erase")
async def slot_erase(raw_id: str):
    slot = slot_id(raw_id)
    await erase_body()
    result = await (await slot_model()).ask(SlotErase, slot)
    return {"id_slot": result.slot, "n_erased": result.n_tokens}


async def erase_body() -> None:
    """Read an erase's body, though an erase takes no fields: one over --max-body-bytes is a 413 (and one that is
    not JSON a 400) as on every route, not silently ignored."""
    await optional_request_json()


@slots.post("/slots/<raw_id>")
async def slot_action(raw_id: str):
    slot = slot_id(raw_id)
    action = request.args.get("action", "")
    if action not in ("save", "restore", "erase"):
        raise invalid(f"action must be save, restore or erase, got {action!r}", "action")
    model = await slot_model()
    if action == "erase":
        await erase_body()
        result = await model.ask(SlotErase, slot)
        return {"id_slot": slot, "n_erased": result.n_tokens}
    slot_save_path = server_state().settings.slot_save_path
    if slot_save_path is None:
        raise not_supported("llama.cpp-style slot save/restore needs --slot-save-path DIR")
    body = SlotFileRequest.model_validate(await request_json())
    if not body.filename:
        raise invalid("filename is required", "filename")
    path = safe_child(slot_save_path, body.filename)
    if action == "save":
        result = await model.ask(SlotSave, slot, path)
        return {"id_slot": slot, "filename": body.filename, "n_saved": result.n_tokens,
                "n_written": result.n_bytes, "timings": {"save_ms": result.milliseconds}}
    if not path.is_file():
        raise not_found(f"snapshot file {body.filename!r} not found", "file_not_found")
    result = await model.ask(SlotRestore, slot, path)
    return {"id_slot": slot, "filename": body.filename, "n_restored": result.n_tokens,
            "n_read": result.n_bytes, "timings": {"restore_ms": result.milliseconds}}
