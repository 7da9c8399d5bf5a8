"""A reply cut by max_tokens, captured on the Anthropic wire (Claude Code's: no server ids, the
addon renders them): the template would close what the model never closed - a cut tool call
rendered complete ("arguments": {}}\n</tool_call>), a cut think block closed, a call the server
parsed whole before its </tool_call> came closed with <|im_end|> - and build trained those
tokens (a probe). Such rows keep no ids and say why; a whole turn and a cut text keep theirs."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.mitm import poll, rows_of, start_mitm
from tests.support.procs import polar_server

SCRIPT = {"scenarios": [
    {"name": "call", "match": {"user_contains": "CALL"},
     "turns": [{"content": "Sure, let me check.", "tool_calls": [
         {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]}], "after_last": "repeat_last"},
    {"name": "think", "match": {"user_contains": "THINK"},
     "turns": [{"reasoning": "The user wants weather; call the tool.", "content": "Hello there."}],
     "after_last": "repeat_last"},
]}
TOOLS = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, logs_dir: Path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cut")
    (tmp / "s.yaml").write_text(yaml.safe_dump(SCRIPT))
    with polar_server(tiny_model_dir, logs_dir, extra=["--script", str(tmp / "s.yaml")]) as base:
        m = start_mitm(tmp / "mitm", modes=[f"reverse:{base}"], tokenizer=tiny_model_dir,
                       options={"polar_flush_seconds": "0.2"})
        try:
            yield base, m
        finally:
            m.stop()


def _row(m, rollout: str) -> dict:
    return poll(lambda: m.out_dir.joinpath("calls").exists() and any(m.out_dir.glob("calls/part-*"))
                and rows_of(m.out_dir, rollout), 30, f"the row of {rollout}")[0]


def _whole_length(base: str, text: str) -> int:
    body = {"model": "tiny", "max_tokens": 200, "tools": TOOLS, "messages": [{"role": "user", "content": text}]}
    return httpx.post(base + "/v1/messages", json=body, timeout=60).json()["usage"]["output_tokens"]


@pytest.mark.parametrize("user, cut_by, stream, why", [
    ("CALL", 6, True, "cut (max_tokens) inside a tool call"),
    ("CALL", 3, False, "close the call and the turn"),  # parsed whole, its </tool_call> never sampled
    ("THINK", 12, True, "cut (max_tokens) inside its thinking"),
])
def test_a_cut_reply_keeps_no_ids_it_never_sampled(stack, user, cut_by, stream, why):
    base, m = stack
    n = _whole_length(base, user)
    rollout = f"cut-{user}-{cut_by}-{stream}"
    body = {"model": "tiny", "max_tokens": n - cut_by, "stream": stream, "tools": TOOLS,
            "messages": [{"role": "user", "content": user}]}
    r = httpx.post(m.url + "/v1/messages", json=body, headers={"x-polar-rollout": rollout}, timeout=60)
    assert r.status_code == 200
    row = _row(m, rollout)
    assert row["status"] == "ok" and row["completion_token_ids"] is None
    assert row["error"].startswith("token ids unavailable: ") and why in row["error"], row["error"]


@pytest.mark.parametrize("user, max_tokens", [("CALL", 200), ("THINK", 200)])
def test_a_whole_reply_keeps_its_rendered_ids(stack, user, max_tokens):
    base, m = stack
    rollout = f"whole-{user}"
    body = {"model": "tiny", "max_tokens": max_tokens, "stream": True, "tools": TOOLS,
            "messages": [{"role": "user", "content": user}]}
    assert httpx.post(m.url + "/v1/messages", json=body, headers={"x-polar-rollout": rollout}, timeout=60).status_code == 200
    row = _row(m, rollout)
    assert row["token_source"] == "rendered" and row["usage_match"] is True
    assert len(row["completion_token_ids"]) == row["usage_completion_tokens"]


def test_only_a_cut_or_the_calls_closing_past_the_count_drops_the_ids():
    """A review: a whole reply the template reprints longer (compact JSON re-serialised with
    spaces) or a chat reply stopped on a generation-config end token kept its ids before; only a
    cut, or tokens past the server's count that are exactly the call's and turn's closing, drop them."""
    from polar_train.capture.render import unsampled_rendering

    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    closing = "<|im_end|>\n"
    assert unsampled_rendering(call, "tool_use", "\n</tool_call><|im_end|>", closing) is not None
    assert unsampled_rendering(call, "tool_calls", "<|im_end|>", closing) is not None
    assert unsampled_rendering(call, "max_tokens", "", closing) is not None
    assert unsampled_rendering(call, "tool_use", '": 3}}\n</tool_call><|im_end|>', closing) is None  # re-serialised
    assert unsampled_rendering(call, "stop", "", closing) is None  # stopped on another end token
    text = {"role": "assistant", "content": "Hel"}
    assert unsampled_rendering(text, "length", "", closing) is None  # a cut text renders as sampled
