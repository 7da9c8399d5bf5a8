"""Secrets and file modes: what a run writes must hold no credential and be readable by its owner only.

Every kind of secret a harness sends goes through the real ``mitmdump`` + addon in regular mode
(the way harnesses use it): proxy credentials in ``Proxy-Authorization`` (absolute-form requests
carry it on every request), an OpenAI bearer token, an Anthropic ``x-api-key``, a key echoed in
the prompt and one sent in a request field named ``api_key``. Then every byte of every output file
(parts, temporary files, the proxy's own log) is searched for each of them, in plain and base64.
"""

from __future__ import annotations

import base64
import stat
import time
import uuid
from pathlib import Path

import httpx

from tests.support.capture_faults import fault_upstream
from tests.support.mitm import read_calls, start_mitm

BEARER = "sk-proj-SECRETbearer-7f3a9c"
X_API_KEY = "sk-ant-SECRETxapikey-42d1"
PROXY_PASS = "proxySECRETpass-91b2"
BODY_KEY = "SECRETbodyfield-5c6d"


def _secrets(rollout: str) -> list[bytes]:
    basic = base64.b64encode(f"{rollout}:{PROXY_PASS}".encode())
    return [s.encode() for s in (BEARER, X_API_KEY, PROXY_PASS, BODY_KEY)] + [basic]


def test_no_credential_in_any_output_and_owner_only_modes(tmp_path: Path) -> None:
    rollout = f"sec-{uuid.uuid4().hex[:8]}"
    with fault_upstream() as (base, received):
        m = start_mitm(tmp_path, options={"polar_flush_seconds": "0.2"})
        try:
            proxy = f"http://{rollout}:{PROXY_PASS}@127.0.0.1:{m.port}"
            with httpx.Client(proxy=proxy, timeout=30) as c:
                calls = [
                    ("/v1/chat/completions", {"authorization": f"Bearer {BEARER}"},
                     {"model": "ok", "messages": [{"role": "user", "content": f"my key is {BEARER}"}]}),
                    ("/v1/chat/completions", {"authorization": f"Bearer {BEARER}"},
                     {"model": "ok-stream", "stream": True, "api_key": BODY_KEY, "messages": []}),
                    ("/v1/messages", {"x-api-key": X_API_KEY},
                     {"model": "ok", "max_tokens": 4, "messages": [{"role": "user", "content": X_API_KEY}]}),
                    ("/v1/chat/completions", {"authorization": f"Bearer {BEARER}"},
                     {"model": "fault-500", "messages": []}),
                ]
                for path, headers, body in calls:
                    c.post(base + path, json=body, headers=headers)
                # non-model traffic through the same proxy with the same credentials
                c.get(base + "/v1/models", headers={"authorization": f"Bearer {BEARER}"})
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and len(read_calls(m.out_dir)) < len(calls):
                time.sleep(0.1)  # polling for the rows, with a deadline
        finally:
            m.stop()

    rows = read_calls(m.out_dir)
    assert len(rows) == len(calls) and {r["rollout_id"] for r in rows} == {rollout}
    assert any("[REDACTED]" in (r["request_json"] or "") for r in rows)  # the echoed key was there, replaced

    # proxy credentials are for the proxy: they never reach the upstream
    for _path, headers, _body in received:
        assert not any(k.lower() == "proxy-authorization" for k in headers), headers

    files = [p for p in m.out_dir.rglob("*") if p.is_file()] + [m.proc.log_path]
    assert any(p.suffix == ".parquet" for p in files)
    for f in files:
        data = f.read_bytes()
        for secret in _secrets(rollout):
            assert secret not in data, f"{secret!r} found in {f}"

    for p in [m.out_dir, *m.out_dir.rglob("*")]:
        mode = stat.S_IMODE(p.stat().st_mode)
        if p.is_dir():
            assert mode == 0o700, f"{p} is {oct(mode)}"
        else:
            assert mode == 0o600, f"{p} is {oct(mode)}"


