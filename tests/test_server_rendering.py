"""What chat completions accept and render, as vLLM 0.32 does: a message of a role the chat
template does not know (``wizard``, ``function``) reaches the template, which drops it (even
every message); assistant tool-call ``arguments`` that are no JSON render as ``{}``; ``arguments``
given as an object are vLLM's pydantic 400.

The reference answers in ``tests/data/vllm_wire/rendering.json`` are vLLM 0.32's (its CPU build on
the tiny model, greedy, with ``return_token_ids``), recorded with these very requests: the
``prompt_token_ids`` show what vLLM rendered.
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.vllm_recorded import assert_answers_as_vllm, recorded

RECORDED = recorded("rendering")
CHAT = "/v1/chat/completions"


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_answer_equals_vllms_recorded_answer(polar_base_url, name):
    assert_answers_as_vllm(polar_base_url, RECORDED[name])


def _prompt_ids(base: str, messages: list) -> list[int]:
    r = httpx.post(base + CHAT, timeout=120, json={
        "model": "tiny", "messages": messages, "max_tokens": 1, "temperature": 0,
        "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"]


@pytest.mark.parametrize("role", ["wizard", "function"])
def test_unknown_role_among_others_is_dropped(polar_base_url, role):
    user = {"role": "user", "content": "yo"}
    dropped = {"role": role, "name": "f", "content": "hi"}
    assert _prompt_ids(polar_base_url, [dropped, user, dropped]) == _prompt_ids(polar_base_url, [user])


@pytest.mark.parametrize("args", [None, "[1, 2]", "42", "null", "true", '"s"'])
def test_arguments_that_are_no_json_object_render_as_an_empty_object(polar_base_url, args):
    """vLLM's _postprocess_messages keeps only a JSON object: text, a list, a number or a string
    all render as {} (a list or a string used to render as itself)."""
    body = RECORDED["chat_tool_args_nonjson"]["request"]["body"]
    given = json.loads(json.dumps(body["messages"]))
    if args is not None:
        given[1]["tool_calls"][0]["function"]["arguments"] = args
    as_empty = json.loads(json.dumps(body["messages"]))
    as_empty[1]["tool_calls"][0]["function"]["arguments"] = "{}"
    assert _prompt_ids(polar_base_url, given[:2]) == _prompt_ids(polar_base_url, as_empty[:2])


def test_object_arguments_of_a_later_tool_call_name_its_index(polar_base_url):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    bad = {"id": "d", "type": "function", "function": {"name": "f", "arguments": {"a": 1, "b": 2}}}
    r = httpx.post(polar_base_url + CHAT, timeout=120, json={"model": "tiny", "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call, bad]}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "body.1.ChatCompletionMessageFunctionToolCallParam.function"
    assert err["message"].startswith("3 validation errors:\n") and "<dict of 2 items>" in err["message"]


#: A template that prints a message's content only when it is a string ("string" content format,
#: as Qwen3's own), and knows no developer role; vLLM 0.32 (its CPU build on the tiny model with this
#: template) gave the same prompt ids as these texts for each case below.
STRING_TEMPLATE = (
    "{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}{{- '<|im_start|>' + message.role + '\\n' + content + "
    "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.mark.parametrize("messages, text", [
    # Claude Code's user turn of several text blocks: the texts joined by newlines (it rendered empty)
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
     "<|im_start|>user\na\nb<|im_end|>\n"),
    ([{"role": "user", "content": [{"type": "input_text", "text": "a"}, "b", {"type": "refusal", "refusal": "c"}]}],
     "<|im_start|>user\na\nb\nc<|im_end|>\n"),
    # Codex's developer messages, for a template without that role: one first system message
    ([{"role": "system", "content": "S"}, {"role": "developer", "content": "D"}, {"role": "user", "content": "a"}],
     "<|im_start|>system\nS\n\nD<|im_end|>\n<|im_start|>user\na<|im_end|>\n"),
    ([{"role": "developer", "content": "D"}, {"role": "user", "content": "a"}],
     "<|im_start|>system\nD<|im_end|>\n<|im_start|>user\na<|im_end|>\n"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}],
     "<|im_start|>user\na<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"),
])
def test_a_string_format_template_gets_what_vllm_hands_it(tiny_tokenizer, messages, text):
    """vLLM reads how a template reads content: a template that loops over it gets the parts (ours),
    any other one string, the texts joined by newlines; developer messages become system ones where
    the template has no such role. Parts were passed to every template as they came."""
    import copy

    from polar_train.wire.content_format import template_content_format
    from polar_train.wire.render import render

    tok = copy.copy(tiny_tokenizer)
    tok.chat_template = STRING_TEMPLATE
    assert template_content_format(STRING_TEMPLATE) == "string"
    assert template_content_format(tiny_tokenizer.get_chat_template()) == "openai"
    assert render(tok, messages, None, add_generation_prompt=False) == text
