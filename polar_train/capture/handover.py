"""What a reloading addon hands to its next instance: the calls in flight, the tunnels' credentials
and the row worker.

Why: mitmproxy reloads a script whose file changed (an editor's save, a ``git checkout``) by
calling ``done`` on the old instance and running the file again. The old ``done`` failed every call
in flight ("proxy shut down") though their streams went on, lost the credentials of open tunnels
(their later calls had no rollout) and closed the row worker on the event loop (every connection
stood still for seconds while it drained). This module is imported once per process (the script
is re-run, the package is not), so what it holds survives the reload.

A reload that fails (a syntax error in the saved file; a package updated under the running proxy,
whose old modules the new file would run with) leaves :class:`CaptureDown` in the addon's place:
model calls are refused, never forwarded unrecorded, until a capture addon loads again.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("polar_capture")


@dataclass
class Live:
    """A running addon's state (see the module docstring)."""

    opts: Any
    writer: Any
    calls: dict
    connect_auth: dict
    #: Model endpoints' WebSocket handshakes waiting for their answer.
    websockets: dict = field(default_factory=dict)
    #: Each open call's request as the addon left it (a later addon's change is seen at its answer).
    as_read: dict = field(default_factory=dict)


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


_heap_frozen = False


def freeze_startup_heap() -> None:
    """``gc.freeze()`` once per process, at the first start: again at each reload it pinned the old
    script's module and whatever garbage there was then, for good (~0.45 MB a reload under load)."""
    global _heap_frozen
    if not _heap_frozen:
        _heap_frozen = True
        gc.freeze()


_PACKAGE_ROOT = Path(__file__).resolve().parents[1]


#: Each loaded ``polar_train`` module file as first checked (at the addon's first load, or the
#: first reload after a late import): its mtime and content digest.
_SEEN: dict[str, tuple[float, str]] = {}


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def changed_modules() -> list[str]:
    """The loaded ``polar_train`` modules whose file content changed since they were first
    checked (``git pull`` while mitmdump runs): a reloaded script would run with the old modules,
    or fail to import a name only the new ones have. A file only touched (same content) is no
    change; a module imported after the last check is checked from the next one on."""
    changed = []
    for name, module in list(sys.modules.items()):
        path = getattr(module, "__file__", None)
        if not (name == "polar_train" or name.startswith("polar_train.")) or not path:
            continue
        try:
            mtime = os.stat(path).st_mtime
            seen = _SEEN.get(path)
            if seen is None:
                _SEEN[path] = (mtime, _digest(path))
            elif mtime != seen[0]:
                digest = _digest(path)
                if digest == seen[1]:
                    _SEEN[path] = (mtime, digest)
                else:
                    changed.append(str(Path(path).resolve().relative_to(_PACKAGE_ROOT.parent)))
        except (OSError, ValueError):
            continue
    return sorted(changed)


class CaptureDown:
    """Stands in for a capture addon whose reload failed (a syntax error in the saved file, a
    package updated under the running proxy): model calls get a 503 saying so, where they would
    otherwise reach the model server and go unrecorded, with nothing but a traceback in the log
    to tell. The addon that loads next removes it (:func:`stand_down`)."""

    name = "polar_capture_down"

    def __init__(self, detect_api: Callable[[str, str], str | None]) -> None:
        self._detect_api = detect_api

    def requestheaders(self, flow: Any) -> None:
        from mitmproxy import http

        forget_failed_load()  # (failed loads in a row: each left one, and the next said "already exists")
        if flow.response is not None or self._detect_api(flow.request.method, flow.request.path) is None:
            return
        body = {"error": {"message": DOWN_MESSAGE, "type": "polar_capture_unavailable", "param": None,
                          "code": 503}}
        flow.response = http.Response.make(503, json.dumps(body), {"content-type": "application/json"})


DOWN_MESSAGE = ("polar-train's capture addon failed to load after a change of its file, so this model call "
                "was refused instead of passing unrecorded; see mitmdump's log, fix the file or restart "
                "mitmdump (after updating polar-train, restart it: a reload keeps the old package)")


def _forget_failed_load(master: Any) -> None:
    """mitmproxy registers a script that failed to load as the addon ``None`` ("nonetype") and never
    removes it: the next failed load of the file then logged "An addon called 'nonetype' already
    exists" with a traceback of its own, on top of the real error."""
    lookup = getattr(master.addons, "lookup", None)
    if isinstance(lookup, dict) and "nonetype" in lookup and lookup["nonetype"] is None:
        del lookup["nonetype"]


def forget_failed_load() -> None:
    """:func:`_forget_failed_load` on the running mitmproxy, if there is one (a test imports the addon
    without a master)."""
    try:
        from mitmproxy import ctx

        _forget_failed_load(ctx.master)
    except Exception:  # noqa: BLE001 - no master: nothing to forget
        pass


def stand_in(master: Any, detect_api: Callable[[str, str], str | None]) -> None:
    """Refuse model calls until a capture addon loads again (once; logged as an error)."""
    _forget_failed_load(master)
    if master.addons.get(CaptureDown.name) is None:
        master.addons.add(CaptureDown(detect_api))
        log.error("polar_capture: %s", DOWN_MESSAGE.replace("this model call was refused", "model calls are refused"))


def stand_down(master: Any) -> None:
    """A capture addon loaded: model calls pass (and are recorded) again."""
    _forget_failed_load(master)
    down = master.addons.get(CaptureDown.name)
    if down is not None:
        master.addons.remove(down)
        log.warning("polar_capture: the capture addon loaded again; model calls are recorded again")
