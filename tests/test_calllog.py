"""The call-log reader: finished parts only, bad parts named and skipped, compact prompts resolved."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_train.calllog import CallLogError, list_parts, read_call_log, read_calls
from polar_train.schema import CALL_LOG_SCHEMA
from tests.support.calls import Conversation, calls_table, compact, make_row, write_parts


@pytest.fixture(scope="module")
def session_rows() -> list[dict]:
    """Four calls of one tool-using conversation (real template renders and token ids)."""
    conv = Conversation(rollout_id="r-read")
    conv.user("count the files")
    rows = [conv.assistant("", tool_calls=[("ls", {"path": "."})])]
    conv.tool("a.txt\nb.txt")
    rows.append(conv.assistant("Two files.", reasoning="ls showed two"))
    conv.user("and hidden ones?")
    rows.append(conv.assistant("", tool_calls=[("ls", {"path": ".", "all": True})]))
    conv.tool(".git a.txt b.txt")
    rows.append(conv.assistant("One hidden: .git"))
    return rows


def test_reads_calls_folder_with_full_schema(tmp_path, session_rows):
    write_parts(tmp_path, session_rows[:2], "part-a")
    write_parts(tmp_path, session_rows[2:], "part-b")
    table = read_calls(tmp_path)
    assert table.schema.equals(CALL_LOG_SCHEMA, check_metadata=False)
    assert sorted(table.column("call_id").to_pylist()) == sorted(r["call_id"] for r in session_rows)
    by_id = {r["call_id"]: r for r in session_rows}
    for row in table.to_pylist():
        assert row["prompt_token_ids"] == by_id[row["call_id"]]["prompt_token_ids"]
        assert row["completion_logprobs"] == pytest.approx(by_id[row["call_id"]]["completion_logprobs"])


def test_a_folder_that_cannot_be_read_is_named_not_passed_over(tmp_path, session_rows, monkeypatch):
    """Calls under a folder the reader may not open were left out of a build without a word."""
    import os

    write_parts(tmp_path, session_rows[:2], "part-a")
    locked = tmp_path / "calls" / "host-b"
    write_parts(locked, session_rows[2:], "part-b")
    real_scandir = os.scandir

    def scandir(path="."):
        if os.fspath(path) in (str(locked), str(locked / "calls")):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_scandir(path)

    monkeypatch.setattr(os, "scandir", scandir)  # what chmod 000 does, also for root
    log = read_call_log(tmp_path)
    assert log.table.num_rows == 2
    assert [str(p) for p in log.problems] == [f"{locked}: unreadable folder: Permission denied"]
    locked_root = tmp_path  # the walk starts at the folder given
    monkeypatch.setattr(os, "scandir", lambda path=".": (_ for _ in ()).throw(
        PermissionError(13, "Permission denied", os.fspath(path))))
    with pytest.raises(CallLogError, match=f"cannot read {locked_root}: Permission denied"):
        read_call_log(tmp_path)  # not "no call-log parts": the folder is there, only closed



def test_a_part_name_that_is_no_file_is_named_not_passed_over(tmp_path, session_rows):
    """A link to parts on a disk not mounted, a FIFO, a device under a part's name: the reader
    passed them over without a word ("1 part(s)", no problem listed, exit 0)."""
    import os

    write_parts(tmp_path, session_rows, "part-a")
    calls = tmp_path / "calls"
    (calls / "part-gone.parquet").symlink_to(tmp_path / "unmounted" / "part-0.parquet")
    os.mkfifo(calls / "part-fifo.parquet")
    (calls / "part-zero.parquet").symlink_to("/dev/zero")
    log = read_call_log(tmp_path)  # never blocks on the FIFO: it is not opened
    assert log.table.num_rows == len(session_rows)
    assert sorted(str(p) for p in log.problems) == [
        f"{calls / 'part-fifo.parquet'}: a FIFO, not a part file",
        f"{calls / 'part-gone.parquet'}: a broken link",
        f"{calls / 'part-zero.parquet'}: a device, not a part file"]


def test_a_part_of_a_later_call_log_version_is_named_not_read(tmp_path, session_rows):
    """A part a later polar-train wrote may mean its columns otherwise: build and inspect read it
    as this version's (the trainer refuses trajectories of another version the same way)."""
    import pyarrow.parquet as pq

    from tests.support.calls import calls_table

    write_parts(tmp_path, session_rows[:2], "part-a")
    table = calls_table(session_rows[2:])
    later = tmp_path / "calls" / "part-later.parquet"
    pq.write_table(table.replace_schema_metadata({**table.schema.metadata, b"polar_train.version": b"99"}), later)
    log = read_call_log(tmp_path)
    assert log.table.num_rows == 2
    assert [str(p) for p in log.problems] == [
        f"{later}: call-log version 99, this polar-train reads version 1; upgrade polar-train"]

def test_folder_of_parts_itself_and_single_file(tmp_path, session_rows):
    path = write_parts(tmp_path, session_rows, "part-x")
    assert read_calls(path.parent).num_rows == 4  # <folder>/calls given directly
    assert read_calls(path).num_rows == 4  # one part file


