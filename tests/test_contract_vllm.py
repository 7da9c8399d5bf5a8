"""Contract: the same requests to real vLLM 0.32 (CPU) and to ``polar-train serve`` give the same
wire shape (keys, nesting, JSON types, event order), and the same prompt token ids.

Both servers run the same tiny model and chat template, so where a value is fully determined by
the request (prompt ids, ``usage.input_tokens``, ``/tokenize``) it must be *equal*, not only of the
same shape. Sampled tokens differ (different RNGs), so text values are not compared.

Deliberately not compared (values, not shapes): ids (``chatcmpl-``/``resp_``/``msg_`` + random hex),
``created``/``created_at``, ``system_fingerprint`` (ours says ``polar``), and how many tokens one
streamed text delta carries (vLLM may merge several; consecutive repeats of one event type are
collapsed before comparing the order). The ``tools`` echo in a Responses object is compared too.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.vllm

USER = [{"role": "user", "content": "Hello"}]
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "shell", "description": "Run a shell command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}}]
RESP_TOOLS = [{"type": "function", "name": "shell", "description": "Run a shell command",
               "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
              {"type": "custom", "name": "apply_patch", "description": "Apply a patch"},
              {"type": "namespace", "name": "multi_agent_v1", "description": "Agents", "tools": [
                  {"type": "function", "name": "spawn", "description": "Spawn an agent",
                   "parameters": {"type": "object", "properties": {"task": {"type": "string"}}}}]},
              {"type": "web_search", "external_web_access": True}]
RESP_INPUT = [
    {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be careful."}]},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix add()"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [],
     "content": [{"type": "reasoning_text", "text": "Read the file first."}]},
    {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
    {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": "{\"cmd\": \"cat calc.py\"}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "def add(a, b): return a - b"},
    {"type": "custom_tool_call", "call_id": "call_2", "name": "apply_patch",
     "input": "*** Begin Patch\n*** End Patch"},
    {"type": "custom_tool_call_output", "call_id": "call_2", "output": "Done!"},
    {"type": "function_call", "call_id": "call_3", "name": "spawn", "namespace": "multi_agent_v1",
     "arguments": "{\"task\": \"test\"}"},
    {"type": "function_call_output", "call_id": "call_3", "output": "spawned"},
]
ANTH_TOOLS = [{"name": "Bash", "description": "Run a command",
               "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
ANTH_MESSAGES = [
    {"role": "user", "content": [{"type": "text", "text": "fix add()"}]},
    {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "Read it.", "signature": "sig"},
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "cat calc.py"}}]},
    {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "def add"}]},
        {"type": "text", "text": "go on"}]},
]
ANTH_SYSTEM = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=abc;"},
               {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]


# -- shapes -----------------------------------------------------------------------------------

def shape(x: Any) -> Any:
    """Types and keys, recursively; a list is described by its elements' shapes, merged."""
    if isinstance(x, dict):
        return {k: shape(v) for k, v in x.items()}
    if isinstance(x, list):
        kinds: list[Any] = []
        for el in x:
            s = shape(el)
            for i, k in enumerate(kinds):
                m = merge(k, s)
                if m is not None:
                    kinds[i] = m
                    break
            else:
                kinds.append(s)
        return ["list", *sorted(kinds, key=lambda k: json.dumps(k, sort_keys=True))]
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, int):
        return "int"
    if isinstance(x, float):
        return "float"
    if isinstance(x, str):
        return "str"
    if x is None:
        return "null"
    raise TypeError(type(x))


def merge(a: Any, b: Any) -> Any:
    """One shape covering both, when they differ only by empty lists (``bytes: []`` of a token
    that decodes to nothing); None when they really differ."""
    if a == b:
        return a
    if isinstance(a, dict) and isinstance(b, dict) and list(a) == list(b):
        out = {}
        for k in a:
            m = merge(a[k], b[k])
            if m is None:
                return None
            out[k] = m
        return out
    if isinstance(a, list) and isinstance(b, list):
        if a == ["list"]:
            return b
        if b == ["list"]:
            return a
        if len(a) == len(b) == 2:  # lists of one kind each, e.g. top_logprobs with ``bytes: []``
            m = merge(a[1], b[1])
            return None if m is None else ["list", m]
    return None