def test_with_mitmproxys_proxyauth_the_rollout_still_comes_from_the_credentials(tmp_path: Path) -> None:
    """`--set proxyauth=...` (for clients that send credentials only after a 407) made mitmproxy
    remove `Proxy-Authorization` before the addon saw it: every row lost its rollout, and the 407
    itself was recorded as a failed model call."""
    from tests.support.mitm import poll, rows_of

    rollout = f"pa-{uuid.uuid4().hex[:8]}"
    with fault_upstream() as (base, received):
        m = start_mitm(tmp_path, options={"polar_flush_seconds": "0.2", "proxyauth": f"{rollout}:{PROXY_PASS}"})
        try:
            body = {"model": "ok", "messages": [{"role": "user", "content": "hi"}]}
            with httpx.Client(proxy=f"http://127.0.0.1:{m.port}", timeout=30) as c:  # no credentials
                assert c.post(base + "/v1/chat/completions", json=body).status_code == 407
            with httpx.Client(proxy=f"http://{rollout}:{PROXY_PASS}@127.0.0.1:{m.port}", timeout=30) as c:
                assert c.post(base + "/v1/chat/completions", json=body).status_code == 200
            (row,) = poll(lambda: rows_of(m.out_dir, rollout), 30, "the row of the authenticated call")
            assert row["rollout_source"] == "proxy_auth" and row["status"] == "ok"
            assert len(read_calls(m.out_dir)) == 1  # the 407 was the proxy's answer, not a model call
            assert all("proxy-authorization" not in {k.lower() for k in h} for _, h, _ in received)
        finally:
            m.stop()
        for path in m.out_dir.rglob("*"):
            if path.is_file():
                assert PROXY_PASS.encode() not in path.read_bytes(), path


def test_identity_headers_never_reach_the_upstream_also_on_other_requests(tmp_path: Path) -> None:
    """`x-polar-rollout`/`x-polar-task` were removed from model calls only: a /tokenize, an
    embeddings call or a count_tokens request carried them to the server."""
    with fault_upstream() as (base, received):
        m = start_mitm(tmp_path, options={"polar_flush_seconds": "0.2"})
        try:
            with httpx.Client(proxy=f"http://r1:{PROXY_PASS}@127.0.0.1:{m.port}", timeout=30) as c:
                for path in ("/tokenize", "/v1/embeddings", "/v1/chat/completions"):
                    c.post(base + path, json={"model": "ok", "messages": [], "prompt": "x"},
                           headers={"x-polar-rollout": "r1", "x-polar-task": "t1"})
        finally:
            m.stop()
    assert [p for p, _, _ in received] == ["/tokenize", "/v1/embeddings", "/v1/chat/completions"]
    for path, headers, _ in received:
        names = {k.lower() for k in headers}
        assert not names & {"x-polar-rollout", "x-polar-task", "proxy-authorization"}, (path, names)


def test_a_credential_echoed_in_the_prompt_keeps_no_token_ids() -> None:
    """Scrubbed from the stored JSON, a key the client sent and also wrote into its prompt was still
    in the row's token ids (they decode to it) and so in the trajectories and the adapter. Such a
    call now keeps no ids; cookie values, a bearer token under any header name and the model
    field are scrubbed too."""
    import json as json_module

    from polar_train.capture import record
    from tests.support.capture_wire import WIRE

    key, cookie, custom = "sk-ECHOED-0123456789", "sess-COOKIE-abcdef", "tok-CUSTOM-987654"
    body = {"model": f"tiny-{key}", "messages": [{"role": "user", "content": f"use {key} and {cookie}, {custom}"}],
            "return_token_ids": True}
    state = record.CallState("openai.chat", "POST", "h", "/v1/chat/completions", "c", None, record.utcnow(),
                             "http://h", header_fields=[(b"authorization", f"Bearer {key}".encode()),
                                                        (b"cookie", f"session={cookie}; theme=dark".encode()),
                                                        (b"x-custom-auth", f"Bearer {custom}".encode()),
                                                        (b"x-polar-rollout", b"r1")])
    state.request_body = json_module.dumps(body).encode()
    state.request_unread = True
    state.response_body = WIRE["chat_inj"].encode()  # a reply with the server's token ids
    state.http_status = 200
    record.resolve_head(state, "x-polar-rollout", "x-polar-task", {})
    row = record.build_row(state, None)
    text = json_module.dumps(row, default=str)
    assert key not in text and cookie not in text and custom not in text
    assert row["prompt_token_ids"] is None and row["completion_token_ids"] is None and row["token_source"] == "none"
    assert row["status"] == "ok" and "credential the call carried" in row["error"]
    clean = dict(body, model="tiny", messages=[{"role": "user", "content": "hello"}])
    state2 = record.CallState("openai.chat", "POST", "h", "/v1/chat/completions", "c", None, record.utcnow(),
                              "http://h", header_fields=[(b"authorization", f"Bearer {key}".encode())])
    state2.request_body, state2.request_unread = json_module.dumps(clean).encode(), True
    state2.response_body, state2.http_status = WIRE["chat_inj"].encode(), 200
    record.resolve_head(state2, "x-polar-rollout", "x-polar-task", {})
    assert record.build_row(state2, None)["token_source"] == "server"  # a key not in the texts costs nothing