def test_ignores_temporary_and_private_files(tmp_path, session_rows):
    real = write_parts(tmp_path, session_rows[:1], "part-real")
    calls = real.parent
    # a part being written (the capture writer's temp name), a private one, a dot-folder
    pq.write_table(calls_table(session_rows[1:2]), calls / ".part-b.parquet.tmp")
    pq.write_table(calls_table(session_rows[1:2]), calls / ".part-c.parquet")
    pq.write_table(calls_table(session_rows[2:3]), calls / "_scratch.parquet")
    (calls / ".staging").mkdir()
    pq.write_table(calls_table(session_rows[3:4]), calls / ".staging" / "part-d.parquet")
    (calls / "notes.txt").write_text("not a part")
    assert list_parts(tmp_path) == [real]
    log = read_call_log(tmp_path)
    assert log.table.column("call_id").to_pylist() == [session_rows[0]["call_id"]]
    assert log.problems == []


def test_missing_and_empty_folders_are_clear_errors(tmp_path):
    with pytest.raises(CallLogError, match="call-log folder not found: .*nope"):
        read_calls(tmp_path / "nope")
    with pytest.raises(CallLogError, match=r"no call-log parts \(\*\.parquet\) in " + re.escape(str(tmp_path)) + "$"):
        read_calls(tmp_path)  # no calls/ folder: no proxy wrote here
    (tmp_path / "calls").mkdir()  # a fresh checkout's data/captures/calls: said to need a proxy, not a wait
    with pytest.raises(CallLogError, match=r"no call-log parts \(\*\.parquet\) in .*calls; no capture proxy has "
                                           r"started here \(mitmdump -s addons/polar_capture.py"):
        read_calls(tmp_path)
    from polar_train.capture.outdir import LIVE_LOCK
    from polar_train.folder_lock import hold_shared_lock

    (tmp_path / "calls" / LIVE_LOCK).touch()  # what the addon makes at its start; parts follow every 10 s
    with pytest.raises(CallLogError, match=r"; no capture proxy on this machine is writing into it, and the one that "
                                           r"made it recorded no call"):
        read_calls(tmp_path)
    held = hold_shared_lock(tmp_path / "calls" / LIVE_LOCK)
    assert held is not None
    with held:
        with pytest.raises(CallLogError, match=rf"; a capture proxy \(its lock held by process {os.getpid()}\) "
                                               rf"is writing into {re.escape(str(tmp_path / 'calls'))}: it writes a "
                                               r"part every polar_flush_seconds"):
            read_calls(tmp_path)
    # a team folder whose only proxy writes into a folder below, no part yet (the review): named too
    deeper = tmp_path / "team" / "machine-b" / "calls"
    deeper.mkdir(parents=True)
    held = hold_shared_lock(deeper / LIVE_LOCK)
    assert held is not None
    with held:
        with pytest.raises(CallLogError, match=re.escape(f"in {tmp_path / 'team'}; a capture proxy (its lock held by "
                                                         f"process {os.getpid()}) is writing into {deeper}: ")):
            read_calls(tmp_path / "team")


def test_read_calls_says_what_inspect_and_build_say(tmp_path, session_rows, caplog):
    """From Python, a capture still being written and calls a proxy lost read as the whole capture,
    unsaid (only the commands printed them), and a trajectory folder read as an empty capture."""
    from polar_train.capture.outdir import LIVE_LOCK, record_loss
    from polar_train.folder_lock import hold_shared_lock

    write_parts(tmp_path, session_rows, "part-a")
    held = hold_shared_lock(tmp_path / "calls" / LIVE_LOCK)
    assert held is not None
    with held, caplog.at_level("WARNING", logger="polar_train.calllog"):
        record_loss(tmp_path / "calls", calls_dropped=5)
        assert read_calls(tmp_path).num_rows == 4
    warned = [r.getMessage() for r in caplog.records]
    assert any("a capture proxy is writing into" in m and f"process {os.getpid()}" in m for m in warned), warned
    assert any("lost 5 call(s) dropped" in m for m in warned), warned
    trajectories = tmp_path / "traj"
    trajectories.mkdir()
    pq.write_table(pa.table({"trajectory_id": ["t"], "completion_ids": [[1]]}), trajectories / "part-00000.parquet")
    with pytest.raises(CallLogError, match=re.escape(f"no readable call-log part in {trajectories}; skipped ")
                       + ".*trajectories \\(what `polar-train build` writes\\), not a call log"):
        read_calls(trajectories)


