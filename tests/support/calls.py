"""Hand-built call logs with real token ids, for tests of everything that reads the call log.

Why not random ids: the builder's job is to notice that the prompt of call k+1 is (or is not)
the template render of the conversation so far. So every prompt here is the real render of
``polar_train/templates/chatml_qwen3.jinja`` encoded with the Qwen3.5 tokenizer (the tiny
model's), every completion is the exact token render of the assistant turn, and each sampled
token gets a distinct logprob, so a test can check alignment token by token.

Usage::

    conv = Conversation(tok, rollout_id="r1")
    conv.user("list files")
    row1 = conv.assistant(content="", tool_calls=[("ls", {"path": "."})])
    conv.tool("a.txt b.txt")
    row2 = conv.assistant(content="done")
    write_parts(folder, [row1, row2])
"""

from __future__ import annotations

import hashlib
import itertools
import json
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from polar_train.schema import CALL_LOG_SCHEMA

IM_END_ID = 248046

_clock = itertools.count()
_T0 = datetime(2026, 12, 2, 12, 0, 0, tzinfo=timezone.utc)


@lru_cache(maxsize=1)
def chat_tokenizer():
    """The tiny model's tokenizer (Qwen3.5 vocabulary + our ChatML template), cached."""
    from polar_train.tokenizer import build_tokenizer

    return build_tokenizer()


def encode(tok, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False))


def next_time() -> datetime:
    """A strictly increasing timestamp shared by all conversations (calls interleave in order)."""
    return _T0 + timedelta(milliseconds=10 * next(_clock))


def logprobs_for(call_id: str, n: int) -> list[float]:
    """Distinct, reproducible logprobs: token i of call X gets a value no other token has."""
    seed = int(hashlib.sha256(call_id.encode()).hexdigest()[:6], 16)
    return [-(1.0 + ((seed + 7919 * i) % 100_000) / 1000.0) for i in range(n)]


