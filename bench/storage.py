"""Benchmark: bytes on disk per captured token for a 50-turn agent session, full vs compact storage.

Run: ``.venv/bin/python bench/storage.py [--turns 50] [--sessions 4]``

Each session has the shape of a real agent log: a system prompt + task (``--system`` tokens), then
per turn a completion (``--completion`` tokens, ending the turn) and a tool output (``--tool``
tokens); the prompt of call k+1 is the prompt of call k + its completion + the tool output. Rows
are real call-log rows (``CALL_LOG_SCHEMA``, optionally the request JSON: the conversation as
text, then tool definitions and per-call metadata in another key order each call, as Codex sends
it), Parquet + zstd like the writer, written once
in full and once through :class:`polar_train.capture.prompt_delta.PromptDeltaEncoder` (prompt ids
and request text as deltas); both are read back with :func:`polar_train.calllog.read_calls`,
which must yield identical full ids and request texts (checked).

"captured token" = a token of the session's final context (the trajectory): what the log has to
hold at least once. "stored id" = every prompt/completion id as written.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from polar_train.calllog import read_calls  # noqa: E402
from polar_train.capture.prompt_delta import PromptDeltaEncoder  # noqa: E402
from polar_train.schema import CALL_LOG_SCHEMA  # noqa: E402

WORDS = "def test read file patch the error value return import path line self assert".split()
#: What a harness sends after the conversation in every call (Codex sends ~20 KiB of these).
PARAMETERS = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": f"tool_{k}", "description": " ".join(WORDS) * 8,
                                           "parameters": PARAMETERS}} for k in range(8)]
METADATA = {"session_id": uuid.uuid4().hex, "thread_id": uuid.uuid4().hex, "window_id": uuid.uuid4().hex,
            "installation_id": uuid.uuid4().hex, "sandbox": "none", "model": "tiny"}


def text_of(ids: np.ndarray) -> str:
    """~4 characters per token, like code and English."""
    return " ".join(WORDS[i % len(WORDS)] for i in ids.tolist())


def session_rows(turns: int, system: int, completion: int, tool: int, rng: np.random.Generator,
                 with_json: bool) -> tuple[list[dict], int]:
    rollout = uuid.uuid4().hex[:12]
    prompt = rng.integers(0, 240_000, system).astype(np.int32)
    messages = [{"role": "system", "content": text_of(prompt)}]
    rows = []
    now = datetime.now(timezone.utc)
    for _ in range(turns):
        comp = rng.integers(0, 240_000, completion).astype(np.int32)
        out = rng.integers(0, 240_000, tool).astype(np.int32)
        row = {name: None for name in CALL_LOG_SCHEMA.names}
        row.update(call_id=uuid.uuid4().hex, rollout_id=rollout, rollout_source="proxy_auth", api="openai.chat",
                   method="POST", host="127.0.0.1", path="/v1/chat/completions", model="tiny", attempt=1,
                   started_at=now, first_byte_at=now, finished_at=now, stream=True, http_status=200,
                   status="ok", prompt_token_ids=prompt.tolist(), completion_token_ids=comp.tolist(),
                   completion_logprobs=(-rng.random(completion, dtype=np.float32) * 5).tolist(),
                   token_source="server", usage_prompt_tokens=len(prompt), usage_completion_tokens=completion,
                   usage_match=True, finish_reason="tool_calls", tool_call_count=1, injected=True)
        if with_json:
            # after the tools, per-call metadata in another key order each call, as Codex sends it
            meta = dict(list(METADATA.items())[i] for i in rng.permutation(len(METADATA)))
            row["request_json"] = json.dumps({"model": "tiny", "stream": True, "messages": messages, "tools": TOOLS,
                                              "client_metadata": {**meta, "turn_id": uuid.uuid4().hex}})
            row["response_json"] = json.dumps({"choices": [{"message": {"content": text_of(comp)}}]})
        rows.append(row)
        messages = [*messages, {"role": "assistant", "content": text_of(comp)},
                    {"role": "tool", "content": text_of(out)}]
        prompt = np.concatenate([prompt, comp, out])
    final_context = len(prompt)  # the last prompt + tool output ~ the trajectory length
    return rows, final_context


def write(rows: list[dict], folder: Path, rows_per_part: int) -> int:
    """Parts of ``rows_per_part`` rows, as the writer flushes them; returns the bytes on disk."""
    size = 0
    for i in range(0, len(rows), rows_per_part):
        path = folder / f"part-bench-{i // rows_per_part:06d}.parquet"
        pq.write_table(pa.Table.from_pylist(rows[i:i + rows_per_part], schema=CALL_LOG_SCHEMA), path,
                       compression="zstd")
        size += path.stat().st_size
    return size


def interleave(rows: list[dict], sessions: int) -> list[dict]:
    """Sessions run side by side: call k of every session, then call k+1 (compaction order kept)."""
    per = len(rows) // sessions
    return [rows[s * per + k] for k in range(per) for s in range(sessions)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=50, help="turns per session (default 50)")
    ap.add_argument("--sessions", type=int, default=4, help="sessions (default 4)")
    ap.add_argument("--system", type=int, default=2000, help="tokens of system prompt + task")
    ap.add_argument("--completion", type=int, default=150, help="tokens per completion")
    ap.add_argument("--tool", type=int, default=300, help="tokens per tool output")
    ap.add_argument("--rows-per-part", type=int, nargs="+", default=[8, 256],
                    help="rows per Parquet part (the writer flushes every 256 rows or 10 s: a part of a "
                         "live run holds a few calls of each session)")
    args = ap.parse_args(argv)
    for name, value, low in (("--turns", args.turns, 1), ("--sessions", args.sessions, 1),
                             ("--system", args.system, 1), ("--completion", args.completion, 1),
                             ("--tool", args.tool, 0), ("--rows-per-part", min(args.rows_per_part), 1)):
        if value < low:
            ap.error(f"{name}: at least {low}, got {value}")
    ids = args.sessions * args.turns * (args.system + args.turns * (args.completion + args.tool))
    if ids > 5e8:  # every call's full prompt is built in memory (4 bytes an id, several copies)
        ap.error(f"these sizes make about {ids:.2g} token ids (every call's full prompt); at most 5e8 fit in "
                 "memory: lower --sessions, --turns or the token counts")

    print(f"storage: {args.sessions} sessions x {args.turns} turns, system {args.system}, "
          f"completion {args.completion}, tool output {args.tool} tokens; Parquet zstd\n")
    cols = ("rows/part", "request JSON", "storage", "MB on disk", "stored ids", "JSON MB stored", "bytes/stored id",
            "bytes/captured token", "write s", "read s", "full/compact")
    print(" | ".join(cols))
    print(" | ".join("-" * len(c) for c in cols))
    for rows_per_part, with_json in [(n, j) for n in args.rows_per_part for j in (False, True)]:
        rng = np.random.default_rng(7)
        sessions = [session_rows(args.turns, args.system, args.completion, args.tool, rng, with_json)
                    for _ in range(args.sessions)]
        full_rows = [r for rows, _ in sessions for r in rows]
        captured = sum(n for _, n in sessions)
        expected = {r["call_id"]: (list(r["prompt_token_ids"]), r["request_json"]) for r in full_rows}
        sizes = {}
        with tempfile.TemporaryDirectory() as tmp:
            for kind in ("full", "compact"):
                folder = Path(tmp, kind, "calls")
                folder.mkdir(parents=True)
                rows = [dict(r) for r in full_rows]
                t0 = time.perf_counter()
                if kind == "compact":
                    enc = PromptDeltaEncoder()
                    rows = [enc.encode(r) for r in rows]
                stored = sum(len(r["prompt_token_ids"]) + len(r["completion_token_ids"]) for r in rows)
                json_mb = sum(len(r["request_json"] or "") for r in rows) / 1e6  # characters (ASCII here)
                size = write(interleave(rows, args.sessions), folder, rows_per_part)
                t1 = time.perf_counter()
                table = read_calls(folder.parent)
                t2 = time.perf_counter()
                got = dict(zip(table.column("call_id").to_pylist(), zip(table.column("prompt_token_ids").to_pylist(),
                                                                          table.column("request_json").to_pylist())))
                if got != expected:
                    raise SystemExit(f"{kind}: the reader did not give back the full prompts and requests")
                sizes[kind] = size
                ratio = f"{sizes['full'] / size:.1f}x" if kind == "compact" else ""
                print(f"{rows_per_part} | {'yes' if with_json else 'no'} | {kind} | {size / 1e6:.2f} | {stored:,} | "
                      f"{json_mb:.1f} | {size / stored:.3f} | {size / captured:.2f} | {t1 - t0:.2f} | {t2 - t1:.2f} | "
                      f"{ratio}")
    print("\nthe reader's full prompts and request texts equal the written ones in every configuration (checked)")
    return 0


if __name__ == "__main__":
    from polar_train.cli import run_script

    sys.exit(run_script(main))