def test_foreign_schema_and_corrupt_parts_are_named_and_skipped(tmp_path, session_rows):
    write_parts(tmp_path, session_rows, "part-good")
    calls = tmp_path / "calls"
    pq.write_table(pa.table({"call_id": ["x"], "text": ["hello"]}), calls / "part-foreign.parquet")
    wrong_type = calls_table(session_rows[:1]).drop_columns(["attempt"]).append_column(
        "attempt", pa.array(["one"], pa.string()))
    pq.write_table(wrong_type, calls / "part-wrongtype.parquet")
    (calls / "part-garbage.parquet").write_bytes(b"this is not parquet at all")
    good_bytes = (calls / "part-good.parquet").read_bytes()
    (calls / "part-truncated.parquet").write_bytes(good_bytes[: len(good_bytes) // 2])
    log = read_call_log(tmp_path)
    assert log.table.num_rows == 4  # the good part is still read in full
    problems = {p.path.rsplit("/", 1)[-1]: p.message for p in log.problems}
    assert set(problems) == {"part-foreign.parquet", "part-wrongtype.parquet",
                             "part-garbage.parquet", "part-truncated.parquet"}
    assert "another schema" in problems["part-foreign.parquet"]
    assert "api (missing)" in problems["part-foreign.parquet"]
    assert "attempt (string, expected int32)" in problems["part-wrongtype.parquet"]
    assert "not a readable Parquet file" in problems["part-garbage.parquet"]


def test_a_trajectories_folder_is_named_as_such(tmp_path):
    # polar-train build's output handed to inspect/build: the message says what it is instead
    # of listing 31 missing call-log columns
    from polar_train.schema import TRAJECTORY_SCHEMA

    pq.write_table(TRAJECTORY_SCHEMA.empty_table(), tmp_path / "part-00000.parquet")
    log = read_call_log(tmp_path)
    assert log.table.num_rows == 0
    assert [p.message for p in log.problems] == ["trajectories (what `polar-train build` writes), not a call log"]


def test_compact_prompts_resolve_to_the_full_prompts(tmp_path, session_rows):
    rows = compact(session_rows)
    # the reference really is compact: later rows store much less than the full prompt
    assert rows[1]["prompt_prefix_call_id"] == session_rows[0]["call_id"]
    assert len(rows[3]["prompt_token_ids"]) < len(session_rows[3]["prompt_token_ids"]) // 2
    # the third call drops reasoning after a new user message: its prefix is shorter than
    # prompt + completion of the second call, so the truncation of the prefix matters
    prev = session_rows[1]["prompt_token_ids"] + session_rows[1]["completion_token_ids"]
    assert rows[2]["prompt_prefix_len"] < len(prev)
    write_parts(tmp_path, rows[2:], "part-late")  # chains resolve across parts and order
    write_parts(tmp_path, rows[:2], "part-early")
    log = read_call_log(tmp_path)
    assert log.problems == []
    got = {r["call_id"]: r for r in log.table.to_pylist()}
    for row in session_rows:
        assert got[row["call_id"]]["prompt_token_ids"] == row["prompt_token_ids"]
        assert got[row["call_id"]]["prompt_prefix_call_id"] is None
        assert got[row["call_id"]]["prompt_prefix_len"] is None


def test_unresolvable_compact_prompts_are_reported_not_guessed(tmp_path, session_rows):
    rows = compact(session_rows)
    rows[1]["prompt_prefix_call_id"] = "no-such-call"  # row 2 and 3 chain through row 1
    short = make_row(call_id="short", prompt_ids=[1, 2], completion_ids=[3])
    too_long = make_row(call_id="too-long", prompt_ids=[4], completion_ids=[5],
                        prompt_prefix_call_id="short", prompt_prefix_len=99)
    loop_a = make_row(call_id="loop-a", prompt_ids=[1], completion_ids=[2],
                      prompt_prefix_call_id="loop-b", prompt_prefix_len=1)
    loop_b = make_row(call_id="loop-b", prompt_ids=[1], completion_ids=[2],
                      prompt_prefix_call_id="loop-a", prompt_prefix_len=1)
    null_suffix = make_row(call_id="null-suffix", prompt_ids=None, completion_ids=[6],  # read as no suffix
                           prompt_prefix_call_id="short", prompt_prefix_len=2)  # before: a shorter prompt
    write_parts(tmp_path, rows + [loop_a, loop_b, short, too_long, null_suffix])
    log = read_call_log(tmp_path)
    got = {r["call_id"]: r["prompt_token_ids"] for r in log.table.to_pylist()}
    assert got["null-suffix"] is None
    checked = read_call_log(tmp_path, rebuild=False)  # inspect's check by lengths finds the same
    assert sorted(map(str, checked.problems)) == sorted(map(str, log.problems))
    assert got[session_rows[0]["call_id"]] == session_rows[0]["prompt_token_ids"]
    for row in session_rows[1:]:
        assert got[row["call_id"]] is None
    assert got["loop-a"] is None and got["loop-b"] is None and got["too-long"] is None
    assert got["short"] == [1, 2]
    messages = [str(p) for p in log.problems]
    assert any("unknown call no-such-call" in m and session_rows[1]["call_id"] in m for m in messages)
    # both calls of the loop are named (only the first was; inspect then counted one lost call)
    assert sorted(p.call_id for p in log.problems if "circular" in p.message) == ["loop-a", "loop-b"]
    assert any("too-long" in m and "prompt_prefix_len 99 outside 0..3" in m for m in messages)
    assert any("null-suffix" in m and "stored suffix (prompt_token_ids) is null" in m for m in messages)
    # nothing else is lost: every row is still there, completions intact
    assert log.table.num_rows == 9
    assert log.table.column("completion_token_ids").null_count == 0


def test_inspect_summarises_rows_without_an_api_or_status(tmp_path, session_rows, capsys):
    """A part another tool wrote, whose schema lets ``api``/``status`` be null: a summary (those
    rows under "(none)"), not a TypeError from sorting None beside the API names."""
    from polar_train.cli import main

    loose = pa.schema([f.with_nullable(True) for f in CALL_LOG_SCHEMA])
    rows = [dict(session_rows[0], api=None), dict(session_rows[1], status=None), *session_rows[2:]]
    (tmp_path / "calls").mkdir()
    pq.write_table(pa.Table.from_pylist(rows, schema=loose), tmp_path / "calls" / "part-0.parquet")
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "4 calls" in out and "\n(none) " in out


def test_inspect_counts_a_retry_another_proxy_numbered_afresh_and_shares_sources_of_ok_calls(
        tmp_path, session_rows, capsys):
    """A call cut off when its proxy stopped, sent again through the restarted proxy: both rows
    say attempt 1 (each proxy numbers what it saw), and inspect said `retries 0`; the cut call
    (no ids: it failed) counted as token source "none", which reads as a missing tokenizer."""
    from polar_train.cli import main

    first = session_rows[0]
    cut = dict(first, call_id="cut", status="proxy_error", token_source="none", completion_token_ids=[],
               error="proxy shut down before the call finished", request_hash="h-1", attempt=1)
    again = dict(first, call_id="again", request_hash="h-1", attempt=1)
    other = dict(session_rows[1], request_hash="h-2", attempt=1)
    elsewhere = dict(session_rows[2], rollout_id="r-other", request_hash="h-1", attempt=1)  # another rollout's
    (tmp_path / "calls").mkdir()
    pq.write_table(pa.Table.from_pylist([cut, again, other, elsewhere], schema=CALL_LOG_SCHEMA),
                   tmp_path / "calls" / "part-0.parquet")
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rollouts = {line.split()[0]: line.split()[1:4] for line in out.splitlines()
                if line.startswith(("r-read ", "r-other "))}
    assert rollouts == {"r-read": ["3", "2", "1"], "r-other": ["1", "1", "0"]}  # calls, ok, retries
    api = next(line.split() for line in out.splitlines() if line.startswith("openai.chat "))
    assert api[-4:-1] == ["100%", "0%", "0%"]  # server, rendered, none: of the 3 ok calls


def test_inspect_never_rounds_a_share_to_none_or_all_and_says_what_a_cut_table_leaves_out(session_rows):
    """One ok call of 224 without ids showed as 0% (and the others as 100%); the errors and notes
    tables stopped at --top without a word, where the rollouts table said how many more there were."""
    from polar_train.inspect import summarize

    ok = [dict(session_rows[k % 4], call_id=f"c{k}", request_hash=f"h{k}") for k in range(223)]
    ok.append(dict(session_rows[0], call_id="bare", token_source="none", request_hash="bare"))
    failed = [dict(session_rows[0], call_id=f"f{k}", status="upstream_error", error=f"error kind {k % 4}",
                   request_hash=f"f{k}") for k in range(11)]
    out = summarize(pa.Table.from_pylist(ok + failed, schema=CALL_LOG_SCHEMA), top=3)
    api = next(line.split() for line in out.splitlines() if line.startswith("openai.chat "))
    assert api[-4:-1] == [">99%", "0%", "<1%"]
    assert "(1 more errors)" in out

def test_inspect_names_a_run_folder_and_a_missing_path(tmp_path, capsys):
    """Two common slips: a training run's folder given for a capture, and a mistyped path (it said
    "is not a folder")."""
    from polar_train.cli import main

    run = tmp_path / "r1"
    (run / "adapter").mkdir(parents=True)
    (run / "train_summary.json").write_text("{}")
    assert main(["inspect", str(run)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"polar-train inspect: error: no call-log parts (*.parquet) in {run}: {run} is a training run "
        "(what `polar-train train` writes), not a capture")
    assert main(["inspect", str(tmp_path / "captres")]) == 2
    assert capsys.readouterr().err.strip() == f"polar-train inspect: error: {tmp_path / 'captres'} not found"


def test_inspect_of_a_parent_folder_names_the_captures_it_merged(tmp_path, session_rows, capsys):
    from polar_train.cli import main

    write_parts(tmp_path / "monday", session_rows[:2])
    write_parts(tmp_path / "tuesday", session_rows[2:])
    assert main(["inspect", str(tmp_path)]) == 0
    size = sum(p.stat().st_size for p in tmp_path.rglob("*.parquet"))
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (f"{tmp_path}: 2 part(s), {size / 1e3:.0f} kB from 2 folders: {tmp_path / 'monday' / 'calls'}, "
                     f"{tmp_path / 'tuesday' / 'calls'}")
    assert main(["inspect", str(tmp_path / "monday")]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"{tmp_path / 'monday'}: 1 part(s), ")


def test_one_rollout_id_in_two_capture_folders_is_named_by_inspect_and_build(tmp_path, capsys):
    """Two days of `polar-train demo` (it names its rollouts r0-greet-0, ...) merged under one
    folder: inspect counted each id's calls as one rollout's, the second day's as retries, and
    build joined them under one reward - unsaid. A capture copied twice (its calls stored twice) is
    no such case."""
    import shutil

    from polar_train.cli import main
    from polar_train.trajectories import build_trajectories

    for day, task in (("monday", "greet"), ("tuesday", "greet, once more")):
        conv = Conversation(rollout_id="r0-greet-0", name=day)
        conv.user(task)
        write_parts(tmp_path / "days" / day, [conv.assistant("hello")])
    note = ("note: 1 rollout id(s) hold calls of several capture folders ('r0-greet-0'): machines or days numbering "
            "their rollouts alike? each is counted as one rollout")
    assert main(["inspect", str(tmp_path / "days")]) == 0
    assert any(line.startswith(note) for line in capsys.readouterr().out.splitlines())
    assert any(n.startswith(note.removeprefix("note: "))
               for n in build_trajectories(tmp_path / "days").report.notes)
    shutil.copytree(tmp_path / "days" / "monday", tmp_path / "copied" / "a")
    shutil.copytree(tmp_path / "days" / "monday", tmp_path / "copied" / "b")
    assert main(["inspect", str(tmp_path / "copied")]) == 0
    assert "several capture folders" not in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "days" / "monday")]) == 0
    assert "several capture folders" not in capsys.readouterr().out
    # one part of a capture copied into a backup/ folder beside it (a probe: named as two runs' rollouts)
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    rows = [conv.assistant("one", append=True)]
    conv.user("more")
    rows.append(conv.assistant("two"))
    part = write_parts(tmp_path / "backed", rows[:1])
    write_parts(tmp_path / "backed", rows[1:], name="part-00001")
    (tmp_path / "backed" / "backup").mkdir()
    shutil.copy(part, tmp_path / "backed" / "backup" / part.name)
    assert main(["inspect", str(tmp_path / "backed")]) == 0
    out = capsys.readouterr().out
    assert "several capture folders" not in out and "repeat a call id already read" in out
    # a whole day copied into a backup beside it still leaves the two days' collision named
    shutil.copytree(tmp_path / "days" / "monday" / "calls", tmp_path / "days" / "monday" / "backup" / "calls")
    assert any(n.startswith(note.removeprefix("note: ")) for n in build_trajectories(tmp_path / "days").report.notes)


