"""vLLM 0.32's recorded answers (``tests/data/vllm_wire/*.json``: its CPU build on the tiny model,
each case the request, its status, headers and raw body) and how a test compares serve's answer to
one: the same status, the same body or stream once ids and timestamps are left out."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

WIRE_DIR = Path(__file__).resolve().parents[1] / "data" / "vllm_wire"
VOLATILE = {"id", "created", "created_at", "system_fingerprint", "item_id"}


def recorded(name: str) -> dict[str, dict]:
    """The cases of ``tests/data/vllm_wire/<name>.json`` by name."""
    return json.loads((WIRE_DIR / f"{name}.json").read_text())


def _strip(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in VOLATILE}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def essentials(text: str) -> Any:
    """A JSON body, or an SSE stream as its list of (event, data), without ids and timestamps."""
    if text.startswith(("data:", "event:")):
        events, name = [], None
        for line in text.splitlines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = line[len("data: "):]
                events.append((name, data if data == "[DONE]" else _strip(json.loads(data))))
                name = None
        return events
    return _strip(json.loads(text)) if text else text


def send(base: str, request: dict) -> httpx.Response:
    """The recorded request, sent as it was (no body: none sent)."""
    if request.get("body") is None:
        return httpx.request(request["method"], base + request["path"], timeout=120)
    headers = {"Content-Type": "application/json", **(request.get("headers") or {})}
    return httpx.request(request["method"], base + request["path"], headers=headers,
                         content=json.dumps(request["body"]), timeout=120)


def assert_answers_as_vllm(base: str, case: dict, expected: Callable[[Any], Any] = lambda body: body) -> httpx.Response:
    """serve answers ``case``'s request as vLLM did (``expected``: how the recorded essentials are
    compared, e.g. floats to a tolerance)."""
    r = send(base, case["request"])
    assert r.status_code == case["status"], r.text
    assert essentials(r.text) == expected(essentials(case["body"]))
    return r
