"""What a reloading addon hands to its next instance: the calls in flight, the tunnels' credentials
and the row worker.

Why: mitmproxy reloads a script whose file changed (an editor's save, a ``git checkout``) by
calling ``done`` on the old instance and running the file again. The old ``done`` failed every call
in flight ("proxy shut down") though their streams went on, lost the credentials of open tunnels
(their later calls had no rollout) and closed the row worker on the event loop (every connection
stood still for seconds while it drained). This module is imported once per process (the script
is re-run, the package is not), so what it holds survives the reload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Live:
    """A running addon's state (see the module docstring)."""

    opts: Any
    writer: Any
    calls: dict
    connect_auth: dict


_pending: Live | None = None


def hand_over(live: Live) -> None:
    global _pending
    _pending = live


def take(live: Live | None = None) -> Live | None:
    """The state handed over and not taken yet (only ``live`` itself, when given), or None."""
    global _pending
    if _pending is None or (live is not None and _pending is not live):
        return None
    found, _pending = _pending, None
    return found