def test_a_capture_folder_copied_in_beside_calls_is_read_too(tmp_path, session_rows, capsys):
    """Machine A's parts in ``team/calls/`` (the default ``polar_out``'s) and machine B's capture
    folder copied in as ``team/machine-b/calls/``: only ``calls/`` was read, machine B's calls
    missing from inspect and build without a word, exit 0."""
    from polar_train.cli import main

    write_parts(tmp_path, session_rows[:2], "part-a")
    write_parts(tmp_path / "machine-b", session_rows[2:3], "part-b")
    (tmp_path / "loose").mkdir()
    pq.write_table(calls_table(session_rows[3:]), tmp_path / "loose" / "part-c.parquet")
    assert sorted(read_calls(tmp_path).column("call_id").to_pylist()) == sorted(r["call_id"] for r in session_rows)
    assert main(["inspect", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"{tmp_path}: 3 part(s), ")


def test_a_part_written_back_by_pandas_reads_as_the_same_calls(tmp_path, session_rows):
    """A user filters a capture in pandas and writes it back with ``to_parquet``: strings come back
    large_string, an int column with nulls double, a column of nulls null - and the part was
    skipped as "another schema than the call log", its calls gone from the build."""
    import pandas as pd

    part = write_parts(tmp_path / "cap", session_rows)
    (tmp_path / "mine" / "calls").mkdir(parents=True)
    pd.read_parquet(part).to_parquet(tmp_path / "mine" / "calls" / "part-pandas.parquet")
    kinds = {f.name: f.type for f in pq.read_schema(tmp_path / "mine" / "calls" / "part-pandas.parquet")}
    assert kinds["call_id"] == pa.large_string() and kinds["prompt_prefix_len"] == pa.float64()
    log = read_call_log(tmp_path / "mine")
    assert log.problems == [] and log.table.sort_by("call_id").equals(read_calls(tmp_path / "cap").sort_by("call_id"))
    (tmp_path / "bad" / "calls").mkdir(parents=True)
    pq.write_table(calls_table(session_rows).set_column(
        CALL_LOG_SCHEMA.get_field_index("attempt"), "attempt", pa.array([1.5] * len(session_rows))),
        tmp_path / "bad" / "calls" / "part-x.parquet")
    bad = read_call_log(tmp_path / "bad")  # a value the cast would change: named, not read as 1
    assert bad.table.num_rows == 0 and [p.message for p in bad.problems] == [
        "unreadable data (Float value 1.500000 was truncated converting to int32)"]


def test_a_read_short_of_memory_stops_instead_of_skipping_the_part(tmp_path, session_rows, monkeypatch):
    """Under ``ulimit -v`` pyarrow could not start a reading thread: the part was skipped as
    "unreadable data" (a good part, blamed) and the rest read - a build without its calls. It is
    no fault of the part: the read stops, saying why."""
    from polar_train import calllog

    write_parts(tmp_path, session_rows[:2], "part-a")

    def short_of_memory(part, schema, wanted):
        raise pa.ArrowMemoryError("malloc of size 65536 failed")

    monkeypatch.setattr(calllog, "_read_part", short_of_memory)
    with pytest.raises(CallLogError, match=r"cannot read .*part-a\.parquet: not enough memory or threads for it "
                                           r"\(malloc of size 65536 failed\); free memory"):
        read_call_log(tmp_path)


def test_an_empty_path_is_refused_not_read_as_the_current_folder(tmp_path, session_rows, monkeypatch):
    """``Path("")`` is ``.``: an unset variable passed as the folder read the whole working folder
    (recursively); the CLI refuses an empty argument, the API does too."""
    write_parts(tmp_path, session_rows)
    monkeypatch.chdir(tmp_path)  # a capture right here: "" would have read it
    for read in (read_calls, read_call_log, list_parts):
        with pytest.raises(CallLogError, match="empty path"):
            read("")
    assert read_calls(".").num_rows == len(session_rows)  # naming the current folder still reads it


def _flipped_copies(data: bytes, step: int):
    """The file with one bit flipped, at every ``step``-th byte of its pages (not the footer)."""
    footer = int.from_bytes(data[-8:-4], "little") + 8
    for pos in range(4, len(data) - footer, step):
        yield pos, data[:pos] + bytes([data[pos] ^ (1 << (pos % 8))]) + data[pos + 1:]


def test_a_flipped_bit_in_a_written_part_is_named_never_read_as_other_ids(tmp_path, session_rows):
    """zstd pages may decode to other values after a flipped bit without any error: about one flip
    in twelve gave other token ids, read without a word (and compact prompts carried them into every
    later call). The capture writes page checksums and the reader verifies them and names the part.
    A page's header is not under its checksum: the rare flip there that still decodes is the bound."""
    from polar_train.capture.writer import PartWriter

    w = PartWriter(tmp_path / "cap", flush_rows=100, flush_seconds=3600)
    w.start()
    for row in session_rows * 8:
        w.submit(lambda row=row: dict(row, call_id=f"{row['call_id']}-{id(row)}"), block=True)
    w.close()
    (part,) = (tmp_path / "cap" / "calls").glob("*.parquet")
    want = read_call_log(tmp_path / "cap").table
    data = part.read_bytes()
    probe = tmp_path / "probe" / "calls"
    probe.mkdir(parents=True)
    named, silent, flips = 0, [], list(_flipped_copies(data, 13))
    for pos, copy in flips:
        (probe / part.name).write_bytes(copy)
        try:
            got = read_call_log(probe.parent)
        except CallLogError:
            named += 1
            continue
        if got.problems:
            named += 1
        elif str(got.table.to_pydict()) != str(want.to_pydict()):  # str: NaN logprobs compare equal
            silent.append(pos)
    assert named > len(flips) / 2
    assert len(silent) <= len(flips) / 100, silent


def test_inspect_counts_unresolved_prompts_and_repeated_calls_once(tmp_path, session_rows, capsys):
    """Parts lost under a compact capture: inspect printed one "skipped: call ..." line per call
    (thousands) and summed their prompts as 0 tokens without a word; a part copied twice was
    counted twice. Now: a count, five named, and each call counted once."""
    from polar_train.cli import main

    rows = compact([dict(r, call_id=f"c{k}") for k, r in enumerate(session_rows * 3)])
    write_parts(tmp_path / "cap", rows[:1], name="part-0")  # the part the others refer to...
    write_parts(tmp_path / "cap", rows[1:], name="part-1")
    (tmp_path / "cap" / "calls" / "part-0.parquet").unlink()  # ...is lost
    write_parts(tmp_path / "cap", rows[1:3], name="part-1-copy")  # and two rows copied twice
    assert main(["inspect", str(tmp_path / "cap")]) == 0
    out = capsys.readouterr().out
    assert "2 rows repeat a call id already read (a part copied twice?): each call counted once" in out
    assert "11 calls whose compact prompt cannot be rebuilt" in out
    assert out.count("  call c") == 5 and "... and 6 more" in out and "skipped:" not in out
    assert "\n11 calls\n" in out


def test_inspect_shows_a_servers_json_error_by_its_message_and_counts_whole_texts(tmp_path, session_rows, capsys):
    """vLLM's refusals (``HTTP 400: {"type":"error","error":{"type":"BadRequestError","message":...``)
    were cut at 80 characters inside the JSON, and two different limits counted as one error."""
    from polar_train.cli import main
    from polar_train.inspect import readable_error

    def refusal(limit: int) -> str:
        return ('HTTP 400: {"type":"error","error":{"type":"BadRequestError","message":"This model\'s maximum '
                f'context length is {limit} tokens. However, your request has 9000 input tokens. Please reduce '
                'the length of the input messages. (parameter=input_tokens, value=9000)\\n"}}')

    errors = [refusal(2048), refusal(2048), refusal(3300)]
    rows = [dict(r, status="upstream_error", error=e) for r, e in zip(session_rows, errors)]
    write_parts(tmp_path, rows + session_rows[3:])
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("upstream_error")]
    assert len(lines) == 2 and lines[0].split()[1] == "2" and lines[1].split()[1] == "1", out
    assert "HTTP 400: BadRequestError: This model's maximum context length is 2048 tokens." in lines[0]
    assert "is 3300 tokens" in lines[1]
    assert readable_error("HTTP 502: upstream gone") == "HTTP 502: upstream gone"  # not JSON: as it is
    assert readable_error('HTTP 500: {"error":{"message":"cut here \\u00') == "HTTP 500: cut here \\u00"
    assert readable_error('HTTP 404: {"object":"error","message":"The model `x` does not exist.",'
                          '"type":"NotFoundError","param":null,"code":404}') == \
        "HTTP 404: NotFoundError: The model `x` does not exist."


