"""Benchmark: what a pause before a piece of proxy work does to its cost on this machine.

Run: ``.venv/bin/python bench/cold_cache.py [--repeats 40] [--pauses 0 1 5 50]``

Why: inside the running proxy the addon's hooks take 4-9 times what the same code takes in a loop
(``bench/proxy_overhead.py --hook-times`` against tflow loops). A call comes after a pause (the
harness thinks, runs a tool; the benchmark waits ``--think-ms``), and during a pause the caches
lose what the work needs. This times the same work, once per pause, with pauses of 0 (a loop: hot)
to 50 ms between runs, and prints each pause's median next to the loop's. The same is done for a
piece of mitmproxy's own per-call work (reading and writing an HTTP/1 request head), which bare
mitmdump runs too: if it slows down as much, the multiplier belongs to the machine, not the addon.

Work timed (a Codex-sized call: ``bench/proxy_overhead.py --api responses --echo-kb 32``):
- ``request``: the Responses request walked member by member, injected and spliced (the addon's
  ``request`` hook, without mitmproxy's flow);
- ``response.created``: the first event of its stream stripped of what was injected (the tap's
  first chunk);
- ``mitmproxy head``: ``http1.read_request_head`` + ``assemble_request_head`` of the same request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mitmproxy.net.http import http1  # noqa: E402

import proxy_overhead  # noqa: E402
from polar_train.capture import record  # noqa: E402
from polar_train.capture.request_walk import splice_injection, walk_request  # noqa: E402


def workloads(echo_kb: int) -> dict[str, Callable[[], object]]:
    """The three pieces of per-call work, each a function of no arguments, warmed once."""
    module = record.FORMATS["openai.responses"]
    request = proxy_overhead.harness_request("responses", 0, echo_kb, 64)
    body = proxy_overhead._compact(request).encode()  # as Codex writes it (serde_json: compact UTF-8)

    def inject() -> tuple[bytes, dict]:
        walked = walk_request(body, module.REQUEST_ECHOED)
        injection = module.inject(walked.obj)
        return splice_injection(walked, injection.body), injection.asked

    sent, asked = inject()
    created = next(proxy_overhead._responses_events(json.loads(sent), 16))[0].encode()

    def strip_created() -> bytes | None:
        return module.event_stripper(asked)(created)

    lines = [b"POST /v1/responses HTTP/1.1", b"Host: 127.0.0.1:8000", b"Content-Type: application/json",
             b"Content-Length: %d" % len(body), b"Authorization: Bearer sk-bench-not-a-secret",
             b"User-Agent: codex_cli_rs/0.1", b"Accept: text/event-stream"]

    def mitmproxy_head() -> bytes:
        return http1.assemble_request_head(http1.read_request_head(lines))

    work = {"request": inject, "response.created": strip_created, "mitmproxy head": mitmproxy_head}
    for run in work.values():
        run()  # warm: imports, regex compiles, echo caches
    stripped = strip_created()  # the work timed is the real one: the injected value goes back
    if stripped is None or b'"top_logprobs":null' not in stripped or b'"top_logprobs":0' not in created:
        raise SystemExit("cold_cache: response.created was not stripped by the byte path; nothing to time")
    return work


def timed(run: Callable[[], object], pause_ms: float, repeats: int) -> float:
    """Median microseconds of ``run`` when each run comes ``pause_ms`` after the last one ended."""
    samples = []
    for _ in range(repeats):
        if pause_ms:
            time.sleep(pause_ms / 1000)
        t0 = time.perf_counter_ns()
        run()
        samples.append(time.perf_counter_ns() - t0)
    return statistics.median(samples) / 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=40, help="runs per work and pause, at least 3 (default 40)")
    ap.add_argument("--pauses", type=float, nargs="+", default=[0, 1, 5, 50], metavar="MS",
                    help="pauses before each run, ms; the first must be 0 (default 0 1 5 50)")
    ap.add_argument("--echo-kb", type=int, default=32,
                    help=f"KiB of echoed instructions and tools, 1 to {proxy_overhead.MAX_KB} (default 32)")
    args = ap.parse_args(argv)
    if args.repeats < 3:
        ap.error("--repeats: at least 3")
    if args.echo_kb < 1:  # below that response.created is short enough for the JSON path: not this work
        ap.error("--echo-kb: at least 1 (the Codex-sized call whose walks are timed)")
    if args.echo_kb > proxy_overhead.MAX_KB:  # the request is built in memory: 10 GB ended in a MemoryError
        ap.error(f"--echo-kb: at most {proxy_overhead.MAX_KB} (16 MiB per request), got {args.echo_kb}")
    if args.pauses[0] != 0 or not all(0 <= p <= 60_000 for p in args.pauses):  # nan and inf fail too
        ap.error("--pauses: start with 0 (the loop every ratio is taken against), each 0 to 60000 ms")

    work = workloads(args.echo_kb)
    # each pause's runs of every work item side by side, in one pass: the machine drifts between passes
    medians = {(name, pause): timed(run, pause, args.repeats) for pause in args.pauses for name, run in work.items()}
    print(f"cold cache: median us per run after a pause, {args.repeats} runs each; Codex-sized call "
          f"({args.echo_kb} KiB echoed)\n")
    header = ["work"] + [f"{p:g} ms" for p in args.pauses] + [f"{p:g} ms / loop" for p in args.pauses[1:]]
    print(" | ".join(header))
    print(" | ".join("-" * len(h) for h in header))
    for name in work:
        hot = medians[(name, 0)]
        row = [name] + [f"{medians[(name, p)]:.1f}" for p in args.pauses]
        row += [f"{medians[(name, p)] / hot:.1f}" for p in args.pauses[1:]]
        print(" | ".join(row))
    return 0


if __name__ == "__main__":
    from polar_train.cli import run_script

    sys.exit(run_script(main))
