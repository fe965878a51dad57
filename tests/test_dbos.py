"""DBOS recovery finds the same key: a guarded call inside a DBOS workflow is keyed by the workflow.

The crash tests run a real pydantic-ai agent (scripted ``FunctionModel``) under ``DBOSDurability`` on a
SQLite system database, in a child process that dies right after the guarded ``charge`` wrote its
charge; a second process launches DBOS, which recovers the pending workflow and runs it again
(tests/_dbos_agent.py). The charges are counted in their own SQLite table. The in-process tests run plain
DBOS workflows and steps.

The children fork from a forkserver that imported pydantic-ai and DBOS once (seconds each, otherwise).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("dbos")
if importlib.util.find_spec("pydantic_ai") is None:  # found, not imported: only the children need it
    pytest.skip("pydantic-ai is not installed (the pydantic-ai extra)", allow_module_level=True)

from dbos import DBOS, DBOSConfig, SetWorkflowID

import onceonly
import onceonly.dbos
from onceonly import Ledger
from onceonly.edge import durable_unit
from tests import _dbos_agent

pytestmark = pytest.mark.slow

REPLAYED = re.compile(r"This action was already done at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ and was not repeated\.")
UNKNOWN = "The outcome of this action is unknown"


@pytest.fixture(scope="module", name="forkserver")
def fixture_forkserver() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["tests._dbos_agent"])
    return ctx


def crash_then_recover(ctx: multiprocessing.context.BaseContext, where: Path, keying: str) -> dict[str, Any]:
    first = ctx.Process(target=_dbos_agent.main, args=("run", where, keying))  # type: ignore[attr-defined]
    first.start()
    first.join(60)
    assert first.exitcode == _dbos_agent.CRASHED, f"the first run should die in the tool, exit code {first.exitcode}"
    second = ctx.Process(target=_dbos_agent.main, args=("recover", where, keying))  # type: ignore[attr-defined]
    second.start()
    second.join(60)
    assert second.exitcode == 0, f"the recovering process failed, exit code {second.exitcode}"
    result: dict[str, Any] = json.loads((where / "result.json").read_text())
    return result


def test_recovered_agent_workflow_replays_the_charge(forkserver: Any, tmp_path: Path) -> None:
    """Keyed by the workflow, the recovered run finds the dead run's charge (its probe confirms it): one
    charge, and the model reads onceonly's replay text."""
    result = crash_then_recover(forkserver, tmp_path, "dbos")
    assert result["charges"] == 1
    assert result["keys"][0].startswith("dbos%3Aorder-1:charge:")
    assert REPLAYED.search(result["output"]) and "charged 5" in result["output"]
    assert "onceonly resolve" not in result["output"]


def test_recovered_agent_workflow_without_a_probe_is_told_unknown(forkserver: Any, tmp_path: Path) -> None:
    """No probe: the recovered call does not charge again, and the model is told the outcome is unknown."""
    result = crash_then_recover(forkserver, tmp_path, "dbos-review")
    assert result["charges"] == 1
    assert UNKNOWN in result["output"]
    assert "onceonly resolve" not in result["output"]


def test_recovered_agent_workflow_replays_the_charge_of_a_pydantic_ai_guarded_tool(
    forkserver: Any, tmp_path: Path
) -> None:
    """The tool guarded by onceonly.pydantic_ai.guard: the key comes from the workflow (onceonly.dbos), not
    the run's conversation, and the recovered run replays the dead run's charge."""
    result = crash_then_recover(forkserver, tmp_path, "pydantic")
    assert result["charges"] == 1
    assert result["keys"][0].startswith("dbos%3Aorder-1:charge:")
    assert REPLAYED.search(result["output"]) and "charged 5" in result["output"]
    assert "onceonly resolve" not in result["output"]


def test_recovered_agent_workflow_replays_the_charge_of_a_guarded_toolset(forkserver: Any, tmp_path: Path) -> None:
    """The same through onceonly.pydantic_ai.guarded(FunctionToolset(...)): DBOS keeps the wrapper around its
    function toolset, whose calls run in workflow code, so the recovered call replays too."""
    result = crash_then_recover(forkserver, tmp_path, "pydantic-toolset")
    assert result["charges"] == 1
    assert result["keys"][0].startswith("dbos%3Aorder-1:charge:")
    assert REPLAYED.search(result["output"]) and "charged 5" in result["output"]


def test_recovered_pydantic_ai_guarded_tool_without_a_probe_is_told_unknown(forkserver: Any, tmp_path: Path) -> None:
    """No probe: no second charge, and the model reads the unknown outcome as the tool's (failed) result."""
    result = crash_then_recover(forkserver, tmp_path, "pydantic-review")
    assert result["charges"] == 1
    assert UNKNOWN in result["output"]
    assert "onceonly resolve" not in result["output"]


def test_without_dbos_keying_the_recovered_workflow_charges_twice(forkserver: Any, tmp_path: Path) -> None:
    """The same flow keyed by the caller's ``ledger.task("conv-1")``: recovery does not enter it, the
    recovered call gets another key, and the customer is charged twice."""
    result = crash_then_recover(forkserver, tmp_path, "task")
    assert result["charges"] == 2
    assert sorted(key.split(":")[0] for key in result["keys"]) == ["conv-1", "default"]


# --- in process: plain DBOS workflows and steps ---------------------------------------------------


class Shop:
    """The ledger and guarded ``charge`` of the running test; the workflows below call through it."""

    ledger: Ledger
    charge: Any
    made: list[str]

    def use(self, ledger: Ledger) -> None:
        self.ledger, self.made = ledger, []

        @ledger.tool(name="charge")
        def charge(amount: int) -> str:
            call = onceonly.current_call()
            assert call is not None
            self.made.append(call.scope)
            return f"charged {amount}"

        self.charge = charge


