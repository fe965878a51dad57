"""The dashboard's kill switch: the pauses in force (``GET /api/pauses``), and setting and lifting one
(``POST /api/pause``, ``POST /api/resume``), as ``onceonly pause`` and ``onceonly resume`` do. The app
serves them behind the same token, content-type and ``Origin`` rules as every other write."""

from __future__ import annotations

from typing import Any

from onceonly.ledger import Ledger

__all__ = ["pause_json", "pauses_json", "resume_json"]


def pauses_json(ledger: Ledger) -> dict[str, Any]:
    """``GET /api/pauses``: ``{"pauses": [...]}``, each as ``onceonly pauses --json`` shows it, with the
    command that lifts it and a line in words."""
    return {"pauses": [{**p.to_json(), "what": p.what(), "resume": p.resume_command()} for p in ledger.pauses()]}


def _name(body: dict[str, Any], field: str) -> str | None:
    value = body.get(field)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ValueError(f'"{field}": give a name as text, or leave it out for every {field}')  # noqa: TRY004 - a 400
    return value.strip() or None


def _body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ValueError('send a JSON object: {"tool", "scope" (optional), "reason", "by"}')  # noqa: TRY004 - a 400
    return body


def pause_json(ledger: Ledger, body: Any) -> dict[str, Any]:
    """``POST /api/pause``: body ``{"tool", "scope"`` (each optional: every one), ``"reason", "by"}``."""
    body = _body(body)
    for field in ("reason", "by"):
        if not isinstance(body.get(field), str) or not body[field].strip():
            raise ValueError(f'"{field}": give who pauses and why; both are shown with the pause')
    ledger.pause(tool=_name(body, "tool"), scope=_name(body, "scope"), reason=body["reason"], by=body["by"].strip())
    return pauses_json(ledger)


def resume_json(ledger: Ledger, body: Any) -> dict[str, Any]:
    """``POST /api/resume``: body ``{"tool", "scope"}`` as the pause was set (each optional), or
    ``{"all": true}``; answers ``{"lifted": N, "pauses": [...]}`` (the pauses still in force)."""
    body = _body(body)
    every = body.get("all") is True
    lifted = ledger.resume(tool=_name(body, "tool"), scope=_name(body, "scope"), every=every)
    return {"lifted": lifted, **pauses_json(ledger)}
