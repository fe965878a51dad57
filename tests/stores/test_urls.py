"""Store URLs as they are shown: every password is masked, in messages, reprs and logs, on each store,
and the rest of the URL is still there to say which store is meant."""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

import pytest

from onceonly import Ledger
from onceonly.stores import open_store, redact_url
from tests._urls import SECRET, with_password


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@cache:6379/0", "redis://:***@cache:6379/0"),
        ("redis://user:pw@cache/0?prefix=app", "redis://user:***@cache/0?prefix=app"),
        ("rediss://user:p%40ss@cache:6380", "rediss://user:***@cache:6380"),
        ("redis://:p@ss:w@rd@cache/0", "redis://:***@cache/0"),  # an unquoted @ in the password
        ("redis://cache/0?password=pw&prefix=a", "redis://cache/0?password=***&prefix=a"),
        ("postgresql://app:pw@db/ledger?schema=s", "postgresql://app:***@db/ledger?schema=s"),
        ("postgresql://db/ledger?PassWord=pw&schema=s", "postgresql://db/ledger?PassWord=***&schema=s"),
        ("postgresql://db/ledger?sslpassword=pw", "postgresql://db/ledger?sslpassword=***"),
        ("postgres://app:pw@[::1]:5432/x", "postgres://app:***@[::1]:5432/x"),
        ("mysql://root:pw@db/x", "mysql://root:***@db/x"),  # a scheme onceonly does not know
        ("redis://[::1:6379/0?password=pw", "redis://[::1:6379/0?password=***"),  # urlsplit refuses it
        ("host=db dbname=x password=pw user=app", "host=db dbname=x password=*** user=app"),
        ("host=db password='p w' user=app", "host=db password=*** user=app"),
        ("app:pw@db/ledger", "app:***@db/ledger"),  # the scheme forgotten
        ("redis://:@cache/0", "redis://:@cache/0"),  # an empty password hides nothing
        # Nothing secret: unchanged, user names included.
        ("sqlite:///.onceonly/ledger.db", "sqlite:///.onceonly/ledger.db"),
        ("sqlite:////tmp/a@b:c.db?timeout=5", "sqlite:////tmp/a@b:c.db?timeout=5"),
        ("redis://cache:6379/0?prefix=a&shards=4", "redis://cache:6379/0?prefix=a&shards=4"),
        ("postgresql://app@db/ledger", "postgresql://app@db/ledger"),
        ("unix:///run/redis.sock?db=0", "unix:///run/redis.sock?db=0"),
        ("", ""),
    ],
)
def test_redact_url(url: str, shown: str) -> None:
    """A password in the user part, a ``password=`` option (any case, ``sslpassword``), a libpq
    keyword string, a URL the parser refuses: each password becomes ``***``; all else is kept."""
    assert redact_url(url) == shown


def _networked(store_url: str) -> None:
    if store_url.startswith("sqlite"):
        pytest.skip("a SQLite URL has no password")


def _hidden(text: str, url: str) -> None:
    """``text`` names the store (its masked URL, or at least its host) but never the password."""
    assert SECRET not in text, text
    assert (urlsplit(url).hostname or "db.example") in text, text


def test_ledger_and_store_show_no_password(store_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A ledger opened with a password in its URL (and ``?password=`` too): ``Ledger.url``, the reprs of
    the ledger, its store and its tools, and every log line of opening, using and closing it hide the
    password; the store itself still connects with it (the real URL stays on ``ledger.store.url``)."""
    _networked(store_url)
    url = with_password(store_url)
    caplog.set_level(logging.DEBUG)
    with Ledger.open(url) as ledger:

        @ledger.tool(name="charge")
        def charge(op: str) -> str:
            return op

        assert charge("a") == "a"
        assert ledger.store.url == url
        assert ledger.url == redact_url(url)
        for shown in (ledger.url, repr(ledger), repr(ledger.store), repr(charge.spec)):
            _hidden(shown, url)
    query = f"{store_url}&password={SECRET}"  # the fixture's URL has a query: its prefix or schema
    with Ledger.open(query) as ledger:
        for shown in (ledger.url, repr(ledger), repr(ledger.store)):
            _hidden(shown, url)
    assert SECRET not in caplog.text


@pytest.mark.parametrize("option", ["shards=x", "prefix={a}", "warn_persistence=maybe"])
def test_redis_url_errors_hide_the_password(redis_base_url: str, option: str) -> None:
    """A bad onceonly option in a Redis URL with a password (user part or ``?password=``) is refused
    with the masked URL (it used to show the URL as given)."""
    for url in (with_password(redis_base_url) + f"?{option}", f"{redis_base_url}?password={SECRET}&{option}"):
        with pytest.raises(ValueError, match=option.split("=", maxsplit=1)[0]) as info:
            open_store(url)
        _hidden(str(info.value), url)


@pytest.mark.parametrize("option", ["schema=bad-name", "pool_max_size=x", "listen=maybe", "no_such_option=1"])
def test_postgres_url_errors_hide_the_password(postgres_database_url: str, option: str) -> None:
    """A bad option in a PostgreSQL URL: the message masks a password given in the user part and one
    given as ``?password=`` (that one used to be shown)."""
    for url in (
        with_password(postgres_database_url) + f"?{option}",
        f"{postgres_database_url}?password={SECRET}&{option}",
    ):
        with pytest.raises(ValueError) as info:
            open_store(url)
        _hidden(str(info.value), url)


@pytest.mark.parametrize(
    "url",
    [
        f"mysql://root:{SECRET}@db.example/x",
        f"root:{SECRET}@db.example/x",
        f"sqlite://root:{SECRET}@db.example/x.db",
        f"sqlite:///db.example.db?password={SECRET}",
        f"sqlite:///db.example.db?timeout=x&password={SECRET}",
        f"postgresql://db.example/x?password={SECRET}&schema=-",
        f"redis://:{SECRET}@db.example/0?shards=0",
        f"postgresql://root:{SECRET}%zz@db.example/x",  # libpq quotes the token it cannot decode
        f"postgresql://root:{SECRET} x@db.example/x",
    ],
)
def test_open_errors_hide_the_password(url: str) -> None:
    """An unknown scheme, a SQLite URL with a host part, a bad option or a password libpq cannot
    decode: the ValueError that opening raises names the store without its password, in its own
    words and in the driver's it quotes (they used to repeat the URL, or the password, as given)."""
    with pytest.raises(ValueError) as info:
        open_store(url)
    _hidden(str(info.value), url)
