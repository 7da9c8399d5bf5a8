"""Compact prompt storage (``polar_prompt_delta``): what is written is smaller, what is read is the
same full prompt, whatever the session does (forks, retries, errors, interleaved rollouts)."""

from __future__ import annotations

import uuid
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_train.calllog import read_call_log
from polar_train.capture.prompt_delta import PromptDeltaEncoder, common_prefix_len
from polar_train.capture.writer import PartWriter
from polar_train.schema import CALL_LOG_SCHEMA


def row(rollout: str | None, prompt: list[int], completion: list[int], status: str = "ok") -> dict:
    now = datetime.now(timezone.utc)
    r = {name: None for name in CALL_LOG_SCHEMA.names}
    r.update(call_id=uuid.uuid4().hex, rollout_id=rollout, api="openai.chat", status=status, started_at=now,
             finished_at=now, prompt_token_ids=list(prompt) if status == "ok" else None,
             completion_token_ids=list(completion) if status == "ok" else None)
    return r


def write_rows(tmp: Path, rows: list[dict], flush_rows: int = 7) -> PartWriter:
    w = PartWriter(tmp, flush_rows=flush_rows, flush_seconds=3600, prompt_delta=True)
    w.start()
    for r in rows:
        assert w.submit(lambda r=dict(r): r)
    w.close()
    return w


