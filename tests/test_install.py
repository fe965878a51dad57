"""Installing onceonly and its extras: the package is not on the public index, so every message that
asks for an extra names a command that works (a VCS URL or a checkout), and ``python -m onceonly`` is
the ``onceonly`` command."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
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


def test_the_readme_extras_table_is_pyproject_s() -> None:
    """The README's table of extras has a row for every extra of pyproject.toml (``test`` and ``dev``
    named below it), and each row names every package its extra installs (``all``: its extras)."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = readme[readme.index("| extra | for | installs |") :].split("\n\n", 1)
    rows = {}
    for line in table[0].splitlines()[2:]:
        name, _, installs = line.strip("|").split(" | ")
        rows[name.strip().strip("`")] = installs
    assert "`test` and `dev` are for working on onceonly itself" in table[1]
    assert set(rows) | {"test", "dev"} == set(extras), sorted(set(rows) ^ (set(extras) - {"test", "dev"}))
    for extra, requirements in extras.items():
        if extra in ("test", "dev"):
            continue
        for requirement in requirements:
            package = re.match(r"[A-Za-z0-9_.-]+(\[[^\]]*\])?", requirement)
            assert package is not None, requirement
            if package[0].startswith("onceonly["):
                named = {e.strip() for e in package[1].strip("[]").split(",")}
                assert {m.strip("` ") for m in rows[extra].split(",")} == named, extra
            else:
                assert f"`{package[0]}`" in rows[extra], f"README's row of the {extra} extra does not name {package[0]}"


def test_the_readme_upgrades_pip_before_installing_from_the_repository() -> None:
    """The README's install commands begin with upgrading pip: a new venv's pip 23 refuses git+file URLs."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Install it into your own project") :]
    block = section[section.index("```bash\n") + 8 :].split("```", 1)[0].splitlines()
    assert block[0].startswith("python -m pip install -U pip"), block[0]
    assert any(line.startswith("pip install 'onceonly[") for line in block[1:]), block
