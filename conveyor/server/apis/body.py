"""A request body under the server's limits: JSON parsed with its depth, number and Unicode checks
(limits.py), a pydantic model validated (400 naming the field), counts checked, the X-Priority header."""

from __future__ import annotations

from typing import TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from conveyor.server import errors
from conveyor.server.limits import RequestLimits, check_priority, check_request, parse_json
from conveyor.server.request_plan import header_priority

Body = TypeVar("Body", bound=BaseModel)


async def parse_body(request: Request, model: type[Body], limits: RequestLimits) -> Body:
    body = validated(model, await json_object(request, limits))
    check_request(body, limits)
    if hasattr(body, "priority") and body.priority is None:  # the header stands in for the field
        check_header_priority(request, limits)
    return body


def check_header_priority(request: Request, limits: RequestLimits) -> None:
    """X-Priority: an integer within --max-priority, or a 400 before anything runs."""
    check_priority(header_priority(request), "X-Priority", limits)


async def json_object(request: Request, limits: RequestLimits) -> dict:
    """The body as a JSON object (a 400 for anything else), before any model sees it."""
    data = parse_json(await request.body(), limits)
    if not isinstance(data, dict):
        raise errors.invalid("The request body must be a JSON object")
    return data


def validated(model: type[Body], data: dict) -> Body:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise errors.from_validation(exc) from None
