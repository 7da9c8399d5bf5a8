"""Scripted mode: the scripted turn's tokens are the template's, logprobs the model's, and every
API (chat, responses, messages; streaming or not) reports the same reasoning, text and tool calls,
parsed by the official SDKs."""

from __future__ import annotations

import json
import re

import anthropic
import httpx
import openai
import pytest
import torch
import yaml

from polar_train.server.script import Script, ScriptError, assistant_turns
from tests.support.procs import polar_server

SCRIPT = {
    "scenarios": [{
        "name": "fix-add",
        "match": {"tool": "shell"},
        "turns": [
            {"reasoning": "I should read the file first.", "content": "Let me look.",
             "tool_calls": [{"name": "shell", "arguments": {"cmd": "cat calc.py"}}]},
            {"tool_calls": [{"name": "apply_patch", "input": "*** Begin Patch\n*** End Patch\n"}]},
            {"content": "Done: the test passes now. ✓"},
        ],
    }],
    "side_calls": [{"match": {"no_tools": True}, "reply": {"content": "Fix failing add()"}}],
}
CHAT_TOOLS = [{"type": "function", "function": {
    "name": "shell", "description": "Run a command",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}]
RESP_TOOLS = [{"type": "function", "name": "shell", "description": "Run a command",
               "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
              {"type": "custom", "name": "apply_patch", "description": "Apply a patch"}]
ANTH_TOOLS = [{"name": "shell", "description": "Run a command",
               "input_schema": {"type": "object", "properties": {"cmd": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def scripted_url(tiny_model_dir, logs_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("script") / "scenario.yaml"
    path.write_text(yaml.safe_dump(SCRIPT, allow_unicode=True))
    with polar_server(tiny_model_dir, logs_dir, extra=["--script", str(path)]) as base:
        yield base


def test_scripted_chat_tokens_are_the_rendered_turn(scripted_url, tiny_tokenizer, tiny_model_dir):
    messages = [{"role": "user", "content": "fix add"}]
    body = httpx.post(scripted_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "tools": CHAT_TOOLS, "return_token_ids": True,
        "logprobs": True}).json()
    ch = body["choices"][0]
    assert ch["finish_reason"] == "tool_calls"
    assert ch["message"]["reasoning"] == "I should read the file first."
    assert ch["message"]["content"] == "Let me look.\n"  # (vLLM keeps the newline before <tool_call>)
    call = ch["message"]["tool_calls"][0]
    assert call["function"]["name"] == "shell" and json.loads(call["function"]["arguments"]) == {
        "cmd": "cat calc.py"}
    # The completion ids + "\n" are exactly what the template renders for the next request
    # that carries this turn back (prefix-stable within the agent loop).
    turn = {"role": "assistant", "content": ch["message"]["content"],
            "reasoning_content": ch["message"]["reasoning"],
            "tool_calls": [{"id": call["id"], "type": "function", "function": {
                "name": "shell", "arguments": json.loads(call["function"]["arguments"])}}]}
    nxt = messages + [turn, {"role": "tool", "tool_call_id": call["id"], "content": "def add"}]
    rendered = tiny_tokenizer.apply_chat_template(nxt, tools=CHAT_TOOLS, tokenize=True,
                                                  return_dict=False, add_generation_prompt=True)
    prefix = body["prompt_token_ids"] + ch["token_ids"]
    assert ch["token_ids"][-1] == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert list(rendered[: len(prefix)]) == prefix
    # logprobs are the model's own
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prefix])).logits[0].float(), -1)
    n = len(body["prompt_token_ids"])
    got = [e["logprob"] for e in ch["logprobs"]["content"]]
    want = [float(ref[n - 1 + k, t]) for k, t in enumerate(ch["token_ids"])]
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-4


def test_scripted_turn_index_and_side_call(scripted_url):
    client = openai.OpenAI(base_url=scripted_url + "/v1", api_key="unused")
    msgs = [{"role": "user", "content": "fix add"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"},
            {"role": "assistant", "content": "patched"},
            {"role": "user", "content": "and now?"}]
    r = client.chat.completions.create(model="tiny", messages=msgs, tools=CHAT_TOOLS)
    assert r.choices[0].message.content == "Done: the test passes now. ✓"
    assert r.choices[0].finish_reason == "stop"
    title = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "t"}])
    assert title.choices[0].message.content == "Fix failing add()"
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs[:1], tools=CHAT_TOOLS,
                                                 stream=True))
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].function.name == "shell" and calls[0].id.startswith("chatcmpl-tool-")
    assert "".join(tc.function.arguments or "" for tc in calls) == '{"cmd": "cat calc.py"}'
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me look.\n"


