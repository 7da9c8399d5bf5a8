"""Rewards and groups: file formats, broadcast vs split, reported groups, bad rows named."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from polar_train.trajectories import BuildOptions, build_trajectories
from polar_train.trajectories.rewards import RewardFileError
from tests.support.calls import Conversation, write_parts

NO_CALLS = "(no call of it is in the call log: a misspelt id, or a session that ended before its first model call)"


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    """Rollouts r1, r2 (task t-add), r3 (task t-sub), r4 (task from the call log: t-log).

    r1 has two trajectories (a history rewrite after a second user message).
    """
    folder = tmp_path_factory.mktemp("captures")
    rows = []
    for rid, task in (("r1", None), ("r2", None), ("r3", None), ("r4", "t-log")):
        conv = Conversation(rollout_id=rid, task_id=task, name=rid)
        conv.user(f"task of {rid}")
        rows.append(conv.assistant("", tool_calls=[("ls", {"path": rid})]))
        conv.tool("ok")
        rows.append(conv.assistant("done", reasoning="checked"))
        if rid == "r1":
            conv.user("one more thing")
            rows.append(conv.assistant("also done"))
    write_parts(folder, rows)
    return folder


def by_rollout(result):
    out: dict[str, list] = {}
    for t in result.trajectories:
        out.setdefault(t.rollout_id, []).append(t)
    return out


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


REWARDS = [{"rollout_id": "r1", "reward": 1.0, "task_id": "t-add"},
           {"rollout_id": "r2", "reward": 0.0, "task_id": "t-add"},
           {"rollout_id": "r3", "reward": 0.5, "task_id": "t-sub"},
           {"rollout_id": "r4", "reward": 0.25}]


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_rewards_and_tasks_attach_in_every_format(tmp_path, captures, fmt):
    path = tmp_path / f"rewards.{fmt}"
    if fmt == "jsonl":
        write_jsonl(path, REWARDS)
    elif fmt == "csv":
        path.write_text("rollout_id,reward,task_id\n" + "".join(
            f"{r['rollout_id']},{r['reward']},{r.get('task_id', '')}\n" for r in REWARDS))
    else:
        pq.write_table(pa.Table.from_pylist(REWARDS), path)
    result = build_trajectories(captures, BuildOptions(rewards=path))
    assert result.report.problems == []
    per = by_rollout(result)
    assert [t.reward for t in per["r1"]] == [1.0, 1.0]  # broadcast to both trajectories
    assert per["r2"][0].reward == 0.0 and per["r3"][0].reward == 0.5
    assert {t.group_id for t in per["r1"] + per["r2"]} == {"t-add"}
    assert per["r3"][0].group_id == "t-sub"
    assert per["r4"][0].group_id == "t-log" and per["r4"][0].task_id == "t-log"  # from the call log
    assert result.report.singleton_groups == ["t-log", "t-sub"]
    assert result.report.equal_reward_groups == []
    assert result.report.groups == 3 and result.report.rollouts_with_reward == 4


def test_split_divides_a_rollouts_reward_among_its_trajectories(tmp_path, captures):
    path = write_jsonl(tmp_path / "r.jsonl", REWARDS)
    result = build_trajectories(captures, BuildOptions(rewards=path, reward_mode="split"))
    per = by_rollout(result)
    assert [t.reward for t in per["r1"]] == [0.5, 0.5]
    assert per["r3"][0].reward == 0.5


def test_tasks_file_wins_and_equal_reward_groups_are_reported(tmp_path, captures):
    rewards = write_jsonl(tmp_path / "r.jsonl", [{"rollout_id": r, "reward": 1} for r in ("r1", "r2", "r3")])
    tasks = tmp_path / "tasks.csv"
    tasks.write_text("rollout_id,task_id\nr1,same\nr2,same\nr3,other\nr4,other\n")
    result = build_trajectories(captures, BuildOptions(rewards=rewards, tasks=tasks))
    per = by_rollout(result)
    assert per["r4"][0].group_id == "other"  # --tasks overrides the call log's task id
    assert result.report.equal_reward_groups == ["same"]  # r1 and r2 both 1.0: no signal
    # "other" holds r3 and r4, but only r3 has a reward: the trainer drops it as a group of one
    # (build called it fine, and train then said "1 groups dropped")
    assert result.report.singleton_groups == ["other"]
    assert per["r4"][0].reward is None and result.report.rollouts_without_reward == 1
    assert result.report.unrewarded_rollouts == ["r4"]
    assert "rollouts (broadcast), 1 without (r4)" in result.report.table()


def test_a_group_without_any_reward_is_counted_apart(tmp_path, captures):
    """Rewards for one task's rollouts only: the other groups were counted among the groups, not
    among the size-1 ones, and said nowhere - yet the trainer leaves every one of them out."""
    rewards = write_jsonl(tmp_path / "r.jsonl", [{"rollout_id": "r1", "reward": 1, "task_id": "t-add"},
                                                 {"rollout_id": "r2", "reward": 0, "task_id": "t-add"}])
    tasks = tmp_path / "tasks.csv"
    tasks.write_text("rollout_id,task_id\nr3,t-sub\n")
    report = build_trajectories(captures, BuildOptions(rewards=rewards, tasks=tasks)).report
    assert (report.groups, report.singleton_groups, report.unrewarded_groups) == (3, [], ["t-log", "t-sub"])
    table = report.table()
    assert "groups (tasks)          3; size 1: 0; all-equal rewards: 0; no reward: 2\n" in table
    assert "groups without a reward: t-log, t-sub" in table
    everyone = build_trajectories(captures, BuildOptions(rewards=write_jsonl(tmp_path / "all.jsonl", REWARDS))).report
    assert everyone.unrewarded_groups == [] and "no reward" not in everyone.table()


def test_bad_reward_rows_are_named_and_valid_rows_still_applied(tmp_path, captures):
    path = tmp_path / "r.jsonl"
    path.write_text("\n".join([
        json.dumps({"rollout_id": "r1", "reward": 1.0}),
        json.dumps({"rollout_id": "r2", "reward": "n/a"}),
        json.dumps({"rollout_id": "ghost", "reward": 1.0}),
        "{not json",
        json.dumps({"rollout_id": "r3", "reward": float("nan")}).replace("NaN", "NaN"),
        json.dumps({"rollout_id": "r1", "reward": 0.0}),
        json.dumps(["r4", 1]),
        "[" * 100_000,  # nested past Python's recursion limit
    ]) + "\n")
    result = build_trajectories(captures, BuildOptions(rewards=path))
    problems = result.report.problems
    assert f"{path}: line 2: non-numeric reward 'n/a' for rollout 'r2'" in problems
    assert f"{path}: line 3: unknown rollout 'ghost' {NO_CALLS}" in problems
    # where on the line (the message alone was cut: "Unterminated string starting at")
    assert f"{path}: line 4: not valid JSON (Expecting property name enclosed in double quotes: column 2)" in problems
    assert f"{path}: line 5: non-finite reward nan for rollout 'r3'" in problems
    assert f"{path}: line 6: rollout 'r1' listed again; the first reward is kept" in problems
    assert f"{path}: line 7: expected a JSON object, got list" in problems
    assert f"{path}: line 8: JSON nested too deeply to read" in problems
    per = by_rollout(result)
    assert [t.reward for t in per["r1"]] == [1.0, 1.0]
    assert per["r2"][0].reward is None and len(result.trajectories) == 5


def test_rewards_the_trainer_cannot_use_or_no_script_meant_are_named(tmp_path, captures):
    """A reward of 1e39 (finite in float64) became inf in the trainer's float32 group statistics
    and a run "trained" with zero gradients; "1_000" was read as 1000 (Python's float); a CSV
    line with a field past its header's was read as if it had none."""
    path = write_jsonl(tmp_path / "r.jsonl", [{"rollout_id": "r1", "reward": 1e39},
                                               {"rollout_id": "r2", "reward": -1e300},
                                               {"rollout_id": "r3", "reward": "1_000"},
                                               {"rollout_id": "r4", "reward": -1e15}])
    result = build_trajectories(captures, BuildOptions(rewards=path))
    problems = result.report.problems
    assert any(p.startswith(f"{path}: line 1: reward 1e+39 for rollout 'r1' is beyond ±1e+15") for p in problems)
    assert any(p.startswith(f"{path}: line 2: reward -1e+300 for rollout 'r2' is beyond") for p in problems)
    assert f"{path}: line 3: non-numeric reward '1_000' for rollout 'r3'" in problems
    assert len(problems) == 3
    assert {r: ts[0].reward for r, ts in by_rollout(result).items()} == {"r1": None, "r2": None, "r3": None,
                                                                        "r4": -1e15}
    csv_path = tmp_path / "r.csv"
    csv_path.write_text("rollout_id,reward\nr1,1,\nr2,0,5\n")  # 0,5: a decimal comma; "1,": a stray comma
    result = build_trajectories(captures, BuildOptions(rewards=csv_path))
    assert result.report.problems == [f"{csv_path}: line 3: 3 fields where the header names 2 (a comma "
                                      "inside a value? quote it)"]
    assert by_rollout(result)["r2"][0].reward is None and by_rollout(result)["r1"][0].reward == 1.0


def test_a_rewarded_rollout_whose_calls_all_failed_is_named(tmp_path):
    """Its reward was accepted and the rollout vanished without a word: a crashed session (often
    a low score) gone from its group's baseline, and the table said to build with --rewards."""
    from tests.support.calls import make_row

    ok = Conversation(rollout_id="ok")
    ok.user("task")
    rows = [ok.assistant("done"),
            make_row(call_id="cut", rollout_id="cut", prompt_ids=None, completion_ids=None, status="proxy_error")]
    write_parts(tmp_path / "cap", rows)
    path = write_jsonl(tmp_path / "r.jsonl", [{"rollout_id": "cut", "reward": 0.0}, {"rollout_id": "ok", "reward": 1}])
    result = build_trajectories(tmp_path / "cap", BuildOptions(rewards=path))
    assert result.report.rewarded_without_calls == ["cut"]
    assert "rollout 'cut' has a reward but no usable call (each failed or was skipped): it is missing from its " \
           "group" in result.report.problems
    table = result.report.table()
    assert "1 rewarded without a usable call" in table and "build again with --rewards" not in table
    assert result.report.to_json()["rewarded_without_calls"] == ["cut"]
    # a file whose every reward is of such a rollout rewards nothing: it exited 0 with nothing to train
    path = write_jsonl(tmp_path / "cut.jsonl", [{"rollout_id": "cut", "reward": 0.0}])
    with pytest.raises(RewardFileError, match=re.escape(
            f"no reward in {path} lands on a trajectory: the rollouts it rewards ('cut') have no usable call "
            "(each failed or was skipped)")):
        build_trajectories(tmp_path / "cap", BuildOptions(rewards=path))


def test_rewards_files_a_reader_cannot_take_whole_name_the_row_and_apply_the_rest(tmp_path, captures, monkeypatch):
    """A CSV field over the csv module's 128 KiB limit ended the build in a traceback; a JSON
    integer of over 4,300 digits stopped it, naming no file or line, with Python's advice; a key
    given twice took its last value, and an Arabic-Indic or full-width digit was read as a number,
    unsaid."""
    from polar_train.trajectories import rewards

    csv_path = tmp_path / "r.csv"
    csv_path.write_text(f'rollout_id,reward,note\nr1,1,x\nr2,0,"{"y" * 200_000}"\nr3,0.5,"two\nlines"\nr4,x,z\n'
                        'r1,2,"a\nb\nc"\n')
    result = build_trajectories(captures, BuildOptions(rewards=csv_path))
    assert result.report.problems == [f"{csv_path}: line 6: non-numeric reward 'x' for rollout 'r4'",
                                      f"{csv_path}: lines 7-9: rollout 'r1' listed again; the first reward is kept"]
    assert {r: ts[0].reward for r, ts in by_rollout(result).items()} == {"r1": 1.0, "r2": 0.0, "r3": 0.5, "r4": None}
    # past our own limit the parser would start again inside the value, any line of which may read as a
    # row: the rest is named as unread (here "r3,1" is inside r2's note)
    monkeypatch.setattr(rewards, "CSV_FIELD_LIMIT", 1000)
    csv_path.write_text(f'rollout_id,reward,note\nr1,1,x\nr2,0,"{"y" * 2000}\nr3,1\n"\nr4,1,z\n')
    result = build_trajectories(captures, BuildOptions(rewards=csv_path))
    assert result.report.problems == [f"{csv_path}: line 3: not readable CSV (field larger than field limit (1000)); "
                                      "the rest of the file is not read"]
    assert {r: ts[0].reward for r, ts in by_rollout(result).items()} == {"r1": 1.0, "r2": None, "r3": None, "r4": None}
    import csv
    assert csv.field_size_limit() == 131072  # the process-wide limit is given back
    path = tmp_path / "r.jsonl"
    path.write_text('{"rollout_id": "r1", "reward": 1, "meta": {"k": 1, "k": 2}}\n'
                    '{"rollout_id": "r2", "reward": ' + "1" * 5000 + '}\n'
                    '{"rollout_id": "r3", "reward": 1, "reward": 0}\n{"rollout_id": "r4", "reward": "\u0661"}\n'
                    '{"rollout_id": "r4", "reward": "\uff17"}\n{"rollout_id": "r4", "reward": "0.5\u00a0"}\n')
    result = build_trajectories(captures, BuildOptions(rewards=path))
    assert result.report.problems == [
        f"{path}: line 2: not readable JSON (Exceeds the limit (4300 digits) for integer string conversion: value "
        "has 5000 digits)",
        f"{path}: line 3: the key 'reward' is given twice (which value is meant?)",
        f"{path}: line 4: non-numeric reward '\u0661' for rollout 'r4'",
        f"{path}: line 5: non-numeric reward '\uff17' for rollout 'r4'"]
    assert {r: ts[0].reward for r, ts in by_rollout(result).items()} == {"r1": 1.0, "r2": None, "r3": None, "r4": 0.5}


def test_a_rewarded_rollout_without_a_task_is_said_under_the_groups(tmp_path, captures):
    """r1-r3 carry no task id: rewarded, they joined no group, and the trainer took each of their
    trajectories as a group of one and left it out, where the table had said nothing."""
    path = write_jsonl(tmp_path / "r.jsonl", [{"rollout_id": r, "reward": 1} for r in ("r1", "r2", "r4")])
    report = build_trajectories(captures, BuildOptions(rewards=path)).report
    assert report.rewarded_without_task == ["r1", "r2"] and report.to_json()["rewarded_without_task"] == ["r1", "r2"]
    lines = report.table().splitlines()
    at = next(k for k, line in enumerate(lines) if line.startswith("groups (tasks)"))
    assert lines[at + 1:at + 3] == [
        " " * 23 + " size-1 groups: t-log",
        " " * 23 + " rewarded rollouts without a task: 2 (r1, r2): in no group, train takes each of their "
        "trajectories as a group of one (--tasks FILE, or x-polar-task at capture)"]
    everyone = build_trajectories(captures, BuildOptions(rewards=write_jsonl(tmp_path / "all.jsonl", REWARDS))).report
    assert everyone.rewarded_without_task == [] and "without a task" not in everyone.table()


def test_a_rollout_listed_twice_in_the_tasks_file_keeps_its_first_task(tmp_path, captures):
    """As for rewards: the first row counts and the conflict is named (the last one won silently)."""
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"rollout_id": "r1", "task_id": "first"}, {"rollout_id": "r1", "task_id": "first"},
        {"rollout_id": "r1", "task_id": "second"}]) + "\n")
    result = build_trajectories(captures, BuildOptions(tasks=path))
    assert result.report.problems == [
        f"{path}: line 3: rollout 'r1' listed again with task 'second'; the first task id 'first' is kept"]
    assert {t.group_id for t in by_rollout(result)["r1"]} == {"first"}


