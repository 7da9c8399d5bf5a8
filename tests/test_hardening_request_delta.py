"""Compact request text (``polar_prompt_delta``): each call's ``request_json`` stored as the new text
between copies of blocks of the previous request of its rollout. What is written grows linearly
with a session; what is read is the same text, whatever the session does."""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from polar_train.calllog import read_call_log
from polar_train.capture.prompt_delta import PromptDeltaEncoder
from polar_train.capture.writer import PartWriter
from polar_train.schema import CALL_LOG_ADDED_COLUMNS, CALL_LOG_SCHEMA
from polar_train.text_delta import BadDelta, apply_text_delta, text_delta

PARAMETERS = {"type": "object", "properties": {"path": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": f"tool_{k}", "description": "does a thing " * 20,
                                           "parameters": PARAMETERS}} for k in range(6)]


def row(rollout: str | None, request: str | None, status: str = "ok", prompt: list[int] | None = None) -> dict:
    now = datetime.now(timezone.utc)
    r = {name: None for name in CALL_LOG_SCHEMA.names}
    r.update(call_id=uuid.uuid4().hex, rollout_id=rollout, api="openai.chat", status=status, started_at=now,
             finished_at=now, request_json=request, prompt_token_ids=prompt,
             completion_token_ids=[1, 2] if prompt is not None else None)
    return r


def write_rows(tmp: Path, rows: list[dict], flush_rows: int = 7, encoder: PromptDeltaEncoder | None = None) -> None:
    w = PartWriter(tmp, flush_rows=flush_rows, flush_seconds=3600, prompt_delta=True)
    if encoder is not None:
        w._delta = encoder
    w.start()
    for r in rows:
        assert w.submit(lambda r=dict(r): r)
    w.close()


def read_requests(tmp: Path) -> dict:
    log = read_call_log(tmp)
    assert not log.problems, log.problems
    return dict(zip(log.table.column("call_id").to_pylist(), log.table.column("request_json").to_pylist()))


texts = st.text(alphabet=st.sampled_from("ab{}\"\\ é€🙂\n"), max_size=400)


@given(old=texts, edits=st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 50), texts), max_size=6),
       move=st.booleans())