def test_a_scripted_call_to_a_tool_the_request_does_not_offer_is_logged(scripted_url, logs_dir):
    """Answered as scripted (a model can do it too), but the serve log says so: a scenario written
    for Codex's tool names got refused calls from another harness without a word."""
    log = logs_dir / f"polar-serve-{scripted_url.rsplit(':', 1)[1]}.log"
    msgs = [{"role": "user", "content": "fix add"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "shell", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "x"}]
    line = "scripted turn calls 'apply_patch', which this openai.chat request does not offer (its tools: shell)"
    before = log.read_text().count("scripted turn calls")  # (other tests share this server)
    offered = httpx.post(scripted_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": msgs[:1], "tools": CHAT_TOOLS})  # turn 1 calls shell: offered
    assert offered.status_code == 200 and log.read_text().count("scripted turn calls") == before
    r = httpx.post(scripted_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": msgs, "tools": CHAT_TOOLS})  # turn 2 calls apply_patch
    assert r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "apply_patch"
    text = log.read_text()
    assert text.count("scripted turn calls") == before + 1 and line in text


def test_scripted_responses_sdk_stream_and_not(scripted_url):
    client = openai.OpenAI(base_url=scripted_url + "/v1", api_key="unused")
    r = client.responses.create(model="tiny", input="fix add", tools=RESP_TOOLS,
                                extra_body={"enable_response_messages": True},
                                include=["message.output_text.logprobs"], top_logprobs=1)
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "I should read the file first."
    assert r.output[1].content[0].text == "Let me look.\n" and len(r.output[1].content[0].logprobs) > 0
    assert json.loads(r.output[2].arguments) == {"cmd": "cat calc.py"}
    out_msgs = r.model_extra["output_messages"]
    assert out_msgs[0]["type"] == "raw_message_tokens" and out_msgs[0]["tokens"][-1] == 248046
    assert r.usage.output_tokens == len(out_msgs[0]["tokens"])
    assert r.model_extra["input_messages"][0]["tokens"][-3:] == [248045, 74455, 198]
    # second turn: the custom tool call (Codex's apply_patch)
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "fix add"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "I should read the file first."}]},
             {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd": "cat calc.py"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "def add(a, b): return a - b"}]
    events = list(client.responses.create(model="tiny", input=items, tools=RESP_TOOLS, stream=True))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert [o.type for o in done.output] == ["custom_tool_call"]
    assert done.output[0].input == "*** Begin Patch\n*** End Patch\n" and done.output[0].name == "apply_patch"
    assert "response.custom_tool_call_input.done" in types


def test_scripted_messages_sdk_stream_and_not(scripted_url):
    client = anthropic.Anthropic(base_url=scripted_url, api_key="unused")
    kw = dict(model="tiny", max_tokens=200, tools=ANTH_TOOLS, system=[{"type": "text", "text": "Be brief"}],
              messages=[{"role": "user", "content": "fix add"}])
    m = client.messages.create(**kw)
    assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
    assert m.content[0].thinking == "I should read the file first."
    assert m.content[2].input == {"cmd": "cat calc.py"} and m.stop_reason == "tool_use"
    count = client.messages.count_tokens(model="tiny", tools=ANTH_TOOLS, system=kw["system"],
                                         messages=kw["messages"])
    assert count.input_tokens == m.usage.input_tokens
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"cmd": "cat calc.py"} and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == m.usage.output_tokens
    short = client.messages.create(**{**kw, "max_tokens": 3})
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3