def test_bad_csv_and_parquet_rows_name_their_row(tmp_path, captures):
    csv_path = tmp_path / "r.csv"
    csv_path.write_text("rollout_id,reward\nr1,1\nr2,abc\nnobody,1\n")
    result = build_trajectories(captures, BuildOptions(rewards=csv_path))
    assert f"{csv_path}: line 3: non-numeric reward 'abc' for rollout 'r2'" in result.report.problems
    assert f"{csv_path}: line 4: unknown rollout 'nobody' {NO_CALLS}" in result.report.problems
    pq_path = tmp_path / "r.parquet"
    pq.write_table(pa.table({"rollout_id": ["r1", "r9"], "reward": [1.0, 2.0]}), pq_path)
    result = build_trajectories(captures, BuildOptions(rewards=pq_path))
    assert result.report.problems == [f"{pq_path}: row 2: unknown rollout 'r9' {NO_CALLS}"]


def test_files_as_spreadsheets_and_databases_write_them_are_read(tmp_path, captures):
    """A CSV with the byte-order mark Excel writes, a Parquet decimal column (DuckDB's ``0.5``) and
    task ids that became floats are read as meant; a ``;``-separated CSV is named as such."""
    from decimal import Decimal

    bom = tmp_path / "excel.csv"
    bom.write_bytes("rollout_id,reward,task_id\r\nr1,0.5,7\r\n".encode("utf-8-sig"))
    result = build_trajectories(captures, BuildOptions(rewards=bom))
    assert result.report.problems == [] and {t.reward for t in by_rollout(result)["r1"]} == {0.5}
    dec = tmp_path / "duck.parquet"
    pq.write_table(pa.table({"rollout_id": ["r1", "r2"], "reward": pa.array([Decimal("0.50"), Decimal("1.25")],
                                                                            pa.decimal128(4, 2)),
                             "task_id": [3.0, 3]}), dec)
    result = build_trajectories(captures, BuildOptions(rewards=dec))
    per = by_rollout(result)
    assert result.report.problems == [] and per["r1"][0].reward == 0.5 and per["r2"][0].reward == 1.25
    assert per["r1"][0].task_id == per["r2"][0].task_id == "3"  # one group, not "3.0" and "3"
    pq.write_table(pa.table({"rollout_id": ["r1", "r2", "r3"], "reward": [0.5, 1.0, 0.0],
                             "task_id": pa.array([Decimal("3.0"), Decimal("3"), Decimal("2.5")], pa.decimal128(4, 1))}),
                   dec)  # DuckDB writes a task id column of 3.0 so
    result = build_trajectories(captures, BuildOptions(rewards=dec))
    per = by_rollout(result)
    assert per["r1"][0].task_id == per["r2"][0].task_id == "3" and per["r3"][0].task_id is None
    assert result.report.problems == [f"{dec}: row 3: task_id Decimal('2.5') of rollout 'r3' is not a string or a "
                                      "whole number; left out (the reward is kept)"]
    semi = tmp_path / "semi.csv"
    semi.write_text("rollout_id;reward\nr1;1\n")
    with pytest.raises(RewardFileError, match=r"the header has no rollout_id column \(found 'rollout_id;reward'\); "
                                              "the file must be comma-separated"):
        build_trajectories(captures, BuildOptions(rewards=semi))


