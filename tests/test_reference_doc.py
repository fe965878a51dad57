"""docs/reference.md stays the whole truth about ``@ledger.tool``: every parameter has a row with its
real default, and every ``via`` value the code writes is explained."""

from __future__ import annotations

import inspect
import itertools
import re
from pathlib import Path

import onceonly
from onceonly.policy import DEFAULT_TTL

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")


def _row(name: str) -> str:
    found = re.search(rf"^\| `{name}` \| (?P<default>[^|]*) \|", PAGE, re.MULTILINE)
    assert found, f"docs/reference.md has no row for {name}"
    return found["default"]


def test_every_parameter_has_a_row_with_its_default() -> None:
    """Each keyword of ``Ledger.tool`` has a row; the defaults that are values are the code's."""
    params = inspect.signature(onceonly.Ledger.tool).parameters
    keywords = [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(keywords) > 15
    for p in keywords:
        _row(p.name)
    for name in ("on_unknown", "on_conflict", "readonly", "reports_dispatch"):
        assert repr(params[name].default).replace("'", '"') in _row(name), name
    assert f"`{params['settle'].default:g}` s" in _row("settle")
    assert f"`{params['lease'].default:g}` s" in _row("lease")
    assert f"`{params['wait'].default:g}` s" in _row("wait")
    assert f"`{DEFAULT_TTL:g}` s (24 h)" in _row("ttl") and DEFAULT_TTL == 24 * 3600


def test_retry_defaults_are_the_documented_ones() -> None:
    """``Retry()`` is 3 attempts, base 1 s, cap 30 s, as the page says."""
    r = onceonly.Retry()
    assert (r.attempts, r.base, r.cap) == (3, 1.0, 30.0)
    assert "`Retry()`: `attempts=3`, `base=1.0` s, `cap=30.0` s" in _row("retry")


def test_every_via_the_code_writes_is_explained() -> None:
    """The ``via`` values written in the source each have a row of the via table."""
    package = ROOT / "src" / "onceonly"
    source = "".join(p.read_text(encoding="utf-8") for p in [*package.glob("*.py"), *package.glob("plan/*.py")])
    written = set(re.findall(r'via="([a-z-]+)"', source)) | {"late:N"}
    assert "late" in source and written >= {"run", "probe", "reconcile-probe", "resolve", "readonly"}
    for via in written:
        assert f"| `{via}` |" in PAGE, via


def test_every_parameter_of_the_metrics_api_has_a_row() -> None:
    """Each public function of ``onceonly.metrics`` has a row, and each of its parameters a row (on the
    function's row or the empty-named rows after it) with its real default."""
    import onceonly.metrics

    lines = PAGE[PAGE.index("## `onceonly.metrics`") :].splitlines()
    for name in ("instrument", "enable", "asgi_app", "start_http_server", "LedgerCollector"):
        at = next((i for i, line in enumerate(lines) if line.startswith(f"| `{name}(")), None)
        assert at is not None, f"docs/reference.md has no row for onceonly.metrics.{name}"
        rows = [lines[at], *(line for line in itertools.takewhile(lambda x: x.startswith("| |"), lines[at + 1 :]))]
        defaults = {cells[1].strip("`"): cells[2].strip() for cells in (row.split(" | ") for row in rows)}
        for p in inspect.signature(getattr(onceonly.metrics, name)).parameters.values():
            assert p.name in defaults, f"no row for {name}({p.name})"
            if p.default is inspect.Parameter.empty:
                assert defaults[p.name] == "required", (name, p.name)
            else:
                shown = "`None`" if p.default is None else f"`{p.default!r}`".replace("'", '"')
                assert defaults[p.name].startswith(shown), (name, p.name, defaults[p.name])