def test_scripted_mismatch_is_a_400(scripted_url):
    r = httpx.post(scripted_url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "other"}}]})
    assert r.status_code == 400 and "no scenario" in r.json()["error"]["message"]


def test_script_parsing_errors_are_one_line(tmp_path, tiny_model_dir, capsys):
    with pytest.raises(ScriptError, match="unknown keys"):
        Script.from_data({"scenarios": [{"turns": [{"text": "x"}]}]})
    with pytest.raises(ScriptError, match="at least one turn"):
        Script.from_data({"scenarios": [{"name": "a"}]})
    turn = {"content": "x"}
    for data, message in (
        ({"scenarios": [{"turns": 5}]}, r"scenarios\[0\]\.turns must be a list, got int"),
        ({"scenarios": [{"turns": [{"tool_calls": 5}]}]}, r"turns\[0\]\.tool_calls must be a list"),
        ({"scenarios": [{"turns": [turn]}], "side_calls": 5}, "side_calls must be a list"),
        ({"scenarios": [{"turns": [turn], "bogus": 1}]}, r"scenarios\[0\]: unknown keys \['bogus'\]"),
        ({"scenarios": [{"turns": [turn]}], "sidecalls": []}, r"unknown keys \['sidecalls'\]"),
        ({"scenarios": [{"turns": [{"tool_calls": [{"name": "f", "arguements": {"a": 1}}]}]}]},
         r"tool_calls\[0\]: unknown keys \['arguements'\]"),
        ({"scenarios": [{"turns": [{}]}]}, r"turns\[0\]: an empty turn"),
        ({"scenarios": [{"turns": [turn], "match": {"no_tools": "yes"}}]}, "match.no_tools must be a bool"),
        ({"scenarios": [{"turns": [turn], "match": {"tool": [1, 2]}}]}, "match.tool must be a str"),
        ({"scenarios": [{"turns": [turn], "name": [1]}]}, r"scenarios\[0\]\.name must be a string"),
        ({"scenarios": [{"turns": [turn], "after_last": "stop"}]}, "after_last must be one of last_text, "),
    ):
        with pytest.raises(ScriptError, match=message):
            Script.from_data(data)  # each started the server before (or failed with a TypeError)
    bad = tmp_path / "bad.yaml"
    bad.write_text("scenarios: [\n")
    from polar_train.cli import main

    assert main(["serve", "--model", str(tiny_model_dir), "--script", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().count("\n") == 0 and "cannot parse" in err


def test_assistant_turns_counts_runs():
    msgs = [{"role": "user"}, {"role": "assistant"}, {"role": "assistant"}, {"role": "tool"},
            {"role": "assistant"}]
    assert assistant_turns(msgs) == 2


# --- bad scenario files: one line naming the file and the field, exit 2, before the model loads ---

def _serve_error(tmp_path, tiny_model_dir, capsys, monkeypatch, name: str, text: str) -> str:
    """``polar-train serve`` on a scenario file: exit 2 with one line, the model never loaded."""
    from polar_train.cli import main
    from polar_train.server import engine

    def no_model(*_a, **_k):
        raise AssertionError("the model was loaded before the scenario file was checked")

    monkeypatch.setattr(engine, "Engine", no_model)
    path = tmp_path / name
    path.write_text(text)
    assert main(["serve", "--model", str(tiny_model_dir), "--script", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().count("\n") == 0, err
    assert err.startswith(f"polar-train serve: error: {path}: "), err
    return err.strip()


def _load_error(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ScriptError) as info:
        Script.load(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: "), message
    return message


TURN_YAML = "scenarios:\n  - turns:\n      - content: hi\n"


def test_yaml_syntax_error_keeps_line_column_and_problem(tmp_path, tiny_model_dir, capsys, monkeypatch):
    err = _serve_error(tmp_path, tiny_model_dir, capsys, monkeypatch, "bad.yaml",
                       "scenarios:\n  - name: a\n - name: b\n")
    assert "cannot parse" in err and "expected <block end>, but found" in err, err
    assert "line 3, column 2" in err, err
    err = _serve_error(tmp_path, tiny_model_dir, capsys, monkeypatch, "tab.yaml",
                       "scenarios:\n  - turns:\n\t- content: x\n")
    assert "found character '\\t' that cannot start any token" in err and "line 3" in err, err
    err = _serve_error(tmp_path, tiny_model_dir, capsys, monkeypatch, "bad.json", '{"scenarios": [\n  1,\n')
    assert "cannot parse" in err and "line 3" in err, err


def test_side_call_needs_a_non_empty_match(tmp_path, tiny_model_dir, capsys, monkeypatch):
    # without `match` it was {}: it matched every request and hid every scenario
    turn = {"content": "x"}
    sides = [{"reply": turn}] + [{"match": m, "reply": turn} for m in (None, {}, [], False, "")]
    for side in sides:
        with pytest.raises(ScriptError, match=r"side_calls\[0\]\.match is required"):
            Script.from_data({"scenarios": [{"turns": [turn]}], "side_calls": [side]})
    # a scenario may match everything, but a falsy non-mapping (`match: false`) is not that
    for match in ([], False, ""):
        with pytest.raises(ScriptError, match=r"scenarios\[0\]\.match must be a mapping"):
            Script.from_data({"scenarios": [{"turns": [turn], "match": match}]})
    err = _serve_error(tmp_path, tiny_model_dir, capsys, monkeypatch, "side.yaml",
                       TURN_YAML + "side_calls:\n  - reply: {content: title}\n")
    assert "side_calls[0].match is required" in err, err


@pytest.mark.parametrize("value", ["null", "{a: 1}", "5", "[x]", "true"])
def test_freeform_input_must_be_a_string(tmp_path, value):
    err = _load_error(tmp_path, "s.yaml", "scenarios:\n  - turns:\n      - tool_calls:\n"
                                          f"          - {{name: apply_patch, input: {value}}}\n")
    assert "scenarios[0].turns[0].tool_calls[0].input must be a string" in err, err


@pytest.mark.parametrize("name", ["''", "'  '"])
def test_a_tool_call_needs_a_name(tmp_path, name):
    """A call to the tool "" passed the loader (a probe): no harness can run it."""
    err = _load_error(tmp_path, "s.yaml", "scenarios:\n  - turns:\n      - tool_calls:\n"
                                          f"          - {{name: {name}, arguments: {{}}}}\n")
    assert "scenarios[0].turns[0].tool_calls[0]: needs a 'name'" in err, err


@pytest.mark.parametrize("arguments, path", [
    ("{when: 2024-01-01}", "arguments.when"),
    ("{x: .nan}", "arguments.x"),
    ("{xs: [1, .inf]}", "arguments.xs[1]"),
    ("{a: {b: 2024-01-01 10:00:00}}", "arguments.a.b"),
    ("{1: a}", "arguments"),
    ("{a: !!binary aGk=}", "arguments.a"),
    ("'{\"a\": NaN}'", "arguments.a"),
])
def test_tool_arguments_must_be_json(tmp_path, arguments, path):
    err = _load_error(tmp_path, "s.yaml", "scenarios:\n  - turns:\n      - tool_calls:\n"
                                          f"          - {{name: f, arguments: {arguments}}}\n")
    assert f"scenarios[0].turns[0].tool_calls[0].{path}" in err and "JSON" in err, err
    # the ones that pass: JSON types only
    ok = _write_script(tmp_path, "scenarios:\n  - turns:\n      - tool_calls:\n          - name: f\n"
                                 "            arguments: {a: '2024-01-01', b: [1, 2.5, true, null],"
                                 " c: {d: x}}\n")
    assert Script.load(ok).scenarios[0].turns[0].tool_calls[0]["arguments"] == {
        "a": "2024-01-01", "b": [1, 2.5, True, None], "c": {"d": "x"}}


def _write_script(tmp_path, text: str, name: str = "ok.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize("turn, field, token", [
    ({"content": "a <|im_end|> b"}, "scenarios[0].turns[0].content", "<|im_end|>"),
    ({"reasoning": "x<|endoftext|>"}, "scenarios[0].turns[0].reasoning", "<|endoftext|>"),
    ({"content": "<|im_start|>user"}, "scenarios[0].turns[0].content", "<|im_start|>"),
    ({"content": "a</think>b"}, "scenarios[0].turns[0].content", "</think>"),
    ({"tool_calls": [{"name": "f<tool_call>"}]}, "scenarios[0].turns[0].tool_calls[0].name", "<tool_call>"),
    ({"tool_calls": [{"name": "f", "arguments": {"a": ["x", "<|im_end|>"]}}]},
     "scenarios[0].turns[0].tool_calls[0].arguments.a[1]", "<|im_end|>"),
    ({"tool_calls": [{"name": "f", "arguments": {"<|im_end|>": 1}}]},
     "scenarios[0].turns[0].tool_calls[0].arguments", "<|im_end|>"),
    ({"tool_calls": [{"name": "f", "arguments": '{"a": "<|audio_pad|>"}'}]},
     "scenarios[0].turns[0].tool_calls[0].arguments.a", "<|audio_pad|>"),
    ({"tool_calls": [{"name": "f", "input": "x<|im_end|>"}]},
     "scenarios[0].turns[0].tool_calls[0].input", "<|im_end|>"),
])
def test_special_tokens_in_scripted_text_are_refused(turn, field, token):
    with pytest.raises(ScriptError) as info:
        Script.from_data({"scenarios": [{"turns": [turn]}]})
    assert field in str(info.value) and repr(token) in str(info.value), str(info.value)
    with pytest.raises(ScriptError, match=r"side_calls\[0\]\.reply\.content"):
        Script.from_data({"side_calls": [{"match": {"no_tools": True}, "reply": {"content": "<|im_end|>"}}]})


def test_special_tokens_refused_are_the_tokenizers(tiny_tokenizer):
    from polar_train.tokenizer import special_tokens

    tokens = special_tokens()
    assert [i for i, _ in tokens] == list(range(248044, 248077))
    for idx, tok in tokens:
        assert tiny_tokenizer.convert_tokens_to_ids(tok) == idx
        with pytest.raises(ScriptError, match=re.escape(repr(tok))):
            Script.from_data({"scenarios": [{"turns": [{"content": f"a {tok} b"}]}]})
    # text that merely looks alike stays allowed
    Script.from_data({"scenarios": [{"turns": [{"content": "a <|im_end| b <think b"}]}]})


def test_yaml_extension_is_case_insensitive(tmp_path):
    for name in ("x.YAML", "x.Yml", "x.yMl"):
        script = Script.load(_write_script(tmp_path, TURN_YAML, name))
        assert script.scenarios[0].turns[0].content == "hi"


def test_duplicate_keys_are_refused(tmp_path, tiny_model_dir, capsys, monkeypatch):
    err = _serve_error(tmp_path, tiny_model_dir, capsys, monkeypatch, "dup.yaml",
                       "scenarios:\n  - match:\n      tool: shell\n      tool: edit\n"
                       "    turns: [{content: hi}]\n")
    assert "duplicate key 'tool'" in err and "line 4" in err and "line 3" in err, err
    err = _load_error(tmp_path, "dup2.yaml", TURN_YAML + "scenarios: []\n")
    assert "duplicate key 'scenarios'" in err and "line 4" in err, err
    err = _load_error(tmp_path, "dup.json", '{"scenarios": [{"turns": [{"content": "a", "content": "b"}]}]}')
    assert "duplicate key 'content'" in err, err
    # a YAML merge key overriding a merged value is not a duplicate
    script = Script.load(_write_script(tmp_path, "scenarios:\n  - match: {<<: {tool: shell}, tool: edit}\n"
                                       "    turns: [{content: hi}]\n"))
    assert script.scenarios[0].match == {"tool": "edit"}


def test_docs_cover_after_last_and_namespace_tools():
    from pathlib import Path

    from polar_train.server.script import _AFTER_LAST

    doc = (Path(__file__).resolve().parents[1] / "docs" / "scenario-format.md").read_text("utf-8")
    for value in _AFTER_LAST:
        assert f"`{value}`" in doc, value
    assert "mcp__search" in doc and "namespace" in doc