def test_common_prefix_len() -> None:
    assert common_prefix_len([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([5], [6]) == 0


def test_fifty_turn_session_round_trips_and_stores_linearly(tmp_path: Path) -> None:
    prompt, rows = list(range(1000, 1400)), []
    for k in range(50):
        completion = [2000 + k] * 30
        rows.append(row("r1", prompt, completion))
        prompt = prompt + completion + [3000 + k] * 40
    write_rows(tmp_path, rows)
    log = read_call_log(tmp_path)
    assert not log.problems
    got = dict(zip(log.table.column("call_id").to_pylist(), log.table.column("prompt_token_ids").to_pylist()))
    assert got == {r["call_id"]: r["prompt_token_ids"] for r in rows}
    raw = read_call_log(tmp_path, resolve_prompts=False).table
    stored = sum(len(p) for p in raw.column("prompt_token_ids").to_pylist())
    # the first prompt once, then only each new tool output - but call 32's prompt whole (FULL_EVERY: a
    # part lost costs the calls up to the next whole one, not every later call)
    assert stored == 400 + 48 * 40 + (400 + 31 * 70)
    assert raw.column("prompt_prefix_call_id").null_count == 2


def test_a_lost_part_costs_the_calls_up_to_the_next_whole_one(tmp_path: Path) -> None:
    """A probe: every compact row was read through the one before it, so a part lost from a long
    session (7 of 876 rows) cost every later call of its rollouts (270). A row stored in full every
    FULL_EVERY rows bounds it; the ids read back are the full prompts still."""
    from polar_train.capture.prompt_delta import FULL_EVERY

    prompt, rows = list(range(1000, 1100)), []
    for k in range(70):
        rows.append(row("r1", prompt, [2000 + k] * 5))
        prompt = prompt + [2000 + k] * 5 + [3000 + k] * 10
    write_rows(tmp_path, rows, flush_rows=1)  # a part per row
    lost = rows[5]["call_id"]
    (part,) = [p for p in (tmp_path / "calls").glob("*.parquet")
               if pq.read_table(p, columns=["call_id"]).column("call_id").to_pylist() == [lost]]
    part.unlink()
    table = read_call_log(tmp_path).table
    got = dict(zip(table.column("call_id").to_pylist(), table.column("prompt_token_ids").to_pylist()))
    readable = [k for k, r in enumerate(rows) if got.get(r["call_id"]) == r["prompt_token_ids"]]
    assert readable == [*range(5), *range(FULL_EVERY - 1, 70)]  # (the rows between chain through row 5)
    # a failed call where the whole row falls (no prompt a later one can refer to): the next is whole
    rows[FULL_EVERY - 1] = row("r1", [], [], "upstream_error")
    write_rows(tmp_path / "failed", rows)
    raw = read_call_log(tmp_path / "failed", resolve_prompts=False).table
    whole = [k for k, (ref, status) in enumerate(zip(raw.column("prompt_prefix_call_id").to_pylist(),
                                                     raw.column("status").to_pylist())) if ref is None and status == "ok"]
    assert whole == [0, FULL_EVERY, 2 * FULL_EVERY] and not read_call_log(tmp_path / "failed").problems


sessions = st.lists(st.tuples(
    st.sampled_from(["a", "b", None]),          # rollout (None: no identity, never compacted)
    st.sampled_from(["extend", "fork", "retry", "error"]),
    st.integers(0, 200),                         # tokens of new tool output / fork point
), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=sessions, flush_rows=st.integers(1, 9), min_prefix=st.integers(1, 80))
def test_any_session_reads_back_exactly(tmp_path_factory, steps, flush_rows: int, min_prefix: int) -> None:
    tmp = tmp_path_factory.mktemp("delta")
    ctx: dict = {}
    rows = []
    for i, (rollout, action, n) in enumerate(steps):
        prompt, completion = ctx.get(rollout, (list(range(100)), []))
        base = prompt + completion
        if action == "extend":
            prompt = base + [10_000 + i] * n
        elif action == "fork":
            prompt = base[: n % (len(base) + 1)] + [20_000 + i] * 5
        r = row(rollout, prompt, [30_000 + i] * (n % 7), "upstream_error" if action == "error" else "ok")
        rows.append(r)
        if action != "error":
            ctx[rollout] = (prompt, r["completion_token_ids"])
    w = PartWriter(tmp, flush_rows=flush_rows, flush_seconds=3600, prompt_delta=True)
    w._delta = PromptDeltaEncoder(min_prefix=min_prefix)
    w.start()
    for r in rows:
        w.submit(lambda r=dict(r): r)
    w.close()
    log = read_call_log(tmp)
    assert not log.problems
    got = dict(zip(log.table.column("call_id").to_pylist(), log.table.column("prompt_token_ids").to_pylist()))
    assert got == {r["call_id"]: r["prompt_token_ids"] for r in rows}


def test_option_reaches_the_writer(tmp_path: Path) -> None:
    import importlib.util

    from mitmproxy.test import taddons

    spec = importlib.util.spec_from_file_location(
        "polar_capture_delta", Path(__file__).resolve().parents[1] / "addons" / "polar_capture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    addon = module.PolarCapture()
    with taddons.context(addon) as tctx:
        try:
            tctx.configure(addon, polar_out=str(tmp_path))
            first = addon.writer
            assert first.opts.prompt_delta is False  # off by default
            tctx.configure(addon, polar_prompt_delta=True)
            assert addon.writer is not first and addon.writer.opts.prompt_delta is True
            addon.done()
        finally:
            tctx.master._legacy_log_events.uninstall()


def _resolved(tmp: Path) -> dict:
    log = read_call_log(tmp)
    assert not log.problems, log.problems
    return dict(zip(log.table.column("call_id").to_pylist(), log.table.column("prompt_token_ids").to_pylist()))


def test_a_row_stored_as_proxy_error_is_never_referred_to(tmp_path: Path) -> None:
    """A row Arrow cannot store (a server's usage count past int32) is kept as a proxy_error without
    ids. It had already been remembered as its rollout's last call, so every later call of the
    rollout referred to it and none could be read back. They now refer to the call before it."""
    base = list(range(1, 100))
    rows = [row("r", base, [7]), row("r", base + [7, 5], [8]), row("r", base + [7, 5, 8, 6], [9]),
            row("r", base + [7, 5, 8, 6, 9, 4], [10])]
    rows[1]["usage_prompt_tokens"] = 2**40
    write_rows(tmp_path, rows, flush_rows=100)
    got = _resolved(tmp_path)
    want = {r["call_id"]: r["prompt_token_ids"] for r in rows}
    want[rows[1]["call_id"]] = None
    assert got == want
    stored = {r["call_id"]: r for r in pq.read_table(tmp_path / "calls").to_pylist()}
    (part,) = (tmp_path / "calls").glob("part-*.parquet")
    assert pq.read_schema(part).metadata[b"polar_train.compact_prompts"] == b"true"  # for direct readers
    assert stored[rows[1]["call_id"]]["status"] == "proxy_error"
    assert stored[rows[2]["call_id"]]["prompt_prefix_call_id"] == rows[0]["call_id"]  # still compact


def test_rows_kept_while_parts_cannot_be_written_never_refer_to_dropped_ones(tmp_path: Path, monkeypatch) -> None:
    """Disk full: the writer keeps the newest rows and drops the oldest. Rows were compacted as they
    came in, so a kept row could refer to a dropped one and could not be read back. They are now
    compacted only when their part is written. The jobs switch the failure on and off in order, on
    the writer's own thread: no timing involved."""
    import errno

    from polar_train.capture import writer as writer_module

    failing = {"on": False}
    real_write, real_read = pq.write_table, pq.read_table

    def write_table(*args, **kwargs):
        if failing["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(writer_module.pq, "write_table", write_table)
    base = list(range(1, 100))
    rows, prompt = [], base
    for i in range(10):
        rows.append(row("r", prompt, [1000 + i]))
        prompt = prompt + [1000 + i, 2000 + i]
    w = PartWriter(tmp_path, flush_rows=1, flush_seconds=0, prompt_delta=True)
    w.max_pending_rows = 2
    w.start()

    def job(i: int):
        failing["on"] = 2 <= i < 7  # rows 2..6 meet a full disk: 2, 3 and 4 are dropped
        return dict(rows[i])

    for i in range(10):
        assert w.submit(lambda i=i: job(i), block=True)
    w.close()
    assert w.lost_rows == 3
    got = _resolved(tmp_path)
    assert got == {r["call_id"]: r["prompt_token_ids"] for k, r in enumerate(rows) if k not in (2, 3, 4)}
    stored = {r["call_id"]: r for r in real_read(tmp_path / "calls").to_pylist()}
    assert stored[rows[5]["call_id"]]["prompt_prefix_call_id"] == rows[1]["call_id"]
    assert stored[rows[9]["call_id"]]["prompt_prefix_call_id"] == rows[8]["call_id"]


def test_rows_kept_for_a_full_disk_are_bounded_in_bytes_too(tmp_path, monkeypatch) -> None:
    """Rows waiting for a writable disk were bounded by count only: 1,151 rows of multi-MB
    histories held 233 MB of text (the worker grew to 794 MB). The newest rows within the byte
    budget stay, the older are dropped and counted, the rest is written once there is space."""
    import errno

    from polar_train.capture import writer as writer_module

    failing = {"on": False}
    real_write = pq.write_table

    def write_table(*args, **kwargs):
        if failing["on"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(writer_module.pq, "write_table", write_table)
    rows = [dict(row(f"r{i}", [1, 2, 3], [4]), request_json='{"pad":"' + "x" * 100_000 + '"}') for i in range(10)]
    w = PartWriter(tmp_path, flush_rows=1, flush_seconds=0)
    w.max_pending_bytes = 350_000  # three rows of ~100 KB
    w.start()

    def job(i: int):
        failing["on"] = i < 9  # the disk is full for the first nine rows
        return dict(rows[i])

    for i in range(10):
        assert w.submit(lambda i=i: job(i), block=True)
    w.close()
    stored = [r["call_id"] for r in pq.read_table(tmp_path / "calls").to_pylist()]
    assert w.lost_rows == len(rows) - len(stored) and 3 <= len(stored) <= 4
    assert stored == [r["call_id"] for r in rows[-len(stored):]]  # the newest kept, in order


def test_the_encoder_keeps_a_bounded_amount_of_rollouts_and_bytes() -> None:
    """A long run's finished rollouts kept their contexts until 4,096 newer rollouts pushed them out
    (gigabytes with long sessions); the memory is now bounded in bytes too. A rollout whose context
    was dropped has its next call stored in full, and nothing refers to what was dropped."""
    enc = PromptDeltaEncoder(max_rollouts=3, max_mb=2)  # 1 MiB of contexts: 131,072 int64 ids
    base = list(range(1000, 1100))

    def call(rollout: str, extra: int) -> dict:
        return enc.encode(row(rollout, base + [7] * extra, [1, 2]))

    assert call("a", 0)["prompt_prefix_call_id"] is None
    assert call("a", 10)["prompt_prefix_call_id"] is not None  # remembered: a delta
    for name in "bcd":  # three newer rollouts push "a" out (at most three kept)
        call(name, 0)
    assert call("a", 20)["prompt_prefix_call_id"] is None
    call("big", 140_000)  # a context past the byte bound: not kept, and it drops the others
    assert call("big", 140_010)["prompt_prefix_call_id"] is None
    assert call("b", 10)["prompt_prefix_call_id"] is None
    assert call("b", 30)["prompt_prefix_call_id"] is not None
