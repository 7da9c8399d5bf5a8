"""Random bytes through the addon's real hooks (mitmproxy's ``tflow``/``taddons``): nothing raises
out of a hook, traffic is never altered when nothing was injected, and every call gets a row.

What a hook may meet: request bodies that are not JSON or not objects, any content-type, any
content-encoding, responses cut anywhere, errors at any point. A hook that raises would make
mitmproxy log a traceback and could leave the call without a row; that must never happen.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mitmproxy.test import taddons, tflow, tutils

ADDON_PATH = Path(__file__).resolve().parents[1] / "addons" / "polar_capture.py"


def load_addon_class():
    spec = importlib.util.spec_from_file_location("polar_capture_fuzz", ADDON_PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.PolarCapture


PolarCapture = load_addon_class()


@contextlib.contextmanager
def addon_context(addon):
    """``taddons.context`` that also removes its master's log handler afterwards (taddons never does:
    a stale handler would post log records to the closed event loop of an earlier example)."""
    with taddons.context(addon) as tctx:
        try:
            yield tctx
        finally:
            handler = getattr(tctx.master, "_legacy_log_events", None)
            if handler is not None:
                handler.uninstall()

paths = st.sampled_from(["/v1/chat/completions", "/v1/responses", "/v1/messages", "/x/v1/chat/completions?a=b"])
json_bodies = st.dictionaries(st.sampled_from(["model", "messages", "stream", "input", "logprobs",
                                               "return_token_ids", "include", "top_logprobs"]),
                              st.none() | st.booleans() | st.integers() | st.text(max_size=5)
                              | st.lists(st.integers(), max_size=3), max_size=6)
request_bodies = st.one_of(st.binary(max_size=200), json_bodies.map(lambda d: json.dumps(d).encode()),
                           st.just(b'{"model": "m", "stream": true, "messages": []}'))
content_types = st.sampled_from(["text/event-stream", "application/json", "text/plain", "",
                                 "TEXT/EVENT-STREAM; charset=utf-8"])
encodings = st.sampled_from(["", "gzip", "br", "deflate", "identity", "bogus"])
chunk_lists = st.lists(st.binary(max_size=120) | st.sampled_from(
    [b"data: [DONE]\n\n", b'data: {"choices": [{"index": 0, "delta": {"content": "x"}}]}\n\n',
     b"event: message_stop\ndata: {}\n\n", b"\r\n\r\n"]), max_size=8)
flows = st.lists(st.fixed_dictionaries({
    "path": paths, "body": request_bodies, "ctype": content_types, "enc": encodings, "chunks": chunk_lists,
    "ending": st.sampled_from(["response", "error-client", "error-upstream", "error-after-headers"]),
    "status": st.sampled_from([200, 200, 400, 500]),
}), min_size=1, max_size=4)


def drive(addon, tctx, spec) -> tuple[list[bytes], list[bytes] | None]:
    """One flow through the hooks in mitmproxy's order; returns (chunks sent, chunks the client got,
    None when the addon did not tap the stream)."""
    loop = tctx.master.event_loop
    f = tflow.tflow(req=tutils.treq(method=b"POST", path=spec["path"].encode(), content=spec["body"]), resp=False)
    addon.requestheaders(f)
    loop.run_until_complete(addon.request(f))
    if spec["ending"] == "error-client":
        f.error = tflow.terr("client disconnected")
        addon.error(f)
        return [], None
    headers = {"content-type": spec["ctype"]}
    if spec["enc"]:
        headers["content-encoding"] = spec["enc"]
    f.response = tutils.tresp(status_code=spec["status"], headers=tuple((k.encode(), v.encode()) for k, v in
                                                                        headers.items()), content=b"")
    addon.responseheaders(f)
    sent, got = list(spec["chunks"]), None
    stream = f.response.stream
    if callable(stream):
        got = []
        for c in [*sent, b""]:
            out = stream(c)
            got.extend(out if isinstance(out, list) else [out])
        if spec["ending"] == "error-after-headers":
            f.error = tflow.terr("server disconnected")
            addon.error(f)
            return sent, got
    else:
        f.response.raw_content = b"".join(sent)
    if spec["ending"] == "error-upstream":
        f.error = tflow.terr("server closed connection")
        addon.error(f)
    else:
        loop.run_until_complete(addon.response(f))
    return sent, got


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=flows)
def test_fuzz_hooks_never_raise_and_every_call_has_a_row(specs: list[dict]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        addon = PolarCapture()
        with addon_context(addon) as tctx:
            tctx.configure(addon, polar_out=tmp, polar_flush_seconds="60", polar_inject=False)
            for spec in specs:
                sent, got = drive(addon, tctx, spec)
                if got is not None and spec["enc"] in ("", "identity"):
                    assert b"".join(got) == b"".join(sent)  # nothing injected: the upstream's bytes
            addon.done()
        rows = [r for p in sorted(Path(tmp, "calls").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
        assert len(rows) == len(specs)
        for row in rows:
            assert row["status"] in ("ok", "upstream_error", "client_disconnected", "proxy_error")
            if row["status"] == "proxy_error":
                assert "hook failed" not in (row["error"] or ""), row["error"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(specs=flows)
def test_fuzz_hooks_with_injection(specs: list[dict]) -> None:
    """Injection on: request bodies get rewritten, stream events stripped; still no hook raises."""
    with tempfile.TemporaryDirectory() as tmp:
        addon = PolarCapture()
        with addon_context(addon) as tctx:
            tctx.configure(addon, polar_out=tmp, polar_flush_seconds="60", polar_inject=True)
            for spec in specs:
                drive(addon, tctx, spec)
            addon.done()
        rows = [r for p in sorted(Path(tmp, "calls").glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
        assert len(rows) == len(specs)
        assert not any("hook failed" in (r["error"] or "") for r in rows)

