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

A pass removes files there, so it trusts the directory only as far as it must. It follows no link to
it, and works in it through one descriptor opened without following one (a swap after the check
moves nothing); it opens only regular files that bear a holder's name, without blocking, and removes
only those. A directory that another user can write (group or world writable, or owned by someone
other than this user, root or the ledger's owner) could hide a dead holder from it: the pass then
reads the held records every time, changes nothing there, and says why.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import mmap
import os
import re
import secrets
import socket
import stat
import threading
import weakref
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

__all__ = ["Holder", "Survey", "UnsafeOwnersDir", "owners_dir", "survey"]

log = logging.getLogger("onceonly.stores.sqlite")

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
# The names of the files a pass opens or removes, as _holder_name makes them: a holder's file
# (host-pid-token), and the same with a dot and ".new" while it is made. Any other name is not opened.
_HOLDER = r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,39}-[0-9]{1,10}-[0-9a-f]{8}|-[0-9]{1,10}-[0-9a-f]{8}"
_IS_HOLDER = re.compile(_HOLDER).fullmatch
_IS_MAKING = re.compile(rf"\.(?:{_HOLDER})\.new").fullmatch
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A file planted there may be a FIFO or a device: never block on opening it, never follow a link.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAKE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeOwnersDir(OSError):
    """``<ledger>-owners`` is a symbolic link or not a directory: refused, as a pass removes files in it."""


def _holder_name() -> str:
    """This process's file name: the host (the characters a host name should have), the pid, a token."""
    host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname()[:40]).lstrip(".")
    return f"{host}-{os.getpid()}-{secrets.token_hex(4)}"


def _open_dir(directory: Path, *, make: bool = False) -> int:
    """The owners directory as a descriptor, opened without following a link (made first if ``make``).

    Raises:
        UnsafeOwnersDir: it is a link, or not a directory.
        OSError: it cannot be opened (missing: FileNotFoundError).
    """
    if make:
        with contextlib.suppress(FileExistsError):
            os.mkdir(directory, 0o755)
    try:
        return os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        what = "a symbolic link" if directory.is_symlink() else "not a directory"
        raise UnsafeOwnersDir(
            f"{directory} is {what}: a SQLite ledger keeps who holds its leases in a directory of its own "
            "beside the ledger file, and follows no link there (a reconcile pass removes files in it); "
            f"remove {directory.name} (onceonly makes the directory again)",
        ) from exc


def _distrust(fd: int, directory: Path) -> str | None:
    """Why the directory (open as ``fd``) may hold what its holders did not write: another user can
    write it. None when only its owner can, and the owner is this user, root or the ledger's owner."""
    st = os.fstat(fd)
    if st.st_mode & 0o022:
        return (
            f"{directory.name} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}): they could "
            f"remove a dead holder's file there, so it is not used to skip the held records; chmod go-w "
            f"{directory} (one user per ledger), or remove it while no process uses the ledger"
        )
    owners = {os.geteuid(), 0}
    with contextlib.suppress(OSError):
        owners.add(os.stat(directory.with_name(directory.name.removesuffix("-owners"))).st_uid)
    if st.st_uid not in owners:
        return (
            f"{directory.name} belongs to uid {st.st_uid}, neither this user nor the ledger's owner: it is "
            f"not used to skip the held records; remove {directory} while no process uses the ledger"
        )
    return None


def _open_regular(dir_fd: int, name: str) -> int | None:
    """A regular file of the directory, opened to read without blocking or following a link; None
    for anything else (a FIFO, a device, a link, a directory) or a file gone since the listing."""
    try:
        fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError:
        return None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return fd


