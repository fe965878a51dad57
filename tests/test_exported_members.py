"""The public face: onceonly/__init__.py exports exactly its sorted __all__."""

from __future__ import annotations

import inspect
import subprocess
import sys

import onceonly


def test_all_is_sorted_and_complete() -> None:
    """Every name in __all__ exists; __all__ is sorted; nothing public is left out."""
    isort_style = sorted(onceonly.__all__, key=lambda n: (0 if n.isupper() else 1 if n[0].isupper() else 2, n))
    assert onceonly.__all__ == isort_style
    for name in onceonly.__all__:
        assert hasattr(onceonly, name), name
    public = {n for n in dir(onceonly) if not n.startswith("_") and not isinstance(getattr(onceonly, n), type(sys))}
    assert public <= set(onceonly.__all__) | {"annotations"}


def test_core_import_is_light() -> None:
    """import onceonly pulls in no optional integration (no redis, psycopg, httpx, starlette, click)."""
    code = (
        "import sys, onceonly; heavy = [m for m in ('redis', 'psycopg', 'httpx', 'starlette', 'fastapi', "
        "'click', 'rich', 'sqlalchemy') if m in sys.modules]; print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_http_exports_its_all_under_its_own_name() -> None:
    """``onceonly.http`` has every name of its sorted ``__all__`` (``RequestsAdapter`` on first use),
    and its classes and functions say ``onceonly.http``, the module users import them from."""
    import onceonly.http

    isort_style = sorted(onceonly.http.__all__, key=lambda n: (0 if n.isupper() else 1 if n[0].isupper() else 2, n))
    assert onceonly.http.__all__ == isort_style
    public = {
        n for n in dir(onceonly.http) if not n.startswith("_") and not isinstance(getattr(onceonly.http, n), type(sys))
    }
    typing_helpers = {"annotations", "TYPE_CHECKING", "Any"}  # the package's own imports for its hints
    assert public <= set(onceonly.http.__all__) | typing_helpers
    for name in onceonly.http.__all__:
        value = getattr(onceonly.http, name)
        if isinstance(value, type) or inspect.isfunction(value):
            assert value.__module__ == "onceonly.http", name
