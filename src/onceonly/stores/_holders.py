"""Who holds leases on a SQLite ledger, so that a reconcile pass reads held records only when one may
have run out. Used by ``SQLiteStore``; I/O on small files beside the ledger, no SQL.

A reconcile pass looks for ``pending``/``in_flight`` records whose lease ran out: their holder died, or
stalled past its heartbeats. Finding them by query needs an index that every claim enters and every
settle leaves, which costs a first call about a third more on SQLite. Instead, each process that holds
leases on a ledger keeps one file in ``<ledger>-owners/``:

- it holds an exclusive ``flock`` on the file for as long as it lives; the kernel drops the lock when
  the process ends, however it ends, so a lock that can be taken means the holder is gone;
- the file, one line of JSON rewritten in place through a shared memory map (no system call), says
  how many leases the process holds (``held``), a time before any of them runs out (``lo``) and one
  after every lease it ever held runs out (``hi``). A lease is published before its record is
  written (a crash right after the write finds it), and taken back after its record left the held
  states. The file may overstate (more held, an earlier ``lo``), never understate: see ``Holder``.

A pass then needs the held records only when a live holder's ``lo`` is past (its heartbeats stalled),
a dead holder held a lease that is past, or no full pass ran for ``full_every`` seconds (a backstop for
what this scheme cannot see: records of an older onceonly still running, a removed directory). A dead
holder's file is removed once a full pass started after its latest lease ran out (``hi``), or at once
when it held nothing.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import mmap
import os
import secrets
import socket
import threading
import weakref
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["Holder", "Survey", "owners_dir", "survey"]

# The file: one line of JSON whose first three values have fixed places and widths, rewritten in place.
_NUM = 24  # wide enough for any float at 17 significant digits
_CNT = 8
_HEAD = b'{"held": '
_N = len(_HEAD)
_LO = _N + _CNT + len(b', "lo": ')
_HI = _LO + _NUM + len(b', "hi": ')
_NULL = b"null".ljust(_NUM)
_MANY = 4096
_COUNTS = [str(n).encode().ljust(_CNT) for n in range(_MANY)]
#: The stamp of the last full pass (JSON: {"at": time}); a dot file, so never read as a holder.
FULL_PASS = ".full-pass"


def owners_dir(ledger_path: Path) -> Path:
    """``<ledger>-owners``: beside the ledger, as SQLite keeps its ``-wal`` and ``-shm``."""
    return ledger_path.with_name(ledger_path.name + "-owners")


def _number(value: float) -> bytes:
    """A time as the file's fixed-width JSON: 17 significant digits are exact for any float."""
    if value == math.inf:
        return _NULL
    return b"%-24.17g" % max(value, -1e308)  # -inf (a held record without a lease): long expired


def _count(n: int) -> bytes:
    return _COUNTS[n] if n < _MANY else str(min(n, 10**_CNT - 1)).encode().ljust(_CNT)