def test_inspect_escapes_what_a_terminal_would_act_on(tmp_path, session_rows, capsys):
    from polar_train.cli import main

    odd = "a\nb\u202ec"
    write_parts(tmp_path, [dict(r, rollout_id=odd) for r in session_rows])
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "a\\nb\\u202ec" in out and odd not in out


def test_inspect_columns_stay_aligned_for_wide_characters(tmp_path, session_rows, capsys):
    """A rollout id holding an emoji (two terminal columns, one ``len``) pushed its row right."""
    from polar_train.cli import main
    from polar_train.inspect import _columns

    assert (_columns("key\U0001F600"), _columns("e\u0301"), _columns("任务")) == (5, 1, 4)
    rows = [dict(r, rollout_id="key\U0001F600") for r in session_rows[:2]] + session_rows[2:]
    write_parts(tmp_path, rows)
    assert main(["inspect", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(x for x in lines if x.startswith("per rollout"))) + 1:]
    table = table[:next((i for i, x in enumerate(table) if not x.strip()), len(table))]
    assert len({_columns(x) for x in table}) == 1, table  # every row as wide as the header


def test_a_linked_folder_below_the_capture_is_read_once(tmp_path, session_rows, capsys):
    """``ln -s other/calls cap/calls/run2``: the linked calls went missing from inspect and build
    without a word. Linked folders are followed, each real folder once (a loop ends)."""
    write_parts(tmp_path / "cap", session_rows[:2])
    write_parts(tmp_path / "other", session_rows[2:])
    (tmp_path / "cap" / "calls" / "run2").symlink_to(tmp_path / "other" / "calls")
    (tmp_path / "cap" / "calls" / "again").symlink_to(tmp_path / "other" / "calls")
    (tmp_path / "other" / "calls" / "loop").symlink_to(tmp_path / "cap" / "calls")
    log = read_call_log(tmp_path / "cap")
    assert log.table.num_rows == 4 and len(log.parts) == 2 and not log.problems