def test_a_delta_rebuilds_the_text(old: str, edits: list, move: bool) -> None:
    """Any edits of any text (insertions, deletions, replacements, a block moved): the plan and the
    new characters rebuild the new text exactly, and only copies are not new characters."""
    new = old
    for where, cut, piece in edits:
        at = where % (len(new) + 1)
        new = new[:at] + piece + new[at + cut:]
    if move and len(new) > 10:
        new = new[len(new) // 2:] + new[:len(new) // 2]
    plan, literals, copied = text_delta(old, new)
    assert apply_text_delta(old, plan, literals) == new
    assert copied + len(literals) == len(new)


def test_a_delta_copies_the_long_blocks_a_harness_resends() -> None:
    """Codex's shape: the history grows in the middle, 18 KB of tools follow, and the per-call
    metadata at the end comes in another key order each call. A prefix and suffix alone stored the
    tools again every call; the delta copies them."""
    tools = json.dumps(TOOLS) * 3
    old = '{"input":[{"a":1}],"tools":' + tools + ',"meta":{"x":"1","y":"2","z":"3"}}'
    new = '{"input":[{"a":1},{"b":2}],"tools":' + tools + ',"meta":{"z":"3","x":"1","y":"2"}}'
    plan, literals, copied = text_delta(old, new)
    assert apply_text_delta(old, plan, literals) == new
    assert len(literals) < 64 and copied > len(tools)
    assert text_delta("", "new") == ([0, 0, 3], "new", 0)
    assert text_delta("same text", "same text") == ([0, 9, 0], "", 9)


def test_a_delta_copies_around_many_small_edits_and_searches_each_region_once(monkeypatch) -> None:
    """A text edited every 2,000 characters: only 12 blocks of 400 were copied (one block per region
    searched, and at most 64); a region whose anchors found nothing was searched again and again
    until the scan budget ran out (~100 ms for 2 MB). Now every anchor's block counts, and each
    region is searched once."""
    import random

    from polar_train import text_delta as module

    rng = random.Random(5)
    old = "".join(rng.choices("abcdefghij", k=800_000))
    new = "".join("X" if i % 2000 == 0 else c for i, c in enumerate(old))
    searched = []
    region_blocks = module._Blocks.region_blocks

    def spy(self, *region):
        searched.append(region)
        return region_blocks(self, *region)

    monkeypatch.setattr(module._Blocks, "region_blocks", spy)
    plan, literals, copied = text_delta(old, new)
    assert apply_text_delta(old, plan, literals) == new
    assert len(literals) == 400 and copied == len(new) - 400
    # unrelated new text around shared blocks: regions without a hit are not searched twice (a
    # shared block much shorter than its region may go unfound: 16 anchors a region, a bound on time)
    unrelated = "".join(rng.choices("klmnopqrst", k=50_000))
    mixed = unrelated + old[100_000:300_000] + unrelated + old[500_000:700_000] + unrelated
    searched.clear()
    plan, literals, copied = text_delta(old, mixed)
    assert apply_text_delta(old, plan, literals) == mixed
    assert copied == 400_000 and len(searched) == len(set(searched)), searched


@pytest.mark.parametrize("plan,literals,message", [
    ([0, 5], "", "not a list of (start, length, new) triples"),
    ([0, None, 0], "", "(nulls: 1) is not a list"),
    ([3, 10, 0], "", "does not fit the 10 characters"),
    ([0, 2, 5], "abc", "does not fit"),
    ([0, 2, 1], "abc", "uses 1 of 3 new characters"),
    ([-1, 2, 0], "", "does not fit"),
])
def test_a_delta_that_does_not_fit_is_refused(plan, literals, message) -> None:
    with pytest.raises(BadDelta, match=re.escape(message)):
        apply_text_delta("0123456789", plan, literals)


def session(api: str, turns: int) -> list[str]:
    """The request texts of one agent session of ``api``'s shape: the conversation grows in the middle,
    the tool definitions and options come after it, as harnesses write them."""
    texts, items = [], [{"role": "user", "content": "fix the failing test in calc.py " * 10}]
    for k in range(turns):
        if api == "openai.chat":
            body = {"model": "m", "messages": items, "tools": TOOLS, "stream": True}
        elif api == "openai.responses":
            body = {"model": "m", "instructions": "You are a coding agent. " * 40, "input": items, "tools": TOOLS,
                    "stream": True, "store": False}
        else:  # Claude Code moves its cache marker to the newest message each turn
            marked = [dict(m) for m in items]
            marked[-1]["cache_control"] = {"type": "ephemeral"}
            body = {"model": "m", "system": "You are Claude Code. " * 40, "messages": marked, "tools": TOOLS,
                    "max_tokens": 512, "stream": True}
        texts.append(json.dumps(body))
        items = [*items, {"role": "assistant", "content": f"I will run the tests ({k}) and look."},
                 {"role": "tool", "content": f"FAILED test_add {k}: assert 3 == 4 " + "log line ü " * 30}]
    return texts


def test_fifty_turn_sessions_round_trip_and_store_linearly(tmp_path: Path) -> None:
    """Three wire shapes side by side (rows interleaved, parts of 7): every text reads back exactly,
    and what is stored is about the session's final text once, not 25 times it."""
    sessions = {api: session(api, 50) for api in ("openai.chat", "openai.responses", "anthropic.messages")}
    rows = [row(api, texts[k]) for k in range(50) for api, texts in sessions.items()]
    write_rows(tmp_path, rows)
    assert read_requests(tmp_path) == {r["call_id"]: r["request_json"] for r in rows}
    raw = read_call_log(tmp_path, resolve_prompts=False).table
    # each session's first call in full, and its 32nd (FULL_EVERY: a lost part costs calls up to the next one)
    assert raw.column("request_json_base_call_id").null_count == 6
    for api, texts in sessions.items():
        stored = sum(len(text) for text, rollout in zip(raw.column("request_json").to_pylist(),
                                                        raw.column("rollout_id").to_pylist()) if rollout == api)
        full = sum(len(t) for t in texts)
        assert stored < 2 * len(texts[-1]) < full / 10, (api, stored, len(texts[-1]), full)


edits = st.lists(st.tuples(
    st.sampled_from(["a", "b", None]),                       # rollout (None: no identity, never compacted)
    st.sampled_from(["append", "insert", "delete", "replace", "same", "none"]),
    st.integers(0, 10_000),                                  # where (modulo the text's length)
    st.text(alphabet=st.sampled_from("ab{}\"\\ é€🙂\n"), max_size=30),
    st.sampled_from(["ok", "upstream_error", "client_disconnected"]),
), min_size=1, max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=edits, flush_rows=st.integers(1, 9), min_shared=st.integers(0, 40))
def test_any_session_reads_back_exactly(tmp_path_factory, steps, flush_rows: int, min_shared: int) -> None:
    """Any edit anywhere (also in the middle of a character run the previous text repeats), any status,
    no request at all, rollouts interleaved, any part size: the reader gives back every text."""
    tmp = tmp_path_factory.mktemp("rdelta")
    texts: dict = {}
    rows = []
    for rollout, action, where, piece, status in steps:
        text = texts.get(rollout, "{\"messages\": []}")
        at = where % (len(text) + 1)
        if action == "append":
            text = text + piece
        elif action == "insert":
            text = text[:at] + piece + text[at:]
        elif action == "delete":
            text = text[:at] + text[at + len(piece):]
        elif action == "replace":
            text = text[:at] + piece + text[at + len(piece):]
        rows.append(row(rollout, None if action == "none" else text, status))
        if action != "none":
            texts[rollout] = text
    write_rows(tmp, rows, flush_rows, PromptDeltaEncoder(min_shared_chars=min_shared))
    assert read_requests(tmp) == {r["call_id"]: r["request_json"] for r in rows}


def test_replies_that_echo_the_tools_store_them_once(tmp_path: Path) -> None:
    """A Responses reply echoes the request's instructions and tools (~18 KB a Codex call): the reply
    text is a delta of the previous reply of the rollout too, and reads back whole."""
    rows = []
    for k, text in enumerate(session("openai.responses", 20)):
        r = row("r", text)
        r["response_json"] = json.dumps({"id": f"resp_{k}", "instructions": "You are a coding agent. " * 40,
                                         "output": [{"type": "message", "content": f"answer {k} " * 5}],
                                         "tools": TOOLS, "usage": {"input_tokens": 100 + k}})
        rows.append(r)
    write_rows(tmp_path, rows)
    log = read_call_log(tmp_path)
    assert not log.problems
    got = {r["call_id"]: (r["request_json"], r["response_json"]) for r in log.table.to_pylist()}
    assert got == {r["call_id"]: (r["request_json"], r["response_json"]) for r in rows}
    raw = pq.read_table(tmp_path / "calls").to_pylist()
    assert sum(r["response_json_base_call_id"] is not None for r in raw) == 19
    stored = sum(len(r["response_json"]) for r in raw)
    assert stored < 2 * len(rows[0]["response_json"]), stored


def test_prompts_and_requests_compact_together_and_apart(tmp_path: Path) -> None:
    """The two deltas are independent: an error row (no ids) still shares its request; a request that
    changed entirely is stored whole while its prompt is still a delta."""
    base = list(range(100, 300))
    texts = session("openai.chat", 4)
    rows = [row("r", texts[0], prompt=base), row("r", texts[1], "upstream_error"),
            row("r", texts[1], prompt=base + [1, 2, 7]), row("r", "{}" * 200, prompt=base + [1, 2, 7, 1, 2, 8])]
    write_rows(tmp_path, rows, flush_rows=100)
    raw = {r["call_id"]: r for r in pq.read_table(tmp_path / "calls").to_pylist()}
    first, error, retry, other = (raw[r["call_id"]] for r in rows)
    assert error["request_json_base_call_id"] == first["call_id"] and error["prompt_prefix_call_id"] is None
    assert retry["request_json_base_call_id"] == error["call_id"] and retry["request_json"] == ""
    assert retry["prompt_prefix_call_id"] == first["call_id"]  # prompts refer to ok calls only
    assert other["request_json_base_call_id"] is None and other["prompt_prefix_call_id"] == retry["call_id"]
    log = read_call_log(tmp_path)
    assert not log.problems
    got = {r["call_id"]: (r["request_json"], r["prompt_token_ids"]) for r in log.table.to_pylist()}
    assert got == {r["call_id"]: (r["request_json"], r["prompt_token_ids"]) for r in rows}


def test_parts_written_before_the_columns_were_added_still_read(tmp_path: Path) -> None:
    """A capture made before this change has no request_json_* columns: it reads as before (the
    columns null), while a part whose column has another type is still named and skipped."""
    rows = [row("r", "{\"a\": 1}", prompt=[1, 2, 3])]
    calls = tmp_path / "calls"
    calls.mkdir()
    older = pa.schema([f for f in CALL_LOG_SCHEMA if f.name not in CALL_LOG_ADDED_COLUMNS])
    pq.write_table(pa.Table.from_pylist(rows, schema=older), calls / "part-old.parquet")
    wrong = pa.schema([pa.field("request_json_delta", pa.string()) if f.name == "request_json_delta" else f
                       for f in CALL_LOG_SCHEMA])
    pq.write_table(pa.Table.from_pylist([row("r", "{}")], schema=wrong), calls / "part-wrong.parquet")
    log = read_call_log(tmp_path)
    assert [p.name for p in log.parts] == ["part-old.parquet"]
    (problem,) = log.problems
    assert "request_json_delta (string, expected list<item: int32>)" in problem.message
    assert log.table.to_pylist()[0]["request_json"] == "{\"a\": 1}"
    assert log.table.column("request_json_delta").null_count == 1


def test_parts_of_the_first_compact_request_format_rebuild_their_texts(tmp_path: Path, capsys) -> None:
    """For fourteen minutes of 2026-12-05 compact storage kept a request's middle in request_json,
    with how many first and last characters of the previous request's surround it. Such a capture
    read back fragments as whole requests, unsaid; its texts are rebuilt (a chain, and the length
    inspect checks), a row whose numbers do not fit is named."""
    from polar_train.cli import main
    from polar_train.schema import LEGACY_REQUEST_DELTA_COLUMNS

    first, second, third = '{"m": ["a", "b"], "x": 1}', '{"m": ["a", "b", "c"], "x": 1}', '{"m": ["a", "b", "c", "d"], "x": 2}'
    rows = [row("r", first, prompt=[1, 2]), row("r", ', "c"', prompt=[1, 2, 3]), row("r", ', "d"], "x": 2}', prompt=[4]),
            row("r", "xyz", prompt=[5])]
    ids = [r["call_id"] for r in rows]
    legacy = [(None, None, None), (ids[0], len('{"m": ["a", "b"'), len('], "x": 1}')), (ids[1], len('{"m": ["a", "b", "c"'), 0),
              (ids[0], 20, 20)]  # the last: 40 characters of a 25-character text
    for r, (ref, p, s) in zip(rows, legacy):
        r.update(zip(LEGACY_REQUEST_DELTA_COLUMNS, (ref, p, s)))
    schema = pa.schema([f for f in CALL_LOG_SCHEMA if f.name not in CALL_LOG_ADDED_COLUMNS]
                       + [pa.field(LEGACY_REQUEST_DELTA_COLUMNS[0], pa.string()),
                          *(pa.field(n, pa.int32()) for n in LEGACY_REQUEST_DELTA_COLUMNS[1:])])
    (tmp_path / "calls").mkdir()
    earlier = [row("q", '{"m": ["z"]}', prompt=[9]), row("q", '{"m": ["y"]}', prompt=[8])]  # read first: rows 0-1
    pq.write_table(pa.Table.from_pylist(earlier, schema=CALL_LOG_SCHEMA), tmp_path / "calls" / "part-1204.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:2], schema=schema), tmp_path / "calls" / "part-1205a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:], schema=schema), tmp_path / "calls" / "part-1205b.parquet")
    pq.write_table(pa.Table.from_pylist(earlier[:1], schema=CALL_LOG_SCHEMA), tmp_path / "calls" / "part-1206.parquet")
    log = read_call_log(tmp_path)
    assert log.table.column("request_json").to_pylist() == ['{"m": ["z"]}', '{"m": ["y"]}', first, second, third, None,
                                                            '{"m": ["z"]}']
    assert [(p.call_id, p.column) for p in log.problems] == [(ids[3], "request_json")]
    assert "request_json_prefix_len 20 and request_json_suffix_len 20 do not fit the 25 characters" in log.problems[0].message
    checked = read_call_log(tmp_path, rebuild=False)
    assert [(p.call_id, p.message) for p in checked.problems] == [(p.call_id, p.message) for p in log.problems]
    assert checked.compact_rows == log.compact_rows == 3
    assert read_call_log(tmp_path, skip={"request_json"}).problems == []  # the builder's read: no texts, no word
    assert main(["inspect", str(tmp_path)]) == 0
    assert "compact storage: 3 of 7 rows" in capsys.readouterr().out


