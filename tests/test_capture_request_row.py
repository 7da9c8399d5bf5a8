"""The request as its row stores it (``polar_train.capture.request_row``): ``request_json`` is the
body as sent only where that says what the redacted, re-encoded request says, and ``request_hash``
of a retry matches its original's."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from hypothesis import given, settings
from hypothesis import strategies as st

from polar_train.capture.identity import Identity
from polar_train.capture import record
from polar_train.capture.json_members import compact
from polar_train.capture.redact import REDACTED, SECRET_KEYS, redacted_dumps, scrub
from polar_train.capture.request_row import VOLATILE_FIELDS, hash_as_sent, text_as_sent
from polar_train.capture.request_walk import walk_request

SECRET = "sk-live/Abc+123=="  # a bearer token as the headers carried it ("/": JSON may write it "\/")


def _row(body: bytes, secrets: frozenset[str] = frozenset({SECRET})) -> dict:
    state = record.CallState(api="openai.chat", method="POST", host="h", path="/v1/chat/completions",
                             client_conn_id="c", identity=None, started_at=datetime.now(timezone.utc),
                             upstream_base="http://h", secrets=set(secrets), request_body=body,
                             request_unread=True, http_status=200, response_body=b"{}")
    return record.build_row(state, None, attempts=record.AttemptCounter())


def _old_request_json(body: bytes, secrets: frozenset[str] = frozenset({SECRET})) -> str:
    """What the row held before it could take the body as sent: parsed, redacted, re-encoded, scrubbed."""
    return scrub(redacted_dumps(json.loads(body), compact), set(secrets))


_keys = st.sampled_from(sorted(SECRET_KEYS) + ["Authorization", "API_KEY", "x-Api-Key", "content", "role",
                                                "tools", "metadata", "user", "store", "/", "\u212aey",
                                                "OPENAI_API_KEY", "auth-token", "max_tokens", "db_password"])
_texts = st.text(max_size=12) | st.sampled_from([SECRET, f"token {SECRET} here", "a/b", "caf\u00e9 \u2014", "\u212a"])
_values = st.recursive(st.none() | st.booleans() | st.integers() | _texts,
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys | _texts, inner, max_size=3),
                       max_leaves=20)
_requests = st.dictionaries(_keys | st.sampled_from(["model", "messages", "input"]), _values, min_size=1, max_size=6)
_ENCODINGS = {
    "compact": lambda v: json.dumps(v, ensure_ascii=False, separators=(",", ":")),
    "ascii": lambda v: json.dumps(v),
    "indented": lambda v: json.dumps(v, ensure_ascii=False, indent=1),
    "slashes escaped": lambda v: json.dumps(v, ensure_ascii=False).replace("/", "\\/"),
    "spaced colons": lambda v: json.dumps(v, ensure_ascii=False, separators=(" , ", " : ")),
}


@settings(max_examples=400, deadline=None)
@given(request=_requests, encoding=st.sampled_from(sorted(_ENCODINGS)))
def test_request_json_says_what_the_redacted_reencoded_request_says(request, encoding) -> None:
    """Whichever way the client wrote it: the row's request JSON reads as the old re-encoded one,
    and neither the secret value nor a secret-named key's value is in it."""
    body = _ENCODINGS[encoding](request).encode()
    text = _row(body)["request_json"]
    assert json.loads(text) == json.loads(_old_request_json(body))
    assert SECRET not in text and SECRET.replace("/", "\\/") not in text


def test_a_compact_request_is_stored_as_sent_and_anything_doubtful_is_reencoded() -> None:
    request = {"model": "m", "input": [{"role": "user", "content": "caf\u00e9 \u2014 a\\b \"q\" /tmp"}],
               "tools": [{"name": "shell", "parameters": {"type": "object"}}], "stream": True}
    sent = json.dumps(request, ensure_ascii=False, separators=(", ", ": ")).encode()
    assert _row(sent)["request_json"] == sent.decode()  # every byte as the client wrote it
    for doubtful in ({**request, "Api_Key": "k"},  # a secret-named key, any case
                     {**request, "x": "\u212a"}):  # a Kelvin sign: lower case is not ASCII-only
        body = json.dumps(doubtful, ensure_ascii=False).encode()
        assert _row(body)["request_json"] == _old_request_json(body)
    for body in (json.dumps(request).encode(),  # \u escapes: a key could hide a letter
                 sent.replace(b"/tmp", b"\\/tmp"),  # \/: a secret could hide its slash
                 sent.replace(b'"stream": true', b'"api_key" :\t"k", "stream": true')):
        assert _row(body)["request_json"] == _old_request_json(body), body
    assert REDACTED in _row(sent.replace(b'"stream": true', b'"api_key" :\t"k", "stream": true'))["request_json"]


def test_text_as_sent_only_for_bodies_the_walk_read() -> None:
    assert walk_request(b'\xef\xbb\xbf{"a":1}') is None  # a byte-order mark: json.loads reads it, the row re-encodes
    assert json.loads(_row(b'\xef\xbb\xbf{"a":1}')["request_json"]) == {"a": 1}
    walked = walk_request(b' {"a": [1, 2]}\n')
    assert text_as_sent(walked) == ' {"a": [1, 2]}\n'


def test_hash_of_a_retry_matches_and_leaves_out_what_may_change() -> None:
    base = {"model": "m", "input": [{"role": "user", "content": "caf\u00e9"}], "tools": [], "stream": True,
            **{k: None for k in sorted(VOLATILE_FIELDS)}}
    h = hash_as_sent(walk_request(compact(base).encode()))
    assert h == _row(compact(base).encode())["request_hash"]
    for volatile in sorted(VOLATILE_FIELDS):
        retry = {**base, volatile: {"changed": [volatile, "\u2014"]}}
        assert hash_as_sent(walk_request(compact(retry).encode())) == h, volatile
    assert hash_as_sent(walk_request(compact({**base, "stream": False}).encode())) != h
    # Codex writes its client_metadata map in a random key order on each send: a retry is a retry
    first = compact({**base, "client_metadata": {"turn_id": "t1", "thread_id": "h1", "session_id": "s1"}})
    again = compact({**base, "client_metadata": {"session_id": "s1", "turn_id": "t1", "thread_id": "h1"}})
    assert first != again and hash_as_sent(walk_request(first.encode())) == hash_as_sent(walk_request(again.encode()))
    assert hash_as_sent(walk_request(compact({**base, "input": "hi"}).encode())) != h
    tail = compact(base)[:-1] + ',"x":"\u00e9"}'  # after the cut values, in a non-ASCII body
    assert hash_as_sent(walk_request(tail.encode())) != hash_as_sent(walk_request(tail.replace("\u00e9", "e").encode()))


def test_retries_through_the_row_worker_count_attempts() -> None:
    attempts = record.AttemptCounter()
    body = compact({"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": {"try": 1}}).encode()
    rows = []
    for b in (body, body, body.replace(b'"try":1', b'"try":2')):
        state = record.CallState(api="openai.chat", method="POST", host="h", path="/v1/chat/completions",
                                 client_conn_id="c", identity=Identity("r1", "header"),
                                 started_at=datetime.now(timezone.utc), upstream_base="http://h", request_body=b,
                                 request_unread=True)
        rows.append(record.build_row(state, None, attempts=attempts))
    assert [r["attempt"] for r in rows] == [1, 2, 3]
    assert len({r["request_hash"] for r in rows}) == 1
    # without a rollout there is nothing to count on: a group's sessions all send one first prompt
    assert attempts.next(None, rows[0]["request_hash"]) == attempts.next(None, rows[0]["request_hash"]) == 1
