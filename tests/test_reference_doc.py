"""docs/reference.md stays the whole truth: every ``@ledger.tool`` parameter has a row with its real
default, every ``via`` value the code writes is explained, and every exported name, ``Ledger`` member,
open option, store URL option, ``Outcome`` and ``Record`` field, state and error is on the page."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import re
from pathlib import Path

import pytest

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


def _section(title: str) -> str:
    """The text of the section headed ``title`` (a ``##`` or ``###`` line), up to the next heading of the
    same level or above."""
    found = re.search(rf"^(?P<level>#+) {re.escape(title)}\n", PAGE, re.MULTILINE)
    assert found, f"docs/reference.md has no section {title!r}"
    level = len(found["level"])
    end = re.compile(rf"^#{{1,{level}}} ", re.MULTILINE).search(PAGE, found.end())
    return PAGE[found.end() : end.start() if end else len(PAGE)]


def _rows(text: str) -> dict[str, str]:
    """The rows of the tables in ``text``, by their first cell's name (backticks dropped)."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| `") and len(cells) > 1:
            rows[cells[0].strip("`")] = line
    return rows


def test_every_exported_name_is_on_the_page() -> None:
    """Each name of ``onceonly.__all__`` is named on the page, in backticks."""
    for name in onceonly.__all__:
        assert re.search(rf"`(onceonly\.)?{re.escape(name)}\b", PAGE), (
            f"onceonly.{name} is exported (onceonly.__all__) and docs/reference.md does not name it: add a short "
            "entry under '## Every other exported name' (or in the section of its kind), with the name in backticks"
        )


def test_every_name_of_onceonly_http_is_in_its_page() -> None:
    """Each name of ``onceonly.http.__all__`` is named in docs/http.md."""
    import onceonly.http

    page = (ROOT / "docs" / "http.md").read_text(encoding="utf-8")
    for name in onceonly.http.__all__:
        assert re.search(rf"\b{re.escape(name)}\b", page), (
            f"onceonly.http.{name} is exported and docs/http.md does not name it: say what it is there"
        )


def test_every_public_member_of_ledger_is_described(tmp_path: Path) -> None:
    """Each public method and property of ``Ledger``, and each attribute an instance sets, is named in
    the ``Ledger`` section as ``ledger.NAME`` (``Ledger.open``)."""
    text = _section("`Ledger`")
    members = {n for n in vars(onceonly.Ledger) if not n.startswith("_")}
    with onceonly.Ledger.open(f"sqlite:///{tmp_path / 'ledger.db'}") as ledger:
        members |= {n for n in vars(ledger) if not n.startswith("_")}
    assert {"open", "tool", "resolve", "purge", "reconcile", "url", "tools"} <= members
    for name in sorted(members):
        described = f"`ledger.{name}" in text or f"`Ledger.{name}(" in text
        assert described, f"Ledger.{name} is public and docs/reference.md's Ledger section does not describe it"


def test_every_open_option_has_a_row_with_its_default() -> None:
    """Each keyword of ``Ledger(...)``, and ``url``, has a row in the open options table, with the
    default the code has."""
    from onceonly.ledger import DEFAULT_URL

    rows = _rows(_section("`Ledger.open()` options"))
    params = inspect.signature(onceonly.Ledger.__init__).parameters
    keywords = [p for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert len(keywords) >= 6
    for p in keywords:
        assert p.name in rows, f"no row for Ledger.open's option {p.name}"
    assert f'`"{params["scope"].default}"`' in rows["scope"]
    for name, value in (("clock", "time.time"), ("sleep", "time.sleep"), ("asleep", "asyncio.sleep")):
        module, _, attr = value.rpartition(".")
        assert getattr(importlib.import_module(module), attr) is params[name].default, name
        assert f"`{value}`" in rows[name], name
    assert params["rng"].default is None and params["store_clock"].default is None
    assert f'`"{DEFAULT_URL}"`' in rows["url"]


def test_every_reconcile_option_has_a_row_with_its_default() -> None:
    """Each keyword of ``onceonly.settle.reconcile`` has a row; the numbers are its defaults."""
    from onceonly.settle import reconcile

    rows = _rows(_section("`ledger.reconcile()` options"))
    params = inspect.signature(reconcile).parameters
    for p in params.values():
        if p.kind is inspect.Parameter.KEYWORD_ONLY:
            assert p.name in rows, f"no row for reconcile's option {p.name}"
            if isinstance(p.default, int | float) and not isinstance(p.default, bool):
                assert f"`{p.default:g}`" in rows[p.name].split(" | ")[1], (p.name, p.default)


def test_every_store_url_option_has_a_row(tmp_path: Path) -> None:
    """Each of onceonly's own query parameters of each store's URL has a row for its store."""
    from onceonly.stores.postgres import PostgresOptions
    from onceonly.stores.redis import parse_redis_url

    text = _section("Store URLs and their query parameters")
    sentinel = "redis+sentinel://h:26379/m/0?sentinel_username=u&sentinel_password=p&sentinel_ssl=true"
    target = parse_redis_url(sentinel)[1]["sentinel"]
    redis_options = set(parse_redis_url("redis://h:6379/0")[1]) - {"sentinel"}
    redis_options |= {f"sentinel_{name}" for name in target.options}
    postgres_options = {f.name for f in dataclasses.fields(PostgresOptions)} - {"conninfo"}
    with pytest.raises(ValueError, match="nonesuch") as refused:
        onceonly.open_store(f"sqlite:///{tmp_path / 'ledger.db'}?nonesuch=1")
    sqlite_options = set(re.findall(r"(\w+)=", str(refused.value).partition("takes")[2]))
    assert sqlite_options == {"timeout", "synchronous"}
    assert len(redis_options) == 10 and "schema" in postgres_options
    for store, options in (("SQLite", sqlite_options), ("Redis", redis_options), ("PostgreSQL", postgres_options)):
        lines = [line for line in text.splitlines() if line.startswith(f"| {store} | `")]
        for name in options:
            assert any(f"`{name}`" in line.split(" | ")[1] for line in lines), f"no row for {store}'s ?{name}="


def test_every_field_of_outcome_and_record_and_every_state_has_a_row() -> None:
    """``Outcome``'s and ``Record``'s fields, and ``State``'s values, each have a row in their section."""
    for title, names in (
        ("`Outcome`", [f.name for f in dataclasses.fields(onceonly.Outcome)]),
        ("`Record`", [f.name for f in dataclasses.fields(onceonly.Record)]),
        ("States", [s.value for s in onceonly.State]),
    ):
        rows = _rows(_section(title))
        for name in names:
            assert name in rows, f"docs/reference.md's {title} section has no row for {name}"


def test_every_error_has_a_row_naming_its_attributes() -> None:
    """Each error of ``onceonly.errors`` has a row in the attributes table, naming its base and each
    attribute its constructor takes."""
    import onceonly.errors

    text = _section("Errors a guarded call raises")
    rows = _rows(text[text.index("| error | a subclass of | attributes |") :])
    for name in onceonly.errors.__all__:
        cls = getattr(onceonly.errors, name)
        if not isinstance(cls, type):
            continue
        assert name in rows, f"no row for {name} in docs/reference.md's table of what each error carries"
        base = cls.__mro__[1].__name__.lstrip("_").replace("RecordError", "OnceOnlyError")
        assert f"`{base}`" in rows[name].split(" | ")[1], (name, base)
        for p in list(inspect.signature(cls.__init__).parameters)[1:]:
            if p not in ("message", "key", "record", "args", "kwargs", "value"):
                assert f"`{p}`" in rows[name], (name, p)