class Holder:
    """This process's leases on one ledger, published in its file (made on the first lease it holds).

    The store calls ``held`` before each write that makes or extends a lease of ours, and ``gone``
    after each write that ends one. The file says how many leases we hold (``held``), a time before
    any of them ends (``lo``) and one after every lease we ever held ends (``hi``).

    A guarded call must stay cheap, so the call's own path writes only what makes the file more
    careful, and only when it must: the count when it was 0, ``lo`` when a lease ends before it, ``hi``
    when one ends after it (a lease ahead, so that the next calls need not). Most calls write nothing:
    a dict entry in, a dict entry out. What makes the file less careful (the count back to 0, ``lo``
    up to the earliest lease now held) waits for ``refresh``, which a thread of the holder's own runs
    about once a second (a quarter of the shortest lease seen, if less) while the file exists. Between
    refreshes the file only overstates: at worst a pass reads the held records when it need not have.
    """

    __slots__ = (
        "__weakref__", "_every", "_fd", "_hi", "_leases", "_lo", "_lock", "_map", "_n", "_stop", "directory", "path",
    )  # fmt: skip

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._lock = threading.Lock()  # every write to the file, and refresh's reading of _leases
        self._leases: dict[tuple[str, str | None], float] = {}  # (key, lease owner) → lease until
        # What the file says (or, during a refresh, values that send a racing held() to the lock).
        self._n = 0
        self._lo = math.inf
        self._hi = -math.inf
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self.path: Path | None = None
        self._stop: threading.Event | None = None  # set: the refresh thread ends
        self._every = 1.0  # seconds between refreshes

    # --- the writer side: this process ----------------------------------------------------------

    def held(self, key: str, owner: str | None, until: float | None, now: float) -> bool:
        """The record of ``key`` is about to be held by ``owner`` (one of our calls) until ``until``,
        written at ``now``. Called before the write, so that a crash just after it is published; the
        caller takes it back (``gone``) if the write did not happen. True when it was not held yet.

        Raises:
            OSError: this process's file could not be made (the directory cannot be written).
        """
        until = -math.inf if until is None else until  # a held record without a lease: expired
        leases = self._leases
        new = (key, owner) not in leases
        leases[key, owner] = until  # first: a refresh that starts after this line counts it
        if not self._n or until < self._lo or until > self._hi:
            self._publish(until, now)
        return new

    def gone(self, key: str, owner: str | None) -> None:
        """The record of ``key`` is no longer held by ``owner``: the next refresh says so."""
        self._leases.pop((key, owner), None)

    def _publish(self, until: float, now: float) -> None:
        with self._lock:
            m = self._map
            if m is None:
                m = self._open()
            if until < self._lo:
                self._lo = until
                m[_LO : _LO + _NUM] = _number(until)
            if until > self._hi:
                self._hi = until + max(until - now, 0.0)
                m[_HI : _HI + _NUM] = _number(self._hi)
                # Refresh within a quarter of a lease, so that a stale lo rarely outlives a live lease.
                self._every = min(self._every, max(0.05, (until - now) / 4))
            if not self._n:
                # Last: a reader that sees the count sees the times. At least 1: ours is in the dict.
                self._n = max(1, len(self._leases))
                m[_N : _N + _CNT] = _count(self._n)

    def refresh(self) -> None:
        """Bring the file down to what is held now: the count, and ``lo`` up to the earliest lease."""
        with self._lock:
            m = self._map
            if m is None:
                return
            # First make a racing held() come to the lock (it reads these without it), then read.
            self._n, self._lo = 0, math.inf
            leases = list(self._leases.values())
            n, lo = len(leases), min(leases, default=math.inf)
            m[_LO : _LO + _NUM] = _number(lo)
            m[_N : _N + _CNT] = _count(n)
            self._n, self._lo = n, lo

    def _open(self) -> mmap.mmap:
        self.directory.mkdir(parents=True, exist_ok=True)
        name = f"{socket.gethostname()[:40]}-{os.getpid()}-{secrets.token_hex(4)}"
        temp = self.directory / f".{name}.new"
        final = self.directory / name
        since = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        tail = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since})[1:]
        text = b"".join((_HEAD, _count(0), b', "lo": ', _NULL, b', "hi": ', _NULL, b", ", tail.encode(), b"\n"))
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            # Locked before it has its name: a surveyor never sees the file unlocked while we live.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, text)
            self._map = mmap.mmap(fd, len(text))
            os.rename(temp, final)
        except BaseException:
            if self._map is not None:
                self._map.close()
                self._map = None
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise
        self._fd = fd
        self.path = final
        self._stop = threading.Event()
        threading.Thread(
            target=_refresh_until_stopped, args=(weakref.ref(self), self._stop), name="onceonly-holder", daemon=True
        ).start()
        return self._map

    def close(self) -> None:
        """Leave: remove the file when nothing is held, else leave it exact and let go of it (its lock
        goes: a reconcile pass takes over what it holds)."""
        with self._lock:
            if self._stop is not None:
                self._stop.set()
            fd, self._fd = self._fd, None
            m, self._map = self._map, None
            self._n, self._lo, self._hi = 0, math.inf, -math.inf
            if fd is None or m is None:
                return
            leases = list(self._leases.values())
            if not leases and self.path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
            else:
                m[_LO : _LO + _NUM] = _number(min(leases))
                m[_N : _N + _CNT] = _count(len(leases))
            m.close()
            os.close(fd)

    def forget(self) -> None:
        """In a forked child: the file and its leases are the parent's. Close our copy of the descriptor
        (the parent's lock stays: it belongs to the parent's open file) and start afresh."""
        self._lock = threading.Lock()
        self._leases = {}
        self._n, self._lo, self._hi = 0, math.inf, -math.inf
        self._stop = None  # the parent's thread did not come with the fork
        if self._map is not None:
            with contextlib.suppress(Exception):
                self._map.close()
        self._map = None
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
        self._fd = None
        self.path = None


