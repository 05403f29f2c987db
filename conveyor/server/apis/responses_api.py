"""(being written)"""

from __future__ import annotations


def add_routes(router, serving, limits, config=None) -> None:
    return None
