"""Benchmark: what the capture addon costs, against bare ``mitmdump`` and a direct connection.

Run: ``.venv/bin/python bench/proxy_overhead.py [--concurrency 1 16 64] [--rounds 5] [--tokens 64]``

One run, three ways, the same streaming workload: OpenAI chat completions with ``stream: true``
against a vLLM-shaped fake upstream (``--upstream fake``, the default: it costs next to nothing, so
the proxy is what is measured) or ``polar-train serve --script`` (``--upstream serve``: scripted
answers scored by the tiny model); ``--chunk-delay-ms`` paces the stream like a model would. Sent

* ``direct``  - straight to the server,
* ``bare``    - through ``mitmdump`` without any script (regular proxy mode, absolute-form requests),
* ``addon``   - through ``mitmdump -s addons/polar_capture.py`` (same mode, writing Parquet parts).

Why a hand-written asyncio HTTP/1.1 client: on two cores the client competes with the proxy and
the server for CPU; a raw socket client costs far less than an SDK and sees every chunk's arrival
time. Why rounds with a rotating order: other processes share the machine, so each configuration
is measured side by side, several times, and the table gives the median with the spread.

Per call: time to first byte of the body (TTFB), the gaps between SSE events, total time; per run:
calls/s, proxy CPU (user+system seconds of the mitmdump process, psutil) per call and peak RSS, and
for the addon the same for its row worker (a child process that parses calls and writes Parquet on
another core; reported separately so that no CPU is hidden). Everything binds to 127.0.0.1; every
request has a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import functools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from paired_stats import LEVEL, median_ci, verdict  # noqa: E402

#: The issue's targets for the addon against bare mitmdump.
TTFB_TARGET, CALLS_TARGET = 1.05, 0.95

BIN = Path(sys.executable).parent
CONFIGS = ("direct", "bare", "addon", "addon-noinject", "addon-nostrip", "addon-handoff0", "bare-asked")
CALL_TIMEOUT_S = 120.0
PROMPT_IDS = [248045, 846, 198, 9419, 248046, 198, 248045, 74455, 198]
WORDS = ("the quick brown fox jumps over the lazy dog while the proxy records every token of "
         "the stream and hands each chunk on at once ").split()


# -- processes -------------------------------------------------------------------------------

def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(ready, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if ready():
            return
        time.sleep(0.1)  # polling a readiness probe
    raise SystemExit(f"{what} not ready after {timeout}s:\n{log.read_text()[-3000:]}")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - loopback only
            return r.status == 200
    except Exception:
        return False


def port_open(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


#: The largest --echo-kb / --request-kb: a harness's request is tens to hundreds of KiB.
MAX_KB = 16384


def spawn(args: list[str], log: Path, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(extra_env or {})}
    with open(log, "wb") as fh:
        return subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def stop(*procs: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM every process group at once, SIGKILL what is left after ``grace_s`` (the addon's
    own limit for its last part): one slow shutdown no longer delays the next one's start, so
    stopping everything takes at most the slowest, not the sum of 60 s waits in turn."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"warning: pid {p.pid} ({Path(p.args[0]).name}) ignored SIGTERM for {grace_s:g} s; killing it",
                  file=sys.stderr, flush=True)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel: nothing more to do
                p.wait(10)


def history(kb: int) -> list[dict]:
    """About ``kb`` KiB of earlier turns: a harness resends its whole conversation with every call."""
    turns, size = [], 0
    while size < kb * 1024:
        text = " ".join(WORDS[(size + i) % len(WORDS)] for i in range(100))
        turns.append({"role": "assistant" if turns and turns[-1]["role"] == "user" else "user", "content": text})
        size += len(text) + 40
    return turns


def codex_echo(kb: int) -> dict:
    """About ``kb`` KiB of instructions and tool schemas, half each, as Codex sends with every call
    (vLLM echoes both in response.created, .in_progress and .completed)."""
    if kb <= 0:
        return {}
    text = " ".join(WORDS[i % len(WORDS)] for i in range(kb * 1024 // 10)) + " \u2014 keep it short.\n"
    tools, size = [], 0
    while size < kb * 512:
        tool = {"type": "function", "name": f"tool_{len(tools)}", "strict": False,
                "description": " ".join(WORDS[(len(tools) + i) % len(WORDS)] for i in range(40)),
                "parameters": {"type": "object", "required": ["command"], "additionalProperties": False,
                               "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                              "workdir": {"type": "string"}, "timeout_ms": {"type": "number"}}}}
        tools.append(tool)
        size += len(json.dumps(tool))
    return {"instructions": text, "tools": tools}


def harness_request(api: str, request_kb: int, echo_kb: int, max_tokens: int) -> dict:
    """One call's request as a harness sends it: ``request_kb`` KiB of history and a new question;
    Responses in Codex's shape (input items, its own include list, ``echo_kb`` KiB of instructions
    and tools)."""
    turns = history(request_kb) + [{"role": "user", "content": "Tell me about the fox."}]
    if api == "chat":
        return {"model": "tiny", "stream": True, "max_tokens": max_tokens, "messages": turns}
    return {"model": "tiny", "stream": True, "max_output_tokens": max_tokens, "input": turns,
            "include": ["reasoning.encrypted_content"], "store": False, **codex_echo(echo_kb)}


def scenario(tokens_hint: int) -> dict:
    text = " ".join(WORDS[i % len(WORDS)] for i in range(tokens_hint))
    return {"scenarios": [{"name": "bench", "match": {}, "turns": [{"content": text}],
                           "after_last": "repeat_last"}]}


# -- the fast upstream ----------------------------------------------------------------------

def prompt_tokens(request_bytes: int) -> int:
    """How long the fake upstream says a request's prompt is: a token per 4 bytes (about what a BPE
    tokenizer makes of English and code: a Codex call's 32 KiB are ~8,000 tokens)."""
    return max(len(PROMPT_IDS), request_bytes // 4)


def prompt_ids(tokens: int) -> list[int]:
    """A prompt's ids as vLLM sends them to a call that asks (all of them, every call): a short
    chat's first, then spread over the vocabulary as real ids are."""
    return (PROMPT_IDS + [(i * 7919) % 248_000 for i in range(tokens)])[:tokens]


@functools.lru_cache(maxsize=16)
def prompt_ids_json(tokens: int) -> str:
    """:func:`prompt_ids` as vLLM writes them, encoded once per prompt length (the fake upstream
    must cost next to nothing: encoding 8,000 ids took it ~0.5 ms per call, before the first byte)."""
    return _compact(prompt_ids(tokens))


@functools.lru_cache(maxsize=16)
def raw_messages_json(tokens: int) -> str:
    """Responses' ``input_messages`` for a prompt of ``tokens`` ids (the ids and a rendered prompt
    about as long as their text), encoded once per prompt length."""
    words = " ".join(WORDS[i % len(WORDS)] for i in range(tokens * 4 // 5))
    lines = "\n".join(words[i:i + 80] for i in range(0, len(words), 80))
    rendered = f"<|im_start|>user\n{lines}<|im_end|>\n<|im_start|>assistant\n"
    return _compact([{"message": rendered, "tokens": prompt_ids(tokens), "type": "raw_message_tokens"}])


#: Where the encoded ``input_messages`` go in a response object (replaced in its JSON text).
_RAW_MESSAGES_SLOT = "@@input_messages@@"


def _chat_events(req: dict, words: int, prompt_len: int = len(PROMPT_IDS)) -> Iterator[tuple[str, bool]]:
    """vLLM 0.32's chat stream: ids and logprobs only when asked, ``null`` otherwise (as vLLM);
    the prompt's ``prompt_len`` ids in the first chunk."""
    ids, lps = req.get("return_token_ids") is True, req.get("logprobs") is True
    base = '{"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1,"model":"tiny",'
    yield ("data: " + base + '"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
           '"finish_reason":null}],"prompt_token_ids":' + (prompt_ids_json(prompt_len) if ids else "null")
           + ',"prompt_text":null}\n\n', False)
    for i in range(words):
        word = WORDS[i % len(WORDS)]
        lp = (f'{{"content":[{{"token":" {word}","logprob":-1.25,"bytes":{_compact(list((" " + word).encode()))},'
              f'"top_logprobs":[]}}]}}' if lps else "null")
        last = i == words - 1
        yield ("data: " + base + f'"choices":[{{"index":0,"delta":{{"content":" {word}"}},"logprobs":{lp},'
               f'"finish_reason":{json.dumps("stop" if last else None)},"stop_reason":null,'
               f'"token_ids":{f"[{1000 + i}]" if ids else "null"}}}]}}\n\n', True)
    yield ("data: " + base + f'"choices":[],"usage":{{"prompt_tokens":{prompt_len},"total_tokens":{prompt_len + words},'
           f'"completion_tokens":{words}}}}}\n\n', False)
    yield "data: [DONE]\n\n", False


def _responses_events(req: dict, words: int, prompt_len: int = len(PROMPT_IDS)) -> Iterator[tuple[str, bool]]:
    """vLLM 0.32's Responses stream (keys in its order): logprobs only with ``include``, raw message
    tokens only with ``enable_response_messages`` (the prompt's ``prompt_len`` ids and its text)."""
    lps = "message.output_text.logprobs" in (req.get("include") or [])
    raw = req.get("enable_response_messages") is True
    seq = iter(range(10**9))
    text = "".join(" " + WORDS[i % len(WORDS)] for i in range(words))
    entries = [{"token": " " + WORDS[i % len(WORDS)], "logprob": -1.25, "top_logprobs": []} for i in range(words)]

    def response(status: str, output: list, done: bool) -> dict:
        return {"id": "resp_bench", "created_at": 1, "incomplete_details": None,
                "instructions": req.get("instructions"),
                "metadata": None, "model": "tiny", "object": "response", "output": output,
                "parallel_tool_calls": True, "temperature": 1.0, "tool_choice": "auto", "tools": req.get("tools", []),
                "top_p": 1.0,
                "background": False, "max_output_tokens": req.get("max_output_tokens"), "max_tool_calls": None,
                "previous_response_id": None, "prompt": None, "reasoning": None, "service_tier": "auto",
                "status": status, "text": None, "top_logprobs": req.get("top_logprobs"), "truncation": "disabled",
                "usage": {"input_tokens": prompt_len, "output_tokens": words, "total_tokens": prompt_len + words}
                if done else None,
                "user": None, "input_messages": _RAW_MESSAGES_SLOT if done and raw else None,
                "output_messages": [{"message": text, "tokens": list(range(1000, 1000 + words)),
                                     "type": "raw_message_tokens"}] if done and raw else None}

    def event(kind: str, payload: dict) -> tuple[str, bool]:
        data = _compact({**payload, "sequence_number": next(seq), "type": kind})
        if kind == "response.completed" and raw:
            data = data.replace(f'"{_RAW_MESSAGES_SLOT}"', raw_messages_json(prompt_len), 1)
        return f"event: {kind}\ndata: {data}\n\n", kind == "response.output_text.delta"

    part = {"annotations": [], "text": text, "type": "output_text", "logprobs": entries if lps else None}
    item = {"id": "msg_bench", "content": [part], "role": "assistant", "status": "completed", "type": "message",
            "phase": None}
    yield event("response.created", {"response": response("in_progress", [], False)})
    yield event("response.in_progress", {"response": response("in_progress", [], False)})
    yield event("response.output_item.added", {"item": {**item, "content": [], "status": "in_progress"},
                                               "output_index": 0})
    yield event("response.content_part.added", {"content_index": 0, "item_id": "msg_bench", "output_index": 0,
                                                "part": {**part, "text": "", "logprobs": []}})
    for i, entry in enumerate(entries):
        yield event("response.output_text.delta", {"content_index": 0, "delta": entry["token"],
                                                   "item_id": "msg_bench", "logprobs": [entry] if lps else [],
                                                   "output_index": 0})
    yield event("response.output_text.done", {"content_index": 0, "item_id": "msg_bench", "logprobs": [],
                                              "output_index": 0, "text": text})
    yield event("response.content_part.done", {"content_index": 0, "item_id": "msg_bench", "output_index": 0,
                                               "part": part})
    yield event("response.output_item.done", {"item": item, "output_index": 0})
    yield event("response.completed", {"response": response("completed", [item], True)})


def _compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


async def _fake_handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, words: int,
                       delay_s: float) -> None:
    """One vLLM-shaped stream (chat or Responses, by path), one event per token, paced by a clock.

    Event k of the tokens goes out ``k * delay_s`` after the first one (at once if the server is
    behind): a model samples at its own rate, whatever it costs the server to format and write what
    it sampled. Sleeping ``delay_s`` after each write instead made every late timer of this
    process (it shares its core with the client) and every microsecond spent formatting the
    injected ids and logprobs part of the stream's length, charged to the configurations that
    receive them, not to the proxy."""
    try:
        request_line = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        req = json.loads(await reader.readexactly(length)) if length else {}
        events = _responses_events if b"/v1/responses" in request_line else _chat_events
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n")
        loop = asyncio.get_running_loop()
        due = None
        for text, paced in events(req, words, prompt_tokens(length)):
            payload = text.encode()
            writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))
            await writer.drain()
            if paced:  # one event per sampled token, as fast as the model samples
                due = (loop.time() if due is None else due) + delay_s
                await asyncio.sleep(max(0.0, due - loop.time()))
        writer.write(b"0\r\n\r\n")
        await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


