"""The capture addon end to end: real mitmdump, real servers (vLLM, ``polar-train serve``), the
official ``openai`` / ``anthropic`` SDKs as clients, in reverse and regular (HTTPS, CONNECT) mode.

What is asserted for every format x streaming x mode: the row's server-source ids equal what the
server returns for the same request and seed when asked directly; rendered ids equal the server's
own ``/tokenize``; what the client receives through the proxy equals what it receives directly
(JSON-equal after masking per-call ids/timestamps; deltas that vLLM batches by timing are merged);
no secret used by the client appears in any output file.
"""

from __future__ import annotations

import importlib.util
import json
import ssl
import time
import uuid
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.support.mitm import read_calls, start_mitm
from tests.support.tls_front import tls_front

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm]

API_KEY = "sk-test-SECRET-api-key-1234"
PROXY_SECRET = "proxy-SECRET-pass-5678"
MASK_KEYS = {"id", "created", "created_at", "item_id", "system_fingerprint", "sequence_number", "call_id"}
MAX_TOKENS = 6


def _servers() -> list:
    params = [pytest.param("vllm", id="vllm")]
    if importlib.util.find_spec("polar_train.server") is not None:
        params.append(pytest.param("polar", id="polar"))
    return params


@pytest.fixture(scope="module", params=_servers())
def upstream(request) -> str:
    return request.getfixturevalue("vllm_base_url" if request.param == "vllm" else "polar_base_url")


@pytest.fixture(scope="module")
def proxies(upstream: str, tiny_model_dir: Path, tmp_path_factory):
    """A reverse-mode and a regular-mode mitmdump for this upstream (regular goes via TLS)."""
    tmp = tmp_path_factory.mktemp("capture-e2e")
    port = int(upstream.rsplit(":", 1)[1])
    opts = {"polar_flush_seconds": "0.2", "polar_tokenize_check": True}
    with tls_front(port, tmp) as https_base:
        rev = start_mitm(tmp / "rev", modes=[f"reverse:{upstream}"], tokenizer=tiny_model_dir,
                         options=opts)
        reg = start_mitm(tmp / "reg", modes=["regular"], tokenizer=tiny_model_dir,
                         options={**opts, "polar_tokenize_url": upstream})
        try:
            yield {"upstream": upstream, "https": https_base, "reverse": rev, "regular": reg}
        finally:
            rev.stop()
            reg.stop()
            for m in (rev, reg):
                for f in m.out_dir.rglob("*"):
                    if f.is_file():
                        data = f.read_bytes()
                        for secret in (API_KEY, PROXY_SECRET):
                            assert secret.encode() not in data, f"secret in {f}"
                log = m.proc.log()
                assert API_KEY not in log and PROXY_SECRET not in log


def _clients(proxies, mode: str, rollout: str):
    """(openai client, anthropic client) through the proxy in ``mode``; direct clients."""
    if mode == "reverse":
        base = proxies["reverse"].url
        headers = {"x-polar-rollout": rollout}
        oc = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, default_headers=headers, max_retries=0)
        ac = anthropic.Anthropic(base_url=base, api_key=API_KEY, default_headers=headers, max_retries=0)
        return oc, ac, proxies["reverse"]
    m = proxies["regular"]
    proxy = f"http://{rollout}:{PROXY_SECRET}@127.0.0.1:{m.port}"
    oc = openai.OpenAI(base_url=proxies["https"] + "/v1", api_key=API_KEY, max_retries=0,
                       http_client=openai.DefaultHttpxClient(proxy=proxy, verify=ssl.create_default_context(cafile=str(m.ca_cert))))
    ac = anthropic.Anthropic(base_url=proxies["https"], api_key=API_KEY, max_retries=0,
                             http_client=anthropic.DefaultHttpxClient(proxy=proxy, verify=ssl.create_default_context(cafile=str(m.ca_cert))))
    return oc, ac, m


def _direct(proxies):
    up = proxies["upstream"]
    return (openai.OpenAI(base_url=up + "/v1", api_key=API_KEY, max_retries=0),
            anthropic.Anthropic(base_url=up, api_key=API_KEY, max_retries=0))


