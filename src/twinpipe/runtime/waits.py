"""How long a wait for a peer may take, and how one rank's failure reaches the ranks waiting for it.

**The limit.** Every twinpipe wait takes its limit from the one setting the user gave: the call's
own ``timeout=`` (``Pipeline``, ``reduce_dense_grads``, ``Balancer``, ...), else the limit in force
in this thread, else ``twinpipe.checks.DEFAULT_TIMEOUT``. ``Pipeline.step`` puts its pipeline's
``timeout`` in force for the step, so an expert all-to-all inside a stage waits as long as the
pipeline's messages; ``with limit(seconds):`` does the same for code run outside a pipeline.

**Failure notices.** A rank that fails in the middle of a step (its own exception, while its peers
wait for its messages) publishes one line in the default process group's store (the TCPStore of
torchrun and ``twinpipe.launch.run_local``) under every group its failure breaks, then closes its
gloo connections on them. A rank waiting on one of those groups, or inside a step of a pipeline
that uses one, gives up within about ``POLL`` seconds with ``PipelinePeerFailedError`` quoting the
group's first notice, instead of at its timeout. Waits that poll (shared memory, collectives) look
at the store only after ``POLL`` seconds without finishing, so a wait that finishes costs nothing
more; a gloo send or receive cannot be polled (a timed-out wait closes its connection), so it waits
as before and learns of the failure from the closed connection. A rank that dies, or hangs, without
a word is still found by the timeout. Keys are per group (``group.group_name``): a broken group
stays broken, and a new group (what the docs ask for after a mid-step failure) starts clean.
"""

from __future__ import annotations

import datetime
import time
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.distributed as dist

from twinpipe.checks import DEFAULT_TIMEOUT, checked_timeout
from twinpipe.runtime.errors import PipelinePeerFailedError

__all__ = ["POLL", "Scope", "limit", "entered", "enter", "leave", "current", "timeout_for", "note", "publish_failure", "notice",
           "Watch", "peer_failed", "poll"]

# Seconds between two looks at the store while a wait has not finished (also the slice of a gloo
# collective's wait). Read at each wait, so a test may shorten it to cross many slice boundaries.
POLL = 0.2
NOTICE_CHARS = 1500  # a notice is one line of an error message
_SEVER_TAG = 0x7FFF_FFF0  # a receive tag nothing else uses (twinpipe's own tags stay below 2**21)


class Scope:
    """A wait policy: the limit of the waits run under it, and the groups whose failure notices
    they heed (and that a failure under it breaks). ``Pipeline`` keeps one for all its steps; the
    groups of the collectives run inside a step (an EP group) join it (``note``)."""

    def __init__(self, timeout: float, groups=()):
        self.timeout = checked_timeout(timeout)
        self.moved = False  # whether a collective that moves data started since ``enter``
        self._groups: dict[str, object] = {}
        for group in groups:
            self.add(group)

    def add(self, group) -> None:
        if group is not None:
            self._groups.setdefault(_name(group), group)

    @property
    def groups(self) -> list:
        return list(self._groups.values())


_CURRENT: ContextVar[Scope | None] = ContextVar("twinpipe_wait_scope", default=None)


@contextmanager
def entered(scope: Scope):
    """Run the block under ``scope`` (in this thread, or this asyncio task)."""
    token = _CURRENT.set(scope)
    try:
        yield scope
    finally:
        _CURRENT.reset(token)


@contextmanager
def limit(timeout: float):
    """Every twinpipe wait in the block that has no ``timeout=`` of its own waits at most ``timeout``
    seconds (for example an ``MoEBlock`` called outside a pipeline)."""
    current = _CURRENT.get()
    scope = Scope(timeout, current.groups if current is not None else ())
    with entered(scope):
        yield scope


def current() -> Scope | None:
    """The scope in force in this thread, if any."""
    return _CURRENT.get()


def timeout_for(timeout=None, name: str = "timeout") -> float:
    """``timeout`` checked when given; else the limit in force; else ``DEFAULT_TIMEOUT``."""
    if timeout is not None:
        return checked_timeout(timeout, name)
    scope = _CURRENT.get()
    return scope.timeout if scope is not None else DEFAULT_TIMEOUT


def note(group, moved: bool = True) -> None:
    """Join ``group`` to the scope in force: a failure under it then breaks ``group`` too, and its
    waits heed ``group``'s notices. ``moved``: a collective that moves data starts on it now (a
    failure after it leaves the ranks half-way; a check that every rank raises alike does not)."""
    scope = _CURRENT.get()
    if scope is not None and group is not None:
        scope.add(group)
        scope.moved = scope.moved or moved


