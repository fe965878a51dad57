"""The extras stay optional: the core and the CLI import no web framework, HTTP client or ORM."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("starlette", "fastapi", "uvicorn", "httpx", "requests", "sqlalchemy", "pydantic")


@pytest.mark.parametrize(
    ("module", "allowed"),
    [
        ("onceonly", ()),
        ("onceonly.cli", ()),
        ("onceonly.server", ()),  # pure ASGI: no framework either
        ("onceonly.http", ("httpx",)),
    ],
)
def test_import_pulls_in_only_what_it_needs(module: str, allowed: tuple[str, ...]) -> None:
    """Importing ``module`` in a fresh interpreter loads none of the heavy optional packages."""
    code = f"import sys, {module}; print(' '.join(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert set(out) <= set(allowed), f"import {module} loaded {out}"
