"""Errors that more than one layer raises, kept below all of them (engine, structured, server, cluster)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request refused before admission (HTTP 400); `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
