"""POST /slots/{id}?action=save|restore|erase: llama-server's slot persistence over engine/slot_store.py.

Errors as llama-server answers them: the feature off (no --slot-save-path, or --no-prompt-cache) 501, an unknown action, slot id or a bad file name 400, a restore of a missing file 404.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse, Response

from conveyor.engine import slot_store
from conveyor.engine.async_engine import AsyncEngine
from conveyor.server import errors
from conveyor.server.errors import APIError
from conveyor.server.limits import RequestLimits, parse_json

ACTIONS = ("save", "restore", "erase")


async def handle(engine: AsyncEngine, slot_id: int, action: str, body: bytes, limits: RequestLimits) -> Response:
    core = engine.core
    directory = core.config.slot_save_path
    if directory is None or core.disk is None:
        return APIError(501, "This server does not support slots action (start it with --slot-save-path DIR, "
                        "and without --no-prompt-cache)", "not_supported_error").response()
    if action not in ACTIONS:
        raise errors.invalid(f"Invalid action {action!r}: one of {', '.join(ACTIONS)}", "action")
    filename = None
    if action != "erase":
        data = parse_json(body, limits) if body.strip() else {}
        filename = data.get("filename") if isinstance(data, dict) else None
    try:
        if filename is not None or action != "erase":
            slot_store.check_filename(directory, filename)  # refused here, before the engine thread
        if action == "save":
            result = await engine.call(lambda c: slot_store.save(c, slot_id, directory, filename))
        elif action == "restore":
            result = await engine.call(lambda c: slot_store.restore(c, slot_id, directory, filename))
        else:
            result = await engine.call(lambda c: slot_store.erase(c, slot_id))
    except slot_store.SlotError as exc:
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        raise APIError(exc.status, str(exc), kind, "filename" if "filename" in str(exc) else None) from None
    return JSONResponse(result)