def test_labels_files_that_are_not_utf8_are_named_not_read_with_replacement_characters(tmp_path, captures):
    """A Latin-1 CSV (Excel on Windows) made the task ``café`` the new group ``caf\ufffd``, unsaid;
    a UTF-16 one ("Unicode text") was refused with a garbled header as the columns it found."""
    for suffix, text in (("csv", "rollout_id,reward,task_id\nr1,1,caf\xe9\nr2,0,t-add\n"),
                         ("jsonl", '{"rollout_id": "r2", "reward": 0, "task_id": "t-add"}\n'
                                   '{"rollout_id": "r1", "reward": 1, "task_id": "caf\xe9"}\n')):
        latin = tmp_path / f"latin.{suffix}"
        latin.write_bytes(text.encode("latin-1"))
        for labels in (BuildOptions(rewards=latin), BuildOptions(tasks=latin)):
            result = build_trajectories(captures, labels)
            assert f"{latin}: line 2: task_id: not UTF-8 (byte 0xe9; save the file as UTF-8)" in result.report.problems
            assert by_rollout(result)["r2"][0].task_id == "t-add"
            assert all("\ufffd" not in (t.task_id or "") for t in result.trajectories)
        for encoding in ("utf-16", "utf-16-le"):  # with its byte-order mark, and without one
            wide = tmp_path / f"wide.{suffix}"
            wide.write_bytes(text.replace("\xe9", "e").encode(encoding))
            for option, what in (("rewards", "reward"), ("tasks", "task id")):
                with pytest.raises(RewardFileError, match=rf"^no usable {what} in {re.escape(str(wide))}: line 1: UTF-16 "
                                                          r"text, not UTF-8 \(save the file as UTF-8\); the file is "
                                                          "not read$"):
                    build_trajectories(captures, BuildOptions(**{option: wide}))
    # a review: a byte of another column (an Excel note) cost the row, or the whole file in a header
    noted = tmp_path / "noted.csv"
    noted.write_bytes("rollout_id,reward,task_id,remarqu\xe9\nr1,1,t,tr\xe8s bien\nr2,0,t,\n".encode("latin-1"))
    result = build_trajectories(captures, BuildOptions(rewards=noted))
    assert result.report.problems == [] and by_rollout(result)["r1"][0].reward == 1.0
    jnoted = tmp_path / "noted.jsonl"
    jnoted.write_bytes('{"rollout_id": "r1", "reward": 1, "note": "tr\xe8s"}\n'.encode("latin-1"))
    assert by_rollout(build_trajectories(captures, BuildOptions(rewards=jnoted)))["r1"][0].reward == 1.0


