"""Benchmark: the row worker's CPU per call for harness-sized requests, the request stored as sent
vs re-encoded, side by side in one run. CPU time of the thread that builds the row (since 12-06;
wall time before, which swung 2.4x with the machine's load between two runs).

Run: ``.venv/bin/python bench/row_worker.py [--request-kb 0 100] [--echo-kb 32] [--repeats 100]``

Each call is what the proxy hands the row worker (the request body as the client sent it, compact
UTF-8 as harnesses write it; the injected stream as vLLM 0.32 sends it, the prompt's token ids
included, from ``bench/proxy_overhead.py``'s fake upstream; the header fields with a bearer token),
and is turned into its row by :func:`polar_train.capture.worker.build_call_row`, as the worker
does. "as sent" is the worker as it is: the request read member by member, ``request_hash`` from
its bytes and ``request_json`` its own text. "re-encoded" is the path it takes for a body it
cannot read that way (and took for every body before): ``json.loads``, a key-sorted dump for the
hash, a redacted compact dump for the row. The two alternate call by call: the machine's drift cancels.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import proxy_overhead  # noqa: E402
from polar_train.capture import record  # noqa: E402
from polar_train.capture.options import CaptureOptions  # noqa: E402
from polar_train.capture.worker import build_call_row  # noqa: E402

#: The most --tokens: the stream and its parse are held in memory, ~5 KB per token (100,000: ~0.5 GB
#: and seconds per call; 1e8 ended in a MemoryError). A model's longest answer is shorter.
MAX_TOKENS = 100_000

_APIS = {"responses": ("openai.responses", "/v1/responses", proxy_overhead._responses_events),
         "chat": ("openai.chat", "/v1/chat/completions", proxy_overhead._chat_events)}


def call_maker(api: str, request_kb: int, echo_kb: int, tokens: int) -> Callable[[], record.CallState]:
    """A function that returns a fresh copy of one finished call, as the proxy hands it over."""
    name, path, events = _APIS[api]
    request = proxy_overhead.harness_request(api, request_kb, echo_kb, 4 * tokens)
    body = proxy_overhead._compact(request).encode()
    injection = record.FORMATS[name].inject(dict(request))
    prompt_len = proxy_overhead.prompt_tokens(len(body))  # vLLM sends every prompt id to a call that asks
    stream = b"".join(text.encode() for text, _ in events(injection.body, tokens, prompt_len))
    fields = ((b"host", b"127.0.0.1:8000"), (b"authorization", b"Bearer sk-bench-not-a-secret"),
              (b"content-type", b"application/json"))

    def make() -> record.CallState:
        now = datetime.now(timezone.utc)
        state = record.CallState(api=name, method="POST", host="127.0.0.1", path=path, client_conn_id="c",
                                 identity=None, started_at=now, upstream_base="http://127.0.0.1:8000",
                                 header_fields=fields, request_body=body, injected=True, asked=injection.asked,
                                 stream=True, http_status=200, first_byte_at=now, finished_at=now)
        state.stream_raw, state.streamed = bytearray(stream), True
        return state

    return make


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--request-kb", type=int, nargs="+", default=[0, 100], metavar="KB",
                    help="KiB of conversation history per request, one row each (default 0 100)")
    ap.add_argument("--echo-kb", type=int, default=32,
                    help="Responses: KiB of instructions and tool schemas, as Codex sends (default 32)")
    ap.add_argument("--tokens", type=int, default=64, help=f"tokens streamed per call, 1 to {MAX_TOKENS} (default 64)")
    ap.add_argument("--repeats", type=int, default=100, help="calls per row and path, at least 3 (default 100)")
    args = ap.parse_args(argv)
    if args.repeats < 3:
        ap.error("--repeats: at least 3")
    if min(args.request_kb) < 0 or args.echo_kb < 0 or args.tokens < 1:
        ap.error("--request-kb and --echo-kb: 0 or more; --tokens: 1 or more")
    if max(args.request_kb + [args.echo_kb]) > proxy_overhead.MAX_KB:  # built in memory: 100 GB ran it out
        ap.error(f"--request-kb and --echo-kb: at most {proxy_overhead.MAX_KB} (16 MiB per request)")
    if args.tokens > MAX_TOKENS:
        ap.error(f"--tokens: at most {MAX_TOKENS} (the stream is built and parsed in memory, ~5 KB per token), "
                 f"got {args.tokens}")

    opts = CaptureOptions()
    print(f"row worker: median CPU us per call (build_call_row, the thread's CPU time), {args.repeats} calls per "
          "path, alternating; "
          f"{args.tokens} tokens streamed, Responses with {args.echo_kb} KiB echoed\n")
    header = ["api", "history KiB", "body KiB", "re-encoded us", "as sent us", "as sent / re-encoded"]
    print(" | ".join(header))
    print(" | ".join("-" * len(h) for h in header))
    for api in _APIS:
        for kb in args.request_kb:
            make = call_maker(api, kb, args.echo_kb, args.tokens)
            attempts = record.AttemptCounter()
            row = build_call_row(make(), None, opts, attempts)  # warm, and the work is the real one
            if row["status"] != "ok" or row["token_source"] != "server":
                raise SystemExit(f"row_worker: the {api} call did not make an ok row with server ids: {row['error']}")
            samples: dict[str, list[int]] = {"re-encoded": [], "as sent": []}
            for _ in range(args.repeats):
                for path in samples:
                    state = make()
                    with (mock.patch.object(record, "walk_request", lambda body: None) if path == "re-encoded"
                          else contextlib.nullcontext()):
                        t0 = time.thread_time_ns()  # CPU, not wall: the machine's other load is not the worker's
                        build_call_row(state, None, opts, attempts)
                        samples[path].append(time.thread_time_ns() - t0)
            old, new = (statistics.median(samples[p]) / 1000 for p in ("re-encoded", "as sent"))
            body_kb = len(make().request_body) / 1024
            print(f"{api} | {kb} | {body_kb:.0f} | {old:.0f} | {new:.0f} | {new / old:.2f}")
    return 0


if __name__ == "__main__":
    from polar_train.cli import run_script

    sys.exit(run_script(main))
