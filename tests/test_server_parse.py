"""Streaming parse vs final parse: whatever the token boundaries, the reasoning / content / tool-call
deltas a stream sends add up to what the non-streamed response reports, where vLLM's do."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from polar_train.server.completion import CompletionState
from polar_train.server.engine import Finish, TokenStep
from polar_train.server.hermes_stream import partial_tag_overlap
from polar_train.server.parse import parse_turn, split_reasoning
from tests.support.piece_tokenizer import piece_tokenizer

PIECES = ["<think>", "</think>", "\n", "\n\n", "Let", " me", " look", ".", "<tool_call>", "</tool_call>",
          '{"name": "f", "arguments": {"a": 1}}', '{"name": "g", "arguments": {}}', "{bad", "<", "tool",
          "_call>", "é", "日本", " "]


class FakeEngine:
    def __init__(self, vocab: list[str]) -> None:
        self.tokenizer = piece_tokenizer(vocab, special=("<|im_end|>",))
        self.stop_token_ids = frozenset({len(vocab) - 1})


@settings(max_examples=400, deadline=None)
@given(st.lists(st.sampled_from(range(len(PIECES))), max_size=14), st.booleans(), st.booleans())
def test_stream_deltas_add_up_to_the_final_parse(ids, tools_enabled, stop):
    """Reasoning and plain content add up to the final parse; with tools, the content is the text
    before the first ``<tool_call>`` (a partial tag at the end held back for good, as vLLM's
    hermes parser does), and where every block parses, the calls' streamed names and argument
    pieces add up to the final calls."""
    vocab = PIECES + ["<|im_end|>"]
    engine = FakeEngine(vocab)
    ids = list(ids) + ([len(vocab) - 1] if stop else [])
    if not ids:
        return
    state = CompletionState(engine, tools_enabled)
    reasoning, content, names, args = "", "", {}, {}
    for k, tid in enumerate(ids):
        last = k == len(ids) - 1
        d = state.push(TokenStep(tid, -1.0, [], Finish("stop" if stop else "length") if last else None))
        reasoning += d.reasoning
        content += d.content
        for c in d.call_deltas:
            if c.name is not None:
                names[c.index] = c.name
            if c.arguments:
                args[c.index] = args.get(c.index, "") + c.arguments
    text = "".join(vocab[i] for i in ids if i != len(vocab) - 1)
    final = parse_turn(text, tools_enabled)
    assert state.final() is not None
    assert reasoning == (final.reasoning or "")
    if not tools_enabled:
        assert content == (final.content or "") and not names
        return
    rest = split_reasoning(text)[1]
    cut = rest.find("<tool_call>")
    assert content == (rest[:cut] if cut >= 0 else rest[: len(rest) - partial_tag_overlap(rest, "<tool_call>")])
    if final.tool_calls:
        assert [names[i] for i in sorted(names)] == [c.name for c in final.tool_calls]
        assert [json.loads(args[i]) for i in sorted(names)] == [json.loads(c.arguments) for c in final.tool_calls]


def test_parse_turn_like_vllm_hermes():
    t = parse_turn('<think>\nplan\n</think>\n\nLet me look.\n<tool_call>\n{"name": "f", "arguments": '
                   '{"path": "é"}}\n</tool_call>', True)
    assert (t.reasoning, t.content) == ("plan", "Let me look.\n")  # (vLLM keeps the newline)
    assert t.tool_calls[0].name == "f" and t.tool_calls[0].arguments == '{"path": "é"}'
    assert parse_turn("<tool_call>\n{bad}\n</tool_call>", True).content == "<tool_call>\n{bad}\n</tool_call>"
    assert parse_turn('<tool_call>{"name": "f", "arguments": {}}</tool_call>', False).tool_calls == []
    assert parse_turn('<tool_call>{"name": "f", "arguments": {}}</tool_call>', True).content is None


def test_a_block_whose_name_is_no_string_is_no_call():
    """vLLM's FunctionCall refuses a name of another type: the whole answer is content (a dict
    name crashed our Responses item building)."""
    for name in ("5", "null", '{"a": 1}'):
        text = '<tool_call>{"name": ' + name + ', "arguments": {}}</tool_call>'
        t = parse_turn(text, True)
        assert (t.content, t.tool_calls) == (text, [])