def _remove(dir_fd: int, name: str) -> None:
    """Remove a file of ours: a regular file, by its name in the directory we looked at."""
    with contextlib.suppress(OSError):  # gone already, or not ours to remove: it stays
        if stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            os.unlink(name, dir_fd=dir_fd)


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
        "__weakref__", "_dir", "_every", "_fd", "_hi", "_leases", "_lo", "_lock", "_map", "_n", "_stop",
        "directory", "path",
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
        self._dir: int | None = None  # the directory, while the file exists: its names are made through it
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
        # Once per process and ledger, so the checks cost a call nothing: no link followed, and every
        # name made through the directory's descriptor (a swap of the directory after the check moves
        # nothing of ours).
        dir_fd = _open_dir(self.directory, make=True)
        try:
            why = _distrust(dir_fd, self.directory)
            if why is not None:
                log.warning("onceonly: %s", why)
            name = _holder_name()
            temp = f".{name}.new"
            since = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            tail = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since})[1:]
            text = b"".join((_HEAD, _count(0), b', "lo": ', _NULL, b', "hi": ', _NULL, b", ", tail.encode(), b"\n"))
            fd = os.open(temp, _MAKE_FLAGS, 0o644, dir_fd=dir_fd)
        except BaseException:
            os.close(dir_fd)
            raise
        try:
            # Locked before it has its name: a surveyor never sees the file unlocked while we live.
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, text)
            self._map = mmap.mmap(fd, len(text))
            os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            if self._map is not None:
                self._map.close()
                self._map = None
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            os.close(dir_fd)
            raise
        self._fd, self._dir = fd, dir_fd
        self.path = self.directory / name
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
            dir_fd, self._dir = self._dir, None
            m, self._map = self._map, None
            self._n, self._lo, self._hi = 0, math.inf, -math.inf
            if fd is None or dir_fd is None or m is None:
                return
            leases = list(self._leases.values())
            if not leases and self.path is not None:
                with contextlib.suppress(OSError):
                    os.unlink(self.path.name, dir_fd=dir_fd)
            else:
                m[_LO : _LO + _NUM] = _number(min(leases))
                m[_N : _N + _CNT] = _count(len(leases))
            m.close()
            os.close(fd)
            os.close(dir_fd)

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
        for fd in (self._fd, self._dir):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._dir = None
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
    ``why``: what made it needed. ``stale``: names of dead holders' files to remove after a complete
    pass that read the held records. ``trusted``: the directory may be changed (False: a link, or
    another user can write it; the pass reads the held records and changes nothing there).
    """

    directory: Path
    before: float
    needed: bool = False
    why: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)
    trusted: bool = True
    identity: tuple[int, int] | None = None  # (device, inode) of the directory looked at

    def distrust(self, why: str) -> Survey:
        """The directory cannot be relied on: read the held records, change nothing there, say why."""
        self.needed, self.trusted = True, False
        self.why.append(why)
        log.warning("onceonly: %s", why)
        return self

    def done(self) -> None:
        """The pass read what it had to, to the end: remove what it made stale and stamp a full pass."""
        if not self.needed or not self.trusted:
            return
        try:
            dir_fd = _open_dir(self.directory, make=True)
        except OSError:
            return  # a link or a file there now: the next pass says so
        try:
            st = os.fstat(dir_fd)
            if _distrust(dir_fd, self.directory) is not None:
                return
            if self.identity is not None and self.identity != (st.st_dev, st.st_ino):
                return  # another directory under that name since the survey: its files are not the ones seen
            for name in self.stale:
                _remove(dir_fd, name)
            with contextlib.suppress(OSError):
                _write_stamp(dir_fd, self.before)
        finally:
            os.close(dir_fd)


def _write_stamp(dir_fd: int, at: float) -> None:
    temp = f"{FULL_PASS}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(temp, _MAKE_FLAGS, 0o644, dir_fd=dir_fd)
    try:
        os.write(fd, (json.dumps({"at": at}) + "\n").encode())
    finally:
        os.close(fd)
    try:
        os.replace(temp, FULL_PASS, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        os.unlink(temp, dir_fd=dir_fd)
        raise


def _read_stamp(dir_fd: int) -> float | None:
    """The time of the last full pass; -inf when none is on record, None when the stamp is unreadable."""
    fd = _open_regular(dir_fd, FULL_PASS)
    if fd is None:
        return None
    try:
        stamp = _read(fd)
    finally:
        os.close(fd)
    return None if stamp is None else _time(stamp.get("at"), -math.inf)


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
    Opens nothing but regular files with a holder's name, and none in a directory another user can
    write (or reached through a link): the pass then reads the held records.
    """
    out = Survey(directory, before)
    try:
        dir_fd = _open_dir(directory)
    except FileNotFoundError:
        out.needed = True
        out.why.append("no full pass on record")
        return out
    except OSError as exc:
        return out.distrust(str(exc) if isinstance(exc, UnsafeOwnersDir) else f"{directory.name}: {exc}")
    try:
        why = _distrust(dir_fd, directory)
        if why is not None:
            return out.distrust(why)
        st = os.fstat(dir_fd)
        out.identity = (st.st_dev, st.st_ino)
        if full_every is not None:
            at = _read_stamp(dir_fd)
            if at is None or at + full_every <= before or at > before:
                out.needed = True
                out.why.append("a full pass is due")
        with os.scandir(dir_fd) as entries:
            # d_type from the listing: a FIFO, a link or a directory is passed over without a system call.
            names = sorted(e.name for e in entries if e.is_file(follow_symlinks=False))
        for name in names:
            if _IS_HOLDER(name):
                _look(out, dir_fd, name)
            elif _IS_MAKING(name) and (fd := _open_regular(dir_fd, name)) is not None:
                try:
                    if not _locked(fd):
                        _remove(dir_fd, name)  # a holder that died while making its file: it held nothing yet
                finally:
                    os.close(fd)
            # else: the stamp, or a name this module never writes: not opened, never removed.
    finally:
        os.close(dir_fd)
    return out


def _locked(fd: int) -> bool:
    """Does a live process hold the file's lock? (Taking a shared one, without waiting, tells.)"""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return True
    return False


def _look(out: Survey, dir_fd: int, name: str) -> None:
    """One holder's file: does it make the held records needed, and may it go?"""
    fd = _open_regular(dir_fd, name)
    if fd is None:
        return  # removed since the listing (its holder left, or another pass removed it), or not a file
    try:
        alive = _locked(fd)
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
            out.stale.append(name)
        return
    if alive:
        if count and lo < out.before:
            out.needed = True
            out.why.append(f"{name}: a lease ran out while its holder lives")
    elif not count:
        _remove(dir_fd, name)  # died holding nothing
    elif lo < out.before:
        out.needed = True
        out.why.append(f"{name}: its holder died holding leases")
        if hi < out.before:
            out.stale.append(name)
    # else: dead, and none of its leases has run out yet: a later pass reads them.
