"""A bounded hand-over queue between a producer that must not block and one consumer thread.

Why its own piece: the proxy hands finished calls to the row worker's sender thread, and the row
worker hands rows to its part writer; both need the same rules - a full queue drops and counts
(never blocks traffic) unless the producer may wait, and a shutdown marker that gets in even when
the queue is full, within a deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

log = logging.getLogger("polar_capture")

#: What :meth:`HandOff.get` returns once :meth:`HandOff.finish` got through.
STOP = object()
#: A full queue's drops are logged at most once per this many seconds (after the first).
DROP_REPEAT_S = 60.0


class HandOff:
    def __init__(self, maxsize: int, what: str) -> None:
        self._queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self._lock = threading.Lock()
        self.what = what
        self.dropped = 0
        self._said_at = 0.0

    def put(self, item: Any, block: bool = False) -> bool:
        """Queue ``item``. Without ``block`` never waits: False (a counted, logged drop) when full."""
        try:
            self._queue.put(item, block=block)
            return True
        except queue.Full:
            now = time.monotonic()
            with self._lock:
                self.dropped += 1
                n = self.dropped
                # the first drop, then a line a minute at most: an overload at 100 calls/s wrote
                # 100 lines a second (the shutdown line gives the total)
                say = n == 1 or now - self._said_at >= DROP_REPEAT_S
                if say:
                    self._said_at = now
            if say:
                log.warning("polar_capture: %s queue full, call dropped (%d dropped so far; said again at most "
                            "once a minute)", self.what, n)
            return False

    def get(self, timeout: float | None = None) -> Any:
        """The next item (or :data:`STOP`); raises ``queue.Empty`` after ``timeout`` seconds."""
        return self._queue.get(timeout=timeout)

    def empty(self) -> bool:
        return self._queue.empty()

    def finish(self, deadline: float, consumer: threading.Thread) -> bool:
        """Queue :data:`STOP` behind what is waiting; False (logged) if it does not get in before
        ``deadline`` (``time.monotonic``) or the consumer has died."""
        while True:
            try:
                self._queue.put(STOP, timeout=0.5)
                return True
            except queue.Full:
                if time.monotonic() > deadline or not consumer.is_alive():
                    log.error("polar_capture: %s queue stuck at shutdown; %d calls not written", self.what,
                              self._queue.qsize())
                    return False
