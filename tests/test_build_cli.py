"""``polar-train build`` as a user runs it: a subprocess, its exit code, its table, its output files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_train.cli import main
from polar_train.schema import TRAJECTORY_SCHEMA
from tests.support.calls import Conversation, compact, write_parts

POLAR = str(Path(sys.executable).parent / "polar-train")


def as_program(argv: list[str]) -> int:
    """The status ``polar-train`` exits with (``main`` hands a caller in Python its Ctrl-C)."""
    from polar_train.cli import _main

    return _main(argv, keep_signal=False)


def run_build(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([POLAR, "build", *map(str, args)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})


@pytest.fixture(scope="module")
def capture(tmp_path_factory):
    """Two rollouts of one task (one with a history-rewrite fork), plus a failed call and a
    foreign part and a corrupt part next to the good one."""
    folder = tmp_path_factory.mktemp("capture")
    rows = []
    for rid in ("r1", "r2"):
        conv = Conversation(rollout_id=rid, task_id="t1", name=rid)
        conv.user("make the test pass")
        rows.append(conv.assistant("", reasoning="look first", tool_calls=[("ls", {"path": "."})]))
        conv.tool("test_x.py")
        rows.append(conv.assistant("Fixed.", reasoning="edit done"))
        if rid == "r1":
            conv.user("thanks, and the docs?")
            rows.append(conv.assistant("Docs too."))
    rows[0]["status"] = "upstream_error"
    rows[0]["request_hash"] = "unique-failure"
    write_parts(folder, rows)
    calls = folder / "calls"
    pq.write_table(pa.table({"something": [1, 2]}), calls / "part-foreign.parquet")
    (calls / "part-corrupt.parquet").write_bytes(b"PAR1 but not really")
    (calls / ".part-open.parquet.tmp").write_bytes(b"half written")
    (folder / "rewards.jsonl").write_text('{"rollout_id": "r1", "reward": 1}\n'
                                          '{"rollout_id": "r2", "reward": "oops"}\n')
    return folder


def test_build_writes_loadable_trajectories_report_and_table(tmp_path, capture):
    out = tmp_path / "traj"
    proc = run_build(capture, "--out", out, "--rewards", capture / "rewards.jsonl")
    assert proc.returncode == 0, proc.stderr
    table_text = proc.stdout
    for label in ("rollouts", "calls", "trajectories", "merge ratio", "forks by cause",
                  "skipped rows", "tokens trained / total"):
        assert label in table_text
    assert "history_rewrite 1" in table_text and "status_upstream_error 1" in table_text
    assert "part-foreign.parquet: another schema" in table_text
    assert "part-corrupt.parquet: not a readable Parquet file" in table_text
    assert "line 2: non-numeric reward 'oops'" in table_text
    assert "Traceback" not in proc.stderr

    report = json.loads((out / "_build_report.json").read_text())
    assert report["trajectories"] == 3 and report["calls_used"] == 4 and report["calls_read"] == 5
    assert report["forks"] == {"history_rewrite": 1}
    assert report["parts_skipped"] == 2 and report["merge_ratio"] == pytest.approx(4 / 3, abs=1e-3)

    from datasets import load_dataset

    ds = load_dataset("parquet", data_files=str(out / "part-*.parquet"), split="train")
    assert ds.num_rows == 3
    assert set(ds.column_names) == set(TRAJECTORY_SCHEMA.names)
    for row in ds:
        assert len(row["completion_ids"]) == len(row["loss_mask"]) == len(row["logprobs"])
        mask = np.asarray(row["loss_mask"])
        lps = np.asarray(row["logprobs"], dtype=np.float64)
        assert mask.sum() > 0 and np.isnan(lps[mask == 0]).all() and not np.isnan(lps[mask == 1]).any()
    rewards = {r["trajectory_id"]: r["reward"] for r in ds}
    assert sorted(rewards.values(), key=lambda v: (v is None, v)) == [1.0, 1.0, None]
    assert pq.read_schema(out / "part-00000.parquet").equals(TRAJECTORY_SCHEMA)
    # the folder itself reads as a dataset: the report's name starts with "_" (as build_report.json
    # pandas and pyarrow failed: "Could not read schema from 'traj/build_report.json'")
    assert pq.read_table(out).num_rows == 3


def test_a_folder_an_older_version_built_is_rebuilt_without_its_old_report(tmp_path, capture):
    """An earlier version named the report build_report.json: its folder is still an earlier build
    (not someone's folder), and the rebuild leaves no second, stale report beside the new one."""
    out = tmp_path / "traj"
    assert run_build(capture, "--out", out).returncode == 0
    (out / "_build_report.json").rename(out / "build_report.json")
    for p in out.glob("part-*.parquet"):
        p.unlink()  # a folder left with its report only is still a build's
    proc = run_build(capture, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".")) == [
        "_build_report.json", "part-00000.parquet"]