def _refresh_until_stopped(ref: weakref.ReferenceType[Holder], stop: threading.Event) -> None:
    """A holder's refresh thread. Holds it only while refreshing: a holder dropped unclosed still goes."""
    while True:
        holder = ref()
        if holder is None:
            return
        every = holder._every
        del holder
        if stop.wait(every):
            return
        holder = ref()
        if holder is None:
            return
        holder.refresh()
        del holder


# --- the reader side: a reconcile pass ------------------------------------------------------------


@dataclass
class Survey:
    """What a pass must read, from the holders' files at ``before``.

    ``needed``: read the held records (else the pass reads only the states without a lease).
    ``why``: what made it needed. ``stale``: dead holders' files to remove after a complete pass that
    read the held records.
    """

    directory: Path
    before: float
    needed: bool = False
    why: list[str] = field(default_factory=list)
    stale: list[Path] = field(default_factory=list)

    def done(self) -> None:
        """The pass read what it had to, to the end: remove what it made stale and stamp a full pass."""
        if not self.needed:
            return
        for path in self.stale:
            _remove(path)
        with contextlib.suppress(OSError):
            self.directory.mkdir(parents=True, exist_ok=True)
            temp = self.directory / f"{FULL_PASS}.{os.getpid()}.{secrets.token_hex(4)}"
            temp.write_text(json.dumps({"at": self.before}) + "\n")
            os.replace(temp, self.directory / FULL_PASS)


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _read(fd: int) -> dict[str, object] | None:
    """The file's JSON; read until two reads agree (a read racing a write could see half of it)."""
    last = None
    for _ in range(5):
        data = os.pread(fd, 4096, 0)
        if data == last:
            try:
                parsed = json.loads(data)
            except ValueError:
                return None
            return parsed if isinstance(parsed, dict) else None
        last = data
    return None


def _time(value: object, missing: float) -> float | None:
    """A time from a holder's file: ``null`` → ``missing``; anything but a finite number → None."""
    if value is None:
        return missing
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def survey(directory: Path, before: float, full_every: float | None) -> Survey:
    """Look at every holder of leases on the ledger, at time ``before`` (the ledger's clock).

    Removes at once the files of dead holders that held nothing, and half-made files of dead ones.
    """
    out = Survey(directory, before)
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        out.needed = True
        out.why.append("no full pass on record")
        return out
    if full_every is not None:
        try:
            stamp = json.loads((directory / FULL_PASS).read_text())
            at = _time(stamp.get("at") if isinstance(stamp, dict) else None, -math.inf)
        except (OSError, ValueError):
            at = None
        if at is None or at + full_every <= before or at > before:
            out.needed = True
            out.why.append("a full pass is due")
    for name in names:
        if name == FULL_PASS or name.startswith(f"{FULL_PASS}."):
            continue
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # removed since the listing (its holder left, or another pass removed it)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                alive = False
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise
                alive = True
            if name.startswith("."):
                if not alive:
                    _remove(path)  # a holder that died while making its file: it held nothing yet
                continue
            data = _read(fd)
        finally:
            os.close(fd)
        count = lo = hi = None
        if data is not None:
            count = data.get("held")
            lo, hi = _time(data.get("lo"), math.inf), _time(data.get("hi"), -math.inf)
        if type(count) is not int or count < 0 or lo is None or hi is None:
            out.needed = True
            out.why.append(f"{name}: unreadable")
            if not alive:
                out.stale.append(path)
            continue
        if alive:
            if count and lo < before:
                out.needed = True
                out.why.append(f"{name}: a lease ran out while its holder lives")
        elif not count:
            _remove(path)  # died holding nothing
        elif lo < before:
            out.needed = True
            out.why.append(f"{name}: its holder died holding leases")
            if hi < before:
                out.stale.append(path)
        # else: dead, and none of its leases has run out yet: a later pass reads them.
    return out
