"""Every fenced Python and shell snippet of README.md and docs/*.md runs as written, each in a fresh
temporary folder, against real services.

A snippet that mentions the ticket service's address (``127.0.0.1:8000``) gets a ticket service of its
own, on a free port that replaces 8000 in its text. Python snippets run in this process (a fresh
namespace, the temporary folder as the working directory) unless marked ``<!-- snippet: process -->``;
shell snippets run in ``bash -e``, with ``onceonly`` on the PATH. A snippet marked
``<!-- snippet: skip — REASON -->`` on the line before its fence is not run, and must say why. A
snippet marked ``<!-- snippet: setup -->`` is a page's declared set-up ("every snippet below runs after
this set-up"): it runs on its own, and its code runs again before each later snippet of its page.
``console`` blocks are transcripts (a command with its output), not snippets.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PYTHON = {"python", "py"}
SHELL = {"bash", "sh", "shell"}
TICKETS_ADDRESS = "127.0.0.1:8000"
_FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[a-z]*)\s*$")
_MARK = re.compile(r"^\s*<!--\s*snippet:\s*(?P<what>skip|process|setup)\b\s*(?:[—-]+\s*(?P<why>.*?))?\s*-->\s*$")


@dataclass(frozen=True)
class Snippet:
    page: str
    line: int
    lang: str
    code: str
    skip: str | None  # the stated reason
    own_process: bool

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def snippets() -> Iterator[Snippet]:
    """The fenced Python and shell blocks of every page, with the mark on the line before each."""
    for page in PAGES:
        lines = page.read_text(encoding="utf-8").splitlines()
        setup = ""
        i = 0
        while i < len(lines):
            m = _FENCE.match(lines[i])
            if not m or not m["lang"]:
                i += 1
                continue
            indent, start = len(m["indent"]), i
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i][indent:])
                i += 1
            i += 1
            if m["lang"] not in PYTHON | SHELL:
                continue
            mark = _MARK.match(lines[start - 1]) if start else None
            skip = None
            if mark and mark["what"] == "skip":
                skip = mark["why"] or ""
            code = "\n".join(body) + "\n"
            yield Snippet(
                page=str(page.relative_to(ROOT)),
                line=start + 1,
                lang="python" if m["lang"] in PYTHON else "bash",
                code=setup + code,
                skip=skip,
                own_process=bool(mark and mark["what"] == "process"),
            )
            if mark and mark["what"] == "setup":
                setup = code


ALL = list(snippets())


def test_every_skipped_snippet_says_why() -> None:
    """A skip mark names its reason: a snippet is never left out silently."""
    assert [s.id for s in ALL if s.skip is not None and len(s.skip) < 10] == []


@pytest.fixture(name="shims")
def fixture_shims(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder for the PATH with ``onceonly`` and ``python`` as this interpreter runs them."""
    bin_dir = tmp_path_factory.mktemp("bin")
    for name, target in (
        ("onceonly", f'exec "{sys.executable}" -m onceonly "$@"'),
        ("python", f'exec "{sys.executable}" "$@"'),
    ):
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\n{target}\n")
        shim.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("snippet", [s for s in ALL if s.skip is None], ids=lambda s: s.id)
def test_snippet_runs(snippet: Snippet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shims: Path) -> None:
    """The snippet runs to its end without an error, in an empty folder of its own."""
    work = tmp_path / "work"
    work.mkdir()
    code = snippet.code
    server = None
    if TICKETS_ADDRESS in code:
        from onceonly.tickets import serve_in_thread

        server = serve_in_thread(db_path=tmp_path / "tickets.db")
        code = code.replace(TICKETS_ADDRESS, server.url.removeprefix("http://"))
    try:
        if snippet.lang == "bash" or snippet.own_process:
            env = {
                **os.environ,
                "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
                "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
                "TMPDIR": str(tmp_path),
            }
            env.pop("ONCEONLY_URL", None)
            argv = ["bash", "-e", "-c", code] if snippet.lang == "bash" else [sys.executable, "-c", code]
            done = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=120, check=False)
            assert done.returncode == 0, f"{snippet.id}\n{code}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"
        else:
            monkeypatch.chdir(work)
            monkeypatch.delenv("ONCEONLY_URL", raising=False)
            namespace = {"__name__": "__main__"}
            exec(compile(code, f"{snippet.id}", "exec"), namespace)
            for value in list(namespace.values()):
                close = getattr(value, "close", None)
                if type(value).__name__ == "Ledger" and close is not None:
                    close()
    finally:
        if server is not None:
            server.stop()
            server.app.state.db.close()