def test_rebuild_replaces_old_parts(tmp_path, capture):
    out = tmp_path / "traj"
    assert run_build(capture, "--out", tmp_path / "earlier").returncode == 0
    out.mkdir()
    (tmp_path / "earlier" / "part-00000.parquet").rename(out / "part-00007.parquet")  # an earlier build
    (out / "notes.txt").write_text("mine: must survive")
    proc = run_build(capture, "--out", out, "--rows-per-part", "1", "--realign")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.glob("*.parquet")) == ["part-00000.parquet", "part-00001.parquet",
                                                             "part-00002.parquet"]
    assert (out / "notes.txt").read_text() == "mine: must survive"
    assert json.loads((out / "_build_report.json").read_text())["output_parts"] == [
        "part-00000.parquet", "part-00001.parquet", "part-00002.parquet"]
    assert not _temps(out)  # no temp files left


def _temps(folder: Path) -> list[str]:
    """Dot-files a build left, other than its lock (which stays, empty: see the writer)."""
    return [p.name for p in folder.glob(".*") if p.name != ".polar-build.lock"]


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != ".polar-build.lock"}


def test_an_out_folder_holding_files_no_build_wrote_is_refused_untouched(tmp_path, capture, capsys):
    """Data a user keeps in --out is never replaced: a call-log part named like a trajectory part
    (a build used to overwrite it), a foreign Parquet file next to an earlier build (train would
    read it), or a folder of someone else's files."""
    good = next(p for p in sorted((capture / "calls").glob("part-*.parquet"))
                if p.name not in ("part-foreign.parquet", "part-corrupt.parquet"))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "part-00000.parquet").write_bytes(good.read_bytes())
    (mine / "build_report.json").write_text('{"mine": 1}')
    earlier = tmp_path / "earlier"
    assert main(["build", str(capture), "--out", str(earlier)]) == 0
    pq.write_table(pa.table({"x": [1]}), earlier / "part-00003.parquet")  # not written by a build
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("keep")
    capsys.readouterr()
    for out, why in ((mine, "holds Parquet files no build wrote (part-00000.parquet)"),
                     (earlier, "holds Parquet files no build wrote (part-00003.parquet)"),
                     (notes, "is not empty and holds no earlier build")):
        before = _snapshot(out)
        assert main(["build", str(capture), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err
        assert _snapshot(out) == before


def test_an_unwritable_out_fails_before_the_build(tmp_path, capture, capsys):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")  # under a loop: it was called "a file"
    cases = [(tmp_path / "afile" / "sub", f"{tmp_path / 'afile'} is a file, not a folder"),
             (tmp_path / "dangling", "is a broken symbolic link"),
             (tmp_path / "loop" / "x", f"{tmp_path / 'loop'} is a broken symbolic link (or a loop of them)")]
    if os.geteuid() != 0:  # root may write anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        cases.append((ro, "permission denied"))
    for out, why in cases:
        assert main(["build", str(capture), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert why in err and "Traceback" not in err, err
        assert "merge ratio" not in err  # refused before anything was read
    assert main(["build", str(capture), "--out", ""]) == 2
    assert "--out is empty" in capsys.readouterr().err


def test_out_with_a_tilde_is_the_home_folder(tmp_path, capture, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["build", str(capture), "--out", "~/traj"]) == 0
    assert (tmp_path / "home" / "traj" / "_build_report.json").is_file() and not (tmp_path / "~").exists()


def test_two_capture_folders_are_refused_by_the_command_with_a_way_to_merge(tmp_path, capsys):
    """``build machA machB`` (the natural mistake when merging) ended in the top-level parser's
    ``polar-train: error: unrecognized arguments`` - not the command's line, and no way on."""
    for argv in (["build", "machA", "machB", "--out", str(tmp_path / "o")], ["inspect", "machA", "machB"]):
        assert main(argv) == 2  # (argparse's SystemExit, returned: main gives the status)
        assert capsys.readouterr().err.splitlines()[-1] == (
            f"polar-train {argv[0]}: error: unrecognized arguments: machB; one capture folder per command: put "
            "several under one parent folder (every folder below it is read)")
    assert main(["inspect", "machA", "--bogus"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "polar-train inspect: error: unrecognized arguments: --bogus"
    assert not (tmp_path / "o").exists()


def test_missing_and_empty_inputs_exit_2_with_one_line(tmp_path, capsys):
    proc = run_build(tmp_path / "nope", "--out", tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"polar-train build: error: call-log folder not found: {tmp_path / 'nope'}"]
    (tmp_path / "empty").mkdir()
    assert main(["build", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith("polar-train build: error: no call-log parts")
    assert not (tmp_path / "out").exists()


def test_nothing_buildable_exits_1_and_bad_rewards_path_exits_2(tmp_path, capsys):
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    row = conv.assistant("ok", token_source="none")
    write_parts(tmp_path / "cap", [row])
    proc = run_build(tmp_path / "cap", "--out", tmp_path / "out")
    assert proc.returncode == 1
    assert "token_source_none 1" in proc.stdout
    # (it said "see skipped rows and problems above" where no problem was printed)
    assert proc.stderr.strip() == (f"polar-train build: error: no trajectory could be built from {tmp_path / 'cap'} (see "
                                   f"skipped rows above; `polar-train inspect {tmp_path / 'cap'}` lists the calls)")
    # an archived calls/ folder built on its own: every compact prompt refers to a call not read here
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    rows = []
    for k in range(22):
        rows.append(conv.assistant(f"step {k}", tool_calls=[("ls", {"path": str(k)})]))
        conv.tool(f"out {k}")
    write_parts(tmp_path / "day2", compact(rows)[1:])
    proc = run_build(tmp_path / "day2", "--out", tmp_path / "out")
    assert proc.returncode == 1 and "more (nothing was built: no _build_report.json holds them" in proc.stdout
    assert "more in _build_report.json" not in proc.stdout
    assert "compact prompts refer to calls in parts not read here - lost or damaged (the problems say), or in " \
        "another folder: build the folder that holds them too" in proc.stderr
    write_parts(tmp_path / "empty", [])  # ("see skipped rows above" with `skipped rows  none` printed)
    proc = run_build(tmp_path / "empty", "--out", tmp_path / "out")
    assert proc.returncode == 1 and proc.stderr.strip() == (
        f"polar-train build: error: no trajectory could be built from {tmp_path / 'empty'} (its parts hold no call)")
    assert not (tmp_path / "out").exists()
    assert main(["build", str(tmp_path / "cap"), "--out", str(tmp_path / "out"),
                 "--rewards", str(tmp_path / "r.jsonl")]) == 2
    assert "error: file not found: " in capsys.readouterr().err
    (tmp_path / "bad" / "calls").mkdir(parents=True)
    (tmp_path / "bad" / "calls" / "part-0.parquet").write_bytes(b"PAR1 but not really")
    assert main(["build", str(tmp_path / "bad"), "--out", str(tmp_path / "out")]) == 2  # unusable, as docs say
    out, err = capsys.readouterr()
    assert f"error: no readable call-log part in {tmp_path / 'bad'}; skipped " in err and "part-0.parquet" in err
    assert out == "" and len(err.strip().splitlines()) == 1  # one line, no table of zeros before it
    assert not (tmp_path / "out").exists()


def test_out_inside_the_capture_is_refused_and_captured_parts_survive(tmp_path, capture, capsys):
    before = sorted(p.name for p in (capture / "calls").iterdir())
    for out in (capture, capture / "calls", capture / "calls" / "traj", capture / "traj"):
        assert main(["build", str(capture), "--out", str(out)]) == 2  # in-process: same code path
        assert "inside the capture folder" in capsys.readouterr().err
    # given its calls/ folder, the capture folder is still the one around it (trajectories in
    # it were read back as a part no call log holds when the parent folder was built)
    for out in (capture, capture / "traj"):
        assert main(["build", str(capture / "calls"), "--out", str(out)]) == 2
        assert f"inside the capture folder {capture};" in capsys.readouterr().err
    assert sorted(p.name for p in (capture / "calls").iterdir()) == before
    assert not (capture / "traj").exists()


def test_a_tokenizer_folder_that_does_not_load_is_one_line(tmp_path, capture, tiny_model_dir, capsys):
    broken = tmp_path / "tok"  # the tokenizer's files, next to a config.json cut short
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    (broken / "config.json").write_text("{")
    assert main(["build", str(capture), "--out", str(tmp_path / "out"), "--tokenizer", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"polar-train build: error: cannot load the tokenizer in {broken}: ")
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    tokenizer_file = broken / "tokenizer.json"
    assert main(["build", str(capture), "--out", str(tmp_path / "out"), "--tokenizer", str(tokenizer_file)]) == 2
    assert capsys.readouterr().err == (f"polar-train build: error: tokenizer {tokenizer_file} is a file; name the "
                                       "model or tokenizer folder it is in\n")
    (broken / "config.json").unlink()
    tokenizer_file.write_text('{"not": "a tokenizer"}')  # tokenizers' bare KeyError: "...: 'added_tokens'"
    assert main(["build", str(capture), "--out", str(tmp_path / "out"), "--tokenizer", str(broken)]) == 2
    assert capsys.readouterr().err.startswith(f"polar-train build: error: cannot load the tokenizer in {broken}: "
                                              "missing key 'added_tokens' (a file there is not what the loader")


def test_one_part_file_builds_anywhere_but_into_its_own_folder(tmp_path, capture, capsys):
    part = tmp_path / "single" / "part-a.parquet"  # named as captured parts are: a rebuild would replace it
    part.parent.mkdir()
    good = next(p for p in sorted((capture / "calls").glob("part-*.parquet"))
                if p.name not in ("part-foreign.parquet", "part-corrupt.parquet"))
    part.write_bytes(good.read_bytes())
    assert main(["build", str(part), "--out", str(part.parent)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"polar-train build: error: --out {part.parent} is the folder of {part}; choose another folder")
    assert part.read_bytes() == good.read_bytes()
    assert main(["build", str(part), "--out", str(part.parent / "traj")]) == 0  # a sibling folder is fine
    assert list((part.parent / "traj").glob("part-*.parquet")) and part.read_bytes() == good.read_bytes()
    # a part in a capture's calls/ folder: trajectories under the capture were read with its calls from then
    # on (each such part named "not a call log" by every later build and inspect of that capture)
    for inside in (capture / "calls" / "traj", capture / "traj"):
        assert main(["build", str(good), "--out", str(inside)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"polar-train build: error: --out {inside} is inside the capture folder {capture.resolve()} of {good}; "
            "choose another folder")
        assert not inside.exists()


def _built(out: Path) -> tuple[list[str], dict]:
    return sorted(p.name for p in out.glob("part-*.parquet")), json.loads((out / "_build_report.json").read_text())


def test_an_interrupt_during_the_swap_waits_until_the_new_build_is_whole(tmp_path, capture, monkeypatch):
    """Ctrl-C between the renames used to leave parts of both builds and the old report: now the
    signal waits for the swap's end, and the folder holds the new build alone."""
    import signal

    from polar_train.trajectories import writer

    out = tmp_path / "traj"
    assert main(["build", str(capture), "--out", str(out), "--rows-per-part", "1"]) == 0
    assert len(_built(out)[0]) == 3
    real_replace = writer.os.replace
    calls = []

    def replace_then_interrupt(src, dst):
        if not calls:  # the user presses Ctrl-C at the first rename; the kernel may hand the signal to
            # any thread (a signal mask on the main thread alone let it through mid-swap)
            import threading

            sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT))
            sender.start()
            sender.join()
        calls.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(writer.os, "replace", replace_then_interrupt)
    assert as_program(["build", str(capture), "--out", str(out), "--rows-per-part", "2"]) == 130
    parts, report = _built(out)
    assert parts == report["output_parts"] == ["part-00000.parquet", "part-00001.parquet"]
    assert len(calls) == 3 and not _temps(out)


def test_a_write_that_fails_leaves_the_earlier_build_whole(tmp_path, capture, monkeypatch, capsys):
    """Disk full in the middle of writing: one line, the earlier build untouched, no temp file
    left; temp files of a build killed earlier are removed by the next one."""
    import errno
    import subprocess

    from polar_train.trajectories import writer

    out = tmp_path / "traj"
    assert main(["build", str(capture), "--out", str(out), "--rows-per-part", "1"]) == 0
    before = _snapshot(out)
    real_write = writer.pq.write_table
    written = []

    def write_until_full(table, where, **kw):
        if written:
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(where)
        real_write(table, where, **kw)

    monkeypatch.setattr(writer.pq, "write_table", write_until_full)
    capsys.readouterr()
    assert main(["build", str(capture), "--out", str(out), "--rows-per-part", "2"]) == 2
    err = capsys.readouterr().err
    assert err == (f"polar-train build: error: cannot write to --out {out}: No space left on device; "
                   "the folder holds what it held before\n")
    assert _snapshot(out) == before and not _temps(out)
    written.append("full from the start")
    assert main(["build", str(capture), "--out", str(tmp_path / "new")]) == 2  # a folder that was not there
    assert capsys.readouterr().err.endswith("No space left on device; nothing was written\n")
    assert not (tmp_path / "new").exists()
    monkeypatch.setattr(writer.pq, "write_table", real_write)
    gone = subprocess.Popen(["true"])
    gone.wait()  # a process id no process has any more: its writer was killed
    (out / f".part-00000.parquet.tmp{gone.pid}").write_bytes(b"half")
    (out / f".build_report.json.tmp{gone.pid}").write_bytes(b"{")  # an older version's report name
    (out / f"._build_report.json.tmp{gone.pid}").write_bytes(b"{")
    assert main(["build", str(capture), "--out", str(out)]) == 0
    assert not _temps(out)


def test_a_second_build_into_the_same_folder_meanwhile_is_refused(tmp_path, capture, capsys):
    """One build suspended mid-swap (Ctrl-Z) and another run to the end left parts of both and
    trajectories twice: a build holds the folder's lock while it writes."""
    import fcntl

    out = tmp_path / "traj"
    assert main(["build", str(capture), "--out", str(out)]) == 0
    before = _snapshot(out)
    with open(out / ".polar-build.lock", "a") as lock:  # what a running build holds
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        capsys.readouterr()
        assert main(["build", str(capture), "--out", str(out), "--rows-per-part", "1"]) == 2
        assert f"another polar-train build is writing into {out}" in capsys.readouterr().err
    assert _snapshot(out) == before
    assert main(["build", str(capture), "--out", str(out), "--rows-per-part", "1"]) == 0  # once it is gone


def test_an_interrupted_build_into_a_new_folder_leaves_no_folder(tmp_path, capture, monkeypatch, capsys):
    from polar_train.trajectories import writer

    def interrupted(table, where, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer.pq, "write_table", interrupted)
    out = tmp_path / "new" / "deep" / "traj"
    assert as_program(["build", str(capture), "--out", str(out)]) == 130
    assert not (tmp_path / "new").exists()
    assert capsys.readouterr().err == f"polar-train build: interrupted; nothing was written to {out}\n"


def test_an_interrupt_during_the_checks_says_what_out_holds(tmp_path, capture, monkeypatch, capsys):
    """Ctrl-C in the first second (the checks, before the read) said only "interrupted (SIGINT)"."""
    from polar_train import build_cli

    def interrupted(out, captures):
        raise KeyboardInterrupt

    monkeypatch.setattr(build_cli, "_check_out", interrupted)
    (tmp_path / "old").mkdir()
    assert as_program(["build", str(capture), "--out", str(tmp_path / "old")]) == 130
    assert capsys.readouterr().err == f"polar-train build: interrupted; {tmp_path / 'old'} holds what it held before\n"


def test_an_interrupted_build_says_which_build_its_folder_holds(tmp_path, capture, monkeypatch, capsys):
    """Ctrl-C exited 130 without a word: with the signal held until the swap was done, the folder
    held the old build or the new one, whole, and the user could not tell which."""
    from contextlib import contextmanager

    from polar_train.trajectories import writer

    out = tmp_path / "traj"
    assert main(["build", str(capture), "--out", str(out), "--rows-per-part", "1"]) == 0
    before = _snapshot(out)
    held = writer._signals_held

    @contextmanager
    def ctrl_c_during_the_swap():
        with held():
            yield
        raise KeyboardInterrupt  # the held Ctrl-C, delivered once the swap is done

    with monkeypatch.context() as m:
        m.setattr(writer, "_signals_held", ctrl_c_during_the_swap)
        capsys.readouterr()
        assert as_program(["build", str(capture), "--out", str(out)]) == 130  # one part now, not one per row
    assert capsys.readouterr().err == f"polar-train build: interrupted; the new build is complete in {out}\n"
    assert _snapshot(out) != before and len(list(out.glob("part-*.parquet"))) == 1

    def interrupted(table, where, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer.pq, "write_table", interrupted)
    after = _snapshot(out)
    assert as_program(["build", str(capture), "--out", str(out), "--rows-per-part", "1"]) == 130
    assert capsys.readouterr().err == f"polar-train build: interrupted; {out} holds what it held before\n"
    assert _snapshot(out) == after


@pytest.mark.parametrize("command", ["build", "inspect"])
def test_a_reader_that_left_the_pipe_is_no_traceback(tmp_path, capture, command):
    """`polar-train build CAPTURE --out DIR | head -4`: the table's print raised BrokenPipeError
    after the build was written (a traceback, exit 1)."""
    args = [POLAR, command, str(capture), *(["--out", str(tmp_path / "traj")] if command == "build" else [])]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    proc.stdout.close()  # the reader is gone before anything is printed
    err = proc.stderr.read()
    assert proc.wait(120) == 0 and "Traceback" not in err and "BrokenPipe" not in err, err
    if command == "build":
        assert (tmp_path / "traj" / "_build_report.json").is_file()


def test_the_api_refuses_unusable_inputs_with_a_value_error_before_reading(tmp_path, capture, tiny_model_dir,
                                                                           monkeypatch, capsys):
    """``build_trajectories`` raises ``ValueError`` subclasses for every unusable input (as documented),
    and checks the options before the (possibly long) read: a bad ``reward_mode`` failed only after
    the whole read and stitch, ``realign="no"`` was taken as true, a missing tokenizer folder was a
    ``FileNotFoundError``, a dict in place of ``BuildOptions`` an ``AttributeError``."""
    import polar_train.trajectories.build as build_module
    from polar_train.calllog import CallLogError
    from polar_train.trajectories import BuildOptions, build_trajectories
    from polar_train.trajectories.build import BuildOptionsError

    def no_read(*args, **kwargs):
        raise AssertionError("the call log was read before the options were checked")

    no_tokenizer = tmp_path / "model-without-tokenizer"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text("{}")
    broken = tmp_path / "tok"  # the tokenizer's files next to a config.json cut short
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (broken / name).write_bytes((tiny_model_dir / name).read_bytes())
    (broken / "config.json").write_text("{")
    monkeypatch.setattr(build_module, "read_call_log", no_read)
    for options, error, message in (
            (BuildOptions(tokenizer=str(tmp_path / "nope")), BuildOptionsError,
             f"^tokenizer directory not found: {tmp_path / 'nope'}$"),
            (BuildOptions(tokenizer=no_tokenizer), BuildOptionsError, "holds no tokenizer"),
            (BuildOptions(tokenizer=broken / "tokenizer.json"), BuildOptionsError, "is a file; name the model"),
            (BuildOptions(tokenizer=broken), BuildOptionsError, "^cannot load the tokenizer in "),
            (BuildOptions(tokenizer=""), BuildOptionsError, "empty tokenizer path"),
            (BuildOptions(reward_mode="bogus"), BuildOptionsError, "reward_mode must be one of broadcast, split"),
            (BuildOptions(reward_mode=None), BuildOptionsError, "reward_mode must be one of"),
            (BuildOptions(realign="no"), BuildOptionsError, "realign must be True or False, got 'no'"),
            (BuildOptions(realign=1), BuildOptionsError, "realign must be True or False"),
            (BuildOptions(rewards=3), BuildOptionsError, "rewards must be a path .* or None, got int"),
            (BuildOptions(tasks=""), BuildOptionsError, "empty tasks path"),
            (BuildOptions(tokenizer=["tok"]), BuildOptionsError, "tokenizer must be a path"),
            ({"realign": True}, BuildOptionsError, "options must be a BuildOptions .*, got dict")):
        with pytest.raises(ValueError, match=message) as caught:
            build_trajectories(capture, options)
        assert isinstance(caught.value, error), (options, type(caught.value))
    for folder, message in (("", "empty path"), (None, "call-log folder must be a path .*, got NoneType")):
        with pytest.raises(CallLogError, match=message):
            build_trajectories(folder)
    # a missing capture fails before a tokenizer folder is loaded (seconds)
    monkeypatch.setattr("polar_train.tokenizer.load_tokenizer", no_read)
    with pytest.raises(CallLogError, match="call-log folder not found"):
        build_trajectories(tmp_path / "no-capture", BuildOptions(tokenizer=tiny_model_dir))
    monkeypatch.undo()
    monkeypatch.chdir(capture)  # "" was read as the current folder: here, a capture
    with pytest.raises(CallLogError, match="empty path"):
        build_trajectories("")
    # the CLI's one line is what it was
    assert main(["build", str(capture), "--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == f"polar-train build: error: tokenizer directory not found: {tmp_path / 'nope'}\n"
    assert main(["build", str(capture), "--out", str(tmp_path / "out"), "--tokenizer", str(no_tokenizer)]) == 2
    assert capsys.readouterr().err == (f"polar-train build: error: {no_tokenizer} holds no tokenizer "
                                       "(no tokenizer.json / tokenizer_config.json)\n")
    result = build_trajectories(capture, BuildOptions(realign=True, reward_mode="split",
                                                      rewards=str(capture / "rewards.jsonl")))
    assert result.trajectories and result.report.reward_mode == "split" and result.report.realign is True


def test_a_new_out_folder_is_the_owners_only(tmp_path, monkeypatch):
    """Trajectories hold the captured prompts: a folder build makes gets mode 0700 (it was 0755 under
    the usual umask); an existing folder keeps its mode."""
    from polar_train.trajectories import build_trajectories
    from polar_train.trajectories.writer import write_trajectories
    from tests.support.calls import Conversation, write_parts

    conv = Conversation(rollout_id="r1")
    conv.user("hello")
    write_parts(tmp_path / "cap", [conv.assistant("hi")])
    built = build_trajectories(tmp_path / "cap")
    old = os.umask(0o022)
    try:
        write_trajectories(built.trajectories, tmp_path / "new" / "traj")
        (tmp_path / "shared").mkdir(mode=0o755)
        write_trajectories(built.trajectories, tmp_path / "shared")
    finally:
        os.umask(old)
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "new" / "traj").stat().st_mode & 0o777 == 0o700
    assert (tmp_path / "shared").stat().st_mode & 0o777 == 0o755


def test_ids_and_names_from_the_capture_and_labels_reach_the_terminal_escaped(tmp_path):
    """A task id in a rewards file, a rollout id and model name a client sent, a part's file name:
    build printed them raw (an ESC ] 0 ; ... BEL retitled the terminal, ESC [ 2 J cleared it, a
    U+202E reversed the line, a U+200B made 'r\\u200b1' read as the rewarded 'r1'), and a
    5-million-character id whole on one line; inspect escaped them already."""
    evil = "\x1b]0;PWNED\x07\x1b[2J"
    folder = tmp_path / "cap"
    rows = []
    for rid in ("r1", "r\u200b1", "\u202egnp.exe", "evil" + evil):
        conv = Conversation(rollout_id=rid, task_id=None, name=rid)
        conv.user("hi")
        rows.append(conv.assistant("Hello."))
    rows[-1]["model"] = "m" + evil
    write_parts(folder, rows)
    (folder / "calls" / f"part-{evil}.parquet").write_bytes(b"not parquet")
    rewards = tmp_path / "rewards.jsonl"
    rewards.write_text(json.dumps({"rollout_id": "r1", "reward": 1, "task_id": "g" + evil}) + "\n"
                       + json.dumps({"rollout_id": "x" * 5_000_000, "reward": 0}) + "\n")
    proc = run_build(folder, "--out", tmp_path / "out", "--rewards", rewards)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text and "\u200b" not in text
    assert "\\x1b]0;PWNED\\x07\\x1b[2J" in text and "r\\u200b1" in text and "\\u202egnp.exe" in text
    assert max(map(len, text.splitlines())) < 1000
    # an error line too: the path named in it is escaped
    bad = run_build(folder / f"missing{evil}", "--out", tmp_path / "out2")
    assert bad.returncode == 2 and "\x1b" not in bad.stderr and "missing\\x1b]0;PWNED" in bad.stderr


def test_train_reads_a_part_whole_while_a_rebuild_replaces_it(tmp_path, capture, monkeypatch):
    """The trainer opened each part twice, for its build id and part count and then for its rows: a
    rebuild in between (3 parts for 1) gave the old build's count with the new build's first part -
    one trajectory of three, taken as a whole build. One open reads the part as it was."""
    import pyarrow.parquet as pq_module

    from polar_train.train.data import DataReport, read_table

    out = tmp_path / "traj"
    assert main(["build", str(capture), "--out", str(out)]) == 0
    assert len(list(out.glob("part-*.parquet"))) == 1
    real_read = pq_module.ParquetFile.read
    rebuilt = []

    def read_after_a_rebuild(self, *args, **kwargs):
        if not rebuilt:
            rebuilt.append(None)  # (the build reads parts too)
            rebuilt[0] = main(["build", str(capture), "--out", str(out), "--rows-per-part", "1"])
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(pq_module.ParquetFile, "read", read_after_a_rebuild)
    assert read_table(out, DataReport()).num_rows == 3 and rebuilt == [0]
    assert len(list(out.glob("part-*.parquet"))) == 3


def test_a_folder_holding_parts_of_two_builds_or_part_of_one_is_refused_by_train(tmp_path, capture):
    """A build killed outright (SIGKILL, the OOM killer) while it swapped its parts for an earlier
    build's left some of each, or some new parts only; train took the mix without a word."""
    import shutil

    from polar_train.cli import UserError
    from polar_train.train.data import DataReport, read_table

    for name in ("a", "b"):
        assert main(["build", str(capture), "--out", str(tmp_path / name), "--rows-per-part", "1"]) == 0
    parts = sorted(p.name for p in (tmp_path / "a").glob("part-*.parquet"))
    assert len(parts) == 3
    assert read_table(tmp_path / "a", DataReport()).num_rows == 3  # a whole build
    report = json.loads((tmp_path / "a" / "_build_report.json").read_text())
    assert pq.read_schema(tmp_path / "a" / parts[0]).metadata[b"polar_train.build_id"] == report["build_id"].encode()

    mixed = tmp_path / "mixed"  # the old build's first part, the new build's others
    shutil.copytree(tmp_path / "a", mixed)
    for name in parts[1:]:
        shutil.copy(tmp_path / "b" / name, mixed / name)
    with pytest.raises(UserError, match=f"^{mixed} holds parts of 2 builds \\(part-00000.parquet and part-00001"):
        read_table(mixed, DataReport())
    cut = tmp_path / "cut"  # the old parts removed, one new part renamed into place
    cut.mkdir()
    shutil.copy(tmp_path / "b" / parts[0], cut / parts[0])
    with pytest.raises(UserError, match=f"^{cut} holds 1 of the 3 parts of its build \\(no part-00001.parquet "
                                        "...\\): a build killed"):
        read_table(cut, DataReport())
    # one part taken out of a build is judged alone (a file given, or under another name), as is a
    # table written back from a build's rows with its metadata
    assert read_table(cut / parts[0], DataReport()).num_rows == 1
    shutil.copy(tmp_path / "b" / parts[1], cut / "picked.parquet")
    (cut / parts[0]).unlink()
    assert read_table(cut, DataReport()).num_rows == 1
    extra = tmp_path / "extra"  # a whole build and a copy of one of its parts under another number
    shutil.copytree(tmp_path / "a", extra)
    shutil.copy(extra / parts[0], extra / "part-00003.parquet")
    with pytest.raises(UserError, match=f"^{extra} holds part-00003.parquet beside the 3 parts of its build, not one"):
        read_table(extra, DataReport())
    edited = tmp_path / "edited"  # one part filtered in pandas and written back: none of our metadata
    shutil.copytree(tmp_path / "a", edited)
    pq.read_table(edited / parts[1]).to_pandas().to_parquet(edited / parts[1])
    assert b"polar_train.table" not in (pq.read_schema(edited / parts[1]).metadata or {})
    assert read_table(edited, DataReport()).num_rows == 3  # was: "holds 2 of the 3 parts (no part-00001.parquet)"
    pq.read_table(edited / parts[0]).to_pandas().to_parquet(edited / "part-00003.parquet")  # one of the user's own
    assert read_table(edited, DataReport()).num_rows == 4  # beside the build: not judged (the review)
    older = tmp_path / "older"  # an earlier version's part (no build id) beside this build's: a mix
    shutil.copytree(tmp_path / "a", older)
    table = pq.read_table(older / parts[2])
    meta = {k: v for k, v in table.schema.metadata.items() if not k.startswith(b"polar_train.build")}
    pq.write_table(table.replace_schema_metadata(meta), older / parts[2])
    with pytest.raises(UserError, match=f"^{older} holds parts of 2 builds"):
        read_table(older, DataReport())
    together = tmp_path / "together"  # two whole builds, each in a subfolder: trained together
    together.mkdir()
    shutil.copytree(tmp_path / "a", together / "a")
    shutil.copytree(tmp_path / "b", together / "b")
    assert read_table(together, DataReport()).num_rows == 6


def test_the_build_is_on_disk_before_its_names(tmp_path, capture, monkeypatch):
    """A rename can reach the disk before the data of the file it names: after a power cut a
    build's parts and report were there by name and empty. Each is flushed under its temporary
    name, and the folder after the swap."""
    from tests.support.fsync import recorded_fsyncs

    synced = recorded_fsyncs(monkeypatch)
    out = tmp_path / "traj"
    assert main(["build", str(capture), "--out", str(out)]) == 0
    parts, report = _built(out)
    temps = [Path(p).name for p in synced if Path(p).parent == out and Path(p).name.startswith(".")]
    assert sorted(t[1:t.index(".tmp")] for t in temps if ".parquet" in t) == parts
    assert any("_build_report.json" in t for t in temps)
    assert synced[-1] == str(out)  # the folder, after the swap


def test_the_library_refuses_what_the_cli_refuses(tmp_path, capture, monkeypatch):
    """From Python: a folder whose every part is skipped returned an empty result (the docs promise
    a CallLogError, as the CLI says); ``write_trajectories`` with rows_per_part=-5 or no
    trajectories removed the earlier build and wrote nothing, and ``""`` wrote into the current
    folder."""
    from polar_train.calllog import CallLogError
    from polar_train.trajectories import build_trajectories
    from polar_train.trajectories.writer import write_trajectories

    built = build_trajectories(capture)
    parts = write_trajectories(built.trajectories, tmp_path / "traj")
    with pytest.raises(CallLogError, match=re.escape(f"no readable call-log part in {tmp_path / 'traj'}; skipped ")):
        build_trajectories(tmp_path / "traj")  # trajectories, not a call log
    before = {p.name: p.read_bytes() for p in (tmp_path / "traj").iterdir()}
    monkeypatch.chdir(tmp_path / "traj")
    for bad, message in ((dict(rows_per_part=-5), "rows_per_part must be a positive whole number, not -5"),
                         (dict(rows_per_part=0), "not 0"), (dict(rows_per_part=2.5), "not 2.5"),
                         (dict(rows_per_part="10"), "not '10'"), (dict(rows_per_part=True), "not True")):
        with pytest.raises(ValueError, match=re.escape(message)):
            write_trajectories(built.trajectories, tmp_path / "traj", **bad)
    with pytest.raises(ValueError, match="no trajectories to write to .*: it keeps what it holds"):
        write_trajectories([], tmp_path / "traj")
    with pytest.raises(ValueError, match="empty path"):
        write_trajectories(built.trajectories, "")
    # what a notebook passes by mistake: said what to pass (was: "object of type 'BuildResult' has no len()")
    for wrong, message in ((built, r"pass the build's trajectories \(result.trajectories\), not the BuildResult"),
                           ((t for t in built.trajectories), "a list of Trajectory .*not generator"),
                           ([None], "a list of Trajectory .*one is a NoneType")):
        with pytest.raises(TypeError, match=message):
            write_trajectories(wrong, tmp_path / "traj")
    with pytest.raises(TypeError, match="out: name a folder \\(str or os.PathLike\\), not NoneType"):
        write_trajectories(built.trajectories, None)
    assert {p.name: p.read_bytes() for p in (tmp_path / "traj").iterdir()} == before and len(parts) == 1


def test_written_from_python_over_a_build_its_report_goes_and_parts_are_private(tmp_path, capture):
    """A build's report stayed beside the parts written over it from Python, describing another
    build (the notebook printed its realign and counts); parts written into a folder made beforehand
    under umask 022 were readable by every user, though they hold the captured prompts."""
    import os
    import stat

    from polar_train.trajectories import build_trajectories
    from polar_train.trajectories.writer import write_trajectories

    out = tmp_path / "traj"
    out.mkdir(mode=0o755)
    old = os.umask(0o022)
    try:
        assert main(["build", str(capture), "--out", str(out)]) == 0
        assert (out / "_build_report.json").is_file()
        (out / "notes.txt").write_text("mine")
        parts = write_trajectories(build_trajectories(capture).trajectories, out)
    finally:
        os.umask(old)
    assert not (out / "_build_report.json").exists() and (out / "notes.txt").read_text() == "mine"
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in parts)
    assert pq.read_schema(parts[0]).metadata.get(b"polar_train.reward_mode") is None  # (not said: not recorded)
    assert main(["build", str(capture), "--out", str(tmp_path / "split"), "--reward-mode", "split"]) == 0
    assert pq.read_schema(tmp_path / "split" / "part-00000.parquet").metadata[b"polar_train.reward_mode"] == b"split"
    from polar_train.trajectories import BuildOptions  # a script of the earlier docs: no reward_mode given

    (tmp_path / "r.jsonl").write_text('{"rollout_id": "r1", "reward": 1}\n{"rollout_id": "r2", "reward": 0}\n')
    split = build_trajectories(capture, BuildOptions(rewards=tmp_path / "r.jsonl", reward_mode="split"))
    (written,) = write_trajectories(split.trajectories, tmp_path / "split-py")
    assert pq.read_schema(written).metadata[b"polar_train.reward_mode"] == b"split"
    # a user's folder with a file in the way is refused, and keeps no lock file of ours
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "part-00000.parquet").write_bytes(b"a user's own file")
    with pytest.raises(FileExistsError, match="exists and was not written by polar-train build"):
        write_trajectories(build_trajectories(capture).trajectories, mine)
    assert sorted(p.name for p in mine.iterdir()) == ["part-00000.parquet"]
    import shutil

    calls = tmp_path / "cap" / "calls"  # a capture's own folder (the command refuses it as inside the capture)
    shutil.copytree(capture / "calls", calls)
    (calls / ".polar-capture.lock").touch()  # what every proxy leaves there
    before = sorted(p.name for p in calls.iterdir())
    for out in (calls, calls.parent):
        with pytest.raises(FileExistsError, match="holds a capture's call log: write the trajectories elsewhere"):
            write_trajectories(build_trajectories(capture).trajectories, out)
    (calls / ".polar-capture.lock").unlink()  # copied without its dot-files: its parts say what it is
    with pytest.raises(FileExistsError, match="holds a capture's call log"):
        write_trajectories(build_trajectories(capture).trajectories, calls)
    assert sorted(p.name for p in calls.iterdir()) == [n for n in before if n != ".polar-capture.lock"]


def test_an_out_folder_named_with_a_newline_is_printed_on_one_line(tmp_path, capture, capsys):
    """``wrote N trajectories ... to <out>``: a newline in the folder's name split the line (inspect
    escaped such names; build's last line did not)."""
    out = tmp_path / "two\nlines"
    assert main(["build", str(capture), "--out", str(out)]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.endswith(f"to {tmp_path}/two\\nlines (report: {tmp_path}/two\\nlines/_build_report.json)")