def test_a_part_folder_named_like_a_call_counts_as_a_skipped_part(tmp_path, session_rows):
    """``build "call data"``: problems of parts whose path starts with "call " were taken for
    problems of calls (a string test), and parts_skipped said 0."""
    from polar_train.trajectories import build_trajectories

    write_parts(tmp_path / "call data", session_rows)
    (tmp_path / "call data" / "calls" / "zero.parquet").write_bytes(b"")
    assert build_trajectories(tmp_path / "call data").report.parts_skipped == 1


def test_skipped_columns_are_not_read_and_come_back_null(tmp_path, session_rows, monkeypatch):
    """The builder never needs the request and response texts (most of a long session's bytes): it
    reads without them. They come back null in a table of the full schema; the ids are all there."""
    from polar_train import calllog

    write_parts(tmp_path, compact(session_rows))
    asked = []
    real_read = calllog._read_part

    def read_part(part, schema, wanted):  # what the reader asks pyarrow for
        asked.append(wanted.names)
        return real_read(part, schema, wanted)

    monkeypatch.setattr(calllog, "_read_part", read_part)
    log = read_call_log(tmp_path, skip=frozenset({"request_json", "response_json"}))
    assert asked and all("request_json" not in c and "response_json" not in c and "request_json_delta" not in c
                         for c in asked)
    assert log.table.schema.equals(CALL_LOG_SCHEMA, check_metadata=False) and not log.problems
    assert log.table.column("request_json").null_count == len(session_rows)
    by_id = {r["call_id"]: r for r in log.table.to_pylist()}
    assert all(by_id[r["call_id"]]["prompt_token_ids"] == r["prompt_token_ids"] for r in session_rows)
    with pytest.raises(ValueError, match="skip: not call-log columns: request_text"):
        read_call_log(tmp_path, skip=frozenset({"request_text"}))
    with pytest.raises(TypeError, match="skip: give a set of column names, e.g. {'request_json'}, not one string"):
        read_call_log(tmp_path, skip="request_json")  # was its letters: "not call-log columns: _, e, j, n, o, ..."
    # what compact rows are rebuilt from: skipped, a stored suffix came back as the whole prompt
    # (or a prompt came back null, "outside 0..105"), without a word (found by a probe)
    for column in ("prompt_prefix_call_id", "completion_token_ids", "call_id", "request_json_base_call_id",
                   "response_json_delta"):
        with pytest.raises(ValueError, match=f"skip: {column} cannot be left unread: compact rows are rebuilt"):
            read_call_log(tmp_path, skip=frozenset({column}))


