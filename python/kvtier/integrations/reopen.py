"""Reopening an engine connector's session after the sidecar went away (restarted, upgraded,
killed): the engine keeps serving without kvtier meanwhile, and picks the sidecar up again
without a restart of its own."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import grpc

from ..errors import KvtierError, SessionClosed
from ..session import Session

T = TypeVar("T")

#: How long one attempt to reach a sidecar that went away may take (seconds).
REOPEN_CONNECT_TIMEOUT_S = 2.0

logger = logging.getLogger(__name__)


class Reopener(Generic[T]):
    """Makes a connector's new session in the background. :meth:`poll` starts an ``attempt``
    (at most one per ``interval_s``, on a thread of its own, so the engine's loop never waits
    for the sidecar) and returns what a finished attempt made, for the caller to put in place;
    None while there is nothing new. ``attempt`` raises :class:`~kvtier.errors.KvtierError`
    or ``OSError`` (or ``retry_on``) when the sidecar is still away; it must not change the
    connector's state."""

    def __init__(self, attempt: Callable[[], T], interval_s: float, what: str,
                 retry_on: tuple[type[Exception], ...] = ()) -> None:
        if not interval_s > 0:
            raise ValueError(f"reconnect_interval_s = {interval_s}: give a positive number of seconds")
        self._attempt = attempt
        #: Seconds between attempts.
        self.interval_s = interval_s
        self._what = what
        self._retry_on = (KvtierError, OSError, *retry_on)
        self._next = 0.0
        self._thread: ThreadPoolExecutor | None = None
        self._inflight: Future[T] | None = None

    def poll(self) -> T | None:
        """What a finished attempt made, or None (then an attempt may have started)."""
        if self._inflight is None:
            now = time.monotonic()
            if now >= self._next:
                self._next = now + self.interval_s
                if self._thread is None:
                    self._thread = ThreadPoolExecutor(1, thread_name_prefix="kvtier-reopen")
                self._inflight = self._thread.submit(self._attempt)
            return None
        if not self._inflight.done():
            return None
        done, self._inflight = self._inflight, None
        try:
            made = done.result()
        except self._retry_on as e:
            logger.warning("kvtier: %s: the session to the sidecar ended; reopening failed (%s), next try in %.1f s",
                           self._what, e, self.interval_s)
            return None
        logger.info("kvtier: %s: session reopened", self._what)
        return made

    def replacement(self, session: Session | None) -> tuple[bool, T | None]:
        """For a connector's current ``session``: ``(True, None)`` while it is open;
        ``(False, None)`` with none yet, or while it has ended and no new one is ready (one is
        being made, see :meth:`poll`); ``(False, made)`` once one is, for the caller to put in
        place."""
        if session is None or not session.closed:
            return session is not None, None
        return False, self.poll()

    def shutdown(self, discard: Callable[[T], None]) -> None:
        """Waits for an attempt in flight and hands what it made to ``discard``."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None
        if self._inflight is not None and self._inflight.exception() is None:
            discard(self._inflight.result())
        self._inflight = None


def held_until(e: Exception, not_after: float) -> float | None:
    """For a store sent with ``not_after`` (:func:`time.time` seconds) that failed with ``e``:
    until when the memory it reads must stay unused, or None when it may be reused now. The
    sidecar publishes nothing of copies that end after ``not_after``, so only a call that
    failed before then without an answer saying how it ended (a cancel, a dropped connection,
    an error raised on this side) keeps its memory, until ``not_after``."""
    answered = isinstance(e, SessionClosed) or (isinstance(e, KvtierError) and e.code not in (
        grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.UNKNOWN))
    return None if answered or time.time() >= not_after else not_after


def discard_reopened(made: tuple[Any, ...]) -> None:
    """Closes a reopened session (and the pool made with it) that came too late to be used:
    ``(session, pool or None, ...)``, the handles after them registered in that session."""
    made[0].close()
    if made[1] is not None:
        made[1].close()
