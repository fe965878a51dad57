"""What an operator imports: the Prometheus alert rules (deploy/prometheus) checked and unit-tested by
promtool, and the Grafana dashboard (deploy/grafana) parsed, its queries checked by promtool as rules,
every metric either names one that onceonly serves."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from onceonly import Ledger, OutcomeUnknown
from onceonly.metrics import LedgerCollector, instrument
from tests.conftest import IN_CI

ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "deploy" / "prometheus" / "onceonly-alerts.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "onceonly-alerts.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "onceonly-dashboard.json"
_NAME = re.compile(r"\bonceonly_[a-z_]+\b")
_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",), "info": ("_info",)}


def _promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        reason = "promtool is not installed (Debian: apt-get install prometheus), so the rules are not checked"
        if IN_CI:
            pytest.fail(f"CI=true and {reason}: .ci/run installs it", pytrace=False)
        pytest.skip(reason)
    return found


def _served(tmp_path: Path) -> set[str]:
    """Every series name an instrumented ledger and the exporter's collector serve."""
    registry = CollectorRegistry()
    with Ledger.open(f"sqlite:///{tmp_path / 'l.db'}") as ledger:
        instrument(ledger, registry=registry)
        registry.register(LedgerCollector(ledger))

        def probe(args: dict[str, object], key: str) -> object:
            raise ConnectionError("the probe's service is down")

        @ledger.tool(name="maybe", on_unknown="probe", probe=probe)
        def maybe(order: str) -> None:
            raise TimeoutError("read timed out")

        with pytest.raises(OutcomeUnknown):
            maybe("o-1")
        ledger.reconcile()  # the reconciler's series exist once a pass has run
        return {f.name + s for f in registry.collect() for s in _SUFFIXES.get(f.type, ("",))}


def _exprs(dashboard: dict[str, object]) -> list[str]:
    panels = dashboard["panels"]
    assert isinstance(panels, list)
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def _rule_exprs() -> list[str]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in doc["groups"] for rule in group["rules"]]


def test_the_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    """``promtool check rules`` accepts the file, and ``promtool test rules`` shows each alert firing on
    the series that should raise it (stuck unknowns, a growing review queue, a late duplicate, a
    reconciler that stopped) and quiet on healthy ones."""
    promtool = _promtool()
    checked = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 7 rules found" in checked.stdout
    tested = subprocess.run(
        [promtool, "test", "rules", RULES_TEST.name], capture_output=True, text=True, check=False, cwd=RULES.parent
    )
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_rules_and_the_dashboard_name_only_metrics_onceonly_serves(tmp_path: Path) -> None:
    """Each metric an alert or a panel queries is one that onceonly serves (a renamed metric fails
    here), and every alert of the issue is there."""
    served = _served(tmp_path)
    dashboard = json.loads(DASHBOARD.read_text())
    used = {name for expr in _rule_exprs() + _exprs(dashboard) for name in _NAME.findall(expr)}
    assert used and used <= served, sorted(used - served)
    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]}
    assert {"OnceOnlyUnknownsStuck", "OnceOnlyReviewQueueGrowing", "OnceOnlyDuplicateDetected"} <= alerts
    assert {"OnceOnlyReconcilerNotRunning", "OnceOnlyReconcilerAbsent"} <= alerts
    # The names this check reads are real ones: a typo would be caught.
    assert "onceonly_records" in served and "onceonly_record" not in served


def test_the_dashboard_parses_and_its_queries_are_valid_promql(tmp_path: Path) -> None:
    """The dashboard is Grafana JSON (panels with unique ids, each query with a refId, the datasource
    an import input, a ``tool`` variable); its queries, with Grafana's variables filled in, pass
    ``promtool check rules`` as recording rules."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "onceonly" and dashboard["__inputs"][0]["name"] == "DS_PROMETHEUS"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert all(t["refId"] for p in dashboard["panels"] for t in p.get("targets", []))
    assert [v["name"] for v in dashboard["templating"]["list"]] == ["tool"]
    exprs = _exprs(dashboard)
    assert len(exprs) >= 15
    filled = [e.replace("$__rate_interval", "5m").replace("$tool", ".*") for e in exprs]
    assert not any("$" in e for e in filled), filled
    rules = {
        "groups": [
            {"name": "dashboard", "rules": [{"record": f"dashboard:q{i}", "expr": e} for i, e in enumerate(filled)]}
        ]
    }
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules))
    checked = subprocess.run([_promtool(), "check", "rules", str(path)], capture_output=True, text=True, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