def wait_row(out_dir: Path, rollout: str, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = [r for r in read_calls(out_dir) if r["rollout_id"] == rollout]
        if rows:
            assert len(rows) == 1, rows
            return rows[0]
        time.sleep(0.1)  # polling the output folder for the row, with a deadline
    raise TimeoutError(f"no row for rollout {rollout} in {out_dir}")


def _mask(value):
    if isinstance(value, dict):
        return {k: ("*" if k in MASK_KEYS else _mask(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [_mask(v) for v in value]
    return value


def _events(body: bytes) -> list:
    """SSE body -> masked JSON events with consecutive text deltas merged (vLLM batches by timing)."""
    from polar_train.capture.sse import event_json, split_all

    raw, rest = split_all(body)
    assert rest.strip() == b""
    out: list = []
    for r in raw:
        ev, obj = event_json(r)
        if ev.data == "[DONE]":
            out.append("[DONE]")
            continue
        obj = _mask(obj)
        kind = (obj.get("type") if isinstance(obj, dict) else None) or ev.event
        prev = out[-1] if out else None
        if kind == "response.output_text.delta" and isinstance(prev, dict) and prev.get("type") == kind:
            prev["delta"] += obj["delta"]
            prev["logprobs"] = prev["logprobs"] + obj["logprobs"]
            continue
        if (kind == "content_block_delta" and isinstance(prev, dict) and prev.get("type") == kind
                and obj["delta"].get("type") == "text_delta"):
            prev["delta"]["text"] += obj["delta"]["text"]
            continue
        if isinstance(obj, dict) and obj.get("object") == "chat.completion.chunk" and obj.get("choices"):
            ch = obj["choices"][0]
            if (isinstance(prev, dict) and prev.get("object") == "chat.completion.chunk" and prev.get("choices")
                    and not prev["choices"][0].get("finish_reason") and "content" in ch.get("delta", {})
                    and set(ch["delta"]) == {"content"} and set(prev["choices"][0]["delta"]) == {"content"}):
                pch = prev["choices"][0]
                pch["delta"]["content"] += ch["delta"]["content"]
                for key in ("finish_reason", "stop_reason"):
                    if key in ch:
                        pch[key] = ch[key]
                for key in set(obj) - {"choices"}:
                    prev[key] = obj[key]
                continue
        out.append(obj)
    return out


def _call(api: str, stream: bool, oc, ac, seed: int, extra: dict | None = None) -> bytes:
    """One call with the SDK; returns the body bytes the SDK received."""
    extra = extra or {}
    if api == "openai.chat":
        kw = dict(model="tiny", messages=[{"role": "user", "content": "Say hello"}], max_tokens=MAX_TOKENS,
                  seed=seed, temperature=0.7, extra_body=extra or None)
        if stream:
            with oc.chat.completions.with_streaming_response.create(stream=True, **kw) as r:
                return b"".join(r.iter_bytes())
        return oc.chat.completions.with_raw_response.create(**kw).http_response.content
    if api == "openai.responses":
        kw = dict(model="tiny", input="Say hello", max_output_tokens=MAX_TOKENS, temperature=0.7,
                  extra_body={"seed": seed, **extra})
        if stream:
            with oc.responses.with_streaming_response.create(stream=True, **kw) as r:
                return b"".join(r.iter_bytes())
        return oc.responses.with_raw_response.create(**kw).http_response.content
    kw = dict(model="tiny", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": "Say hello"}],
              system="You are terse.", extra_body={"temperature": 0.0, **extra})  # no seed there: greedy
    if stream:
        with ac.messages.with_streaming_response.create(stream=True, **kw) as r:
            return b"".join(r.iter_bytes())
    return ac.messages.with_raw_response.create(**kw).http_response.content


def _body_view(body: bytes, stream: bool):
    return _events(body) if stream else _mask(json.loads(body))


@pytest.mark.parametrize("mode", ["reverse", "regular"])
@pytest.mark.parametrize("stream", [False, True], ids=["body", "sse"])
@pytest.mark.parametrize("api", ["openai.chat", "openai.responses", "anthropic.messages"])
def test_capture_matches_server(proxies, api: str, stream: bool, mode: str) -> None:
    rollout = f"r-{uuid.uuid4().hex[:10]}"
    seed = 1234
    oc, ac, m = _clients(proxies, mode, rollout)
    doc, dac = _direct(proxies)
    through = _call(api, stream, oc, ac, seed)
    direct = _call(api, stream, doc, dac, seed)
    assert _body_view(through, stream) == _body_view(direct, stream)

    row = wait_row(m.out_dir, rollout)
    assert row["status"] == "ok", row["error"]
    assert row["api"] == api and row["stream"] is stream
    assert row["rollout_source"] == ("header" if mode == "reverse" else "proxy_auth")
    assert row["temperature"] == pytest.approx(0.0 if api == "anthropic.messages" else 0.7)
    assert API_KEY not in (row["request_json"] or "") and PROXY_SECRET not in json.dumps(row, default=str)
    if api == "openai.chat":
        assert row["token_source"] == "server"
        ids = json.loads(_call(api, False, doc, dac, seed, {"return_token_ids": True, "logprobs": True}))
        assert row["prompt_token_ids"] == ids["prompt_token_ids"]
        assert row["completion_token_ids"] == ids["choices"][0]["token_ids"]
        want = [c["logprob"] for c in ids["choices"][0]["logprobs"]["content"]]
        assert row["completion_logprobs"] == pytest.approx(want, abs=1e-4)
        assert row["usage_match"] in (True, None)
    elif api == "openai.responses":
        assert row["token_source"] == "server"
        ids = json.loads(_call(api, False, doc, dac, seed, {
            "enable_response_messages": True, "include": ["message.output_text.logprobs"], "top_logprobs": 0}))
        assert row["prompt_token_ids"] == ids["input_messages"][0]["tokens"]
        assert row["completion_token_ids"] == ids["output_messages"][0]["tokens"]
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"])
        assert row["usage_match"] is True
    else:
        assert row["token_source"] == "rendered"
        tok = httpx.post(proxies["upstream"] + "/tokenize", timeout=30, json={
            "model": "tiny", "add_generation_prompt": True,
            "messages": [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Say hello"}]}).json()
        assert row["prompt_token_ids"] == tok["tokens"]
        assert row["server_tokenize_match"] is True
        assert row["usage_prompt_tokens"] == len(tok["tokens"])


@pytest.fixture(scope="module")
def plain_proxy(upstream: str, tiny_model_dir: Path, tmp_path_factory):
    """Reverse mode with injection off: bytes pass unchanged, ids are rendered."""
    m = start_mitm(tmp_path_factory.mktemp("capture-plain"), modes=[f"reverse:{upstream}"],
                   tokenizer=tiny_model_dir, options={"polar_flush_seconds": "0.2", "polar_inject": False})
    yield m
    m.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["body", "sse"])
def test_rendered_chat_ids_equal_server_ids(upstream, plain_proxy, stream: bool) -> None:
    """Rendering is proven exact where it can be compared: the chat prompt, rendered by the addon
    from the request alone, equals the ids the server itself reports for the same request."""
    rollout = f"p-{uuid.uuid4().hex[:10]}"
    oc = openai.OpenAI(base_url=plain_proxy.url + "/v1", api_key=API_KEY, max_retries=0,
                       default_headers={"x-polar-rollout": rollout})
    doc = openai.OpenAI(base_url=upstream + "/v1", api_key=API_KEY, max_retries=0)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi — ça va? 你好"},
                {"role": "assistant", "content": "Fine."}, {"role": "user", "content": "List files"}]
    tools = [{"type": "function", "function": {"name": "shell", "description": "run a command",
                                               "parameters": {"type": "object", "properties": {
                                                   "cmd": {"type": "string"}}}}}]
    kw = dict(model="tiny", messages=messages, tools=tools, max_tokens=MAX_TOKENS, seed=7)
    if stream:
        with oc.chat.completions.with_streaming_response.create(stream=True, **kw) as r:
            through = b"".join(r.iter_bytes())
    else:
        through = oc.chat.completions.with_raw_response.create(**kw).http_response.content
    assert b"token_ids\":[" not in through  # nothing injected
    row = wait_row(plain_proxy.out_dir, rollout)
    assert row["status"] == "ok" and row["injected"] is False and row["token_source"] == "rendered"
    server = doc.chat.completions.create(**kw, extra_body={"return_token_ids": True}).model_dump()
    assert row["prompt_token_ids"] == server["prompt_token_ids"]
    assert row["usage_prompt_tokens"] in (None, len(server["prompt_token_ids"]))


@pytest.mark.parametrize("stream", [False, True], ids=["body", "sse"])
def test_rendered_responses_ids_equal_server_ids(upstream, plain_proxy, stream: bool) -> None:
    """A Responses call without injection (as from a hosted API) is rendered from the request;
    its prompt ids equal the ids the server reports (input_messages) for the same request."""
    rollout = f"p-{uuid.uuid4().hex[:10]}"
    oc = openai.OpenAI(base_url=plain_proxy.url + "/v1", api_key=API_KEY, max_retries=0,
                       default_headers={"x-polar-rollout": rollout})
    doc = openai.OpenAI(base_url=upstream + "/v1", api_key=API_KEY, max_retries=0)
    kw = dict(model="tiny", instructions="You are a coding agent.", max_output_tokens=MAX_TOKENS,
              input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix add()"}]},
                     {"type": "message", "role": "assistant",
                      "content": [{"type": "output_text", "text": "Reading the file."}]},
                     {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Go on"}]}])
    if stream:
        with oc.responses.with_streaming_response.create(stream=True, **kw) as r:
            b"".join(r.iter_bytes())
    else:
        oc.responses.with_raw_response.create(**kw)
    row = wait_row(plain_proxy.out_dir, rollout)
    assert row["status"] == "ok" and row["token_source"] == "rendered"
    server = doc.responses.create(**kw, extra_body={"enable_response_messages": True}).model_dump()
    assert row["prompt_token_ids"] == server["input_messages"][0]["tokens"]
    assert row["usage_prompt_tokens"] == len(row["prompt_token_ids"])


def test_rendered_responses_ids_with_codex_tools_equal_server_ids(upstream, plain_proxy) -> None:
    """Codex's history shapes - a freeform ``custom`` tool (apply_patch) with its
    ``custom_tool_call`` / ``custom_tool_call_output`` items, a namespaced function and a plain
    function call - render to the ids the server itself reports for the same request."""
    rollout = f"p-{uuid.uuid4().hex[:10]}"
    oc = openai.OpenAI(base_url=plain_proxy.url + "/v1", api_key=API_KEY, max_retries=0,
                       default_headers={"x-polar-rollout": rollout})
    doc = openai.OpenAI(base_url=upstream + "/v1", api_key=API_KEY, max_retries=0)
    patch = "*** Begin Patch\n*** Update File: calc.py\n@@\n-    return a - b\n+    return a + b\n*** End Patch\n"
    tools = [
        {"type": "function", "name": "exec_command", "description": "Run a command.",
         "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
        {"type": "custom", "name": "apply_patch", "description": "Edit files with a patch.",
         "format": {"type": "text"}},  # vLLM 0.32 refuses grammar-format custom tools (400)
        {"type": "namespace", "name": "mcp", "description": "MCP tools", "tools": [
            {"type": "function", "name": "search", "description": "Search.",
             "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}]},
    ]
    kw = dict(model="tiny", instructions="You are a coding agent.", max_output_tokens=MAX_TOKENS, tools=tools,
              input=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Fix add()"}]},
                     {"type": "function_call", "call_id": "c1", "name": "exec_command",
                      "arguments": json.dumps({"cmd": "cat calc.py"})},
                     {"type": "function_call_output", "call_id": "c1", "output": "def add(a, b):\n    return a - b\n"},
                     {"type": "custom_tool_call", "call_id": "c2", "name": "apply_patch", "input": patch},
                     {"type": "custom_tool_call_output", "call_id": "c2", "output": "Success. Updated calc.py"}])
    oc.responses.with_raw_response.create(**kw)
    row = wait_row(plain_proxy.out_dir, rollout)
    assert row["status"] == "ok" and row["token_source"] == "rendered"
    server = doc.responses.create(**kw, extra_body={"enable_response_messages": True}).model_dump()
    assert row["prompt_token_ids"] == server["input_messages"][0]["tokens"]


def test_custom_tool_calls_count_as_tool_calls() -> None:
    """A Responses output with a ``custom_tool_call`` (Codex's apply_patch) is a tool-call turn."""
    from polar_train.capture.openai_responses import parse_response

    parsed = parse_response({"object": "response", "status": "completed", "output": [
        {"type": "custom_tool_call", "call_id": "c9", "name": "apply_patch", "input": "*** Begin Patch\n"},
        {"type": "function_call", "call_id": "c10", "name": "exec_command", "arguments": "{}"}]})
    assert parsed.tool_call_count == 2 and parsed.finish_reason == "tool_calls"
    calls = parsed.assistant["tool_calls"]
    assert calls[0]["function"] == {"name": "apply_patch", "arguments": json.dumps({"input": "*** Begin Patch\n"})}


def test_vllm_itself_on_the_harness_proxy_port_is_refused(vllm_base_url, tmp_path, capsys):
    """A user gives vLLM's port as --proxy-port: vLLM answers the check's absolute-form GET of
    /v1/models itself (a proxy's request shape), so the check passed and the Codex session ran
    with exit 0, unrecorded, its proxy credentials sent to vLLM. Only the capture addon marks
    its answer."""
    from urllib.parse import urlsplit

    from polar_train.cli import main

    port = urlsplit(vllm_base_url).port
    assert main(["harness", "codex", "x", "--server", vllm_base_url, "--model", "tiny", "--workdir", str(tmp_path),
                 "--proxy-port", str(port), "--rollout", "r1", "--timeout", "600"]) == 2
    err = capsys.readouterr().err
    from tests.support.harness import not_the_capture_proxy

    assert err == not_the_capture_proxy(port)
