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


#: A Qwen3-like template of our own: a reasoning line, string content, an empty think block before
#: the last assistant turn (and after the generation prompt when thinking is off).
THINKING_TEMPLATE = (
    "{{- 'Reasoning: ' + (reasoning_effort or 'medium') + '\\n' }}"
    "{%- for message in messages %}{%- if message.content is string %}{%- set content = message.content %}"
    "{%- else %}{%- set content = '' %}{%- endif %}"
    "{%- if message.role == 'assistant' and loop.last %}{{- '<|im_start|>assistant\\n<think>\\n' + "
    "(message.reasoning_content or '') + '\\n</think>\\n\\n' + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}")


def test_a_requests_reasoning_effort_reaches_the_template_as_vllms(tiny_tokenizer):
    """vLLM renders with the request's chat_template_kwargs and its reasoning effort (Claude Code's
    output_config.effort "high"; thinking disabled is "none", so enable_thinking=false): rendered
    without them, a capture recorded "Reasoning: medium" where vLLM ran "high", and 4 tokens short
    of the disabled-thinking prompt (a probe with the real Claude Code and vLLM)."""
    import copy

    from polar_train.wire.anthropic import chat_messages, request_template_kwargs
    from polar_train.wire.render import render, template_kwargs

    assert template_kwargs(None, "high") == {"reasoning_effort": "high", "enable_thinking": True}
    assert template_kwargs({"enable_thinking": False}, "high") == {"enable_thinking": False, "reasoning_effort": "high"}
    assert template_kwargs({"x": 1}, "auto") == {"x": 1} and template_kwargs(None, None) == {}
    tok = copy.copy(tiny_tokenizer)
    tok.chat_template = THINKING_TEMPLATE
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
            "output_config": {"effort": "high"}}
    text = render(tok, chat_messages(body), None, kwargs=request_template_kwargs(body))
    assert text == "Reasoning: high\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    off = {**body, "thinking": {"type": "disabled"}}
    assert render(tok, chat_messages(off), None, kwargs=request_template_kwargs(off)).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n") and "Reasoning: none\n" in render(
        tok, chat_messages(off), None, kwargs=request_template_kwargs(off))
    # a template that reads none of them is rendered as before (ours)
    assert render(tiny_tokenizer, chat_messages(body), None, kwargs=request_template_kwargs(body)) == \
        render(tiny_tokenizer, chat_messages(body), None)


def test_a_think_block_the_template_adds_to_a_reply_without_reasoning_is_not_a_sampled_token(tiny_model_dir):
    """A template that prints a think block before the last assistant turn (Qwen3's): a reply with no
    reasoning got `<think>\\n\\n</think>\\n\\n` as its first completion tokens, which no sampler drew,
    trained as sampled (a probe). A reply with reasoning keeps its block: the model sampled it."""
    from polar_train.capture.render import Renderer

    renderer = Renderer(str(tiny_model_dir))
    renderer.tokenizer.chat_template = THINKING_TEMPLATE
    messages = [{"role": "user", "content": "hi"}]
    plain = renderer.completion_ids(messages, None, {"role": "assistant", "content": "Hello"}, True)
    assert plain == [*renderer.encode("Hello"), renderer.encode("<|im_end|>")[0]]
    thought = renderer.completion_ids(messages, None, {"role": "assistant", "content": "Hello",
                                                       "reasoning": "hmm"}, True)
    assert thought[:-1] == renderer.encode("<think>\nhmm\n</think>\n\nHello")


def test_a_tools_strict_flag_reaches_the_template_as_vllms(polar_base_url):
    """vLLM's FunctionDefinition keeps `strict` and `defer_loading` where given: Codex sends
    `"strict": false` with every tool, and each tool line of the prompt was shorter than vLLM's
    (60 tokens in a real Codex prompt; a probe with vLLM 0.32 on a Qwen3 template)."""
    from polar_train.wire.anthropic import chat_tools as messages_tools
    from polar_train.wire.render import normalize_tool
    from polar_train.wire.responses import chat_tools as responses_tools

    assert normalize_tool({"type": "function", "function": {"name": "f", "parameters": {}, "strict": True}}) == {
        "type": "function", "function": {"name": "f", "description": None, "parameters": {}, "strict": True}}
    assert responses_tools([{"type": "function", "name": "f", "parameters": {}, "strict": False}])[0]["function"] == {
        "name": "f", "description": None, "parameters": {}, "strict": False}
    assert messages_tools([{"name": "f", "input_schema": {}, "defer_loading": True}])[0]["function"] == {
        "name": "f", "description": None, "parameters": {}, "defer_loading": True}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    plain = _prompt_ids_with(polar_base_url, [tool])
    strict = _prompt_ids_with(polar_base_url, [{**tool, "function": {**tool["function"], "strict": False}}])
    assert len(strict) > len(plain)


def _prompt_ids_with(base: str, tools: list) -> list[int]:
    r = httpx.post(base + CHAT, timeout=120, json={"model": "tiny", "messages": [{"role": "user", "content": "a"}],
                                                   "tools": tools, "max_tokens": 1, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["prompt_token_ids"]


def test_messages_reach_the_template_rebuilt_as_vllms_parser_hands_them(tiny_tokenizer):
    """vLLM 0.32's parser (its functions called on the same messages; a review): for a template that
    loops over content, a string content is one text part - "" too, which the template tests as
    true; a client's
    `reasoning_content` is read as `reasoning`; a string template gets no empty texts."""
    import copy

    from polar_train.wire.render import render

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    convo = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    parts = copy.copy(tiny_tokenizer)  # a template that loops over content and tests it as a truth value
    parts.chat_template = ("{%- for m in messages -%}[{%- if m['content'] -%}T{%- endif -%}:"
                           "{%- for p in m['content'] -%}{{ p['text'] }};{%- endfor -%}]{%- endfor -%}")
    assert render(parts, convo, None, add_generation_prompt=False) == "[T:q;][T:;]"
    none = [convo[0], {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert render(parts, none, None, add_generation_prompt=False) == "[T:q;][:]"
    thought = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "R"}]
    assert "<think>\nR\n</think>\n\na" in render(tiny_tokenizer, thought, None, add_generation_prompt=False)
    tok = copy.copy(tiny_tokenizer)
    tok.chat_template = STRING_TEMPLATE
    parts = [{"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "b"}]}]
    assert render(tok, parts, None, add_generation_prompt=False) == "<|im_start|>user\nb<|im_end|>\n"