def test_a_lost_reference_costs_only_that_request_and_inspect_says_so(tmp_path: Path, capsys) -> None:
    """The part a compact request refers to is gone: its text reads as null and is named, its prompt
    (stored in full) is kept, and inspect does not call it a lost prompt."""
    from polar_train.cli import main

    texts = session("openai.chat", 3)
    rows = [row("r", t, prompt=[5, 6, 7]) for t in texts]
    write_rows(tmp_path, rows[:1], flush_rows=1)
    (part,) = (tmp_path / "calls").glob("part-*.parquet")
    rows[1]["request_json_base_call_id"] = "gone"
    rows[1]["request_json_delta"] = [0, 10, len(texts[1]) - 10]
    rows[1]["request_json"] = texts[1][10:]
    pq.write_table(pa.Table.from_pylist(rows[1:], schema=CALL_LOG_SCHEMA), tmp_path / "calls" / "part-z.parquet")
    part.unlink()
    log = read_call_log(tmp_path)
    by_id = {r["call_id"]: r for r in log.table.to_pylist()}
    assert by_id[rows[1]["call_id"]]["request_json"] is None
    assert by_id[rows[1]["call_id"]]["prompt_token_ids"] == [5, 6, 7]
    assert by_id[rows[2]["call_id"]]["request_json"] == texts[2]  # stored in full: not part of the chain
    assert [(p.call_id, p.column) for p in log.problems] == [(rows[1]["call_id"], "request_json")]
    assert "request_json base refers to unknown call gone" in log.problems[0].message
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "1 call whose compact request or response text cannot be rebuilt" in out
    assert "compact storage: 1 of 2 rows store their prompt or texts as a delta of an earlier call" in out
    assert "compact prompt cannot" not in out


