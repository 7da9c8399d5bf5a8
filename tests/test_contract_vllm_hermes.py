"""Our streamed tool calls = vLLM 0.32's: the same pieces of model text fed to
:class:`polar_train.server.hermes_stream.HermesStream` and to vLLM's own streaming hermes parser
(run in .venv-vllm) give the same content and tool-call deltas, step for step - whole calls,
parallel calls, calls cut short, malformed blocks, tags split across pieces."""

from __future__ import annotations

import json
import os
import random
import subprocess

import pytest

from polar_train.server.hermes_stream import HermesStream
from tests.support.procs import REPO, VLLM_VENV, vllm_available

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'
TEXTS = [
    "Sure.\n" + CALL,
    "Sure.\n\n" + CALL + "\n" + CALL.replace("get_weather", "get_time"),
    CALL,
    "Let me look." + CALL[:40],  # cut by max_tokens inside the arguments
    CALL[:37],  # cut right after the name: the stream's end sends arguments "{}"
    "x <tool_" ,  # a partial tag at the end: held back for good
    '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>',  # arguments as a string
    "<tool_call>\n{bad json}\n</tool_call>",
    '<tool_call>\n{"arguments": {"a": 1}, "name": "late"}\n</tool_call>',  # name after the arguments
    "no tools here, only < and tool_call words",
    "text\n" + CALL + " trailing words",
    '<tool_call>{"name": "spaced", "arguments": {"a": 1}  }</tool_call>',  # blanks before the outer }
]


def _cases(seed: int = 7, per_text: int = 40) -> list[list[str]]:
    """Each text cut into pieces at random places (1-12 characters), as tokens arrive."""
    rng = random.Random(seed)
    cases = []
    for text in TEXTS:
        cases.append([text])
        cases.append(list(text))
        for _ in range(per_text):
            pieces, pos = [], 0
            while pos < len(text):
                step = rng.randint(1, 12)
                pieces.append(text[pos:pos + step])
                pos += step
            cases.append(pieces)
    return cases


def _ours(pieces: list[str]) -> list[dict | None]:
    stream, text, out = HermesStream(), "", []
    for k, piece in enumerate(pieces):
        text += piece
        content, calls = stream.feed(text, finished=k == len(pieces) - 1)
        out.append({"content": content, "tool_calls": [
            {"index": c.index, "name": c.name, "arguments": c.arguments, "has_id": c.id is not None}
            for c in calls]} if content or calls else None)
    return out


def test_streamed_tool_calls_match_vllms_hermes_parser():
    if not vllm_available():
        if os.environ.get("POLAR_SKIP_VLLM") == "1":
            pytest.skip("POLAR_SKIP_VLLM=1 and .venv-vllm missing")
        pytest.fail(".venv-vllm is missing: run scripts/install-vllm-cpu (make test does)")
    cases = _cases()
    ref = subprocess.run([str(VLLM_VENV / "bin" / "python"), str(REPO / "tests/support/vllm_hermes_reference.py")],
                         input=json.dumps(cases), capture_output=True, text=True, timeout=600,
                         env={**os.environ, "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"})
    assert ref.returncode == 0, ref.stderr[-3000:]
    want = json.loads(ref.stdout.strip().splitlines()[-1])
    for pieces, expected in zip(cases, want, strict=True):
        assert _ours(pieces) == expected, pieces