class Conversation:
    """One agent conversation: messages so far, and call-log rows for each model call."""

    def __init__(self, tok=None, *, rollout_id: str | None = "r1", task_id: str | None = None,
                 system: str | None = "You are a coding agent.", tools: list[dict] | None = None,
                 model: str = "tiny", temperature: float | None = 1.0, name: str | None = None):
        self.tok = tok or chat_tokenizer()
        self.rollout_id = rollout_id
        self.task_id = task_id
        self.tools = tools if tools is not None else [
            {"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
        self.model = model
        self.temperature = temperature
        self.name = name or (rollout_id or "anon")
        self.messages: list[dict[str, Any]] = []
        self.calls = 0
        if system:
            self.messages.append({"role": "system", "content": system})

    # --- conversation -------------------------------------------------------------------
    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def tool(self, content: str, tool_call_id: str = "call_0") -> None:
        self.messages.append({"role": "tool", "tool_call_id": tool_call_id, "content": content})

    def render(self, messages: list[dict] | None = None, *, generation_prompt: bool = True) -> str:
        return self.tok.apply_chat_template(
            messages if messages is not None else self.messages, tools=self.tools or None,
            tokenize=False, add_generation_prompt=generation_prompt)

    def prompt_ids(self) -> list[int]:
        return encode(self.tok, self.render())

    @staticmethod
    def assistant_message(content: str = "", reasoning: str | None = None,
                          tool_calls: list[tuple[str, dict]] | None = None) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if tool_calls:
            msg["tool_calls"] = [
                {"id": f"call_{i}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}}
                for i, (name, args) in enumerate(tool_calls)]
        return msg

    def completion_text(self, msg: dict[str, Any]) -> str:
        """What the model sampled for ``msg``: its render after the generation prompt, with
        ``<|im_end|>`` but without the template's trailing newline."""
        prompt = self.render()
        full = self.render(self.messages + [msg], generation_prompt=False)
        assert full.startswith(prompt), "template is not prefix-stable here"
        text = full[len(prompt):]
        assert text.endswith("<|im_end|>\n")
        return text[:-1]

    def assistant(self, content: str = "", *, reasoning: str | None = None,
                  tool_calls: list[tuple[str, dict]] | None = None,
                  completion_ids: list[int] | None = None, include_im_end: bool = True,
                  finish_reason: str | None = None, append: bool = True,
                  **row_overrides: Any) -> dict[str, Any]:
        """A model call answering the conversation so far; appends the answer to it.

        ``completion_ids`` overrides the sampled ids (e.g. a different tokenisation of the same
        text); ``include_im_end=False`` mimics a server that leaves the stop token out.
        """
        msg = self.assistant_message(content, reasoning, tool_calls)
        prompt = self.prompt_ids()
        if completion_ids is None:
            completion_ids = encode(self.tok, self.completion_text(msg))
            if not include_im_end:
                assert completion_ids[-1] == IM_END_ID
                completion_ids = completion_ids[:-1]
        self.calls += 1
        call_id = f"{self.name}-c{self.calls}"
        row = make_row(call_id=call_id, rollout_id=self.rollout_id, task_id=self.task_id,
                       prompt_ids=prompt, completion_ids=list(completion_ids), model=self.model,
                       temperature=self.temperature,
                       finish_reason=finish_reason or ("tool_calls" if tool_calls else "stop"),
                       request={"model": self.model, "messages": self.messages, "tools": self.tools},
                       tool_call_count=len(tool_calls or []))
        row.update(row_overrides)
        if append:
            self.messages.append(msg)
        return row


def make_row(*, call_id: str, prompt_ids: list[int] | None, completion_ids: list[int] | None,
             rollout_id: str | None = "r1", task_id: str | None = None, model: str = "tiny",
             temperature: float | None = 1.0, finish_reason: str = "stop", status: str = "ok",
             attempt: int = 1, request: dict | None = None, token_source: str = "server",
             logprobs: list[float] | None = None, tool_call_count: int = 0,
             **extra: Any) -> dict[str, Any]:
    """One call-log row with every column of ``CALL_LOG_SCHEMA`` filled plausibly."""
    started = next_time()
    request_json = json.dumps(request or {"call": call_id}, sort_keys=True)
    if logprobs is None and completion_ids is not None:
        logprobs = logprobs_for(call_id, len(completion_ids))
    row: dict[str, Any] = {
        "call_id": call_id, "rollout_id": rollout_id,
        "rollout_source": "proxy_auth" if rollout_id else "none", "task_id": task_id,
        "api": "openai.chat", "method": "POST", "host": "127.0.0.1:8000",
        "path": "/v1/chat/completions", "model": model, "attempt": attempt,
        "request_hash": hashlib.sha256(request_json.encode()).hexdigest()[:32],
        "client_conn_id": f"conn-{rollout_id}", "started_at": started,
        "first_byte_at": started + timedelta(milliseconds=2),
        "finished_at": started + timedelta(milliseconds=5), "stream": False,
        "http_status": 200 if status == "ok" else 500, "status": status,
        "error": None if status == "ok" else "upstream said no", "request_json": request_json,
        "response_json": "{}", "prompt_token_ids": prompt_ids,
        "completion_token_ids": completion_ids, "completion_logprobs": logprobs,
        "token_source": token_source,
        "usage_prompt_tokens": len(prompt_ids) if prompt_ids is not None else None,
        "usage_completion_tokens": len(completion_ids) if completion_ids is not None else None,
        "usage_match": True, "finish_reason": finish_reason, "tool_call_count": tool_call_count,
        "temperature": temperature, "top_p": 1.0, "injected": False,
        "prompt_prefix_call_id": None, "prompt_prefix_len": None,
    }
    row.update(extra)
    return row


def calls_table(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=CALL_LOG_SCHEMA)


def write_parts(folder: str | Path, rows: list[dict[str, Any]], name: str = "part-00000") -> Path:
    """Write ``rows`` as one finished part ``<folder>/calls/<name>.parquet``; returns the path."""
    calls = Path(folder) / "calls"
    calls.mkdir(parents=True, exist_ok=True)
    path = calls / f"{name}.parquet"
    pq.write_table(calls_table(rows), path)
    return path


def compact(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same calls with prompts stored compactly (prefix of the previous call + suffix).

    Row k refers to row k-1 whenever row k's prompt starts with a prefix of row k-1's prompt +
    completion; it then stores only the rest. Used to test the reader's resolution.
    """
    out = []
    for k, row in enumerate(rows):
        row = dict(row)
        if k > 0 and rows[k - 1]["prompt_token_ids"] is not None:
            prev = rows[k - 1]["prompt_token_ids"] + (rows[k - 1]["completion_token_ids"] or [])
            prompt = row["prompt_token_ids"]
            n = 0
            while n < min(len(prev), len(prompt)) and prev[n] == prompt[n]:
                n += 1
            row["prompt_prefix_call_id"] = rows[k - 1]["call_id"]
            row["prompt_prefix_len"] = n
            row["prompt_token_ids"] = prompt[n:]
        out.append(row)
    return out
