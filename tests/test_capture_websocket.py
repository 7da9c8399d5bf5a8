"""Model calls over a WebSocket (Codex's Responses WebSocket transport) through the real mitmdump.

The capture records HTTP and SSE only. What a user must be able to rely on: a session whose
handshake the upstream accepts is not lost unseen (a ``proxy_error`` row with its rollout, one log
line), a handshake the upstream refuses - vLLM has no such endpoint, and Codex then falls back to
HTTP - leaves no row, and other WebSockets pass untouched.
"""

from __future__ import annotations

import base64
import signal

from tests.support.mitm import mitm, read_calls, rid, start_mitm
from tests.support.ws_upstream import WsClient, WsUpstream

WARNING = "carries model calls, which the capture does not record"


def _auth(rollout: str) -> bytes:
    return b"Basic " + base64.b64encode(f"{rollout}:pw-{rollout}".encode())


def test_an_accepted_websocket_session_gets_an_error_row_and_one_log_line(tmp_path):
    rollouts = [rid(), rid()]
    with WsUpstream() as up:
        with mitm(tmp_path) as m:
            for rollout in rollouts:
                client = WsClient(m.port, up.port, _auth(rollout))
                assert client.status == 101
                assert client.call({"model": "m", "input": "hi"})["type"] == "response.completed"
                assert client.call({"model": "m", "input": "again"})["response"]["id"] == f"resp_{len(up.received)}"
                client.close()
        log = m.proc.log()
    assert len(up.received) == 4  # the messages reached the upstream as sent
    rows = read_calls(m.out_dir)
    assert sorted(r["rollout_id"] for r in rows) == sorted(rollouts)
    for row in rows:
        assert (row["status"], row["api"], row["method"], row["http_status"]) == (
            "proxy_error", "openai.responses", "GET", 101)
        assert "over a WebSocket are not recorded" in row["error"]
        assert "(2 messages from the client)" in row["error"]
        assert row["request_json"] is None and row["prompt_token_ids"] is None
        assert "pw-" not in repr(row)  # the proxy password stays out of the row
    assert log.count(WARNING) == 1, log  # once per proxy, not per session


def test_a_session_open_at_shutdown_gets_its_row(tmp_path):
    rollout = rid()
    with WsUpstream() as up:
        m = start_mitm(tmp_path)
        try:
            client = WsClient(m.port, up.port, _auth(rollout))
            client.call({"model": "m", "input": "hi"})
            assert m.stop(signal.SIGTERM) == 0
        finally:
            m.stop()
            client.sock.close()
    (row,) = read_calls(m.out_dir)
    assert row["rollout_id"] == rollout and row["status"] == "proxy_error"
    assert "over a WebSocket are not recorded" in row["error"]


def test_a_refused_handshake_and_other_websockets_leave_no_row(tmp_path):
    with WsUpstream(accept=False) as refusing, WsUpstream() as other:
        with mitm(tmp_path) as m:
            client = WsClient(m.port, refusing.port, _auth(rid()))
            assert client.rejected and client.status == 404  # the harness falls back to HTTP: nothing lost
            client.sock.close()
            chat = WsClient(m.port, other.port, _auth(rid()), path="/socket")  # no model endpoint
            assert chat.call({"hello": 1})["type"] == "response.completed"
            chat.close()
        log = m.proc.log()
    assert read_calls(m.out_dir) == []
    assert WARNING not in log
