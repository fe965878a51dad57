"""``onceonly demo``: agents creating tickets under injected faults, four strategies side by side.

    from onceonly.demo import DemoConfig, run_demo

    result = run_demo(DemoConfig(agents=8, ops=200, fault_rate=0.2, seed=7))
    print(result.to_dict())   # {"seed": 7, "strategies": [{"name": "naive", ...}, ...]}

Embedded: the reference ticket service on 127.0.0.1 (a free port), SQLite files in a temporary
directory, agents in threads. Needs the ``server`` and ``http`` extras. See docs/demo.md.

Names are imported on first use, so that the ``onceonly`` command (which imports ``onceonly.demo.cli``
at start) stays fast and works without those extras.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from onceonly.demo.run import DemoConfig, DemoResult, StrategyResult, run_demo
    from onceonly.demo.workload import Ask, Workload, make_workload

__all__ = ["Ask", "DemoConfig", "DemoResult", "StrategyResult", "Workload", "make_workload", "run_demo"]

_WHERE = {
    "DemoConfig": "onceonly.demo.run",
    "DemoResult": "onceonly.demo.run",
    "StrategyResult": "onceonly.demo.run",
    "run_demo": "onceonly.demo.run",
    "Ask": "onceonly.demo.workload",
    "Workload": "onceonly.demo.workload",
    "make_workload": "onceonly.demo.workload",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'onceonly.demo' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