def test_a_call_id_stored_twice_resolves_from_the_row_inspect_and_build_count(tmp_path, session_rows):
    """Two rows with one call id (a hand-made part): inspect and build keep the first, while the
    compact rows that refer to it were rebuilt from the last (found by a probe)."""
    rows = compact([dict(r) for r in session_rows])
    impostor = dict(rows[0], prompt_token_ids=[9] * len(rows[0]["prompt_token_ids"]))
    write_parts(tmp_path, [*rows, impostor])
    by_row = read_call_log(tmp_path).table.to_pylist()
    assert [r["prompt_token_ids"] for r in by_row[:len(rows)]] == [r["prompt_token_ids"] for r in session_rows]


def test_inspect_keeps_a_rollout_named_none_apart_from_the_calls_without_one(tmp_path, session_rows, capsys):
    """A rollout literally named "(none)" was counted in one row with the calls that have no
    rollout id (build keeps them apart)."""
    from polar_train.cli import main

    rows = [dict(session_rows[0], rollout_id="(none)"), *(dict(r, rollout_id=None) for r in session_rows[1:])]
    write_parts(tmp_path, rows)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "per rollout (2)" in out
    assert re.search(r"\n\(none\) +1 ", out) and re.search(rf"\n\[no rollout id\] +{len(rows) - 1} ", out)
    # a rollout named as the id-less row is labelled: shown quoted, apart from it
    rows[0]["rollout_id"] = "[no rollout id]"
    write_parts(tmp_path, rows)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert re.search(r'\n"\[no rollout id\]" +1 ', out) and re.search(rf"\n\[no rollout id\] +{len(rows) - 1} ", out)