def test_numbers_that_do_not_fit_are_named_not_guessed(tmp_path: Path) -> None:
    texts = session("openai.chat", 2)
    rows = [row("r", texts[0]), row("r", texts[1][5:])]
    rows[1].update(request_json_base_call_id=rows[0]["call_id"], request_json_delta=[0, len(texts[0]) + 1, 0])
    calls = tmp_path / "calls"
    calls.mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=CALL_LOG_SCHEMA), calls / "part-0.parquet")
    log = read_call_log(tmp_path)
    assert log.table.to_pylist()[1]["request_json"] is None
    (problem,) = log.problems
    assert "does not fit the" in problem.message and problem.column == "request_json"


def test_a_row_stored_as_proxy_error_keeps_its_whole_request(tmp_path: Path) -> None:
    """A row Arrow cannot store as built (a usage count past int32) is kept as a proxy_error with its
    request text but without the reference columns: it must keep the whole text, not a middle that
    refers to nothing, and the calls after it refer to the call before it."""
    texts = session("openai.chat", 4)
    rows = [row("r", t, prompt=[5, 6, 7]) for t in texts]
    rows[1]["usage_prompt_tokens"] = 2**40
    write_rows(tmp_path, rows, flush_rows=100)
    assert read_requests(tmp_path) == {r["call_id"]: r["request_json"] for r in rows}
    raw = {r["call_id"]: r for r in pq.read_table(tmp_path / "calls").to_pylist()}
    bad, after = raw[rows[1]["call_id"]], raw[rows[2]["call_id"]]
    assert bad["status"] == "proxy_error" and bad["request_json"] == texts[1]
    assert after["request_json_base_call_id"] == rows[0]["call_id"]