def diff(a: Any, b: Any, path: str = "$") -> list[str]:
    """Readable differences between two shapes (for assertion messages)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}.{k}: only in vLLM" for k in a.keys() - b.keys()]
        out += [f"{path}.{k}: only in ours" for k in b.keys() - a.keys()]
        for k in a.keys() & b.keys():
            out += diff(a[k], b[k], f"{path}.{k}")
        if not out and list(a) != list(b):
            out.append(f"{path}: key order {list(a)} != {list(b)}")
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):  # element by element: a
        # list's dicts compare equal whatever their key order, which a client may read by position
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{path}[{i}]")]
    if a != b:
        return [f"{path}: vLLM {json.dumps(a)[:300]} != ours {json.dumps(b)[:300]}"]
    return []


def assert_same_shape(vllm: Any, ours: Any) -> None:
    d = diff(shape(vllm), shape(ours))
    assert not d, "\n".join(d)


def post(base: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=120)


def both(vllm: str, ours: str, path: str, body: dict) -> tuple[dict, dict]:
    a, b = post(vllm, path, body), post(ours, path, body)
    assert a.status_code == b.status_code == 200, (a.text[:500], b.text[:500])
    return a.json(), b.json()


def sse(base: str, path: str, body: dict) -> list[tuple[str | None, Any]]:
    """(event name or None, parsed data) for each server-sent event."""
    out: list[tuple[str | None, Any]] = []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()[:500]
        event = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                event = line[len("event: "):]
            elif line.startswith("data: "):
                data = line[len("data: "):]
                out.append((event, data if data == "[DONE]" else json.loads(data)))
                event = None
    return out


def collapse(seq: list[str]) -> list[str]:
    return [s for i, s in enumerate(seq) if i == 0 or seq[i - 1] != s]


def assert_same_event_stream(a: list, b: list, kind=lambda e: e[0]) -> None:
    """Same order of event kinds (repeats collapsed) and, per kind, the same data shapes."""
    assert collapse([kind(e) for e in a]) == collapse([kind(e) for e in b])
    by_kind: dict[str, tuple[list, list]] = {}
    for side, events in ((0, a), (1, b)):
        for e in events:
            by_kind.setdefault(kind(e), ([], []))[side].append(e[1])
    for k, (va, vb) in by_kind.items():
        assert_same_shape(va, vb)


def text_deltas_filled(events: list) -> list:
    """A token chunk's empty ``delta`` (its token holds half a character: no text yet) as the
    ``{"content": str}`` of a token with text: whether a *random* token has text is a value, not a
    shape (which tokens have none, and their logprob names, are compared exactly on forced tokens
    in ``test_contract_vllm_half_characters``)."""
    for _, data in events:
        for ch in data.get("choices", []) if isinstance(data, dict) else []:
            if ch.get("delta") == {}:
                ch["delta"] = {"content": ""}
    return events


# -- chat completions -------------------------------------------------------------------------

@pytest.mark.parametrize("extra", [
    {},
    {"return_token_ids": True, "logprobs": True, "top_logprobs": 2},
    {"return_token_ids": True, "tools": CHAT_TOOLS, "seed": 3, "temperature": 0.8, "top_p": 0.95},
], ids=["plain", "token-ids-logprobs", "tools"])
def test_chat_non_streamed(vllm_base_url, polar_base_url, extra):
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, **extra}
    a, b = both(vllm_base_url, polar_base_url, "/v1/chat/completions", body)
    assert_same_shape(a, b)
    assert a["usage"] == b["usage"]
    assert a["prompt_token_ids"] == b["prompt_token_ids"]


def test_chat_stop_token_is_reported_alike(vllm_base_url, polar_base_url):
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, "logit_bias": {"248046": 100},
            "return_token_ids": True, "logprobs": True}
    a, b = both(vllm_base_url, polar_base_url, "/v1/chat/completions", body)
    assert_same_shape(a, b)
    ca, cb = a["choices"][0], b["choices"][0]
    assert (ca["finish_reason"], ca["token_ids"], ca["message"]["content"]) == \
        (cb["finish_reason"], cb["token_ids"], cb["message"]["content"]) == ("stop", [248046], "")
    # same model, same context: the same raw logprob of <|im_end|>
    assert abs(ca["logprobs"]["content"][0]["logprob"] - cb["logprobs"]["content"][0]["logprob"]) < 1e-4


@pytest.mark.parametrize("extra", [
    {},
    {"return_token_ids": True, "logprobs": True, "stream_options": {"include_usage": True}},
], ids=["plain", "token-ids-logprobs-usage"])
def test_chat_streamed(vllm_base_url, polar_base_url, extra):
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, **extra}
    a = text_deltas_filled(sse(vllm_base_url, "/v1/chat/completions", body))
    b = text_deltas_filled(sse(polar_base_url, "/v1/chat/completions", body))

    def kind(e):
        data = e[1]
        if data == "[DONE]":
            return "done"
        if not data["choices"]:
            return "usage"
        ch = data["choices"][0]
        return "role" if "role" in ch["delta"] else ("finish" if ch["finish_reason"] else "delta")

    assert_same_event_stream(a, b, kind)
    if extra:
        assert a[0][1]["prompt_token_ids"] == b[0][1]["prompt_token_ids"]
        assert a[-2][1]["usage"] == b[-2][1]["usage"]


# -- responses --------------------------------------------------------------------------------

RESP_EXTRA = {"enable_response_messages": True, "include": ["message.output_text.logprobs"],
              "top_logprobs": 1}


@pytest.mark.parametrize("extra", [
    {"input": "Hello"},
    {"input": "Hello", **RESP_EXTRA},
    {"input": RESP_INPUT, "instructions": "You are Codex.", "tools": RESP_TOOLS, **RESP_EXTRA},
], ids=["plain", "messages-logprobs", "codex-like-history"])
def test_responses_non_streamed(vllm_base_url, polar_base_url, extra):
    body = {"model": "tiny", "max_output_tokens": 4, **extra}
    a, b = both(vllm_base_url, polar_base_url, "/v1/responses", body)
    assert_same_shape(a, b)
    # input_tokens_details.cached_tokens is vLLM's prefix-cache hit count (0 on ours: no cache)
    assert {**a["usage"], "input_tokens_details": None} == {**b["usage"], "input_tokens_details": None}
    if "enable_response_messages" in extra:
        assert a["input_messages"] == b["input_messages"]  # the same rendered prompt, text and ids


def test_responses_streamed(vllm_base_url, polar_base_url):
    body = {"model": "tiny", "max_output_tokens": 4, "input": RESP_INPUT, "tools": RESP_TOOLS,
            **RESP_EXTRA}
    a = sse(vllm_base_url, "/v1/responses", body)
    b = sse(polar_base_url, "/v1/responses", body)
    assert all(name == data["type"] for name, data in a + b)
    assert_same_event_stream(a, b)
    assert [d["sequence_number"] for _, d in b] == list(range(len(b)))
    assert a[-1][1]["response"]["input_messages"] == b[-1][1]["response"]["input_messages"]


# -- messages ---------------------------------------------------------------------------------

ANTH_BODY = {"model": "tiny", "max_tokens": 4, "system": ANTH_SYSTEM, "tools": ANTH_TOOLS,
             "messages": ANTH_MESSAGES, "metadata": {"user_id": "u1"}, "temperature": 1,
             "thinking": {"type": "adaptive"}}


def test_messages_non_streamed(vllm_base_url, polar_base_url):
    a, b = both(vllm_base_url, polar_base_url, "/v1/messages?beta=true", ANTH_BODY)
    assert_same_shape(a, b)
    assert a["usage"] == b["usage"]  # input_tokens is the true prompt count on both


def test_messages_streamed(vllm_base_url, polar_base_url):
    a = sse(vllm_base_url, "/v1/messages?beta=true", ANTH_BODY)
    b = sse(polar_base_url, "/v1/messages?beta=true", ANTH_BODY)
    assert_same_event_stream(a, b)
    assert a[0][1]["message"]["usage"] == b[0][1]["message"]["usage"]


def test_messages_count_tokens(vllm_base_url, polar_base_url):
    body = {k: v for k, v in ANTH_BODY.items() if k in ("model", "system", "tools", "messages")}
    a, b = both(vllm_base_url, polar_base_url, "/v1/messages/count_tokens", body)
    assert a == b


# -- tokenize, models, errors -----------------------------------------------------------------

@pytest.mark.parametrize("body", [
    {"model": "tiny", "messages": USER, "add_generation_prompt": True},
    {"model": "tiny", "messages": USER + [{"role": "assistant", "content": "Hi"}], "tools": CHAT_TOOLS,
     "add_generation_prompt": False, "return_token_strs": True},
    {"model": "tiny", "prompt": "Hello <think>"},
], ids=["messages", "tools-token-strs", "prompt"])
def test_tokenize(vllm_base_url, polar_base_url, body):
    a, b = both(vllm_base_url, polar_base_url, "/tokenize", body)
    assert a == b


def test_detokenize(vllm_base_url, polar_base_url):
    body = {"model": "tiny", "tokens": [248045, 846, 198, 9419, 248068]}
    a, b = both(vllm_base_url, polar_base_url, "/detokenize", body)
    assert a == b


@pytest.mark.parametrize("tokens", [[-1], [1.5], [True, "3", 2.0], [3, 999999, 3], [2**32], [-1, 1.5, "x"], "abc",
                                    [2**63], [1e19]])
def test_detokenize_reads_ids_as_vllms_model_does(vllm_base_url, polar_base_url, tokens):
    """A probe: lax ids (true, "3", 2.0) were refused, an id past the vocabulary too (vLLM decodes it
    to nothing), and every other mistake had our own words."""
    a, b = (post(base, "/detokenize", {"model": "tiny", "tokens": tokens}) for base in (vllm_base_url, polar_base_url))
    assert (a.status_code, a.json()) == (b.status_code, b.json())


def test_models(vllm_base_url, polar_base_url):
    a, b = httpx.get(vllm_base_url + "/v1/models").json(), httpx.get(polar_base_url + "/v1/models").json()
    assert_same_shape(a, b)
    assert [m["id"] for m in a["data"]] == [m["id"] for m in b["data"]]
    assert a["data"][0]["max_model_len"] == b["data"][0]["max_model_len"]


@pytest.mark.parametrize("path, body, status", [
    ("/v1/chat/completions", {"model": "nope", "messages": USER}, 404),
    ("/v1/responses", {"model": "nope", "input": "x"}, 404),
    ("/v1/chat/completions", {"model": "tiny", "messages": USER, "max_tokens": 100000}, 400),
    ("/v1/messages", {"model": "nope", "max_tokens": 2, "messages": USER}, 404),
    # vLLM: its thinking_token_budget without a reasoning parser; ours: not supported (another message)
    ("/v1/messages", {"model": "tiny", "max_tokens": 2000, "messages": USER,
                      "thinking": {"type": "enabled", "budget_tokens": 1024}}, 400),
])
def test_error_shapes(vllm_base_url, polar_base_url, path, body, status):
    a, b = post(vllm_base_url, path, body), post(polar_base_url, path, body)
    assert a.status_code == b.status_code == status
    assert_same_shape(a.json(), b.json())


BAD = {"model": "tiny", "messages": USER, "max_tokens": 2}


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "tiny", "messages": "hi"}),
    ("/v1/chat/completions", {**BAD, "stop": [5]}),
    ("/v1/chat/completions", {**BAD, "stop": [""]}),
    ("/v1/chat/completions", {**BAD, "logit_bias": {"x": 1}}),
    ("/v1/chat/completions", {**BAD, "logit_bias": {"999999999": 1}}),
    ("/v1/chat/completions", {**BAD, "n": 0}),
    ("/v1/chat/completions", {**BAD, "tools": [{"type": "x"}]}),
    ("/v1/chat/completions", {**BAD, "tools": []}),
    ("/v1/chat/completions", {**BAD, "tool_choice": "required"}),
    ("/v1/chat/completions", {**BAD, "top_k": -2}),
    ("/v1/chat/completions", {**BAD, "logprobs": True, "top_logprobs": 21}),
    ("/v1/chat/completions", {**BAD, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {
        "type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}),
    ("/v1/chat/completions", {**BAD, "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "http://127.0.0.1:9/a.mp4"}}]}]}),
    ("/v1/chat/completions", {**BAD, "messages": [{"role": "user", "content": [
        {"type": "audio_url", "audio_url": {"url": "http://127.0.0.1:9/a.wav"}}]}]}),
    ("/v1/responses", {"model": "tiny", "input": 5}),
    ("/v1/responses", {"model": "tiny", "input": "x", "include": "x"}),
    ("/v1/messages", {"model": "tiny", "messages": USER}),
    ("/v1/messages", {**BAD, "messages": [{"role": "bot", "content": "x"}]}),
    ("/v1/messages", {**BAD, "stop_sequences": [""]}),
    ("/tokenize", {"model": "tiny"}),
])
def test_bad_request_bodies_equal(vllm_base_url, polar_base_url, path, body):
    """The whole error body (status, type, message, param, code; the Messages API's shape where
    vLLM uses it) is vLLM's, not only its shape."""
    a, b = post(vllm_base_url, path, body), post(polar_base_url, path, body)
    assert a.status_code == b.status_code == 400
    assert a.json() == b.json()


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": None}],
    [{"role": "system", "content": None}, {"role": "user", "content": "x"}],
    [{"role": "system"}, {"role": "user", "content": "x"}],
    [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}, {"role": "user", "content": "y"}],
])
def test_a_null_or_missing_content_is_taken_or_refused_alike(vllm_base_url, polar_base_url, messages):
    """vLLM refuses an explicit null content but an assistant's, and takes a message without the key
    (its custom message type; an empty turn): serve answered 200 to all of them (a probe)."""
    body = {"model": "tiny", "messages": messages, "max_tokens": 2}
    a, b = post(vllm_base_url, "/v1/chat/completions", body), post(polar_base_url, "/v1/chat/completions", body)
    assert a.status_code == b.status_code, (a.text[:300], b.text[:300])
    if a.status_code == 200:
        assert a.json()["usage"]["prompt_tokens"] == b.json()["usage"]["prompt_tokens"]
    else:
        assert a.json()["error"]["type"] == b.json()["error"]["type"] == "Bad Request"