def test_unusable_reward_files_fail_before_building(tmp_path, captures):
    with pytest.raises(RewardFileError, match="file not found: .*missing.jsonl"):
        build_trajectories(captures, BuildOptions(rewards=tmp_path / "missing.jsonl"))
    with pytest.raises(RewardFileError, match="is a folder, not a file"):  # not "not found": it is there
        build_trajectories(captures, BuildOptions(rewards=tmp_path))
    odd = tmp_path / "rewards.xlsx"
    odd.write_text("x")
    with pytest.raises(RewardFileError, match=r"unknown file type \.xlsx"):
        build_trajectories(captures, BuildOptions(tasks=odd))


@pytest.mark.parametrize("content, message", [
    ("", r"no reward in .*r\.jsonl: the file holds no rows"),
    ("{not json\n", r"no usable reward in .*r\.jsonl: line 1: not valid JSON"),
    ('{"rollout_id": "ghost", "reward": 1}\n{"rollout_id": "r1"}\n',
     r"no usable reward in .*r\.jsonl: line 1: unknown rollout 'ghost' " + re.escape(NO_CALLS) + r" \(and 1 more problem\)"),
])
def test_a_reward_file_with_nothing_usable_fails_before_building(tmp_path, captures, content, message):
    """Named but useless (the wrong file, another format): building on would write trajectories
    without the rewards asked for; a file with some usable rows is applied (test above)."""
    path = tmp_path / "r.jsonl"
    path.write_text(content)
    with pytest.raises(RewardFileError, match=message):
        build_trajectories(captures, BuildOptions(rewards=path))
    with pytest.raises(RewardFileError, match=message.replace("reward", "task id")):
        build_trajectories(captures, BuildOptions(tasks=path))


