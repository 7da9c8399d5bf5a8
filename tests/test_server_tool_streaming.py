"""Tool calls on the wire as vLLM 0.32 (hermes parser) sends them, on every API: streamed piece by
piece (name with id, then the arguments' raw text), a call cut by max_tokens streamed as far as it
got (and the whole answer content when not streamed), parallel_tool_calls: false keeping the first
call, include_reasoning: false hiding reasoning, ids and logprobs. Shapes checked against a running
vLLM on forced tool-call text (/tmp probe scripts; vLLM cannot be made to call a tool from random
weights in the suite) and against vLLM's own parser class (tests/test_contract_vllm_hermes.py)."""

from __future__ import annotations

import json

import httpx
import pytest
import yaml

from tests.support.procs import polar_server

SCRIPT = {"scenarios": [
    {"name": "two-calls", "match": {"user_contains": "PAR"},
     "turns": [{"content": "Sure.", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}},
                                                   {"name": "get_weather", "arguments": {"city": "Rome"}}]}],
     "after_last": "repeat_last"},
    {"name": "blank-before-call", "match": {"user_contains": "BLANK"},
     "turns": [{"content": "\n", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]}],
     "after_last": "repeat_last"},
    {"name": "thinking", "match": {"user_contains": "THINK"},
     "turns": [{"reasoning": "Let me think.", "content": "Hello."}], "after_last": "repeat_last"},
]}
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
RESP_TOOLS = [{"type": "function", "name": "get_weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]
ANTH_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def url(tiny_model_dir, logs_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tool-stream") / "scenario.yaml"
    path.write_text(yaml.safe_dump(SCRIPT))
    with polar_server(tiny_model_dir, logs_dir, extra=["--script", str(path)]) as base:
        yield base


def _events(r: httpx.Response) -> list[dict]:
    assert r.status_code == 200, r.text
    return [json.loads(line[6:]) for line in r.text.splitlines()
            if line.startswith("data: ") and line[6:] != "[DONE]"]


def _chat(url: str, **extra) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "PAR weather?"}], "tools": CHAT_TOOLS,
            "max_tokens": 200, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def _cut_at(url: str, marker: str = '"Par') -> int:
    """The max_tokens whose turn first holds ``marker`` (by default: inside the first call's arguments)."""
    ids = _chat(url, return_token_ids=True).json()["choices"][0]["token_ids"]
    for k in range(1, len(ids)):
        text = httpx.post(url + "/detokenize", json={"model": "tiny", "tokens": ids[:k]}, timeout=60).json()["prompt"]
        if marker in text:
            return k
    raise AssertionError(f"no cut at {marker!r}")


def test_chat_streams_each_call_piece_by_piece(url):
    deltas = [c["choices"][0] for c in _events(_chat(url, stream=True))[1:]]
    content = "".join(d["delta"].get("content") or "" for d in deltas)
    assert content == "Sure.\n"  # the newline the model put before <tool_call> (vLLM keeps it)
    entries = [e for d in deltas for e in d["delta"].get("tool_calls") or []]
    assert all(d["delta"]["content"] is None for d in deltas if d["delta"].get("tool_calls"))
    for index, city in ((0, "Paris"), (1, "Rome")):
        mine = [e for e in entries if e["index"] == index]
        assert mine[0]["type"] == "function" and mine[0]["id"].startswith("chatcmpl-tool-")
        assert mine[0]["function"] == {"name": "get_weather"}
        pieces = [e["function"]["arguments"] for e in mine[1:]]
        assert len(pieces) > 1 and all(set(e) == {"index", "function"} for e in mine[1:])
        assert json.loads("".join(pieces)) == {"city": city}
    assert deltas[-1]["finish_reason"] == "tool_calls"
    whole = _chat(url).json()["choices"][0]
    assert whole["message"]["content"] == "Sure.\n"
    assert [json.loads(c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == [
        {"city": "Paris"}, {"city": "Rome"}]


def test_parallel_tool_calls_false_keeps_the_first_call(url):
    whole = _chat(url, parallel_tool_calls=False).json()["choices"][0]
    assert [json.loads(c["function"]["arguments"]) for c in whole["message"]["tool_calls"]] == [{"city": "Paris"}]
    deltas = [c["choices"][0]["delta"] for c in _events(_chat(url, stream=True, parallel_tool_calls=False))[1:]]
    assert {e["index"] for d in deltas for e in d.get("tool_calls") or []} == {0}
    assert {"content": None} in deltas  # the second call's chunks, emptied (vLLM's filter)
    resp = httpx.post(url + "/v1/responses", timeout=120, json={
        "model": "tiny", "input": "PAR weather?", "tools": RESP_TOOLS, "parallel_tool_calls": False}).json()
    assert [o["type"] for o in resp["output"]] == ["message", "function_call"]
    events = _events(httpx.post(url + "/v1/messages", timeout=120, json={
        "model": "tiny", "max_tokens": 200, "tools": ANTH_TOOLS, "stream": True,
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "messages": [{"role": "user", "content": "PAR weather?"}]}))
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["text", "tool_use"]
    pieces = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
              and e["delta"]["type"] == "input_json_delta"]
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == ["tool_use"]


def test_a_call_cut_short_streams_as_far_as_it_got(url):
    k = _cut_at(url)
    deltas = [c["choices"][0] for c in _events(_chat(url, stream=True, max_tokens=k))[1:]]
    entries = [e for d in deltas for e in d["delta"].get("tool_calls") or []]
    assert entries[0]["function"] == {"name": "get_weather"}
    assert "".join(e["function"].get("arguments") or "" for e in entries).startswith('{"city": "Par')
    assert deltas[-1]["finish_reason"] == "length"
    whole = _chat(url, max_tokens=k).json()["choices"][0]  # not streamed: the parse fails, all is text
    assert whole["message"]["content"].startswith("Sure.\n<tool_call>") and "tool_calls" not in whole["message"]
    body = {"model": "tiny", "input": "PAR weather?", "tools": RESP_TOOLS, "max_output_tokens": k}
    events = _events(httpx.post(url + "/v1/responses", json={**body, "stream": True}, timeout=120))
    done = events[-1]["response"]
    assert done["status"] == "incomplete"
    assert done["output"] == [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [o["type"] for o in done["output"]] == ["message", "function_call"]
    assert done["output"][1]["arguments"].startswith('{"city": "Par') and done["output"][1]["status"] == "completed"
    plain = httpx.post(url + "/v1/responses", json=body, timeout=120).json()
    assert [o["type"] for o in plain["output"]] == ["message"]
    assert plain["output"][0]["content"][0]["text"].startswith("Sure.\n<tool_call>")


def test_include_reasoning_false_hides_reasoning_ids_and_logprobs(url):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "THINK"}], "max_tokens": 50,
            "logprobs": True, "return_token_ids": True, "include_reasoning": False}
    ch = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert ch["message"]["reasoning"] is None and ch["message"]["content"] == "Hello."
    assert ch["logprobs"] is None and ch["token_ids"] is None
    chunks = _events(httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120))
    said = [c["choices"][0] for c in chunks[1:] if c["choices"][0]["delta"]]
    assert "".join(c["delta"].get("content") or "" for c in said) == "Hello."
    assert all(c["delta"].get("reasoning", "absent") is None for c in said if c["delta"].get("content"))
    assert all(c["logprobs"] is None and c["token_ids"] is None for c in said)
    shown = httpx.post(url + "/v1/chat/completions", json={**body, "include_reasoning": True}, timeout=120).json()
    assert shown["choices"][0]["message"]["reasoning"] == "Let me think." and shown["choices"][0]["token_ids"]