SHOP = Shop()
SEEN: list[Any] = []  # onceonly.dbos.unit() as the ``pay`` step saw it


@pytest.fixture(scope="module", name="dbos")
def fixture_dbos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One DBOS for the module (launching and destroying one takes a second): its workflows call
    ``SHOP``, which each test points at its own ledger. Workflow ids are the tests' own: DBOS returns a
    finished workflow's recorded result for its id."""
    where = tmp_path_factory.mktemp("dbos")
    config: DBOSConfig = {"name": "onceonly-dbos-inproc", "system_database_url": f"sqlite:///{where / 'dbos.db'}"}
    DBOS(config=config)

    @DBOS.step(name="pay")
    def pay() -> str:
        SEEN.append(onceonly.dbos.unit())
        return str(SHOP.charge(5))

    @DBOS.workflow(name="charge_twice")
    def charge_twice() -> list[str]:
        return [SHOP.charge(5), SHOP.charge(5)]

    @DBOS.workflow(name="charge_once")
    def charge_once() -> str:
        return str(SHOP.charge(5))

    @DBOS.workflow(name="charge_in_task")
    def charge_in_task(conversation: str) -> str:
        with SHOP.ledger.task(conversation):
            return str(SHOP.charge(5))

    @DBOS.workflow(name="pay_in_steps")
    def pay_in_steps() -> list[str]:
        return [pay(), pay(), str(SHOP.charge(5))]

    DBOS.launch()
    try:
        yield {f.__name__: f for f in (charge_twice, charge_once, charge_in_task, pay_in_steps)}
    finally:
        DBOS.destroy(destroy_registry=True)


@pytest.fixture(name="shop")
def fixture_shop(dbos: dict[str, Any], sqlite_url: str) -> Iterator[Shop]:
    with Ledger.open(sqlite_url) as ledger:
        SHOP.use(ledger)
        SEEN.clear()
        try:
            yield SHOP
        finally:
            onceonly.dbos.uninstall()


def test_two_workflows_each_charge_and_a_replan_in_one_replays(dbos: dict[str, Any], store_url: str) -> None:
    """Keyed per workflow, on each store: the same charge in two orders runs twice (two customers), and
    the same charge asked twice inside one workflow (a re-planned tool call) runs once."""
    onceonly.dbos.install()
    try:
        with Ledger.open(store_url) as ledger:
            SHOP.use(ledger)
            kind = store_url.split(":", maxsplit=1)[0]
            for name in (f"two-{kind}-a", f"two-{kind}-b"):
                with SetWorkflowID(name):
                    assert dbos["charge_twice"]() == ["charged 5", "charged 5"]
            assert SHOP.made == [f"dbos:two-{kind}-a", f"dbos:two-{kind}-b"]
            assert SHOP.charge(5) == "charged 5"  # outside a workflow: the ledger's scope, as before
            assert SHOP.made[-1] == ledger.scope
    finally:
        onceonly.dbos.uninstall()


def test_a_task_entered_inside_the_workflow_wins(dbos: dict[str, Any], shop: Shop) -> None:
    """``ledger.task`` inside the workflow function is entered again on recovery, so it scopes the calls:
    two workflows of one conversation share the charge."""
    onceonly.dbos.install()
    for name in ("inside-a", "inside-b"):
        with SetWorkflowID(name):
            assert dbos["charge_in_task"]("conv-1") == "charged 5"
    assert shop.made == ["conv-1"]


def test_a_task_entered_outside_the_workflow_gives_way_with_a_warning(
    dbos: dict[str, Any], shop: Shop, caplog: pytest.LogCaptureFixture
) -> None:
    """The caller's task is not there when DBOS recovers the workflow: the workflow's scope is used
    (the same on the first run and on recovery), and a warning says where to enter the task (once per
    process: no other test here enters a task outside a workflow)."""
    onceonly.dbos.install()
    with caplog.at_level(logging.WARNING, "onceonly"), shop.ledger.task("conv-1"), SetWorkflowID("outside-a"):
        assert dbos["charge_once"]() == "charged 5"
    assert shop.made == ["dbos:outside-a"]
    assert any("inside the workflow function" in r.getMessage() for r in caplog.records)


def test_per_step_scopes_each_step(dbos: dict[str, Any], shop: Shop) -> None:
    """``per="step"``: the same charge in two DBOS steps runs in each (DBOS's own reading of two steps),
    keyed by the step id DBOS gives it again on recovery; workflow code keeps the workflow's scope."""
    onceonly.dbos.install(per="step")
    with SetWorkflowID("steps-a"):
        assert dbos["pay_in_steps"]() == ["charged 5"] * 3
    assert shop.made == ["dbos:steps-a/step:1", "dbos:steps-a/step:2", "dbos:steps-a"]
    assert [u.unit for u in SEEN] == ["dbos:steps-a", "dbos:steps-a"]
    with pytest.raises(ValueError, match="uninstall"):
        onceonly.dbos.install(per="workflow")


def test_install_is_idempotent_and_uninstall_restores_the_task_scope(dbos: dict[str, Any], shop: Shop) -> None:
    onceonly.dbos.install()
    onceonly.dbos.install()
    assert onceonly.dbos.installed() == "workflow"
    onceonly.dbos.uninstall()
    assert onceonly.dbos.installed() is None
    with shop.ledger.task("conv-1"), SetWorkflowID("uninstalled-a"):
        dbos["charge_once"]()
    assert shop.made == ["conv-1"]
    assert durable_unit() is None
    with pytest.raises(ValueError, match="per="):
        onceonly.dbos.install(per="call")  # type: ignore[arg-type]