def serve_fake(port: int, words: int, delay_ms: float) -> None:
    async def main() -> None:
        server = await asyncio.start_server(lambda r, w: _fake_handle(r, w, words, delay_ms / 1000),
                                            "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- the client ------------------------------------------------------------------------------

@dataclass
class CallResult:
    ok: bool
    ttfb: float = 0.0
    total: float = 0.0
    gaps: list[float] = field(default_factory=list)
    events: int = 0
    first_event: float = 0.0
    last_event: float = 0.0

    #: The call's place in its slot (0: the slot's first call).
    seq: int = 0

    @property
    def interval(self) -> float:
        """Mean time between events over the whole stream (robust to reads that batch events)."""
        return (self.last_event - self.first_event) / (self.events - 1) if self.events > 1 else float("nan")
    error: str = ""


#: api -> (path, the bytes that mark a complete stream)
APIS = {"chat": ("/v1/chat/completions", b"data: [DONE]"), "responses": ("/v1/responses", b"event: response.completed")}


async def one_call(port: int, upstream_port: int, via_proxy: bool, body: bytes, rollout: str,
                   api: str = "chat") -> CallResult:
    """One streamed call; times the arrival of each SSE event (not each TCP read)."""
    path, final = APIS[api]
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        target = f"http://127.0.0.1:{upstream_port}{path}" if via_proxy else path
        head = [f"POST {target} HTTP/1.1", f"Host: 127.0.0.1:{upstream_port}",
                "Content-Type: application/json", f"Content-Length: {len(body)}",
                "Authorization: Bearer sk-bench-not-a-secret", "Connection: close"]
        if via_proxy:
            cred = base64.b64encode(f"{rollout}:bench-pass".encode()).decode()
            head.append(f"Proxy-Authorization: Basic {cred}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await writer.drain()
        status = await reader.readline()
        if b" 200 " not in status:
            return CallResult(False, error=status.decode(errors="replace").strip())
        chunked = False
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b""):
                break
            if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
                chunked = True
        result = CallResult(True)
        tail = b""
        last = None
        done = False

        def on_data(data: bytes) -> None:
            nonlocal tail, last, done
            now = time.perf_counter()
            if last is None:
                result.ttfb = now - t0
                last = now
            tail += data
            n = tail.count(b"\n\n")
            if n:
                if result.events == 0:
                    result.first_event = now
                result.last_event = now
                for _ in range(n):
                    result.gaps.append(now - last)
                    last = now
                result.events += n
                if final in tail:
                    done = True
                tail = tail[tail.rfind(b"\n\n") + 2:]

        if chunked:
            while True:
                size_line = await reader.readline()
                if not size_line:
                    break
                size = int(size_line.split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    break
                on_data(await reader.readexactly(size))
                await reader.readexactly(2)
        else:
            while data := await reader.read(65536):
                on_data(data)
        result.total = time.perf_counter() - t0
        result.gaps = result.gaps[1:]  # the first event's "gap" is the TTFB
        if not done:
            return CallResult(False, error=f"stream ended without {final.decode()}")
        return result
    finally:
        writer.close()


def run_calls(coro: Any) -> Any:
    """``asyncio.run`` for the client's calls, whose clean-up after an interrupt is bounded:
    asyncio.run waits for every task it cancels, and after a SIGTERM mid-call one never ended (CI,
    once: the bench hung in ``_cancel_all_tasks`` with its proxies up and its temp folder kept)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coro)
    finally:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in pending:
            task.cancel()
        if pending:  # a clean run leaves none; an interrupted one gets 5 s to unwind its calls
            loop.run_until_complete(asyncio.wait(pending, timeout=5))
        loop.close()


async def guarded_call(port: int, upstream_port: int, via_proxy: bool, body: bytes, rollout: str,
                       api: str) -> CallResult:
    """:func:`one_call` within ``CALL_TIMEOUT_S``; a failure is a failed result, never an exception."""
    try:
        return await asyncio.wait_for(one_call(port, upstream_port, via_proxy, body, rollout, api), CALL_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as exc:
        return CallResult(False, error=repr(exc))


async def run_load(ports: list[int], upstream_port: int, via_proxy: bool, body: bytes, calls: int,
                   concurrency: int, tag: str, api: str = "chat", stagger_s: float = 0.0,
                   ) -> tuple[list[CallResult], float]:
    """``calls`` calls, ``concurrency`` at a time: each slot sends its next call when its last one
    has ended; slot i through ``ports[i % len(ports)]`` (several proxies share the load).
    ``stagger_s`` > 0: slot i starts i * stagger_s / concurrency later (the slots stay spread over
    a call's duration, as independent rollouts are); 0: all slots start together and,
    their calls being equally long, stay in lockstep (a burst of ``concurrency`` connection setups
    at every round). Results in slot order, each slot's calls in the order sent."""
    per_slot = [calls // concurrency + (1 if i < calls % concurrency else 0) for i in range(concurrency)]

    async def call(i: int, n: int) -> CallResult:
        return await guarded_call(ports[i % len(ports)], upstream_port, via_proxy, body, f"{tag}-{i}-{n}", api)

    async def slot(i: int) -> list[CallResult]:
        if stagger_s > 0:
            await asyncio.sleep(i * stagger_s / concurrency)
        out = []
        for n in range(per_slot[i]):
            r = await call(i, n)
            r.seq = n
            out.append(r)
        return out

    t0 = time.perf_counter()
    results = await asyncio.gather(*(slot(i) for i in range(concurrency)))
    return [r for rs in results for r in rs], time.perf_counter() - t0


# -- measurement -----------------------------------------------------------------------------

class PeakRSS:
    """Samples RSS every 20 ms on a thread (the peak of a run, not its end): of the proxy processes
    (summed, with ``--proxies``), and separately of their children (the addon's row workers)."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = [psutil.Process(pid) for pid in pids]
        self.peak = 0
        self.children_peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, sum(p.memory_info().rss for p in self.procs))
                kids = sum(c.memory_info().rss for p in self.procs for c in p.children(recursive=True))
                self.children_peak = max(self.children_peak, kids)
            except psutil.Error:
                pass
            self._stop.wait(0.02)

    def __enter__(self) -> "PeakRSS":
        if self.procs:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.procs:
            self._thread.join()


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (not their children), summed."""
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def settle(pids: list[int], handoff_s: float = 0.05, poll_s: float = 0.05, limit_s: float = 60.0) -> None:
    """Wait until a proxy and its row worker have finished with the run (their CPU time stops
    growing): the work that follows a run's last byte - closing its connections, handing its last
    calls over, the worker's backlog - is then counted in that run, for bare and addon alike, and
    never runs during the next configuration's run."""
    if not pids:
        return
    time.sleep(handoff_s)  # the calls of the last hand-off window reach the worker

    def total() -> float:
        return cpu_seconds(pids) + sum(children_cpu_seconds(pids).values())

    deadline = time.monotonic() + limit_s
    before = total()
    while time.monotonic() < deadline:
        time.sleep(poll_s)
        now = total()
        if now == before:
            return
        before = now


def children_cpu_seconds(pids: list[int]) -> dict[int, float]:
    """CPU seconds of each live child (the row worker), by pid: a replaced child is not mixed in."""
    out: dict[int, float] = {}
    for child in (c for pid in pids for c in psutil.Process(pid).children(recursive=True)):
        try:
            t = child.cpu_times()
            out[child.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


@dataclass
class RunStats:
    config: str
    concurrency: int
    calls: int
    failed: int
    wall: float
    ttfb_ms: float       # median over calls
    gap_ms: float        # median over calls of the mean interval between events
    gap_p99_ms: float    # 99th percentile of single gaps (stalls)
    total_ms: float      # median over calls
    calls_per_s: float
    ok_calls: int
    proxy_cpu_s: float
    worker_cpu_s: float  # the addon's row worker process (another core)
    upstream_cpu_s: float
    peak_rss_mb: float
    worker_rss_mb: float
    errors: list[str]
    round: int = 0       # which round of its concurrency (runs of one round are paired)


def measure(config: str, concurrency: int, calls: int, ports: dict[str, list[int]], pids: dict[str, list[int]],
            upstream_pid: int, upstream_port: int, body: bytes, tag: str, api: str = "chat",
            stagger_s: float = 0.0) -> RunStats:
    """One run. Burst arrivals: calls/s = calls / wall time. Staggered: the slots' first calls
    (sent while the others are still starting) are left out of the latencies, and calls/s is
    concurrency / mean time per call (Little's law for a closed loop of ``concurrency`` clients:
    what the run sustains once every slot is busy, without the start-up ramp)."""
    pid = pids[config]
    cpu0, up0, kids0 = cpu_seconds(pid), cpu_seconds([upstream_pid]), children_cpu_seconds(pid)
    with PeakRSS(pid) as rss:
        results, wall = run_calls(run_load(ports[config], upstream_port, config != "direct", body, calls,
                                             concurrency, tag, api, stagger_s))
    settle(pid)
    cpu1, up1, kids1 = cpu_seconds(pid), cpu_seconds([upstream_pid]), children_cpu_seconds(pid)
    worker = sum(t - kids0.get(k, 0.0) for k, t in kids1.items())
    return summarize(config, concurrency, calls, results, wall, cpu1 - cpu0, worker, up1 - up0, rss,
                     staggered=stagger_s > 0)


def summarize(config: str, concurrency: int, calls: int, results: list[CallResult], wall: float,
              proxy_cpu: float, worker_cpu: float, upstream_cpu: float, rss: "PeakRSS", staggered: bool = False,
              little: bool = False) -> RunStats:
    """A run's medians. ``staggered``: each slot's first call (sent during the ramp) is left out.
    ``staggered`` or ``little``: calls/s is concurrency / mean time per call; otherwise calls / wall
    time."""
    little = little or staggered
    ok = [r for r in results if r.ok]
    steady = [r for r in ok if r.seq > 0] if staggered else ok
    steady = steady or ok
    gaps = sorted(g for r in steady for g in r.gaps)
    med = lambda xs: statistics.median(xs) * 1000 if xs else float("nan")  # noqa: E731
    if little and steady:
        calls_per_s = concurrency / statistics.fmean(r.total for r in steady) if len(ok) == len(results) else 0.0
    else:
        calls_per_s = len(ok) / wall
    return RunStats(
        config, concurrency, calls, len(results) - len(ok), wall,
        med([r.ttfb for r in steady]), med([r.interval for r in steady if r.events > 1]),
        gaps[int(0.99 * (len(gaps) - 1))] * 1000 if gaps else float("nan"),
        med([r.total for r in steady]), calls_per_s, len(ok),
        proxy_cpu, worker_cpu, upstream_cpu, rss.peak / 2**20, rss.children_peak / 2**20,
        [r.error for r in results if not r.ok][:3])


def measure_interleaved(configs: tuple[str, ...], calls: int, ports: dict[str, list[int]],
                        pids: dict[str, list[int]],
                        upstream_pid: int, upstream_port: int, bodies: dict[str, bytes], tag: str, api: str,
                        think_s: float) -> list[RunStats]:
    """One round at concurrency 1 with the configurations' calls alternating one by one (call n goes
    to each configuration in an order rotated by n), each call after a pause of ``think_s`` (a
    harness running its tool) so that no call's after-work - the proxy closing its flow, the row
    worker parsing it - lands in the next configuration's call.

    Why: back-to-back runs of one configuration each are seconds apart, and this machine's speed
    drifts by more than the 5 % under test between them; calls a few hundred ms apart see the same
    machine. Each proxy is idle while the others' calls run, so its CPU over the round is its own;
    the upstream's CPU is read around each call. calls/s is 1 / mean time per call."""
    cpu0 = {c: cpu_seconds(pids[c]) for c in configs}
    kids0 = {c: children_cpu_seconds(pids[c]) for c in configs}
    results: dict[str, list[CallResult]] = {c: [] for c in configs}
    upstream = dict.fromkeys(configs, 0.0)

    async def alternate() -> None:
        for n in range(calls):
            k = n % len(configs)
            for config in configs[k:] + configs[:k]:
                await asyncio.sleep(think_s)
                u0 = cpu_seconds([upstream_pid])
                r = await guarded_call(ports[config][0], upstream_port, config != "direct", bodies[config],
                                       f"{tag}-{config}-{n}", api)
                upstream[config] += cpu_seconds([upstream_pid]) - u0
                r.seq = n
                results[config].append(r)

    with contextlib.ExitStack() as stack:
        samplers = {c: stack.enter_context(PeakRSS(pids[c])) for c in configs}
        run_calls(alternate())
    out = []
    for c in configs:
        kids1 = children_cpu_seconds(pids[c])
        worker = sum(t - kids0[c].get(k, 0.0) for k, t in kids1.items())
        wall = sum(r.total for r in results[c])
        out.append(summarize(c, 1, calls, results[c], wall, cpu_seconds(pids[c]) - cpu0[c], worker,
                             upstream[c], samplers[c], little=True))
    return out


def pin(pids: dict[str, list[int]], upstream_pid: int, proxies: int = 1) -> None:
    """Each proxy alone on the first CPU (with ``proxies`` > 1: a configuration's k-th proxy alone on
    CPU k); this process (the client), the upstream and every proxy's children (the row workers) on
    the others."""
    cpus = sorted(os.sched_getaffinity(0))
    proxy_cpus, others = cpus[:proxies], set(cpus[proxies:])
    os.sched_setaffinity(0, others)
    os.sched_setaffinity(upstream_pid, others)
    for config_pids in pids.values():
        for k, pid in enumerate(config_pids):
            os.sched_setaffinity(pid, {proxy_cpus[k]})
            for child in psutil.Process(pid).children(recursive=True):
                os.sched_setaffinity(child.pid, others)


def spread(values: list[float]) -> float:
    """(max - min) / median, in percent: how much the rounds disagree."""
    values = [v for v in values if v == v]
    if len(values) < 2:
        return 0.0
    return (max(values) - min(values)) / statistics.median(values) * 100


# -- main ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64],
                    help="concurrent calls, one table row each (default 1 16 64)")
    ap.add_argument("--configs", nargs="+", default=["direct", "bare", "addon"], choices=CONFIGS,
                    help="what to compare (direct must come first, addon must be included); "
                         "addon-noinject = the addon with polar_inject=false; addon-nostrip = the addon "
                         "injecting but passing the injected fields on to the client (polar_strip=false); "
                         "addon-handoff0 = the addon "
                         "handing each call to its row worker the moment it ends (polar_handoff_ms=0); "
                         "bare-asked = bare mitmdump "
                         "with a client that asks for token ids and logprobs itself (what receiving the "
                         "injected data costs mitmproxy without the addon)")
    ap.add_argument("--rounds", type=int, default=5, help="repetitions of every configuration (interleaved; default 5)")
    ap.add_argument("--calls-per-slot", type=int, default=4,
                    help="calls per run = concurrency x this (at least --min-calls)")
    ap.add_argument("--min-calls", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="words in the scripted reply (~tokens streamed)")
    ap.add_argument("--chunk-delay-ms", type=float, default=5.0)
    ap.add_argument("--api", choices=sorted(APIS), default="chat",
                    help="chat: Chat Completions (Claude Code via a gateway, Pi); responses: the Responses "
                         "API (Codex), with Codex's own include list in every request")
    ap.add_argument("--arrivals", choices=["burst", "staggered"], default="burst",
                    help="staggered: the concurrent slots start spread over one call's duration and stay "
                         "spread (independent rollouts); burst: all start at once and stay in lockstep "
                         "(every round opens `concurrency` connections in the same millisecond)")
    ap.add_argument("--interleave", action="store_true",
                    help="concurrency 1 only: in each round the configurations' calls alternate one by one "
                         "(instead of one run per configuration), each after a --think-ms pause: the "
                         "machine's drift between runs cancels")
    ap.add_argument("--think-ms", type=float, default=None,
                    help="with --interleave: the pause before each call (a harness running its tool), long "
                         "enough for the previous call's after-work (hand-off, row worker) to end first "
                         "(default: 50)")
    ap.add_argument("--echo-kb", type=int, default=0,
                    help="Responses only: KiB of instructions and tool schemas per request, echoed by the server "
                         "in three events as vLLM does (Codex sends tens of KiB)")
    ap.add_argument("--request-kb", type=int, default=0,
                    help="pad each request with this many KiB of conversation history (harnesses send "
                         "tens to hundreds of KiB per call; 0: a one-line prompt)")
    ap.add_argument("--upstream", choices=["fake", "serve"], default="fake",
                    help="fake: a minimal asyncio server streaming vLLM-shaped chunks (costs ~nothing); "
                         "serve: `polar-train serve --script` on the tiny model (scores every scripted "
                         "token with the 248k-vocabulary head: ~0.3 s CPU per call, the bottleneck)")
    ap.add_argument("--model", default=None, help="tiny model folder for --upstream serve "
                                                  "(default: write one into a temp dir)")
    ap.add_argument("--serve-fake", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile", default=None, metavar="PREFIX",
                    help="write py-spy profiles (collapsed stacks, flamegraph input) of every mitmdump "
                         "to PREFIX-CONFIG.txt (PREFIX-addon.txt, PREFIX-bare.txt, ...)")
    ap.add_argument("--pin", action="store_true",
                    help="each mitmdump alone on CPU 0; the client, the upstream and the addon's row worker on "
                         "the other CPUs (what the proxy costs without sharing its core with the load); with "
                         "--proxies N: a configuration's k-th mitmdump alone on CPU k")
    ap.add_argument("--proxies", type=int, default=1,
                    help="mitmdump processes per proxied configuration (the addon's all writing one capture "
                         "folder, as docs/capture.md scales out); concurrent slot i goes through the (i mod N)-th; "
                         "CPU and RSS are their sums")
    ap.add_argument("--hook-times", action="store_true",
                    help="run the addon with a clock around each hook and stream-tap call (bench/timed_addon.py) "
                         "and print where its time on the event loop goes, per call (the clocks add ~0.3 us "
                         "per hook to the addon's numbers)")
    ap.add_argument("--keep", action="store_true", help="keep the temp folder (logs, captured parts)")
    args = ap.parse_args(argv)
    if args.think_ms is not None and not args.interleave:  # it was taken and not used
        ap.error("--think-ms: with --interleave only (the pause before each interleaved call)")
    if args.model is not None and args.upstream != "serve":
        ap.error("--model: with --upstream serve only (the fake upstream has no model)")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():  # refused after the start
        ap.error(f"--model: {args.model} is not a model folder (no config.json)")
    args.think_ms = 50.0 if args.think_ms is None else args.think_ms
    for name, value, low in (("--concurrency", min(args.concurrency), 1), ("--rounds", args.rounds, 1),
                             ("--calls-per-slot", args.calls_per_slot, 1), ("--min-calls", args.min_calls, 1),
                             ("--tokens", args.tokens, 1), ("--chunk-delay-ms", args.chunk_delay_ms, 0),
                             ("--think-ms", args.think_ms, 0), ("--echo-kb", args.echo_kb, 0),
                             ("--request-kb", args.request_kb, 0), ("--proxies", args.proxies, 1)):
        if not low <= value < math.inf:  # nan and inf too: an endless delay hung every stream
            ap.error(f"{name}: a finite number, at least {low}, got {value}")
    for name, value in (("--echo-kb", args.echo_kb), ("--request-kb", args.request_kb)):
        if value > MAX_KB:  # each request is built in memory, per call: 100 GB grew until the memory ran out
            ap.error(f"{name}: at most {MAX_KB} (16 MiB per request), got {value}")
    if len(set(args.configs)) != len(args.configs):
        ap.error(f"--configs: each configuration once, got {' '.join(args.configs)}")
    if len(set(args.concurrency)) != len(args.concurrency):  # a row twice, medians over both, one paired ratio
        ap.error(f"--concurrency: each value once, got {' '.join(map(str, args.concurrency))}")
    if args.profile:
        outputs = [Path(f"{args.profile}-{name}.txt") for name in args.configs if name != "direct"]
        folder = outputs[0].absolute().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            ap.error(f"--profile: {folder} is not a folder it can write to")
        if taken := [str(o) for o in outputs if o.exists()]:
            ap.error(f"--profile: {', '.join(taken)} exists already; choose another PREFIX")
    if args.echo_kb and args.api != "responses":
        ap.error("--echo-kb: Responses only (--api responses); a chat request has no echoed instructions")
    if args.configs[0] != "direct" or not {"bare", "addon"} <= set(args.configs):
        ap.error("--configs: start with direct and include bare and addon")
    if args.interleave and (args.concurrency != [1] or args.arrivals != "burst"):
        ap.error("--interleave: concurrency 1 only (--concurrency 1), without --arrivals")
    if args.pin and (not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 1 + args.proxies):
        ap.error(f"--pin needs Linux and at least {1 + args.proxies} CPUs (one per proxy, one for the rest)")
    if args.proxies > 1 and (args.interleave or args.hook_times or args.profile):
        ap.error("--proxies: not with --interleave, --hook-times or --profile (they follow one proxy)")
    if args.profile and not (BIN / "py-spy").exists():
        ap.error("--profile needs py-spy (pip install py-spy; it is in the test extra)")
    if args.serve_fake:
        serve_fake(args.serve_fake, args.tokens, args.chunk_delay_ms)
        return 0

    tmp = Path(tempfile.mkdtemp(prefix="polar-bench-proxy-"))
    # torch makes its compile cache folder (TMPDIR/torchinductor_USER) when a model loads (the tiny
    # model written here, `polar-train serve` for --upstream serve, which inherits this): ours, removed
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp / "torchinductor"))
    procs: list[subprocess.Popen] = []
    try:
        up_port = free_port()
        up_log = tmp / "serve.log"
        if args.upstream == "fake":
            server = spawn([sys.executable, __file__, "--serve-fake", str(up_port), "--tokens", str(args.tokens),
                            "--chunk-delay-ms", str(args.chunk_delay_ms)], up_log)
            health = lambda: port_open(up_port)  # noqa: E731
        else:
            model = Path(args.model) if args.model else None
            if model is None:
                from polar_train.tiny_model import write_tiny_model

                model = write_tiny_model(tmp / "tiny")
            script = tmp / "bench-scenario.json"
            script.write_text(json.dumps(scenario(args.tokens)))
            server = spawn([str(BIN / "polar-train"), "serve", "--model", str(model), "--host", "127.0.0.1",
                            "--port", str(up_port), "--script", str(script), "--served-model-name", "tiny",
                            "--chunk-delay-ms", str(args.chunk_delay_ms)], up_log)
            health = lambda: http_ok(f"http://127.0.0.1:{up_port}/health")  # noqa: E731
        procs.append(server)
        ports: dict[str, list[int]] = {"direct": [up_port]}
        pids: dict[str, list[int]] = {"direct": []}
        proxy_procs: dict[str, list[subprocess.Popen]] = {}
        configs = tuple(args.configs)
        for name, k in ((name, k) for name in configs[1:] for k in range(args.proxies)):
            port = free_port()
            confdir = tmp / f"conf-{name}"  # shared by a configuration's proxies: one CA
            cmd = [str(BIN / "mitmdump"), "--listen-host", "127.0.0.1", "--mode", f"regular@{port}",
                   "--set", f"confdir={confdir}", "--set", "flow_detail=0", "--set", "termlog_verbosity=warn"]
            if name.startswith("bare"):  # without a script mitmproxy buffers whole bodies: stream them instead
                cmd += ["--set", "stream_large_bodies=1"]
            extra_env = None
            if name.startswith("addon"):
                script = REPO / "addons" / "polar_capture.py"
                if name == "addon" and args.hook_times:  # the same addon, a clock around each hook
                    script = REPO / "bench" / "timed_addon.py"
                    extra_env = {"POLAR_BENCH_HOOK_TIMES": str(tmp / "hook-times.json")}
                cmd += ["-s", str(script), "--set", f"polar_out={tmp / name}"]
            if name == "addon-noinject":
                cmd += ["--set", "polar_inject=false"]
            if name == "addon-nostrip":
                cmd += ["--set", "polar_strip=false"]
            if name == "addon-handoff0":
                cmd += ["--set", "polar_handoff_ms=0"]
            log = tmp / (f"mitmdump-{name}.log" if args.proxies == 1 else f"mitmdump-{name}-{k}.log")
            p = spawn(cmd, log, extra_env)
            procs.append(p)
            proxy_procs.setdefault(name, []).append(p)
            ports.setdefault(name, []).append(port)
            pids.setdefault(name, []).append(p.pid)
            wait_for(lambda port=port: port_open(port), 60, f"mitmdump ({name})", p, log)
        wait_for(health, 180, f"upstream ({args.upstream})", server, up_log)

        request = harness_request(args.api, args.request_kb, args.echo_kb, 4 * args.tokens)
        if args.api == "chat":
            asked = {"return_token_ids": True, "logprobs": True}
        else:
            asked = {"enable_response_messages": True, "top_logprobs": 0,
                     "include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}
        # compact UTF-8, as the harnesses write it (Codex: serde_json; Claude Code, Pi: JSON.stringify)
        bodies = {c: _compact(request).encode() for c in configs}
        if "bare-asked" in bodies:  # the client asks for what the addon injects: the upstream sends it
            bodies["bare-asked"] = _compact({**request, **asked}).encode()
        warm = max(2, args.proxies)  # two calls through each proxy
        for config in configs:  # warm-up: first-call costs (imports, template compile) stay out
            measure(config, warm, 2 * warm, ports, pids, server.pid, up_port, bodies[config], f"warm-{config}",
                    args.api)
        if args.pin:  # after the warm-up: the row workers exist now
            pin(pids, server.pid, args.proxies)

        profilers = []
        if args.profile:  # every mitmdump (the addon's variants and bare), side by side
            for name in [c for c in configs if c != "direct"]:
                profilers.append(subprocess.Popen(
                    [str(BIN / "py-spy"), "record", "--pid", str(pids[name][0]), "--format", "raw",
                     "--output", f"{args.profile}-{name}.txt", "--rate", "200"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        runs: list[RunStats] = []
        load_before = os.getloadavg()[0]
        t_start = time.monotonic()
        for c in args.concurrency:
            calls = max(args.min_calls, c * args.calls_per_slot)
            stagger_s = args.tokens * args.chunk_delay_ms / 1000 if args.arrivals == "staggered" else 0.0
            for r in range(args.rounds):
                if args.interleave:
                    round_runs = measure_interleaved(configs, calls, ports, pids, server.pid, up_port, bodies,
                                                     f"c{c}-r{r}", args.api, args.think_ms / 1000)
                else:
                    k = r % len(configs)
                    order = configs[k:] + configs[:k]  # rotate who goes first
                    round_runs = (measure(config, c, calls, ports, pids, server.pid, up_port, bodies[config],
                                          f"{config}-c{c}-r{r}", args.api, stagger_s) for config in order)
                for st in round_runs:
                    st.round = r
                    runs.append(st)
                    print(f"  c={c:<3} round {r + 1} {st.config:<6} {st.calls_per_s:6.2f} calls/s  "
                          f"ttfb {st.ttfb_ms:7.1f} ms  gap {st.gap_ms:5.2f} ms  failed {st.failed}"
                          + (f"  {st.errors}" if st.errors else ""), flush=True)
        for profiler in profilers:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(60)
            if profiler.returncode:  # its own messages go nowhere: at least say which one failed
                print(f"warning: py-spy {' '.join(profiler.args[1:])} failed (exit {profiler.returncode})",
                      file=sys.stderr)
        elapsed = time.monotonic() - t_start
        report(runs, args, elapsed, (load_before, os.getloadavg()[0]))
        captured = [name for name in configs if name.startswith("addon")]
        stop(*(p for name in captured for p in proxy_procs[name]))  # each addon's last part is written on exit
        if args.hook_times:
            report_hook_times(tmp / "hook-times.json")
        import pyarrow.dataset as ds

        complete = True
        print()
        for name in captured:  # every addon configuration's capture: a variant that lost calls fails the run too
            parts = sorted((tmp / name / "calls").glob("*.parquet"))
            rows = ds.dataset([str(p) for p in parts]).to_table(columns=["status"]).column("status").to_pylist() \
                if parts else []
            expected = 2 * warm + sum(r.calls for r in runs if r.config == name)
            print(f"{name} recorded {len(rows)} calls ({rows.count('ok')} ok) of {expected} sent through it, "
                  f"in {len(parts)} part(s)")
            complete &= rows.count("ok") == expected
        return 0 if all(st.failed == 0 for st in runs) and complete else 1
    finally:
        stop(*procs)
        if not args.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")


def report(runs: list[RunStats], args, elapsed: float, load: tuple[float, float]) -> None:
    arrivals = (f"calls interleaved one by one across configurations, {args.think_ms:g} ms pause before each"
                if args.interleave else f"{args.arrivals} arrivals")
    print(f"\nproxy overhead: {args.api} API, upstream {args.upstream}, {arrivals}, "
          + (f"{args.proxies} mitmdump processes per proxied configuration (slots spread over them; CPU and "
             f"RSS summed), " if args.proxies > 1 else "")
          + (("proxies pinned to CPU 0 (client, upstream, row worker on the others), " if args.proxies == 1 else
              f"proxies pinned to CPUs 0-{args.proxies - 1}, one each (client, upstream, row workers on the "
              f"others), ") if args.pin else "")
          + f"{args.tokens}-token stream, chunk delay {args.chunk_delay_ms} ms, "
          f"requests of {args.request_kb} KiB history, "
          + (f"{args.echo_kb} KiB instructions and tools echoed, " if args.api == "responses" and args.echo_kb else "")
          + f"{args.rounds} rounds per configuration (median; spread = (max-min)/median over rounds); "
          f"{elapsed:.0f} s measured; load average {load[0]:.2f} before, {load[1]:.2f} after; {os.cpu_count()} CPUs\n")
    cols = ("conc", "config", "calls/s", "spread", "TTFB ms", "TTFB spread", "event interval ms", "gap p99 ms",
            "total ms", "proxy CPU ms/call", "worker CPU ms/call", "upstream CPU ms/call", "proxy RSS MB", "worker RSS MB",
            "failed")
    print(" | ".join(cols))
    print(" | ".join("-" * len(c) for c in cols))
    agg: dict[tuple[int, str], dict[str, float]] = {}
    for c in args.concurrency:
        for config in args.configs:
            rs = [r for r in runs if r.concurrency == c and r.config == config]
            m = {k: statistics.median(getattr(r, k) for r in rs)
                 for k in ("calls_per_s", "ttfb_ms", "gap_ms", "gap_p99_ms", "total_ms")}
            n = max(1, sum(r.ok_calls for r in rs))  # CPU times tick in 10 ms: sum over all rounds
            for k in ("proxy", "worker", "upstream"):
                m[f"{k}_cpu_ms_per_call"] = sum(getattr(r, f"{k}_cpu_s") for r in rs) * 1000 / n
            m["peak_rss_mb"] = max(r.peak_rss_mb for r in rs)
            m["worker_rss_mb"] = max(r.worker_rss_mb for r in rs)
            m["spread"] = spread([r.calls_per_s for r in rs])
            m["ttfb_spread"] = spread([r.ttfb_ms for r in rs])
            m["failed"] = sum(r.failed for r in rs)
            agg[(c, config)] = m
            proxied = config != "direct"
            addon = config.startswith("addon")
            print(f"{c} | {config} | {m['calls_per_s']:.2f} | {m['spread']:.0f}% | {m['ttfb_ms']:.1f} | "
                  f"{m['ttfb_spread']:.0f}% | "
                  f"{m['gap_ms']:.2f} | {m['gap_p99_ms']:.1f} | {m['total_ms']:.0f} | "
                  + (f"{m['proxy_cpu_ms_per_call']:.2f} | " if proxied else "- | ")
                  + (f"{m['worker_cpu_ms_per_call']:.2f} | " if addon else "- | ")
                  + f"{m['upstream_cpu_ms_per_call']:.2f} | "
                  + (f"{m['peak_rss_mb']:.0f} | " if proxied else "- | ")
                  + (f"{m['worker_rss_mb']:.0f} | " if addon else "- | ") + f"{m['failed']}")
    print(f"\nratios addon/bare, paired by round: the median of the per-round ratios [{LEVEL:.0%} confidence "
          f"interval of that median, from order statistics]; targets: TTFB <= {TTFB_TARGET}, calls/s >= "
          f"{CALLS_TARGET} (met / missed: the whole interval on one side; unresolved: it straddles the "
          f"target)\n")
    cols = ("conc", "TTFB addon/bare", "TTFB target", "calls/s addon/bare", "calls/s target", "interval addon/bare",
            "proxy CPU addon/bare", "(proxy+worker) CPU addon/bare", "TTFB bare/direct", "calls/s bare/direct",
            "interval bare/direct")
    print(" | ".join(cols))
    print(" | ".join("-" * len(c) for c in cols))
    below_clock = False

    def div(x: float, y: float) -> str:
        """x / y, or n/a where bare's proxy CPU read 0 (a few calls use less than its 10 ms tick): not nan."""
        nonlocal below_clock
        below_clock |= not y
        return f"{x / y:.2f}" if y else "n/a"

    for c in args.concurrency:
        a, b = agg[(c, "addon")], agg[(c, "bare")]
        ttfb, calls = paired(runs, c, "addon", "bare", "ttfb_ms"), paired(runs, c, "addon", "bare", "calls_per_s")
        print(f"{c} | {ttfb} | {ttfb.verdict(TTFB_TARGET, higher_is_better=False)} | {calls} | "
              f"{calls.verdict(CALLS_TARGET, higher_is_better=True)} | "
              f"{paired(runs, c, 'addon', 'bare', 'gap_ms').median:.3f} | "
              f"{div(a['proxy_cpu_ms_per_call'], b['proxy_cpu_ms_per_call'])} | "
              f"{div(a['proxy_cpu_ms_per_call'] + a['worker_cpu_ms_per_call'], b['proxy_cpu_ms_per_call'])} | "
              f"{paired(runs, c, 'bare', 'direct', 'ttfb_ms').median:.3f} | "
              f"{paired(runs, c, 'bare', 'direct', 'calls_per_s').median:.3f} | "
              f"{paired(runs, c, 'bare', 'direct', 'gap_ms').median:.3f}")
        for other in ("addon-noinject", "addon-nostrip", "addon-handoff0", "bare-asked"):
            if (c, other) in agg:
                n = agg[(c, other)]
                print(f"   {other}/bare at {c}: TTFB {paired(runs, c, other, 'bare', 'ttfb_ms')}, calls/s "
                      f"{paired(runs, c, other, 'bare', 'calls_per_s')}, proxy CPU "
                      f"{div(n['proxy_cpu_ms_per_call'], b['proxy_cpu_ms_per_call'])}")
    if below_clock:
        print("\nn/a: bare's proxy CPU read 0, below the CPU clock's resolution (10 ms ticks, summed over "
              "the rounds): run more calls (--rounds, --calls-per-slot) for a CPU ratio")


def report_hook_times(path: Path) -> None:
    """The addon's wall time per hook on the proxy's event loop (``bench/timed_addon.py``), warm-up
    calls included: what runs before a call's first byte (request hooks, response headers, the
    tap's first chunk) is what the addon adds to TTFB."""
    try:
        samples: dict[str, list[int]] = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"\nno hook times ({path}: {exc})")
        return
    calls = max(1, len(samples.get("requestheaders", [])))
    print(f"\naddon hooks, wall time on the proxy's event loop ({calls} calls, the warm-up's included; "
          "bench/timed_addon.py)\n")
    print("hook | runs | median us | mean us | us per call")
    print("---- | ---- | --------- | ------- | -----------")
    before_first_byte = 0.0
    for name, xs in samples.items():
        if not xs:
            continue
        per_call = sum(xs) / 1000 / calls
        if name in ("requestheaders", "request", "responseheaders", "tap first chunk"):
            before_first_byte += per_call
        print(f"{name} | {len(xs)} | {statistics.median(xs) / 1000:.1f} | {statistics.fmean(xs) / 1000:.1f} | "
              f"{per_call:.1f}")
    print(f"before the first byte (request hooks, response headers, first chunk): {before_first_byte:.0f} us per call")
    print("(the indented 'strip EVENT' rows: the tap's strip of each whole event, by name, inside the tap rows)")


@dataclass
class PairedRatio:
    """One metric of config A over config B, round by round (see bench/paired_stats.py)."""
    ratios: list[float]

    @property
    def median(self) -> float:
        xs = [r for r in self.ratios if r == r]
        return statistics.median(xs) if xs else float("nan")

    def verdict(self, target: float, higher_is_better: bool) -> str:
        return verdict(*median_ci(self.ratios), target, higher_is_better)

    def __str__(self) -> str:
        low, high, cover = median_ci(self.ratios)
        return f"{self.median:.3f} [{low:.3f}, {high:.3f}]" + ("" if cover >= LEVEL else f" ({cover:.0%})")


def paired(runs: list[RunStats], concurrency: int, a: str, b: str, metric: str) -> PairedRatio:
    """``metric`` of ``a`` / ``metric`` of ``b`` in each round of ``concurrency`` that ran both."""
    by_round: dict[int, dict[str, float]] = {}
    for r in runs:
        if r.concurrency == concurrency and r.config in (a, b):
            by_round.setdefault(r.round, {})[r.config] = getattr(r, metric)
    return PairedRatio([v[a] / v[b] if v[b] else float("nan")
                        for _, v in sorted(by_round.items()) if a in v and b in v])


if __name__ == "__main__":
    from polar_train.cli import run_script

    sys.exit(run_script(main))
