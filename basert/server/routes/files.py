"""/v1/files: upload, list, read and delete files in the files store (needs --files-dir)."""

from __future__ import annotations

import trio
from quart import Blueprint, Response, request

from basert.format.atomic import StorageError
from basert.server.errors import invalid
from basert.server.state import server_state

files = Blueprint("files", __name__)


@files.post("/v1/files")
async def upload_file():
    store = server_state().files()
    try:
        # Large parts are spooled to a temporary file while the form is parsed.
        form = await request.form
        uploads = await request.files
    except OSError as exc:
        raise StorageError("file upload", exc) from None
    if "file" not in uploads:
        raise invalid("multipart field 'file' is required", "file")
    upload = uploads["file"]
    content = upload.read()
    stored = await trio.to_thread.run_sync(store.create, content, upload.filename or "upload",
                                           form.get("purpose", "user_data"))
    return stored.to_openai()


@files.get("/v1/files")
async def list_files():
    store = server_state().files()
    return {"object": "list", "data": [f.to_openai() for f in store.list(request.args.get("purpose"))]}


@files.get("/v1/files/<file_id>")
async def get_file(file_id: str):
    return server_state().files().get(file_id).to_openai()


@files.get("/v1/files/<file_id>/content")
async def file_content(file_id: str):
    content = await trio.to_thread.run_sync(server_state().files().content, file_id)
    return Response(content, mimetype="application/octet-stream")


@files.delete("/v1/files/<file_id>")
async def delete_file(file_id: str):
    stored = server_state().files().delete(file_id)
    return {"id": stored.id, "object": "file", "deleted": True}