def test_a_task_id_that_is_no_name_is_named_not_turned_into_text(tmp_path, captures):
    """``"task_id": ["x"]`` made up the group "['x']" (a dict, true: "{'a': 1}", "True")."""
    path = write_jsonl(tmp_path / "r.jsonl", [{"rollout_id": "r1", "reward": 1.0, "task_id": ["x"]},
                                              {"rollout_id": "r2", "reward": 0.0, "task_id": True},
                                              {"rollout_id": "r3", "reward": 0.5, "task_id": 7.0}])
    tasks = write_jsonl(tmp_path / "t.jsonl", [{"rollout_id": "r4", "task_id": {"a": 1}},
                                               {"rollout_id": "r2", "task_id": "t-two"}])
    result = build_trajectories(captures, BuildOptions(rewards=path, tasks=tasks))
    problems = result.report.problems
    assert f"{path}: line 1: task_id ['x'] of rollout 'r1' is not a string or a whole number; left out " \
           "(the reward is kept)" in problems
    assert f"{path}: line 2: task_id True of rollout 'r2' is not a string or a whole number; left out " \
           "(the reward is kept)" in problems
    assert f"{tasks}: line 1: task_id {{'a': 1}} of rollout 'r4' is not a string or a whole number" in problems
    per = by_rollout(result)
    assert [t.reward for t in per["r1"]] == [1.0, 1.0] and per["r1"][0].group_id is None
    assert per["r3"][0].group_id == "7" and per["r4"][0].group_id == "t-log" and per["r2"][0].group_id == "t-two"


