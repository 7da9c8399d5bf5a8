"""Contract: tokens that hold half a UTF-8 character are named and printed as vLLM 0.32 does.

A logprob entry names such a token ``""`` (bytes ``[]``) until a token completes the character,
which is then named by the whole character (vLLM corrects ``decode([id])``'s U+FFFD using the up
to 4 tokens sampled before). The answer's text leaves out the tokens after the last point where
the text ended in a whole character (vLLM's detokenizer never flushes a half character).

The old ``decode([id])`` naming (``"\\ufffd"``, bytes ``[239, 191, 189]``) failed a stream contract
test now and then, whenever the tiny model sampled such a token. Here the tokens are forced:
``allowed_token_ids`` lets vLLM sample only the three pieces of `` 🦜``, in any order, and its
names are compared with serve's names for the very same ids; the prompt's pieces are compared
through ``echo``'s prompt logprobs.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from polar_train.server.chat import logprob_entries
from polar_train.server.completion import CompletionState
from polar_train.server.engine import Engine, Finish, TokenStep

pytestmark = pytest.mark.vllm

# " 🦜" = " \xf0\x9f" + "\xa6" + "\x9c" in the Qwen3.5 vocabulary; each piece alone decodes to U+FFFD
PARROT = [10838, 99, 250]
SPLIT_PROMPT = "I ❤ 🦜 鿰 é"


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> Engine:
    return Engine(tiny_model_dir)


def names(entries: list[dict]) -> list[tuple]:
    return [(e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]])
            for e in entries]


def test_the_pieces_are_half_characters(engine):
    assert all(engine.token_text(i).endswith("\ufffd") for i in PARROT)
    assert engine.tokenizer.decode(PARROT) == " 🦜"


def test_sampled_half_characters_are_named_as_vllm_names_them(vllm_base_url, engine):
    seen: set[str] = set()
    for _ in range(4):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                "allowed_token_ids": PARROT, "logprobs": True, "top_logprobs": 2,
                "return_token_ids": True}
        r = httpx.post(vllm_base_url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answer = r.json()
        choice = answer["choices"][0]
        steps = engine.score(answer["prompt_token_ids"], choice["token_ids"], 2)
        state = CompletionState(engine, tools_enabled=False)
        for step in steps:
            state.push(step)
        ours = logprob_entries(SimpleNamespace(engine=engine), steps, 2)
        assert names(ours) == names(choice["logprobs"]["content"])
        seen.update(e["token"] for e in ours)
    assert "" in seen  # the first token always completes nothing


def test_prompt_half_characters_are_named_as_vllm_names_them(vllm_base_url, polar_base_url):
    body = {"model": "tiny", "messages": [{"role": "user", "content": SPLIT_PROMPT}], "max_tokens": 1,
            "echo": True, "logprobs": True, "top_logprobs": 2, "temperature": 0}
    a, b = (httpx.post(base + "/v1/chat/completions", json=body, timeout=120).json()
            for base in (vllm_base_url, polar_base_url))

    def decoded(answer: dict) -> list:
        return [None if row is None else {i: v["decoded_token"] for i, v in row.items()}
                for row in answer["prompt_logprobs"]]

    assert decoded(a) == decoded(b)
    got = [t for row in decoded(b) if row for t in row.values()]
    assert " 🦜" in got and "鿰" in got and "" in got


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_text_with_half_characters_is_printed_as_vllm_prints_it(vllm_base_url, engine, stream):
    # the parrot's pieces mixed with whole tokens ("I", " "): characters completed, cut, unfinished
    allowed = [*PARROT, 40, 220]
    for _ in range(6):
        body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6,
                "allowed_token_ids": allowed, "return_token_ids": True, "stream": stream}
        with httpx.stream("POST", vllm_base_url + "/v1/chat/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, r.read()
            raw = r.read().decode()
        if stream:
            chunks = [json.loads(line[6:]) for line in raw.splitlines()
                      if line.startswith("data: {")]
            ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids") or []]
            text = "".join(ch["delta"].get("content", "") for c in chunks for ch in c["choices"])
        else:
            choice = json.loads(raw)["choices"][0]
            ids, text = choice["token_ids"], choice["message"]["content"]
        state = CompletionState(engine, tools_enabled=False)
        sent = ""
        for n, token_id in enumerate(ids, 1):
            finish = Finish("length") if n == len(ids) else None
            delta = state.push(TokenStep(token_id, 0.0, finish=finish))
            sent += delta.content
        assert (sent if stream else state.completion_text) == text, ids
