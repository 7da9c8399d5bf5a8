"""``polar-train build`` as a user runs it: a subprocess, its exit code, its table, its output files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_train.cli import main
from polar_train.schema import TRAJECTORY_SCHEMA
from tests.support.calls import Conversation, write_parts

POLAR = str(Path(sys.executable).parent / "polar-train")


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

    report = json.loads((out / "build_report.json").read_text())
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


def test_rebuild_replaces_old_parts(tmp_path, capture):
    out = tmp_path / "traj"
    assert run_build(capture, "--out", tmp_path / "earlier").returncode == 0
    out.mkdir()
    (tmp_path / "earlier" / "part-00000.parquet").rename(out / "part-00007.parquet")  # an earlier build
    (out / "part-00008.parquet").write_bytes(b"not ours: must survive")
    proc = run_build(capture, "--out", out, "--rows-per-part", "1", "--realign")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.glob("*.parquet")) == ["part-00000.parquet", "part-00001.parquet",
                                                             "part-00002.parquet", "part-00008.parquet"]
    assert not list(out.glob(".*"))  # no temp files left


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
    assert "token_source_none 1" in proc.stdout and "no trajectory could be built" in proc.stderr
    assert not (tmp_path / "out").exists()
    assert main(["build", str(tmp_path / "cap"), "--out", str(tmp_path / "out"),
                 "--rewards", str(tmp_path / "r.jsonl")]) == 2
    assert "error: file not found: " in capsys.readouterr().err


def test_out_inside_the_capture_is_refused_and_captured_parts_survive(tmp_path, capture, capsys):
    before = sorted(p.name for p in (capture / "calls").iterdir())
    for out in (capture, capture / "calls", capture / "calls" / "traj"):
        assert main(["build", str(capture), "--out", str(out)]) == 2  # in-process: same code path
        assert "inside the capture folder" in capsys.readouterr().err
    assert sorted(p.name for p in (capture / "calls").iterdir()) == before


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
