"""uvicorn's server, stopped the way every polar-train command stops.

Why: uvicorn stops on SIGINT and SIGTERM with a grace for open streams, and a second Ctrl-C is
meant to quit at once. Left as it is, (1) a SIGHUP (the terminal closed) is not one of its signals,
and the CLI's unwinding raised inside its event loop; (2) it took SIGINT and SIGTERM also where the
caller ignores them (``nohup``, a background job's SIGINT), and then exited 0; (3) its force quit
skips its wait loops but not the listening sockets' ``wait_closed`` (Python 3.12 waits there for
every open connection), so the streams ran on to the end of the grace all the same, and it skipped
the app's lifespan shutdown, whose cancelled task then logged a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Iterator
from types import FrameType

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

logger = logging.getLogger("uvicorn.error")


class StoppingServer(uvicorn.Server):
    """A SIGHUP stops it as SIGTERM does; a signal the caller ignores stays ignored; a second Ctrl-C
    during the grace cuts the open streams now and still ends the app cleanly."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.hung_up = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._cut = False
        self._old_hangup = signal.getsignal(signal.SIGHUP)

    def run(self, sockets=None) -> None:  # type: ignore[override]
        if self._old_hangup is not signal.SIG_IGN:
            signal.signal(signal.SIGHUP, self._hang_up)
        try:
            super().run(sockets)
        finally:
            if self._old_hangup is not signal.SIG_IGN:
                signal.signal(signal.SIGHUP,
                              self._old_hangup if self._old_hangup is not None else signal.SIG_DFL)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        ignored = [s for s in HANDLED_SIGNALS if signal.getsignal(s) is signal.SIG_IGN]
        with super().capture_signals():
            for s in ignored:  # (uvicorn restores them afterwards: ignored again, nothing re-raised)
                signal.signal(s, signal.SIG_IGN)
            yield

    def _hang_up(self, signum: int, frame: FrameType | None) -> None:
        self.hung_up = True
        self.handle_exit(signum, frame)  # (uvicorn raises it again once stopped, into this handler: a no-op)

    async def startup(self, sockets=None) -> None:  # type: ignore[override]
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        if self.force_exit and not self._cut and self._loop is not None:
            self._cut = True  # (a signal handler: the loop does the cutting, between its callbacks)
            try:
                self._loop.call_soon_threadsafe(self._cut_open_streams)
            except RuntimeError:  # the loop has closed: nothing is open any more
                pass

    def _cut_open_streams(self) -> None:
        tasks = list(self.server_state.tasks)
        if tasks:
            logger.warning("second Ctrl-C: cutting %d open request(s) now", len(tasks))
        for task in tasks:  # the handler's cancel closes its connection (its log line is dropped)
            task.cancel(msg="second Ctrl-C")

    async def shutdown(self, sockets=None) -> None:  # type: ignore[override]
        forced_before = self.force_exit
        await super().shutdown(sockets)
        # uvicorn skipped the app's lifespan shutdown where the force quit came before it got there;
        # where it came during that shutdown, uvicorn ran it already
        if forced_before or (self.force_exit and not self._lifespan_ended()):
            await self.lifespan.shutdown()

    def _lifespan_ended(self) -> bool:
        event = getattr(self.lifespan, "shutdown_event", None)
        return event is not None and event.is_set()