def test_rollouts_build_names_itself_take_rewards(tmp_path):
    """Calls without a rollout id (reverse mode without the header) are grouped by conversation
    into rollouts named conv-<first call id>; a rewards file naming one was refused as "unknown
    rollout", so such captures could never be trained."""
    rows = []
    for k in range(2):
        conv = Conversation(rollout_id=None, name=f"anon{k}")
        conv.user(f"anonymous task {k}")
        rows.append(conv.assistant(f"answer {k}"))
    write_parts(tmp_path / "cap", rows)
    first = build_trajectories(tmp_path / "cap")
    names = sorted(t.rollout_id for t in first.trajectories)
    assert len(names) == 2 and all(n.startswith("conv-") for n in names)
    path = write_jsonl(tmp_path / "r.jsonl", [{"rollout_id": names[0], "reward": 1.0, "task_id": "t"},
                                              {"rollout_id": names[1], "reward": 0.0, "task_id": "t"}])
    result = build_trajectories(tmp_path / "cap", BuildOptions(rewards=path))
    assert not result.report.problems
    assert {t.rollout_id: t.reward for t in result.trajectories} == {names[0]: 1.0, names[1]: 0.0}


def test_ids_in_labels_files_are_trimmed_as_the_capture_trims_them(tmp_path, captures):
    """``"g1 "`` made a group of its own beside ``"g1"`` (a CSV written with spaces after commas),
    a task id of spaces only became a group named "   ", and ``"rollout_id": true`` was looked up
    as the rollout 'True'."""
    path = write_jsonl(tmp_path / "r.jsonl", [{"rollout_id": "r1", "reward": 1.0, "task_id": "g1"},
                                              {"rollout_id": " r2", "reward": 0.0, "task_id": "g1 "},
                                              {"rollout_id": "r3", "reward": 0.5, "task_id": "   "},
                                              {"rollout_id": True, "reward": 0.5}])
    tasks = write_jsonl(tmp_path / "t.jsonl", [{"rollout_id": "r4", "task_id": "\tg1"}])
    result = build_trajectories(captures, BuildOptions(rewards=path, tasks=tasks))
    per = by_rollout(result)
    assert {t.group_id for r in ("r1", "r2", "r4") for t in per[r]} == {"g1"}
    assert per["r3"][0].group_id is None
    assert f"{path}: line 4: rollout_id True is not a string or a number" in result.report.problems


@pytest.mark.parametrize("named_call_failed", [False, True])
def test_a_conversation_without_an_id_is_not_given_one_a_client_named(tmp_path, named_call_failed):
    """A client naming its rollout ``conv-<call id>`` of a call sent without an id: the two were
    one rollout (one reward for both), a fork of each other; also where the named rollout's calls
    all failed (a rewards file still names it)."""
    anon = Conversation(rollout_id=None, name="anon")
    anon.user("anonymous task")
    rows = [anon.assistant("answer")]
    taken = f"conv-{rows[0]['call_id']}"
    named = Conversation(rollout_id=taken, name="named")
    named.user("a named task")
    rows.append(named.assistant("named answer"))
    if named_call_failed:
        rows[1]["status"] = "upstream_error"
    write_parts(tmp_path / "cap", rows)
    result = build_trajectories(tmp_path / "cap")
    assert sorted(t.rollout_id for t in result.trajectories) == [taken, f"{taken}-2"][named_call_failed:]
    assert all(t.fork_cause is None for t in result.trajectories)
