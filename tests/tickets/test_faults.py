"""Fault settings and draws: validated, seeded, reproducible."""

from __future__ import annotations

import random

import pytest

from onceonly.tickets.faults import KINDS, FaultInjector, Faults, request_identity


def test_same_seed_same_faults() -> None:
    """Two injectors with one seed draw the same faults in the same order; another seed differs."""
    faults = Faults(lost=0.3, delay=0.2, fail=0.1, seed=42)
    a, b, c = FaultInjector(faults), FaultInjector(faults), FaultInjector(Faults(lost=0.3, delay=0.2, fail=0.1, seed=7))
    seq_a = [a.draw() for _ in range(200)]
    assert seq_a == [b.draw() for _ in range(200)]
    assert seq_a != [c.draw() for _ in range(200)]
    counts = a.snapshot()["injected"]
    assert sum(counts.values()) == sum(1 for d in seq_a if d is not None)
    # Roughly the asked rates (200 draws: generous bounds, never flaky for a fixed seed).
    assert 30 <= counts["lost"] <= 90 and 15 <= counts["delay"] <= 65 and 5 <= counts["fail"] <= 40


def test_a_request_meets_its_own_faults_in_any_order() -> None:
    """A request's fault depends on the request and how many times it came before, not on what
    arrived before it: two orders of the same requests, one fault per (request, repeat)."""
    faults = Faults(lost=0.3, delay=0.2, fail=0.1, seed=42)
    sent = [f"request-{n}" for n in range(60)] * 3  # each sent three times: a first time and two retries
    shuffled = random.Random(1).sample(sent, len(sent))
    met = []
    for order in (sent, shuffled):
        injector, repeats, faults_met = FaultInjector(faults), dict[str, int](), {}
        for identity in order:
            repeats[identity] = repeats.get(identity, 0) + 1
            faults_met[identity, repeats[identity]] = injector.draw(identity)
        met.append((faults_met, injector.snapshot()["injected"]))
    assert met[0] == met[1]
    assert len(set(met[0][0].values())) == 4  # lost, delay, fail and none
    other = FaultInjector(Faults(lost=0.3, delay=0.2, fail=0.1, seed=43))
    assert [other.draw(i) for i in sent[:60]] != [met[0][0][i, 1] for i in sent[:60]]


def test_a_request_is_its_client_and_its_body() -> None:
    """Two clients sending one body are two requests; one client sending it twice is one, repeated."""

    def scope(auth: bytes | None) -> dict[str, object]:
        return {"headers": [(b"content-type", b"application/json")] + ([(b"authorization", auth)] if auth else [])}

    a = request_identity(scope(b"Bearer a"), b'{"title": "t"}')
    assert a == request_identity(scope(b"Bearer a"), b'{"title": "t"}')
    assert a != request_identity(scope(b"Bearer b"), b'{"title": "t"}')
    assert a != request_identity(scope(b"Bearer a"), b'{"title": "u"}')
    assert request_identity(scope(None), b"x") != request_identity(scope(b"x"), b"")


def test_configure_restarts_the_draws() -> None:
    """New settings restart the draws from their seed and the counts from zero."""
    inj = FaultInjector(Faults(lost=0.5, seed=1))
    first = [inj.draw() for _ in range(20)]
    inj.configure(Faults(lost=0.5, seed=1))
    assert [inj.draw() for _ in range(20)] == first
    assert inj.snapshot()["requests"] == 20


def test_no_faults_draw_nothing_and_certain_faults_always() -> None:
    """Probability 0 never fires, 1 always does."""
    assert {FaultInjector().draw() for _ in range(50)} == {None}
    assert {FaultInjector(Faults(crash=1.0)).draw() for _ in range(50)} == {"crash"}


def test_parse_cli_specs() -> None:
    """``--fault KIND=P`` parses, with '-' or '_' in kind names."""
    faults = Faults.parse(["lost=0.2", "crash-after-commit=0.1"], seed=5, delay_seconds=1.0)
    assert faults.lost == 0.2 and faults.crash_after_commit == 0.1
    assert faults.seed == 5 and faults.delay_seconds == 1.0
    assert set(KINDS) <= set(faults.to_dict())


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["lost"], "KIND=P"),
        (["gone=0.1"], "KIND=P"),
        (["lost=x"], "number"),
        (["lost=1.5"], "between 0 and 1"),
        (["lost=0.6", "fail=0.6"], "add up to"),
    ],
)
def test_bad_specs_are_refused(specs: list[str], message: str) -> None:
    """A fault spec that cannot be meant is refused with a message that says what to write."""
    with pytest.raises(ValueError, match=message):
        Faults.parse(specs)


def test_delay_seconds_is_bounded() -> None:
    """A held answer is at most MAX_DELAY_SECONDS long, and never negative."""
    from onceonly.tickets.faults import MAX_DELAY_SECONDS

    assert Faults(delay_seconds=MAX_DELAY_SECONDS).delay_seconds == MAX_DELAY_SECONDS
    for bad in (-1.0, MAX_DELAY_SECONDS + 1):
        with pytest.raises(ValueError, match="delay_seconds"):
            Faults(delay_seconds=bad)
