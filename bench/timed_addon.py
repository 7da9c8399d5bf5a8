"""mitmproxy script for ``bench/proxy_overhead.py --hook-times``: the capture addon with a wall clock
around each of its hooks and each stream-tap call, on the proxy as it runs.

    mitmdump -s bench/timed_addon.py --set polar_out=... (POLAR_BENCH_HOOK_TIMES=FILE in the environment)

Why: in isolation a hook costs a few microseconds; inside mitmproxy, between its own work and with
the stream idle between events, the same code runs several times slower (cold caches), and the
benchmark's TTFB ratio is the sum of what runs before a call's first byte. This says which hook
that is. The timer adds ~0.3 us per hook. At shutdown the samples (ns, one list per hook; the tap
split into a call's first chunk and the rest, and inside them the strip of each whole event by its
name) are written as JSON to ``POLAR_BENCH_HOOK_TIMES``.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import time
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "polar_capture_timed", Path(__file__).resolve().parents[1] / "addons" / "polar_capture.py")
_capture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_capture)

from polar_train.capture.tap import StreamTap  # noqa: E402  (after the addon put the checkout on sys.path)

#: The hooks that run on a model call's path, in the order they run.
TIMED_HOOKS = ("requestheaders", "request", "responseheaders", "response")
SAMPLES: dict[str, list[int]] = {name: [] for name in (*TIMED_HOOKS, "tap first chunk", "tap later chunk")}


def _timed(name: str, hook):
    out = SAMPLES[name]
    clock = time.perf_counter_ns
    if inspect.iscoroutinefunction(hook):
        async def timed_async(flow) -> None:
            t0 = clock()
            await hook(flow)
            out.append(clock() - t0)
        return timed_async

    def timed(flow) -> None:
        t0 = clock()
        hook(flow)
        out.append(clock() - t0)
    return timed


def _timed_tap(call):
    first, later, clock = SAMPLES["tap first chunk"], SAMPLES["tap later chunk"], time.perf_counter_ns

    def timed(self, chunk: bytes):
        is_first = not self.seen_bytes
        t0 = clock()
        result = call(self, chunk)
        (first if is_first else later).append(clock() - t0)
        return result
    return timed


def _timed_rewrite(rewrite):
    """The tap's strip of each whole event, by event name ("data" for chat's unnamed events): which
    event of a stream costs what (inside the tap rows; an event spanning reads is timed once)."""
    clock = time.perf_counter_ns

    def timed(self, raw: bytes):
        t0 = clock()
        result = rewrite(self, raw)
        dt = clock() - t0
        name = raw[7:raw.find(b"\n")].decode("ascii", "replace") if raw.startswith(b"event: ") else "data"
        SAMPLES.setdefault(f"  strip {name}", []).append(dt)
        return result
    return timed


capture = _capture.PolarCapture()
for _name in TIMED_HOOKS:
    setattr(capture, _name, _timed(_name, getattr(capture, _name)))
StreamTap.__call__ = _timed_tap(StreamTap.__call__)
StreamTap._rewrite = _timed_rewrite(StreamTap._rewrite)


class WriteSamples:
    """Writes the samples once the capture addon has shut down (it comes first in ``addons``)."""

    def done(self) -> None:
        path = os.environ.get("POLAR_BENCH_HOOK_TIMES")
        if path:
            Path(path).write_text(json.dumps(SAMPLES))


addons = [capture, WriteSamples()]
