"""Installing onceonly and its extras: the package is not on the public index, so every message that
asks for an extra names a command that works (a VCS URL or a checkout), and ``python -m onceonly`` is
the ``onceonly`` command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from onceonly._install import install_hint

ROOT = Path(__file__).resolve().parents[1]


def test_the_hint_names_a_vcs_url_and_a_checkout_with_the_extra() -> None:
    """The hint for an extra is a pip command from the repository, never the bare index name."""
    hint = install_hint("redis")
    assert "pip install 'onceonly[redis] @ git+<repository URL>'" in hint
    assert "pip install -e '/path/to/onceonly[redis]'" in hint


def test_python_dash_m_onceonly_is_the_command(tmp_path: Path) -> None:
    """``python -m onceonly --help`` lists the commands, from any folder."""
    done = subprocess.run(
        [sys.executable, "-m", "onceonly", "--help"], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Usage: python -m onceonly" in done.stdout
    assert "resolve" in done.stdout


def test_a_missing_store_extra_names_the_repository_form(tmp_path: Path) -> None:
    """Opening a Redis or PostgreSQL ledger without its extra is an ImportError naming the command
    that installs it from the repository."""
    for scheme, module, extra in (
        ("redis://127.0.0.1:1/0", "redis", "redis"),
        ("postgresql://h/db", "psycopg", "postgres"),
    ):
        code = f"import sys; sys.modules[{module!r}] = None; import onceonly; onceonly.Ledger.open({scheme!r})"
        done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False)
        assert done.returncode != 0
        assert f"needs the {extra} extra: pip install 'onceonly[{extra}] @ git+" in done.stderr, done.stderr


def test_no_doc_or_message_suggests_the_bare_index_name() -> None:
    """No README, docs page, example or source file tells a reader to ``pip install 'onceonly[x]'``
    from the index, where the package is not."""
    offenders = []
    files = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("src/**/*.py"), *ROOT.glob("examples/**/*.py")]
    for path in files:
        text = path.read_text(encoding="utf-8")
        for bad in ("pip install 'onceonly[", 'pip install "onceonly['):
            start = 0
            while (at := text.find(bad, start)) != -1:
                end = text.find("]", at)
                if " @ " not in text[end : end + 4]:
                    offenders.append(f"{path.relative_to(ROOT)}: {text[at : end + 2]}")
                start = at + 1
    assert not offenders, offenders
