"""Counters and histograms for the guarded call's hot path, exported through prometheus-client.

A ``prometheus_client`` child takes a lock and checks its type on every ``inc`` (a histogram's
``observe`` twice: its sum and its bucket): about 1 µs a value, 8 values on a first call. These keep a
family's values behind one lock per update and hand them to the registry when it is scraped (a
``Collector``), with the same names, labels, buckets and ``_total``/``_bucket``/``_sum``/``_count``
samples as ``Counter``/``Histogram`` would export.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = ["CounterFamily", "HistogramFamily"]


class _CounterChild:
    __slots__ = ("created", "lock", "value")

    def __init__(self, lock: threading.Lock) -> None:
        self.lock = lock
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        with self.lock:
            self.value += amount


class _HistogramChild:
    __slots__ = ("bounds", "counts", "lock", "sum")

    def __init__(self, lock: threading.Lock, bounds: tuple[float, ...]) -> None:
        self.lock = lock
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        i = bisect.bisect_left(self.bounds, amount)  # the first bound >= amount: Prometheus' le
        with self.lock:
            self.counts[i] += 1
            self.sum += amount


class _Family(Collector):
    """One metric family: its children by label values, registered in ``registry``."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str], registry: CollectorRegistry) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.lock = threading.Lock()
        self.children: dict[tuple[str, ...], object] = {}
        registry.register(self)

    def _child(self, values: tuple[str, ...]) -> object:
        if len(values) != len(self.labelnames):
            raise ValueError(f"{self.name} takes the labels {self.labelnames}, got {values}")
        found = self.children.get(values)
        if found is None:
            with self.lock:
                found = self.children.setdefault(values, self._new())
        return found

    def _new(self) -> object:  # pragma: no cover - each family makes its own
        raise NotImplementedError

    def describe(self) -> Iterator[Metric]:
        yield from self._families(with_samples=False)

    def collect(self) -> Iterator[Metric]:
        yield from self._families(with_samples=True)

    def _families(self, *, with_samples: bool) -> Iterator[Metric]:  # pragma: no cover
        raise NotImplementedError


class CounterFamily(_Family):
    """A labelled counter, exported as ``NAME_total`` (and ``NAME_created``)."""

    def labels(self, *values: str) -> _CounterChild:
        child = self._child(values)
        assert isinstance(child, _CounterChild)
        return child

    def _new(self) -> object:
        return _CounterChild(self.lock)

    def _families(self, *, with_samples: bool) -> Iterator[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        if with_samples:
            with self.lock:
                values = [(k, c.value, c.created) for k, c in self.children.items() if isinstance(c, _CounterChild)]
            for labels, value, created in values:
                family.add_metric(labels, value, created=created)
        yield family


class HistogramFamily(_Family):
    """A labelled histogram with fixed ``buckets``, exported as ``NAME_bucket``, ``NAME_sum``, ``NAME_count``."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry,
        *,
        buckets: Sequence[float],
    ) -> None:
        self.bounds = tuple(sorted(float(b) for b in buckets))
        self.les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, registry)

    def labels(self, *values: str) -> _HistogramChild:
        child = self._child(values)
        assert isinstance(child, _HistogramChild)
        return child

    def _new(self) -> object:
        return _HistogramChild(self.lock, self.bounds)

    def _families(self, *, with_samples: bool) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        if with_samples:
            with self.lock:
                values = [
                    (k, list(c.counts), c.sum) for k, c in self.children.items() if isinstance(c, _HistogramChild)
                ]
            for labels, counts, total in values:
                cumulative, running = [], 0
                for le, n in zip(self.les, counts, strict=True):
                    running += n
                    cumulative.append((le, float(running)))
                family.add_metric(labels, cumulative, sum_value=total)
        yield family