def _name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


def _key(group) -> str:
    return f"twinpipe/failed/{_name(group)}"


def _store():
    """The default process group's store, or None (no process group, or a store we cannot use)."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:
        return None


def publish_failure(message: str, groups) -> None:
    """Tell every rank of ``groups`` that this rank failed in the middle of its work (``message``:
    who failed, where, and the error), then close this rank's gloo connections on them, so that a
    peer blocked in a gloo send or receive with this rank fails at once too.

    The first notice of a group stays (later ones, such as the peers' own errors that follow from
    it, do not replace it). Call it only for failures that break the groups (messages half-way,
    ranks out of step), not for errors every rank raises alike before anything moved."""
    store, text = _store(), " ".join(str(message).split())[:NOTICE_CHARS]
    groups = list(groups)
    if store is not None:
        for group in groups:
            try:
                store.compare_set(_key(group), "", text)  # set unless a notice is already there
            except Exception:  # a store that is gone: the peers will time out
                pass
    for group in groups:
        _sever(group)


def _sever(group) -> None:
    """Close this rank's connections of ``group``'s gloo backend: gloo closes every connection of a
    group whose receive wait timed out, and the peers' pending sends and receives with this rank
    then fail with "Connection closed by peer" (checked by the tests on the torch in use)."""
    try:
        if group is None or group.size() < 2:
            return
        backend = group._get_backend(torch.device("cpu"))
        if type(backend).__name__ != "ProcessGroupGloo":
            return
        work = group.recv([torch.zeros(1)], (group.rank() + 1) % group.size(), _SEVER_TAG)
        work.wait(datetime.timedelta(milliseconds=1))
    except Exception:  # the expected timeout, or a group that is already gone
        pass


def notice(group=None) -> str | None:
    """The first failure published for ``group`` or for a group of the scope in force, or None.

    Does not wait (one store look-up per group)."""
    scope = _CURRENT.get()
    groups = ([group] if group is not None else []) + (scope.groups if scope is not None else [])
    if not groups:
        return None
    store = _store()
    if store is None:
        return None
    for g in groups:
        key = _key(g)
        try:
            if store.check([key]):
                return store.get(key).decode(errors="replace")
        except Exception:
            return None
    return None


def peer_failed(what: str, first: str) -> PipelinePeerFailedError:
    """The error of a wait given up because of ``first`` (a published notice)."""
    return PipelinePeerFailedError(f"{what}: stopped waiting, another rank failed: {first}", first)


class Watch:
    """Failure checks for a polling wait on ``group``: ``check(now)`` looks at the store once every
    ``POLL`` seconds (the first time ``POLL`` after the watch was made) and raises
    ``PipelinePeerFailedError`` when a notice is out."""

    __slots__ = ("group", "due")

    def __init__(self, group=None, now: float | None = None):
        self.group = group
        self.due = (time.monotonic() if now is None else now) + POLL

    def check(self, now: float, what) -> None:
        """``what``: the wait's name, or a function giving it (called only to raise)."""
        if now >= self.due:
            self.due = now + POLL
            first = notice(self.group)
            if first is not None:
                raise peer_failed(what if isinstance(what, str) else what(), first)


def poll(ready, deadline: float, what, group=None) -> bool:
    """Ask ``ready()`` until it says True (True) or the ``time.monotonic()`` ``deadline`` passes
    (False), yielding the core after a short spin and heeding ``group``'s failure notices (``Watch``;
    ``what``: the wait's name, or a function giving it). ``ready()`` is asked once more after the
    deadline: what arrived while this rank was not running is not late."""
    spins, watch = 0, None
    while not ready():
        spins += 1
        if spins > 64:  # after a short spin, yield the core (ranks may share cores)
            time.sleep(0 if spins < 256 else 2e-5)
            now = time.monotonic()
            if now > deadline:
                return bool(ready())
            if watch is None:
                watch = Watch(group, now)
            watch.check(now, what)
    return True


def enter(scope: Scope):
    """Put ``scope`` in force (until ``leave`` with what this returns), with ``moved`` cleared: a
    new stretch of work, such as one pipeline step."""
    scope.moved = False
    return _CURRENT.set(scope)


def leave(token) -> None:
    _CURRENT.reset(token)