def test_inspect_counts_one_body_sent_to_two_apis_as_no_retry(tmp_path, session_rows, capsys):
    """The capture and the build take a body sent to two APIs for two requests; inspect counted the
    second as a retry of the first."""
    from polar_train.cli import main

    first = dict(session_rows[0], rollout_id="r1", request_hash="h" * 32, attempt=1)
    second = dict(session_rows[1], rollout_id="r1", request_hash="h" * 32, attempt=1, api="anthropic.messages")
    write_parts(tmp_path, [first, second])
    assert main(["inspect", str(tmp_path)]) == 0
    assert re.search(r"\nr1 +2 +\d+ +0 ", capsys.readouterr().out)


def test_a_part_removed_while_read_or_compressed_is_named_and_the_rest_read(tmp_path, session_rows, monkeypatch):
    """A live probe: a part removed by an archiving job while build read the folder ended the build
    in a bare path ("error: .../part-x-1.parquet"; pyarrow's FileNotFoundError from Python); a
    part gzip'd in place was passed over without a word (30 calls of 48 read)."""
    import gzip

    import polar_train.calllog as calllog

    write_parts(tmp_path, session_rows[:1], "part-a")
    gone = write_parts(tmp_path, session_rows[1:2], "part-b")
    packed = write_parts(tmp_path, session_rows[2:3], "part-c")
    write_parts(tmp_path, session_rows[3:], "part-d")
    packed.with_name(packed.name + ".gz").write_bytes(gzip.compress(packed.read_bytes()))
    packed.unlink()
    found = calllog._find_parts

    def find_then_remove(folder):
        parts = found(folder)
        gone.unlink()  # the archiving job's turn: after the listing, before the part is opened
        return parts

    monkeypatch.setattr(calllog, "_find_parts", find_then_remove)
    last = tmp_path / "calls" / "part-d.parquet"
    opened = pq.ParquetFile

    def open_then_remove(path, **kwargs):  # removed once open: its calls are read all the same
        part = opened(path, **kwargs)
        if Path(path) == last:
            last.unlink()
        return part

    monkeypatch.setattr(calllog.pq, "ParquetFile", open_then_remove)
    log = read_call_log(tmp_path)
    assert sorted(log.table.column("call_id").to_pylist()) == sorted(r["call_id"] for r in (session_rows[0],
                                                                                            session_rows[3]))
    assert not last.exists()
    assert sorted((p.path, p.message) for p in log.problems) == sorted([
        (str(gone), "removed while it was read"),
        (str(packed) + ".gz", "a compressed part: decompress it (gunzip, zstd -d, ...) to read its calls")])


def test_inspect_says_its_token_columns_count_recorded_ids(session_rows):
    """A rollout whose ok calls kept no ids (a Messages reply cut inside its thinking, a prompt the
    template refuses) showed "cc-rs 4 4 0 0" for ~12,000 tokens of the server's usage: the columns
    count recorded ids; the summary now says how many ok calls count 0 there and what usage reported."""
    from polar_train.inspect import summarize

    bare = [dict(session_rows[k], call_id=f"bare{k}", rollout_id="r-bare", token_source="none", prompt_token_ids=None,
                 completion_token_ids=None, completion_logprobs=None, usage_prompt_tokens=3000, usage_completion_tokens=64,
                 error="token ids unavailable: the reply was cut (max_tokens) inside its thinking")
            for k in range(2)]
    out = summarize(pa.Table.from_pylist(session_rows + bare, schema=CALL_LOG_SCHEMA))
    assert "tokens count recorded ids: 2 ok call(s) kept none and count 0 (the server's usage for them: 6128 tokens)" in out
    assert "tokens count recorded ids" not in summarize(pa.Table.from_pylist(session_rows, schema=CALL_LOG_SCHEMA))


def test_inspect_says_which_count_a_usage_mismatch_is_in(session_rows):
    """A rendered completion re-encodes the reply's text, a prompt is exact with the server's
    template: one usage_mismatch count could not say which (a probe: Claude Code's rows)."""
    from polar_train.inspect import summarize

    rows = [dict(r, usage_prompt_tokens=len(r["prompt_token_ids"]), usage_completion_tokens=len(r["completion_token_ids"]),
                 usage_match=True) for r in session_rows]
    rows[1].update(usage_completion_tokens=rows[1]["usage_completion_tokens"] + 22, usage_match=False)
    rows[2].update(usage_completion_tokens=rows[2]["usage_completion_tokens"] + 1, usage_match=False)
    rows[3].update(usage_prompt_tokens=rows[3]["usage_prompt_tokens"] - 1, usage_match=False)
    out = summarize(pa.Table.from_pylist(rows, schema=CALL_LOG_SCHEMA))
    assert ("usage mismatches: 1 in the prompt's count (another template than the server's?), 2 in the completion's "
            "(rendered ids re-encode the reply's text)") in out
    assert "usage mismatches:" not in summarize(pa.Table.from_pylist(rows[:1], schema=CALL_LOG_SCHEMA))