@pytest.mark.parametrize("method, path", [("GET", "/v1/responses/resp_x"), ("POST", "/v1/responses/resp_x/cancel")])
def test_a_stored_response_is_not_found_alike(vllm_base_url, polar_base_url, method, path):
    """Nothing is stored (vLLM without VLLM_ENABLE_RESPONSES_API_STORE): the SDK's responses.retrieve
    read our bare {"detail": "Not Found"} as "Error code: 404"."""
    a = httpx.request(method, vllm_base_url + path, timeout=30)
    b = httpx.request(method, polar_base_url + path, timeout=30)
    assert a.status_code == b.status_code == 404
    assert a.json() == b.json()


@pytest.mark.parametrize("method, path", [("GET", "/v1/no-such-route"), ("GET", "/v1/chat/completions")])
def test_unknown_routes_answer_alike(vllm_base_url, polar_base_url, method, path):
    # a client with a wrong base URL or method gets vLLM's JSON answer from us too, not plain text
    a = httpx.request(method, vllm_base_url + path, timeout=30)
    b = httpx.request(method, polar_base_url + path, timeout=30)
    assert a.status_code == b.status_code and a.status_code in (404, 405)
    assert a.headers["content-type"] == b.headers["content-type"]
    assert a.json() == b.json()


def test_an_absolute_form_request_target_is_served_alike(vllm_base_url, polar_base_url):
    """``GET http://HOST/v1/models`` (what a client sends to a proxy, or to a server it takes for
    one): vLLM's uvicorn parses it with httptools and serves it; ours, parsing with h11, said 404."""
    import http.client
    from urllib.parse import urlsplit

    answers = []
    for base in (vllm_base_url, polar_base_url):
        where = urlsplit(base)
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
        conn.request("GET", f"{base}/v1/models")
        response = conn.getresponse()
        answers.append((response.status, [m["id"] for m in json.loads(response.read())["data"]]))
        conn.close()
    assert answers[0] == answers[1] == (200, ["tiny"])


def test_the_tokenize_check_of_a_responses_call_runs_on_vllm(vllm_base_url):
    """A Codex call's messages keep Responses parts (`input_text`): vLLM's chat /tokenize refused
    them with a 400 on every Codex call, and the row kept only the status line."""
    from polar_train.capture.render import server_tokenize

    parts = [{"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "input_text", "text": "hi"}, {"type": "input_text", "text": "there"}]}]
    plain = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
             {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    assert server_tokenize(vllm_base_url, "tiny", parts, None) == server_tokenize(vllm_base_url, "tiny", plain, None)
    with pytest.raises(ValueError, match=r"HTTP 404: The model `nope` does not exist"):
        server_tokenize(vllm_base_url, "nope", plain, None)
