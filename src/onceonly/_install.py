"""How to install an extra: onceonly is not on the public package index, so ``pip install
'onceonly[redis]'`` alone finds nothing. Every missing-extra message names the two forms that work."""

from __future__ import annotations

__all__ = ["install_hint"]


def install_hint(extra: str) -> str:
    """The command that adds ``extra`` to one's own environment, from this repository.

    ``install_hint("redis")`` reads ``pip install 'onceonly[redis] @ git+<repository URL>' (or from a
    checkout: pip install -e '/path/to/onceonly[redis]')``.

    .. versionadded:: 0.1
    """
    return (
        f"pip install 'onceonly[{extra}] @ git+<repository URL>' "
        f"(or from a checkout: pip install -e '/path/to/onceonly[{extra}]')"
    )
