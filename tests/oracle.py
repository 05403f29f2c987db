"""Names the oracle tests take from a reference library's private modules, resolved across its versions.

Tests compare with transformers (and others) through their public API where one exists. Where a test must
reach into a private module (a layer class, a weight converter), it asks here with every spelling that the
locked range and the newest releases have, newest first, so an upstream rename is one line in the test,
and a version that has none of them fails the test saying so (never a skip: the comparison would be lost).
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest


def private_name(*candidates: str, library: str = "transformers") -> Any:
    """The first of `candidates` ("package.module:Name") that the installed `library` has."""
    lib = pytest.importorskip(library)  # the test extra installs it; without it the oracle tests cannot run
    tried = []
    for candidate in candidates:
        module_name, _, name = candidate.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            tried.append(f"{candidate} (module: {exc})")
            continue
        if hasattr(module, name):
            return getattr(module, name)
        tried.append(f"{candidate} (no such name)")
    pytest.fail(f"{library} {getattr(lib, '__version__', '?')} has none of the names this test compares "
                f"against: {'; '.join(tried)}. Find its new name in that release and add it first.")
