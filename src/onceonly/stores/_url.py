"""Store URLs as they may be shown: in messages, reprs, logs and command output."""

from __future__ import annotations

import re
from urllib.parse import unquote

__all__ = ["redact_url", "scrub"]

MASK = "***"

# scheme://userinfo@host…: the userinfo ends at the last "@" before the path, so that an unquoted "@"
# in a password is still masked whole.
_AUTHORITY = re.compile(r"^(?P<head>[A-Za-z][A-Za-z0-9+.-]*://)(?P<netloc>[^/?#]*)")
# user:password@host with the scheme forgotten (no "//" at all).
_BARE_USERINFO = re.compile(r"^(?P<user>[^:/@?#\s]*):(?P<password>[^/?#\s]+)@")
# An option: name=value after "?", "&" or ";" in a query, or at the start or after whitespace in a libpq
# keyword string (where a value may be quoted).
_OPTION = re.compile(r"(?:^|(?<=[?&;\s]))(?P<name>[^=&;?#\s]+)=(?P<value>'(?:[^'\\]|\\.)*'|[^&;#\s]*)")
# The options that carry a secret: libpq's password and sslpassword, redis-py's password, onceonly's
# sentinel_password, the usual spellings of others (a token, a secret). Not passfile: that is the name
# of a file.
_SECRET = re.compile(r"[a-z0-9_]*password|passwd|pwd|pass|[a-z0-9_]*(?:secret|token)", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with every password in it replaced by ``***``, for showing it.

    Masks the password of the user part (``redis://:pw@host``, ``postgresql://user:pw@host``) and the
    value of options that carry one (``?password=``, ``sslpassword=``, libpq's ``password=…``
    keywords). The rest is kept as written, so the shown URL still says which store is meant. Never
    raises, whatever the text: it is used in error messages about URLs that do not parse.

    Args:
        url: a store URL, or any text a user gave as one.

    .. versionadded:: 0.1
    """
    match = _AUTHORITY.match(url)
    if match is not None:
        userinfo, at, host = match["netloc"].rpartition("@")
        user, colon, password = userinfo.partition(":")
        if at and colon and password:
            url = f"{match['head']}{user}:{MASK}@{host}{url[match.end() :]}"
    elif "//" not in url:
        url = _BARE_USERINFO.sub(lambda m: f"{m['user']}:{MASK}@", url, count=1)
    return _OPTION.sub(_mask_option, url)


def _mask_option(match: re.Match[str]) -> str:
    if not match["value"] or not _SECRET.fullmatch(unquote(match["name"])):
        return match[0]
    return f"{match['name']}={MASK}"


def scrub(text: str, url: str) -> str:
    """``text`` (a driver's message about ``url``) with each password of ``url`` replaced by ``***``:
    a driver may quote the part of a URL it could not parse, password included."""
    for secret in sorted(_secrets(url), key=len, reverse=True):
        text = text.replace(secret, MASK)
    return text


def _secrets(url: str) -> set[str]:
    found: set[str] = set()
    match = _AUTHORITY.match(url)
    userinfo = match["netloc"].rpartition("@")[0] if match is not None else ""
    if match is None and "//" not in url and (bare := _BARE_USERINFO.match(url)) is not None:
        found.add(bare["password"])
    found.add(userinfo.partition(":")[2])
    for option in _OPTION.finditer(url):
        if _SECRET.fullmatch(unquote(option["name"])):
            found.add(option["value"])
            found.add(option["value"].strip("'"))
    found |= {unquote(secret) for secret in found}
    found.discard("")
    return found
