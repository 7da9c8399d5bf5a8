"""Scripted mode: the scripted turn's tokens are the template's, logprobs the model's, and every
API (chat, responses, messages; streaming or not) reports the same reasoning, text and tool calls,
parsed by the official SDKs."""

from __future__ import annotations

import json

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
    assert ch["message"]["content"] == "Let me look."
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
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me look."


def test_scripted_responses_sdk_stream_and_not(scripted_url):
    client = openai.OpenAI(base_url=scripted_url + "/v1", api_key="unused")
    r = client.responses.create(model="tiny", input="fix add", tools=RESP_TOOLS,
                                extra_body={"enable_response_messages": True},
                                include=["message.output_text.logprobs"], top_logprobs=1)
    kinds = [o.type for o in r.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "I should read the file first."
    assert r.output[1].content[0].text == "Let me look." and len(r.output[1].content[0].logprobs) > 0
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