def test_compact_rows_can_be_checked_without_being_rebuilt(tmp_path: Path, capsys) -> None:
    """inspect rebuilt every prompt and request text of a compact capture and showed only counts:
    2.97 GB for a 2 MB capture of four 300-turn sessions (found by a review), and past 2**31
    rebuilt tokens it could not read the capture at all. It now checks the deltas by their lengths
    only; what does not fit is still found and counted, and the token counts are the same."""
    from polar_train.cli import main

    texts = session("openai.chat", 6)
    prompts = [list(range(100 + 7 * k)) for k in range(6)]
    rows = [row("r", text, prompt=prompt) for text, prompt in zip(texts, prompts)]
    for r, prompt in zip(rows, prompts):
        r["completion_token_ids"] = list(range(len(prompt), len(prompt) + 7))[:5]  # the next prompt goes on
    write_rows(tmp_path, rows)
    checked = read_call_log(tmp_path, rebuild=False)
    assert not checked.problems and checked.compact_rows == 5
    assert checked.prompt_lengths == [len(p) for p in prompts]
    for column in ("prompt_token_ids", "request_json", "request_json_delta", "prompt_prefix_len"):
        assert checked.table.column(column).null_count == 6, column
    # stored numbers that do not fit: named by the check as by the rebuild
    (part,) = (tmp_path / "calls").glob("part-*.parquet")
    table = pq.read_table(part).to_pylist()
    table[3]["request_json_delta"] = [0, 10**6, len(table[3]["request_json"])]
    table[2]["prompt_prefix_len"] = 10**6
    pq.write_table(pa.Table.from_pylist(table, schema=CALL_LOG_SCHEMA), part)
    found = {}
    for rebuild in (True, False):
        log = read_call_log(tmp_path, rebuild=rebuild)
        found[rebuild] = [(p.call_id, p.column, p.message) for p in log.problems]
    assert found[True] == found[False]
    assert [c for c, column, _ in found[True] if column == "request_json"] == [r["call_id"] for r in rows[3:]]
    assert [c for c, column, _ in found[True] if column == "prompt_token_ids"] == [r["call_id"] for r in rows[2:]]
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "4 calls whose compact prompt cannot be rebuilt" in out
    assert "compact request or response text cannot" not in out  # the same calls: counted once, as prompts
    tokens = sum(len(p) for p in prompts[:2])
    assert f" {tokens} " in out.split("per api")[1].splitlines()[3], out


def test_the_texts_kept_per_rollout_are_bounded_and_huge_texts_stored_whole(monkeypatch) -> None:
    """The texts remembered per rollout count against the writer's byte bound too (a quarter each
    for requests and responses), and a text past MAX_DELTA_CHARS is stored whole, never diffed."""
    from polar_train.capture import prompt_delta

    enc = PromptDeltaEncoder(max_mb=2)  # 0.5 MiB for request texts
    small, big = "{" + "a" * 1000 + "}", "{" + "b" * 600_000 + "}"
    first = enc.encode(row("r", small))
    assert enc.encode(row("r", small + " "))["request_json_base_call_id"] == first["call_id"]
    enc.encode(row("s", big))  # past the bound: it drops what was kept, itself included
    assert enc.encode(row("r", small))["request_json_base_call_id"] is None
    assert enc.encode(row("s", big))["request_json_base_call_id"] is None
    monkeypatch.setattr(prompt_delta, "MAX_DELTA_CHARS", 500)
    enc = PromptDeltaEncoder()
    enc.encode(row("r", small))
    assert enc.encode(row("r", small))["request_json_base_call_id"] is None  # 1,002 characters: whole