def test_a_name_on_the_streams_last_step_gets_empty_arguments(url):
    """The review: vLLM's stream end gives a call that sent no arguments "{}" - on its name entry,
    which we printed without it (a client joined "" as the arguments)."""
    k = _cut_at(url, '"name": "get_weather"')
    last = _events(_chat(url, stream=True, max_tokens=k))[-1]["choices"][0]
    assert last["finish_reason"] == "length"
    (entry,) = last["delta"]["tool_calls"]
    assert entry["function"] == {"name": "get_weather", "arguments": "{}"} and entry["id"]


def test_blank_text_before_a_call_is_no_content(url):
    """vLLM: whitespace before the calls is no content (a message item of "\n" in Responses)."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "BLANK"}], "tools": CHAT_TOOLS, "max_tokens": 200}
    ch = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]
    assert ch["message"]["content"] is None and len(ch["message"]["tool_calls"]) == 1
    resp = httpx.post(url + "/v1/responses", timeout=120, json={
        "model": "tiny", "input": "BLANK", "tools": RESP_TOOLS, "parallel_tool_calls": None}).json()
    assert [o["type"] for o in resp["output"]] == ["function_call"]
    assert resp["parallel_tool_calls"] is True  # (null echoed as the default, as vLLM does)


def test_a_tool_less_messages_request_still_has_its_calls_parsed(url):
    """The review: a Messages request without tools gets tool_choice None in vLLM, whose hermes
    parser then still reads the answer - streamed, its calls are tool_use blocks; not streamed,
    only the text before them is left. Chat with an explicit `tool_choice: null` alike."""
    body = {"model": "tiny", "max_tokens": 200, "messages": [{"role": "user", "content": "PAR weather?"}]}
    whole = httpx.post(url + "/v1/messages", json=body, timeout=120).json()
    assert whole["content"] == [{"type": "text", "text": "Sure.\n"}] and whole["stop_reason"] == "end_turn"
    events = _events(httpx.post(url + "/v1/messages", json={**body, "stream": True}, timeout=120))
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == [
        "text", "tool_use", "tool_use"]
    assert [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"] == ["tool_use"]
    plain = _chat(url, tool_choice=None).json()["choices"][0]
    assert plain["message"]["content"] == "Sure.\n" and "tool_calls" not in plain["message"]
    assert plain["finish_reason"] == "stop"
    chunks = [c["choices"][0] for c in _events(_chat(url, tool_choice=None, stream=True))[1:]]
    assert {e["index"] for c in chunks for e in c["delta"].get("tool_calls") or []} == {0, 1}
    assert chunks[-1]["finish_reason"] == "tool_calls"


def test_one_call_at_most_or_a_strict_tool_is_refused_when_sampling(polar_base_url):
    """vLLM constrains the call envelope there (a structural tag); a free sampler could give a second
    call, an unknown name, arguments off the schema: refused, as other constrained decoding is."""
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": CHAT_TOOLS, "max_tokens": 2}
    strict = [{"type": "function", "function": {**CHAT_TOOLS[0]["function"], "strict": True}}]
    for path, body in (
            ("/v1/chat/completions", {**chat, "parallel_tool_calls": False}),
            ("/v1/chat/completions", {**chat, "tools": strict}),
            ("/v1/responses", {"model": "tiny", "input": "hi", "tools": RESP_TOOLS, "parallel_tool_calls": "false"}),
            ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                              "tools": ANTH_TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}})):
        r = httpx.post(polar_base_url + path, json=body, timeout=120)
        assert r.status_code == 400 and "needs constrained decoding" in r.text, (path, r.text)
    for body in ({**chat, "parallel_tool_calls": True}, {**chat, "tools": [
            {"type": "function", "function": {**CHAT_TOOLS[0]["function"], "strict": False}}]},
            {**chat, "parallel_tool_calls": False, "tool_choice": "none"}):
        assert httpx.post(polar_base_url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
