"""Stitching hand-built call logs: exact token streams, masks, logprob alignment, forks, retries."""

from __future__ import annotations

import dataclasses
import json
from datetime import timedelta

import numpy as np
import pytest

from polar_train.trajectories import BuildOptions, build_trajectories
from tests.support.calls import IM_END_ID, Conversation, chat_tokenizer, compact, encode, make_row, write_parts


def build(tmp_path, rows, **options):
    write_parts(tmp_path, rows)
    return build_trajectories(tmp_path, BuildOptions(**options))


def sampled_runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of loss_mask == 1."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def assert_aligned(traj, rows) -> None:
    """Every sampled run is one call's completion, with exactly the logprobs the server reported."""
    ids, mask, lps = traj.completion_arrays()
    assert len(ids) == len(mask) == len(lps)
    assert mask.dtype == np.int8 and lps.dtype == np.float32
    runs = sampled_runs(mask)
    assert len(runs) == len(rows)
    for (a, b), row in zip(runs, rows):
        assert ids[a:b].tolist() == row["completion_token_ids"]
        np.testing.assert_array_equal(lps[a:b], np.asarray(row["completion_logprobs"], np.float32))
    assert np.isnan(lps[mask == 0]).all()
    assert traj.call_ids == [r["call_id"] for r in rows]


def tool_session(conv: Conversation, turns: int, **kw) -> list[dict]:
    rows = []
    conv.user("fix the failing test")
    for k in range(turns):
        rows.append(conv.assistant(f"step {k}", reasoning=f"thinking {k}",
                                   tool_calls=[("ls", {"path": f"dir{k}"})], **kw))
        conv.tool(f"file{k}.py\nREADME")
    rows.append(conv.assistant("All green.", **kw))
    return rows


def test_tool_session_is_one_trajectory_with_exact_stream(tmp_path):
    rows = tool_session(Conversation(rollout_id="r1"), 3)
    result = build(tmp_path, rows)
    assert len(result.trajectories) == 1
    (t,) = result.trajectories
    ids, mask, _ = t.completion_arrays()
    assert t.prompt.tolist() == rows[0]["prompt_token_ids"]
    assert t.prompt.tolist() + ids.tolist() == rows[-1]["prompt_token_ids"] + rows[-1]["completion_token_ids"]
    assert_aligned(t, rows)
    # glue between completions = what the next prompt adds: tool output + template, never trained
    a, b = sampled_runs(mask)[0][1], sampled_runs(mask)[1][0]
    glue = ids[a:b].tolist()
    assert chat_tokenizer().decode(glue).startswith("\n<|im_start|>user\n<tool_response>\nfile0.py")
    assert t.fork_cause is None and not t.truncated and not t.realigned
    assert result.report.merge_ratio == 4.0 and result.report.forks == {}
    assert result.report.tokens_trained == int(mask.sum())


def test_server_without_im_end_glue_is_untrained(tmp_path):
    rows = tool_session(Conversation(rollout_id="r1"), 2, include_im_end=False)
    assert all(r["completion_token_ids"][-1] != IM_END_ID for r in rows)
    (t,) = build(tmp_path, rows).trajectories
    ids, mask, _ = t.completion_arrays()
    assert t.prompt.tolist() + ids.tolist() == rows[-1]["prompt_token_ids"] + rows[-1]["completion_token_ids"]
    assert_aligned(t, rows)
    end_of_first = sampled_runs(mask)[0][1]
    assert ids[end_of_first] == IM_END_ID and mask[end_of_first] == 0


def test_new_user_message_dropping_reasoning_forks_as_history_rewrite(tmp_path):
    conv = Conversation(rollout_id="r1")
    rows = tool_session(conv, 1)
    conv.user("now also update the docs")
    rows.append(conv.assistant("Done with docs.", reasoning="docs are in docs/"))
    result = build(tmp_path, rows)
    first, second = result.trajectories
    assert_aligned(first, rows[:2])
    assert_aligned(second, rows[2:])
    assert second.fork_cause == "history_rewrite" and second.rollout_id == "r1"
    assert second.prompt.tolist() == rows[2]["prompt_token_ids"]  # whole history = untrained prompt
    assert result.report.forks == {"history_rewrite": 1}


def test_dropped_long_reasoning_is_history_rewrite_not_compaction(tmp_path):
    conv = Conversation(rollout_id="r1")
    conv.user("explain")
    first = conv.assistant("Short answer.", reasoning="long deliberation " * 100)
    conv.user("ok")
    second = conv.assistant("Bye.")
    # the new prompt is shorter than the trajectory so far, yet nothing was summarised
    assert len(second["prompt_token_ids"]) < len(first["prompt_token_ids"]) + len(first["completion_token_ids"])
    result = build(tmp_path, [first, second])
    assert [t.fork_cause for t in result.trajectories] == [None, "history_rewrite"]


def _retokenized_session(conv: Conversation):
    """Call 1 samples 'Hel'+'lo' where the re-rendered history has the single token 'Hello'."""
    tok = conv.tok
    conv.user("greet")
    canonical = encode(tok, conv.completion_text(conv.assistant_message("Hello there")))
    hello = encode(tok, "Hello")
    assert hello == [9419] and canonical[0] == 9419
    drifted = encode(tok, "Hel") + encode(tok, "lo") + canonical[1:]
    assert tok.decode(drifted) == tok.decode(canonical) and drifted != canonical
    first = conv.assistant("Hello there", completion_ids=drifted)
    conv.user("again")
    second = conv.assistant("Hi.")
    return [first, second]


def test_retokenization_forks_by_default(tmp_path):
    rows = _retokenized_session(Conversation(rollout_id="r1"))
    result = build(tmp_path, rows)
    assert [t.fork_cause for t in result.trajectories] == [None, "retokenization"]
    assert not any(t.realigned for t in result.trajectories)
    assert_aligned(result.trajectories[1], rows[1:])


def _assert_continued_as_retokenization(tmp_path, rows: list[dict], realign: bool) -> None:
    """``rows``' second call forks from the first as a retokenization, or with ``realign`` goes on
    in one realigned trajectory with every sampled id and logprob in place."""
    result = build(tmp_path, rows, realign=realign)
    if realign:
        (t,) = result.trajectories
        assert t.realigned and result.report.realigned_calls == 1
        assert_aligned(t, rows)
    else:
        assert [t.fork_cause for t in result.trajectories] == [None, "retokenization"]


@pytest.mark.parametrize("realign", [False, True])
def test_a_sampled_text_the_tokenizer_normalises_is_a_retokenization(tmp_path, realign):
    """The model sampled ``e`` + a combining acute; the client sent the text back unchanged and the
    tokenizer (NFC, as Qwen's) made it one ``é``: other bytes, no edit. It forked as a
    ``history_rewrite``, and ``--realign`` could not continue across it."""
    conv = Conversation(rollout_id="r1")
    tok = conv.tok
    conv.user("greet in French")
    text = conv.completion_text(conv.assistant_message("cafe\u0301 ok"))
    head, tail = text.split("\u0301")
    sampled = encode(tok, head) + encode(tok, "\u0301") + encode(tok, tail)
    first = conv.assistant("cafe\u0301 ok", completion_ids=sampled)
    conv.user("again")
    second = conv.assistant("Oui.")
    said = tok.decode(second["prompt_token_ids"])  # the next prompt holds the composed form
    assert "caf\u00e9 ok" in said and "\u0301" not in said
    _assert_continued_as_retokenization(tmp_path, [first, second], realign)


@pytest.mark.parametrize("sampled, sent_back, same", [
    ("Tie\u0302\u0301ng Vie\u0323\u0302t ok", "Ti\u1ebfng Vi\u1ec7t ok", True),  # Vietnamese, decomposed
    ("\u1100\u1161\u11a8 ok", "\uac01 ok", True),  # Hangul jamo -> one syllable
    ("cafe\u0301 ok", "caf\u00e9 no", False),  # composed, then other text
    ("cafe ok", "caf\u00e9 ok", False),  # an ASCII text: bytes only, nothing to normalise
    ("ok \U0001F9EA cafe\u0301", "ok \U0001F9EA caf\u00e9", True),  # an emoji split over ids
])
def test_text_cover_takes_the_composed_form_only_for_the_same_text(sampled, sent_back, same):
    from polar_train.trajectories.tokenbytes import default_token_bytes, ids_bytes, text_cover

    tok, tb = chat_tokenizer(), default_token_bytes()
    ids = [i for ch in sampled for i in encode(tok, ch)]  # one character at a time: kept decomposed
    back = encode(tok, sent_back)
    assert text_cover(tb, back, ids_bytes(tb, ids)) == ((len(back), True) if same else None)


def test_text_cover_waits_for_a_character_split_3_plus_1() -> None:
    """Ids that split a 4-byte character 3 + 1 left three escaped halves, past the margin of two
    characters that may still compose: a composed text was not recognised."""
    from polar_train.trajectories.tokenbytes import text_cover

    emoji = "\U0001F9EA".encode()
    pieces = {1: b"ok ", 2: emoji[:3], 3: emoji[3:], 4: b" cafe", 5: "\u0301".encode(), 6: " caf\u00e9".encode()}
    want = b"".join(pieces[i] for i in (1, 2, 3, 4, 5))
    assert text_cover(pieces.get, [1, 2, 3, 6], want) == (4, True)


def test_realign_keeps_sampled_ids_and_resumes_after_the_same_text(tmp_path):
    rows = _retokenized_session(Conversation(rollout_id="r1"))
    result = build(tmp_path, rows, realign=True)
    (t,) = result.trajectories
    assert t.realigned and result.report.realigned_calls == 1
    assert_aligned(t, rows)
    ids, mask, _ = t.completion_arrays()
    first_len = len(rows[0]["completion_token_ids"])
    # after the sampled ids comes the next prompt from the point where the texts agree
    resume = len(rows[0]["prompt_token_ids"]) + first_len - 1  # one token shorter ('Hello')
    assert ids[first_len:].tolist() == rows[1]["prompt_token_ids"][resume:] + rows[1]["completion_token_ids"]
    text = chat_tokenizer().decode(t.prompt.tolist() + ids.tolist())
    assert text == chat_tokenizer().decode(rows[1]["prompt_token_ids"] + rows[1]["completion_token_ids"])


def test_retokenization_reaching_into_the_generation_prompt_is_realigned(tmp_path):
    """A completion that starts with newlines: sampled as "\n" tokens after the generation prompt's
    own "\n", re-rendered as one "\n\n\n" token that swallows the prompt's last token. Same text,
    so it is BPE drift (not a history rewrite), and --realign continues the trajectory."""
    tok = chat_tokenizer()
    conv = Conversation(rollout_id="r1")
    conv.user("greet")
    sampled = encode(tok, "\n") + encode(tok, "\n") + encode(tok, "Hello") + [IM_END_ID]
    first = conv.assistant("\n\nHello", completion_ids=sampled)
    conv.user("again")
    second = conv.assistant("Hi.")
    p1, p2 = first["prompt_token_ids"], second["prompt_token_ids"]
    assert p2[len(p1) - 1] != p1[-1]  # the divergence lies inside the first prompt
    assert [t.fork_cause for t in build(tmp_path / "a", [first, second]).trajectories] == [None, "retokenization"]
    (t,) = build(tmp_path / "b", [first, second], realign=True).trajectories
    assert t.realigned
    assert_aligned(t, [first, second])
    ids, _, _ = t.completion_arrays()
    assert tok.decode(t.prompt.tolist() + ids.tolist()) == tok.decode(p2 + second["completion_token_ids"])


def test_ids_that_name_no_token_are_no_retokenization_and_no_crash(tmp_path):
    """A corrupt or foreign capture with a negative id where the check compares token bytes:
    the tokenizer raised OverflowError out of the build; such an id says nothing that matches."""
    rows = _retokenized_session(Conversation(rollout_id="r1"))
    for bad in (-5, 2_000_000_000):
        first = dict(rows[0], completion_token_ids=[bad, *rows[0]["completion_token_ids"][1:]],
                     call_id=f"{rows[0]['call_id']}{bad}")
        result = build(tmp_path / str(bad), [first, dict(rows[1], call_id=f"{rows[1]['call_id']}{bad}")],
                       realign=True)
        assert [t.fork_cause for t in result.trajectories] == [None, "history_rewrite"]
        assert result.report.realigned_calls == 0


def test_rows_without_a_call_id_are_counted_not_built(tmp_path):
    """Written by another tool whose schema lets call_id be null: they have no name to be built by
    (the first used to become a trajectory with a null call id, the second a "duplicate")."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from polar_train.schema import CALL_LOG_SCHEMA

    rows = _retokenized_session(Conversation(rollout_id="r1"))
    loose = pa.schema([f.with_nullable(True) for f in CALL_LOG_SCHEMA])
    (tmp_path / "calls").mkdir()
    pq.write_table(pa.Table.from_pylist([dict(r, call_id=None) for r in rows], schema=loose),
                   tmp_path / "calls" / "part-0.parquet")
    result = build_trajectories(tmp_path, BuildOptions())
    assert result.trajectories == [] and result.report.skipped == {"no_call_id": 2}


def test_changed_completion_text_is_not_retokenization(tmp_path):
    conv = Conversation(rollout_id="r1")
    conv.user("greet")
    first = conv.assistant("Hello there", append=False)
    conv.messages.append(conv.assistant_message("Hello!"))  # the harness rewrote the answer
    conv.user("again")
    second = conv.assistant("Hi.")
    result = build(tmp_path, [first, second], realign=True)
    assert [t.fork_cause for t in result.trajectories] == [None, "history_rewrite"]
    assert result.report.realigned_calls == 0


def test_sub_agent_is_a_new_conversation_and_main_thread_keeps_merging(tmp_path):
    main = Conversation(rollout_id="r1", name="main")
    sub = Conversation(rollout_id="r1", name="sub", system="You are a search sub-agent.")
    main.user("refactor utils")
    m1 = main.assistant("", tool_calls=[("ls", {"path": "utils"})])
    sub.user("find callers of utils.parse")
    s1 = sub.assistant("", tool_calls=[("ls", {"path": "src"})])
    sub.tool("src/a.py")
    s2 = sub.assistant("Callers: src/a.py")
    main.tool("sub-agent says: src/a.py")
    m2 = main.assistant("Refactored.")
    result = build(tmp_path, [m1, s1, s2, m2])
    by_first = {t.call_ids[0]: t for t in result.trajectories}
    assert set(by_first) == {m1["call_id"], s1["call_id"]}
    assert_aligned(by_first[m1["call_id"]], [m1, m2])
    assert_aligned(by_first[s1["call_id"]], [s1, s2])
    assert by_first[s1["call_id"]].fork_cause == "new_conversation"
    assert by_first[s1["call_id"]].rollout_id == "r1"


def test_same_system_prompt_different_first_task_is_a_new_conversation(tmp_path):
    a = Conversation(rollout_id="r1", name="a")
    b = Conversation(rollout_id="r1", name="b")
    a.user("task one")
    b.user("task two")
    rows = [a.assistant("one"), b.assistant("two")]
    result = build(tmp_path, rows)
    assert [t.fork_cause for t in result.trajectories] == [None, "new_conversation"]


def test_compaction_forks(tmp_path):
    conv = Conversation(rollout_id="r1")
    rows = tool_session(conv, 3)
    # the harness compacts: keeps system + first request, replaces the rest by a summary
    conv.messages = conv.messages[:2] + [{"role": "user", "content": "Summary: ran ls 3 times."}]
    rows.append(conv.assistant("Continuing."))
    result = build(tmp_path, rows)
    assert [t.fork_cause for t in result.trajectories] == [None, "compaction"]
    assert_aligned(result.trajectories[1], rows[-1:])


def test_resampling_an_earlier_prompt_is_a_branch(tmp_path):
    conv = Conversation(rollout_id="r1")
    conv.user("pick a file")
    first = conv.assistant("", tool_calls=[("ls", {"path": "."})])
    conv.tool("a.txt")
    second = conv.assistant("Picked a.txt")
    again = make_row(call_id="r1-resample", prompt_ids=first["prompt_token_ids"],  # sent after both
                     completion_ids=encode(conv.tok, "Nothing to do.<|im_end|>"),
                     request={"resample": 1})
    result = build(tmp_path, [first, second, again])
    causes = {t.call_ids[0]: t.fork_cause for t in result.trajectories}
    assert causes == {first["call_id"]: None, "r1-resample": "branch"}
    assert_aligned(result.trajectories[0], [first, second])
    # the first prompt again after the session went on: what a rollout id reused for the next
    # round's session looks like (its reward and group would be shared): named in the report
    assert result.report.restarted_rollouts == ["r1"]
    assert "1 sent their first request again (r1): one rollout id for several" in result.report.table()
    rewind = make_row(call_id="r1-rewind", prompt_ids=second["prompt_token_ids"],
                      completion_ids=encode(conv.tok, "Other.<|im_end|>"), request={"rewind": 1})
    result = build(tmp_path / "later", [first, second, rewind])  # a branch of a later prompt: no restart
    assert [t.fork_cause for t in result.trajectories] == [None, "branch"]
    assert result.report.restarted_rollouts == [] and "restarted" not in result.report.table()


def test_a_restart_is_seen_where_the_session_forked_after_its_first_call(tmp_path):
    """A reused rollout id whose earlier session's second call forked (retokenization, as in 15 of
    the demo's 16 sessions): its first trajectory held one call, and the restart went unnamed."""
    first, second = _retokenized_session(Conversation(rollout_id="r1"))
    again = make_row(call_id="r1-next-round", prompt_ids=first["prompt_token_ids"],
                     completion_ids=first["completion_token_ids"], request={"round": 2})
    result = build(tmp_path, [first, second, again])
    assert [t.fork_cause for t in result.trajectories] == [None, "retokenization", "branch"]
    assert result.report.restarted_rollouts == ["r1"]
    result = build(tmp_path / "parallel", [first, again])  # a second sample before the session went on
    assert result.report.restarted_rollouts == []
    samples = [dict(again, call_id=f"r1-sample-{k}", request_hash=f"sample-{k}") for k in range(3)]
    result = build(tmp_path / "samples", [first, *samples])  # parallel samples of the first prompt alone
    assert result.report.restarted_rollouts == []


def test_a_rollout_id_reused_for_an_identical_session_is_named_and_both_sessions_train(tmp_path):
    """A deterministic session run again under its rollout id (a restarted proxy, the next round):
    every call equals one of the first session's, so each pair was taken for a retry answered
    alike - the first session lost calls to the second, whose first calls became a branch, and
    no restart was named. An attempt gone on from before the next one was sent is no retry."""
    first = tool_session(Conversation(rollout_id="r1", name="a"), 2)
    again = [dict(row, attempt=2, completion_logprobs=row["completion_logprobs"])
             for row in tool_session(Conversation(rollout_id="r1", name="b"), 2)]
    assert [r["request_hash"] for r in again] == [r["request_hash"] for r in first]
    result = build(tmp_path, first + again)
    assert "superseded_retry" not in result.report.skipped and result.report.calls_used == 6
    assert result.report.restarted_rollouts == ["r1"]
    by_first = {t.call_ids[0]: t for t in result.trajectories}
    assert sorted(by_first) == [first[0]["call_id"], again[0]["call_id"]]
    assert_aligned(by_first[first[0]["call_id"]], first)
    assert_aligned(by_first[again[0]["call_id"]], again)


def test_one_rollout_id_recorded_under_two_tasks_is_named(tmp_path):
    """Two machines both numbering their rollouts from rollout-0001, merged: its calls carry two
    task ids, and the build put every trajectory in the first task's group with its reward,
    saying nothing."""
    a, b = Conversation(rollout_id="rollout-0001", name="a"), Conversation(rollout_id="rollout-0001", name="b")
    a.user("task A")
    b.user("task B, another prompt")
    rows = [a.assistant("one", task_id="taskA"), b.assistant("two", task_id="taskB")]
    result = build(tmp_path, rows)
    assert result.report.mixed_task_rollouts == {"rollout-0001": ["taskA", "taskB"]}
    assert ("rollouts of several tasks  1 (rollout-0001: taskA, taskB): a rollout id reused for another task? "
            "each session needs its own (all its trajectories join one task's group)") in result.report.table()
    rows = [a.assistant("three", task_id="taskA"), a.assistant("four", task_id=None)]
    result = build(tmp_path / "one", rows)
    assert result.report.mixed_task_rollouts == {} and "several tasks" not in result.report.table()


def test_one_rollout_id_over_two_harness_sessions_is_named(tmp_path):
    """A rollout id reused for a second Codex or Claude Code session: its first prompt differs
    (Codex's names the session's folder), so the second session forked as a `new_conversation` - what
    a sub-agent is too - and shared the first one's reward and group, unsaid. The harness's own
    session id (a sub-agent's is its parent's) tells them apart."""
    a, b = Conversation(rollout_id="r1", name="a"), Conversation(rollout_id="r1", name="b")
    a.user("task in /tmp/one")
    b.user("task in /tmp/two")
    rows = [a.assistant("one", client_session_id="s-1"), a.assistant("two", client_session_id="s-1"),
            b.assistant("three", client_session_id="s-2")]
    result = build(tmp_path, rows)
    assert result.report.forks == {"new_conversation": 1}
    assert result.report.mixed_session_rollouts == {"r1": 2}
    assert ("rollouts of several sessions  1 (r1: 2 sessions): the harness named several sessions under one "
            "rollout id; each session needs its own") in result.report.table()
    sub, pi = Conversation(rollout_id="r1", name="sub"), Conversation(rollout_id="r2", name="pi")
    sub.user("sub-agent task")  # a sub-agent of the session: its own conversation, its session's id
    pi.user("a task")  # a harness that names no session
    rows = [a.assistant("four", client_session_id="s-1"), sub.assistant("five", client_session_id="s-1"),
            pi.assistant("six", client_session_id=None), pi.assistant("seven", client_session_id=None)]
    result = build(tmp_path / "one", rows)
    assert result.report.forks == {"new_conversation": 1}
    assert result.report.mixed_session_rollouts == {} and "several sessions" not in result.report.table()


def test_two_harnesses_under_one_rollout_id_are_named(tmp_path):
    """Pi (chat completions) and Claude Code (messages) run at once under one rollout id: two
    conversations of one rollout with one reward, and nothing said (a sub-agent looks the same)."""
    pi, claude = Conversation(rollout_id="r1", name="pi"), Conversation(rollout_id="r1", name="cc")
    pi.user("task")
    claude.user("task, asked otherwise")
    rows = [pi.assistant("one"), claude.assistant("two", api="anthropic.messages", path="/v1/messages")]
    result = build(tmp_path, rows)
    assert result.report.mixed_api_rollouts == {"r1": ["anthropic.messages", "openai.chat"]}
    assert ("rollouts of several APIs  1 (r1: anthropic.messages, openai.chat): two harnesses under one "
            "rollout id? each session needs its own") in result.report.table()
    assert result.report.calls_used == 2
    result = build(tmp_path / "one", [rows[0], Conversation(rollout_id="r2").assistant("three",
                                                                                      api="anthropic.messages")])
    assert result.report.mixed_api_rollouts == {} and "several APIs" not in result.report.table()


def test_a_rollout_whose_last_call_failed_is_named(tmp_path):
    """A harness killed mid-call left its rollout's earlier calls: they built a trajectory like a
    finished session's, under a reward that scored an unfinished run, and nothing said so."""
    killed, retried = Conversation(rollout_id="killed"), Conversation(rollout_id="retried")
    killed.user("go")
    retried.user("go")
    rows = [killed.assistant("one"), retried.assistant("one")]
    killed.user("on")
    retried.user("on")
    rows += [make_row(call_id="killed-cut", rollout_id="killed", prompt_ids=None, completion_ids=None,
                      status="client_disconnected"),
             make_row(call_id="retried-cut", rollout_id="retried", prompt_ids=None, completion_ids=None,
                      status="upstream_error"),
             retried.assistant("two"),  # the harness asked again, and went on
             make_row(call_id="failed-only", rollout_id="failed", prompt_ids=None, completion_ids=None,
                      status="upstream_error")]
    result = build(tmp_path, rows)
    assert result.report.cut_off_rollouts == {"killed": "client_disconnected"}
    table = result.report.table()
    assert ("rollouts ending in a failed call  1 (killed: client_disconnected): sessions cut off? their "
            "rewards score unfinished runs") in table
    assert result.report.trajectories == 2 and result.report.to_json()["cut_off_rollouts"] == {
        "killed": "client_disconnected"}
    # inspect counts 3 rollouts: build's line says where the third went (not among the cut off:
    # it built nothing to train)
    assert table.splitlines()[0].split() == "rollouts 2 (and 1 in the call log without a usable call: each failed or was skipped)".split()
    assert result.report.rollouts_without_usable_call == ["failed"]


@pytest.mark.parametrize("added", ["system", "tools"])
def test_a_system_prompt_or_tools_put_before_a_first_call_without_them_is_a_new_conversation(tmp_path, added):
    """An SDK probe: a first call with neither, a second with the same user turn behind a system
    prompt (or a tool list): "compaction" (the context grew from 9 to 149 tokens), as if a summary
    had been put before the task."""
    bare = Conversation(rollout_id="r1", name="bare", system=None, tools=[])
    bare.user("Hi")
    first = bare.assistant("Hello.")
    more = Conversation(rollout_id="r1", name="more", system="You are a coding agent." if added == "system" else None,
                        tools=None if added == "tools" else [])
    more.user("Hi")
    second = more.assistant("Hello again.")
    result = build(tmp_path, [first, second])
    assert [t.fork_cause for t in result.trajectories] == [None, "new_conversation"]


def test_a_rollout_id_reused_by_the_next_rounds_adapter_is_named(tmp_path):
    """Round 2 reused a round-1 rollout id in the same capture folder; its first prompt differed
    (Pi's names the work folder), so no restart was seen: two sessions under one reward, unnamed.
    The models the calls asked for (base, then the adapter vLLM serves as ``r1``) say it."""
    one = Conversation(rollout_id="pi-a", model="tiny", name="round1")
    one.user("fix add() in /tmp/w1")
    first = one.assistant("Done.")
    two = Conversation(rollout_id="pi-a", model="r1", name="round2")
    two.user("fix add() in /tmp/w2")
    second = two.assistant("Fixed.")
    other = Conversation(rollout_id="pi-b", model="r1", name="other")
    other.user("fix add() in /tmp/w3")
    third = other.assistant("Ok.")
    result = build(tmp_path, [first, second, third])
    assert result.report.models == {"tiny": 1, "r1": 2}
    assert result.report.mixed_model_rollouts == {"pi-a": ["r1", "tiny"]}
    table = result.report.table()
    assert "models" in table and "r1 2, tiny 1 (trajectories)" in table
    assert "rollouts of several models  1 (pi-a: r1, tiny): a rollout id reused in a later round?" in table
    assert "1 without; training needs them: build again with --rewards FILE" not in table  # one has none
    assert "0 rollouts (broadcast), 2 without; training needs them: build again with --rewards FILE" in table
    rewards = tmp_path / "rewards.jsonl"
    rewards.write_text('{"rollout_id": "pi-b", "reward": 1}\n')
    result = build(tmp_path / "one-round", [first, third], rewards=rewards)
    assert result.report.mixed_model_rollouts == {} and "several models" not in result.report.table()
    assert "1 rollouts (broadcast), 1 without (pi-a)\n" in result.report.table() + "\n"

def test_a_group_holding_two_rounds_models_is_named(tmp_path):
    """Two rounds' captures (new rollout ids each) built as one folder: each task's GRPO group held
    the base's and the adapter's sessions, one baseline for two policies, and build said nothing
    (a probe; train warned only later, after loading the model)."""
    rows = []
    for rollout, model, task in (("a0", "base", "greet"), ("a1", "r1", "greet"), ("b0", "base", "sum"),
                                 ("b1", "base", "sum")):
        conv = Conversation(rollout_id=rollout, model=model, task_id=task, name=rollout)
        conv.user(f"task {task}")
        rows.append(conv.assistant("ok"))
    result = build(tmp_path, rows)
    assert result.report.mixed_model_groups == {"greet": ["base", "r1"]}
    assert ("groups of several models: 1 (greet: base, r1): two rounds in one build? one GRPO baseline for two "
            "policies; build each round's capture apart") in result.report.table()
    one_round = build(tmp_path / "one", rows[2:])
    assert one_round.report.mixed_model_groups == {} and "groups of several models" not in one_round.report.table()
    # every rollout of a group with side calls to a small model (Claude Code's): one policy set, no row
    side = []
    for rollout in ("c0", "c1"):
        for model in ("tiny", "small"):
            conv = Conversation(rollout_id=rollout, model=model, task_id="side", name=f"{rollout}-{model}")
            conv.user(f"ask {model}")
            side.append(conv.assistant("ok"))
    alike = build(tmp_path / "side", side)
    assert alike.report.mixed_model_groups == {} and "groups of several models" not in alike.report.table()


def test_temperature_change_forks_as_sampler_change(tmp_path):
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    first = conv.assistant("", tool_calls=[("ls", {"path": "."})])
    conv.tool("x")
    conv.temperature = 0.25
    second = conv.assistant("done")
    result = build(tmp_path, [first, second])
    assert [t.fork_cause for t in result.trajectories] == [None, "sampler_change"]
    assert result.trajectories[1].temperature == pytest.approx(0.25)


def test_retries_keep_the_completed_attempt(tmp_path):
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    ok = conv.assistant("", tool_calls=[("ls", {"path": "."})], attempt=2)
    failed = make_row(call_id="r1-failed", prompt_ids=None, completion_ids=None, status="upstream_error",
                      attempt=1, request_hash=ok["request_hash"])
    disconnected = make_row(call_id="r1-disc", prompt_ids=ok["prompt_token_ids"],
                            completion_ids=ok["completion_token_ids"][:2], status="client_disconnected",
                            attempt=3, request_hash=ok["request_hash"])
    conv.tool("x")
    final = conv.assistant("done")
    lone_error = make_row(call_id="r2-err", rollout_id="r2", prompt_ids=None, completion_ids=None,
                          status="upstream_error")
    text_only = make_row(call_id="r3-text", rollout_id="r3", prompt_ids=None, completion_ids=None,
                         token_source="none")
    result = build(tmp_path, [failed, disconnected, ok, final, lone_error, text_only])
    (t,) = result.trajectories
    assert_aligned(t, [ok, final])
    assert result.report.skipped == {"superseded_retry": 2, "status_upstream_error": 1,
                                     "token_source_none": 1}
    assert result.report.calls_read == 6 and result.report.calls_used == 2


def test_two_completed_attempts_keep_the_last(tmp_path):
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    first = conv.assistant("one", append=False)
    second = conv.assistant("two", request_hash=first["request_hash"], attempt=2)
    result = build(tmp_path, [first, second])
    (t,) = result.trajectories
    assert t.call_ids == [second["call_id"]]
    assert result.report.skipped == {"superseded_retry": 1}


def test_a_one_call_session_run_again_under_its_id_by_a_restarted_proxy_keeps_both(tmp_path):
    """A one-call task run each day under the same rollout id, the proxy restarted in between (so
    both calls are numbered attempt 1): the build took the first day's call for a retry of the
    second's and dropped it, its reward row naming a trajectory that was gone."""
    conv = Conversation(rollout_id="r1")
    conv.user("the daily task")
    monday = conv.assistant("one", append=False)
    tuesday = conv.assistant("two", append=False, request_hash=monday["request_hash"], attempt=1)
    assert monday["finished_at"] < tuesday["started_at"]
    result = build(tmp_path, [monday, tuesday])
    assert sorted(c for t in result.trajectories for c in t.call_ids) == sorted([monday["call_id"], tuesday["call_id"]])
    assert "superseded_retry" not in result.report.skipped
    assert result.report.restarted_rollouts == ["r1"]


@pytest.mark.parametrize("first_turn", [False, True])
def test_a_retry_numbered_1_by_a_replaced_row_worker_stays_a_retry(tmp_path, first_turn):
    """The review: a row worker replaced mid-session (killed, out of memory) numbers a real retry
    attempt 1 again; the rule for a one-call task run again after a proxy restart kept both
    answers, trained the one the harness threw away and named a restart that never was. Only a
    session's first request numbered 1 again starts a session."""
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    rows = []
    if not first_turn:
        rows.append(conv.assistant("", tool_calls=[("ls", {"path": "."})]))
        conv.tool("x")
    unused = conv.assistant("unused answer", append=False)  # the client timed out, and asked again
    used = conv.assistant("used answer", request_hash=unused["request_hash"], attempt=1)
    conv.tool("y")
    rows += [unused, used, conv.assistant("done")]
    result = build(tmp_path, rows)
    (t,) = result.trajectories
    assert unused["call_id"] not in t.call_ids and used["call_id"] in t.call_ids
    assert result.report.skipped == {"superseded_retry": 1} and result.report.restarted_rollouts == []


def test_one_call_recorded_by_two_chained_proxies_is_kept_once(tmp_path):
    """Two proxies in a chain each record the call under its rollout (both read the id from the
    API key), each numbering it attempt 1; the outer one's row starts before and ends after the
    inner one's: one call, not two sessions."""
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    outer = conv.assistant("one", append=False)
    inner = dict(outer, call_id="inner-copy", started_at=outer["started_at"] + timedelta(milliseconds=1),
                 finished_at=outer["finished_at"] - timedelta(milliseconds=1))
    result = build(tmp_path, [outer, inner])
    assert len(result.trajectories) == 1 and result.report.skipped == {"superseded_retry": 1}
    assert result.report.restarted_rollouts == []


def test_one_body_sent_to_two_apis_is_two_requests_not_a_retry(tmp_path):
    """A chat call and a messages call of one rollout with byte-identical bodies shared a request
    hash: the second was counted attempt 2 and the build dropped one as a superseded retry."""
    from polar_train.capture.record import AttemptCounter

    counter = AttemptCounter()
    assert [counter.next("r1", "h", "openai.chat"), counter.next("r1", "h", "anthropic.messages"),
            counter.next("r1", "h", "openai.chat")] == [1, 1, 2]
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    first = conv.assistant("one", append=False)
    second = conv.assistant("two", request_hash=first["request_hash"], api="anthropic.messages")
    result = build(tmp_path, [first, second])
    assert sorted(c for t in result.trajectories for c in t.call_ids) == sorted([first["call_id"], second["call_id"]])
    assert "superseded_retry" not in result.report.skipped


@pytest.mark.parametrize("compact", [False, True])
def test_of_two_completed_attempts_the_one_the_rollout_went_on_from_is_kept(tmp_path, compact):
    """The same request sent twice and both answered (a client that timed out and asked again):
    the harness continued the first answer, and the build kept the second - training tokens the
    harness never used, and forking the next call as a history rewrite."""
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    first = conv.assistant("one")  # the answer the conversation goes on with
    second = conv.assistant("two", append=False, request_hash=first["request_hash"], attempt=2)
    second["prompt_token_ids"] = first["prompt_token_ids"]
    conv.user("and then?")
    follow = conv.assistant("three")
    rows = [first, second, follow]
    if compact:  # stored as polar_prompt_delta stores it: the follow-up's prompt refers to the last call
        from polar_train.capture.prompt_delta import PromptDeltaEncoder

        encoder = PromptDeltaEncoder()
        rows = [encoder.encode(dict(r)) for r in rows]
        assert rows[2]["prompt_prefix_call_id"] is not None
    result = build(tmp_path, rows)
    (t,) = result.trajectories
    assert t.call_ids == [first["call_id"], follow["call_id"]] and t.fork_cause is None
    assert result.report.skipped == {"superseded_retry": 1}


def test_the_same_first_request_gone_on_from_twice_is_no_retry(tmp_path):
    """Two conversations of one rollout send the same first request and each goes on (parallel
    samples under one id): both answers were taken for attempts of one call, one dropped as a
    superseded retry, and its conversation's later calls forked one by one."""
    a, b = Conversation(rollout_id="r1", name="a"), Conversation(rollout_id="r1", name="b")
    a.user("the same task")
    b.user("the same task")
    a1 = a.assistant("", tool_calls=[("ls", {"path": "a"})])
    b1 = b.assistant("", tool_calls=[("ls", {"path": "b"})], request_hash=a1["request_hash"], attempt=2)
    rows = [a1, b1]
    for k in range(2):
        a.tool(f"A{k}")
        b.tool(f"B{k}")
        rows += [a.assistant(f"a step {k}"), b.assistant(f"b step {k}")]
    result = build(tmp_path, rows)
    assert "superseded_retry" not in result.report.skipped and result.report.calls_used == 6
    by_first = {t.call_ids[0]: t for t in result.trajectories}
    assert_aligned(by_first[a1["call_id"]], rows[0::2])
    assert_aligned(by_first[b1["call_id"]], rows[1::2])
    assert by_first[b1["call_id"]].fork_cause == "branch"


@pytest.mark.parametrize("retried_next_turn", [False, True])
def test_the_same_request_answered_alike_side_by_side_is_two_samples(tmp_path, retried_next_turn):
    """A probe: Claude Code's two sub-agents given the same task answered alike (a short first turn);
    the second was dropped as a retry of the first, its conversation a one-call branch whose prompt
    held its first turn untrained. Completed attempts in flight together, numbered apart by one
    proxy, are no retries (a client asks again once it gave up on the first); a retry sent after
    its first attempt ended stays one sample."""
    a, b = Conversation(rollout_id="r1", name="a"), Conversation(rollout_id="r1", name="b")
    a.user("the same task")
    b.user("the same task")
    a1 = a.assistant("", tool_calls=[("ls", {"path": "."})])
    b1 = b.assistant("", tool_calls=[("ls", {"path": "."})], request_hash=a1["request_hash"], attempt=2)
    assert (a1["prompt_token_ids"], a1["completion_token_ids"]) == (b1["prompt_token_ids"], b1["completion_token_ids"])
    b1["started_at"] = a1["finished_at"] - timedelta(microseconds=1)  # sent side by side: no retry
    rows = [a1, b1]
    for k in range(2):
        a.tool(f"A{k}")
        b.tool(f"B{k}")
        rows += [a.assistant(f"a step {k}"), b.assistant(f"b step {k}")]
    if retried_next_turn:  # a's second call sent twice, answered alike: still one conversation of a's
        retry = make_row(call_id="a2-retry", prompt_ids=rows[2]["prompt_token_ids"],
                         completion_ids=rows[2]["completion_token_ids"], request_hash=rows[2]["request_hash"],
                         attempt=2)
        retry.update(started_at=rows[2]["finished_at"] + timedelta(microseconds=1),  # once a2 was given up on
                     finished_at=rows[2]["finished_at"] + timedelta(microseconds=2))
        rows.insert(3, retry)
    result = build(tmp_path, rows)
    assert result.report.skipped == ({"superseded_retry": 1} if retried_next_turn else {})
    assert sorted(len(t.call_ids) for t in result.trajectories) == [3, 3]
    assert {t.call_ids[-1] for t in result.trajectories} == {rows[-2]["call_id"], rows[-1]["call_id"]}
    for t in result.trajectories:
        assert t.prompt.tolist() == a1["prompt_token_ids"]  # each sub-agent's first turn trained in its own
        assert t.completion_arrays()[1][:len(a1["completion_token_ids"])].tolist() == [1] * len(a1["completion_token_ids"])


def test_of_attempts_in_flight_together_those_no_later_call_went_on_from_are_dropped(tmp_path):
    """The review: a client that asked again while its first attempt still ran (hedging, or a timeout
    the proxy did not see) and went on from the second; the first, finishing ok too, was kept as a
    one-call trajectory the harness never used."""
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    first = conv.assistant("one", append=False)
    second = conv.assistant("two", request_hash=first["request_hash"], attempt=2)
    second["prompt_token_ids"] = first["prompt_token_ids"]
    second["started_at"] = first["started_at"] + timedelta(microseconds=1)
    first["finished_at"] = second["finished_at"] + timedelta(microseconds=1)  # (it ran on, and ended ok)
    conv.user("and then?")
    follow = conv.assistant("three")
    result = build(tmp_path, [first, second, follow])
    assert [t.call_ids for t in result.trajectories] == [[second["call_id"], follow["call_id"]]]
    assert result.report.skipped == {"superseded_retry": 1}


def test_two_attempts_that_answered_alike_are_one_sample(tmp_path):
    """A retry answered exactly as the first attempt (temperature 0, a seed): a later call goes on
    from both, which is no sign of two conversations - the sample is trained once."""
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    first = conv.assistant("one")
    retry = make_row(call_id="r1-retry", prompt_ids=first["prompt_token_ids"],
                     completion_ids=first["completion_token_ids"], request_hash=first["request_hash"], attempt=2)
    conv.user("and then?")
    follow = conv.assistant("three")
    result = build(tmp_path, [first, retry, follow])
    (t,) = result.trajectories
    assert t.call_ids == [retry["call_id"], follow["call_id"]]  # the highest attempt, as before
    assert result.report.skipped == {"superseded_retry": 1}


def _retried_with_drift(conv: Conversation, first_ids, second_text: str, second_ids=None):
    """Attempt 1 answers "Hello there" with ``first_ids``; attempt 2 of the same request answers
    ``second_text``; the harness goes on from attempt 1's answer, which the next prompt holds as
    re-tokenised text ("Hello" where "Hel" + "lo" was sampled)."""
    conv.user("greet")
    first = conv.assistant("Hello there", completion_ids=first_ids)  # appended: the harness's choice
    second = conv.assistant(second_text, completion_ids=second_ids, append=False,
                            request_hash=first["request_hash"], attempt=2)
    second["prompt_token_ids"] = first["prompt_token_ids"]
    conv.user("again")
    follow = conv.assistant("Hi.")
    return first, second, follow


def _drifted(tok, conv: Conversation, *pieces: str) -> list[int]:
    canonical = encode(tok, conv.completion_text(conv.assistant_message("Hello there")))
    ids = [i for p in pieces for i in encode(tok, p)] + canonical[1:]
    assert tok.decode(ids) == tok.decode(canonical) and ids != canonical
    return ids


@pytest.mark.parametrize("realign", [False, True])
def test_the_attempt_gone_on_from_is_found_by_its_text_where_its_ids_were_re_tokenised(tmp_path, realign):
    """Two completed attempts of one request; the harness went on from the first, sent back as
    text that the server tokenised otherwise. The ids found no attempt gone on from, and the
    highest (the answer the harness dropped) was kept and trained."""
    conv = Conversation(rollout_id="r1")
    first, second, follow = _retried_with_drift(conv, None, "Good day to you")
    first["completion_token_ids"] = _drifted(conv.tok, Conversation(rollout_id="x"), "Hel", "lo")
    first["completion_logprobs"] = [-0.5] * len(first["completion_token_ids"])
    result = build(tmp_path, [first, second, follow], realign=realign)
    kept = [c for t in result.trajectories for c in t.call_ids]
    assert kept == [first["call_id"], follow["call_id"]]
    assert result.report.skipped == {"superseded_retry": 1}
    if realign:
        (t,) = result.trajectories
        assert_aligned(t, [first, follow])
    else:
        assert [t.fork_cause for t in result.trajectories] == [None, "retokenization"]


def test_attempts_that_said_the_same_text_tokenised_otherwise_are_one_sample(tmp_path):
    """Both attempts said "Hello there" ("Hel" + "lo" and "He" + "llo"), and the next prompt
    holds it as one "Hello": which tokenisation the harness used cannot be told, so the sample is
    trained once (the highest attempt), not taken for two conversations."""
    conv = Conversation(rollout_id="r1")
    other = Conversation(rollout_id="x")
    first, second, follow = _retried_with_drift(
        conv, _drifted(conv.tok, other, "Hel", "lo"), "Hello there", _drifted(conv.tok, other, "He", "llo"))
    result = build(tmp_path, [first, second, follow], realign=True)
    (t,) = result.trajectories
    assert t.call_ids == [second["call_id"], follow["call_id"]]
    assert result.report.skipped == {"superseded_retry": 1}


@pytest.mark.parametrize("first", [[31628], [31628, 379, 1017]])  # "Hel"; "Hel"+"lo"+" there": the same text
def test_an_attempt_whose_text_only_begins_what_the_next_prompt_says_is_a_superseded_retry(tmp_path, first):
    """Attempt 1 said "Hel" (cut off), attempt 2 "Hello there" (no stop token); the harness went
    on from attempt 2. Attempt 1's text begins the next prompt's, and it was kept as a trajectory
    of its own (the real conversation a branch of it). Only an attempt whose text ends where the
    prompt's reply ends (a stop token there, or the template's) is one gone on from."""
    from tests.support.calls import IM_END_ID

    conv = Conversation(rollout_id="r1")
    conv.user("greet")
    cut = make_row(call_id="r1-cut", prompt_ids=conv.prompt_ids(), completion_ids=first,
                   request={"same": "request"}, attempt=1, finish_reason="length")
    answer = conv.assistant("Hello there", include_im_end=False, request_hash=cut["request_hash"], attempt=2)
    assert IM_END_ID not in answer["completion_token_ids"]
    conv.user("again")
    follow = conv.assistant("Hi.")
    result = build(tmp_path, [cut, answer, follow])
    assert result.report.skipped == {"superseded_retry": 1}
    (t,) = result.trajectories
    assert t.call_ids == [answer["call_id"], follow["call_id"]]


def test_the_tokenizer_is_not_loaded_for_attempts_nothing_went_on_from(tmp_path):
    """Two completed attempts and no later call that shares their prompt: the text comparison
    (which loads a tokenizer: seconds) is not reached."""
    from polar_train.calllog import read_call_log
    from polar_train.trajectories.build import select_calls

    conv = Conversation(rollout_id="r1")
    conv.user("go")
    first = conv.assistant("one", append=False)
    second = conv.assistant("two", request_hash=first["request_hash"], attempt=2)
    other = Conversation(rollout_id="r1", name="b")
    other.user("another task entirely")
    unrelated = other.assistant("three")
    write_parts(tmp_path, [first, second, unrelated])

    def no_tokenizer():
        raise AssertionError("the tokenizer was loaded")

    rows, skipped, _restarted = select_calls(read_call_log(tmp_path).table, no_tokenizer)
    assert skipped == {"superseded_retry": 1} and len(rows) == 2


def test_calls_without_rollout_id_are_grouped_by_conversation(tmp_path):
    a = Conversation(rollout_id=None, name="a")
    b = Conversation(rollout_id=None, name="b")
    a.user("task A")
    b.user("task B")
    a1, b1 = a.assistant("", tool_calls=[("ls", {"path": "a"})]), b.assistant("", tool_calls=[("ls", {"path": "b"})])
    a.tool("A!")
    b.tool("B!")
    b2, a2 = b.assistant("B done"), a.assistant("A done")
    result = build(tmp_path, [a1, b1, b2, a2])
    assert len(result.trajectories) == 2
    by_first = {t.call_ids[0]: t for t in result.trajectories}
    assert_aligned(by_first[a1["call_id"]], [a1, a2])
    assert_aligned(by_first[b1["call_id"]], [b1, b2])
    assert {t.rollout_id for t in result.trajectories} == {f"conv-{a1['call_id']}", f"conv-{b1['call_id']}"}
    assert all(t.fork_cause is None for t in result.trajectories)
    assert result.report.rollouts == 2


def test_anonymous_sessions_with_the_same_first_request_are_separate_rollouts(tmp_path):
    """A GRPO group sent without rollout ids: the same first request, other samples. The second
    session was a ``branch`` of the first and shared its rollout (one reward for both)."""
    a, b = Conversation(rollout_id=None, name="a"), Conversation(rollout_id=None, name="b")
    a.user("the same task")
    b.user("the same task")
    a1 = a.assistant("", tool_calls=[("ls", {"path": "a"})])
    b1 = b.assistant("", tool_calls=[("ls", {"path": "b"})])
    assert a1["prompt_token_ids"] == b1["prompt_token_ids"]
    a.tool("A!")
    b.tool("B!")
    a2, b2 = a.assistant("A done"), b.assistant("B done")
    result = build(tmp_path, [a1, b1, a2, b2])
    by_first = {t.call_ids[0]: t for t in result.trajectories}
    assert_aligned(by_first[a1["call_id"]], [a1, a2])
    assert_aligned(by_first[b1["call_id"]], [b1, b2])
    assert {t.rollout_id for t in result.trajectories} == {f"conv-{a1['call_id']}", f"conv-{b1['call_id']}"}
    assert all(t.fork_cause is None for t in result.trajectories) and result.report.rollouts == 2


@pytest.mark.parametrize("sessions", [("s-a", "s-b"), (None, None), (("s-a", None), "s-b"), ((None, "s-a"), "s-b")])
def test_anonymous_sessions_that_share_their_first_turns_are_told_apart_by_their_session_ids(tmp_path, sessions):
    """Two sessions without rollout ids that send the same first user turn (Codex's environment
    context for one folder), then their own task: the second read as the first compacted - one
    rollout, one reward, fork cause "compaction" (a probe). The harness's session id
    (client_session_id) tells them apart; without one they stay one conversation (documented). A
    session that names itself on only some calls (parts written before the column) stays whole
    (a review: it was split into two rollouts)."""
    a, b = Conversation(rollout_id=None, name="a"), Conversation(rollout_id=None, name="b")
    for conv in (a, b):
        conv.user("<environment_context>cwd: /repo</environment_context>")
    a.user("task A")
    a1 = a.assistant("", tool_calls=[("ls", {"path": "a"})])
    a.tool("A!")
    a2 = a.assistant("A done")
    b.user("task B")
    b1 = b.assistant("", tool_calls=[("ls", {"path": "b"})])
    b.tool("B!")
    b2 = b.assistant("B done")
    a_sessions = sessions[0] if isinstance(sessions[0], tuple) else (sessions[0], sessions[0])
    for row, session in ((a1, a_sessions[0]), (a2, a_sessions[1]), (b1, sessions[1]), (b2, sessions[1])):
        row["client_session_id"] = session
    result = build(tmp_path, [a1, a2, b1, b2])
    rollouts = {t.call_ids[0]: t.rollout_id for t in result.trajectories}
    if sessions[1] is not None:
        assert sorted(len(t.call_ids) for t in result.trajectories) == [2, 2]
        assert rollouts == {a1["call_id"]: f"conv-{a1['call_id']}", b1["call_id"]: f"conv-{b1['call_id']}"}
        assert all(t.fork_cause is None for t in result.trajectories) and result.report.rollouts == 2
    else:
        assert result.report.rollouts == 1 and len(set(rollouts.values())) == 1


def _forked_session_gone_on(conv: Conversation) -> list[dict]:
    """A session whose second call forked (retokenization) and went on: the fork closed the
    trajectory that held its first prompt."""
    rows = _retokenized_session(conv)
    conv.user("and once more")
    rows.append(conv.assistant("Done."))
    return rows


@pytest.mark.parametrize("rollout_id", [None, "r1"])
def test_a_second_session_from_the_first_prompt_is_seen_after_the_first_forked_and_went_on(tmp_path, rollout_id):
    """The first session forked (retokenization) and went on, which closed the trajectory holding
    its first prompt: the second session's first call was classified against the fork and was
    neither a new anonymous rollout (a GRPO group's sessions shared one reward) nor a restart."""
    rows = _forked_session_gone_on(Conversation(rollout_id=rollout_id, name="a"))
    b = Conversation(rollout_id=rollout_id, name="b")
    b.user("greet")
    b1 = b.assistant("Howdy.", request_hash="next-round")  # (the same hash: a retry of the first call)
    assert b1["prompt_token_ids"] == rows[0]["prompt_token_ids"]
    result = build(tmp_path, [*rows, b1])
    by_first = {t.call_ids[0]: t for t in result.trajectories}
    if rollout_id is None:
        assert by_first[b1["call_id"]].rollout_id == f"conv-{b1['call_id']}"
        assert by_first[b1["call_id"]].fork_cause is None and result.report.rollouts == 2
    else:
        assert by_first[b1["call_id"]].fork_cause == "branch"
        assert result.report.restarted_rollouts == ["r1"]
    assert_aligned(by_first[b1["call_id"]], [b1])


@pytest.mark.parametrize("rollout_id", ["r1", None])
def test_an_attempt_gone_on_from_by_text_is_kept_beside_one_gone_on_from_by_ids(tmp_path, rollout_id):
    """Two sessions, the same first request (attempts 1 and 2 of its hash): the first session went
    on from its answer's ids, the second from its answer re-tokenised. Only where no attempt's ids
    went on was text compared, so the second session's first call was dropped as a superseded
    retry; and its next call, tied with the first session's at the first prompt, was taken for a
    compaction of the first session (of its rollout, where calls carry no rollout id)."""
    a, b = Conversation(rollout_id=rollout_id, name="a"), Conversation(rollout_id=rollout_id, name="b")
    a.user("greet")
    b.user("greet")
    a1 = a.assistant("Hi.")
    drifted = _drifted(b.tok, Conversation(rollout_id="x"), "Hel", "lo")
    b1 = b.assistant("Hello there", completion_ids=drifted, request_hash=a1["request_hash"], attempt=2)
    assert b1["prompt_token_ids"] == a1["prompt_token_ids"]
    a.user("again")
    b.user("again")
    rows = [a1, b1, a.assistant("Bye."), b.assistant("Bye!")]
    result = build(tmp_path, rows)
    assert result.report.skipped == {} and result.report.calls_used == 4
    by_first = {t.call_ids[0]: t for t in result.trajectories}
    assert by_first[a1["call_id"]].call_ids == [a1["call_id"], rows[2]["call_id"]]
    (fork,) = [t for t in result.trajectories if rows[3]["call_id"] in t.call_ids]
    assert fork.fork_cause == "retokenization" and result.report.forks.get("compaction") is None
    assert fork.rollout_id == (rollout_id or f"conv-{b1['call_id']}")


def test_a_re_tokenised_reply_forks_from_its_own_session_where_another_agrees_further(tmp_path):
    """Two anonymous sessions, one first prompt; both replies begin with "Hello", sampled as "Hel" +
    "lo". The first session's fork holds the one "Hello" token, so the second session's next prompt
    agrees with that fork one token further than with its own session: it was taken as a
    compaction of the first session's rollout."""
    a, b = Conversation(rollout_id=None, name="a"), Conversation(rollout_id=None, name="b")
    rows = []
    for conv, said in ((a, "Hello there"), (b, "Hello friend")):
        conv.user("greet")
        text = conv.completion_text(conv.assistant_message(said))
        canonical = encode(conv.tok, text)
        drifted = encode(conv.tok, "Hel") + encode(conv.tok, "lo") + canonical[1:]
        assert canonical[0] == encode(conv.tok, "Hello")[0] and conv.tok.decode(drifted) == conv.tok.decode(canonical)
        rows.append(conv.assistant(said, completion_ids=drifted))
    for conv in (a, b):
        conv.user("again")
        rows.append(conv.assistant("Hi."))
    result = build(tmp_path, rows)
    (b2,) = [t for t in result.trajectories if rows[3]["call_id"] in t.call_ids]
    assert b2.fork_cause == "retokenization" and b2.rollout_id == f"conv-{rows[1]['call_id']}"
    assert result.report.forks == {"retokenization": 2} and result.report.rollouts == 2


@pytest.mark.parametrize("cut", ["length", "max_tokens"])  # chat and Responses; Anthropic Messages
def test_interleaved_rollouts_and_truncation(tmp_path, cut):
    r1, r2 = Conversation(rollout_id="r1", name="x"), Conversation(rollout_id="r2", name="y")
    r1.user("same task")
    r2.user("same task")
    a1 = r1.assistant("", tool_calls=[("ls", {"path": "."})])
    b1 = r2.assistant("", tool_calls=[("ls", {"path": "."})])  # identical prompt, other rollout
    r1.tool("x")
    r2.tool("x")
    a2 = r1.assistant("done")
    b2 = r2.assistant("partial answer", include_im_end=False, finish_reason=cut)
    result = build(tmp_path, [a1, b1, b2, a2])
    by_rollout = {t.rollout_id: t for t in result.trajectories}
    assert_aligned(by_rollout["r1"], [a1, a2])
    assert_aligned(by_rollout["r2"], [b1, b2])
    assert by_rollout["r2"].truncated and not by_rollout["r1"].truncated
    assert result.report.truncated_trajectories == 1
    assert "\ntrajectories " in result.report.table() and " (1 end at the length limit)\n" in result.report.table()


def test_missing_logprobs_are_nan_and_counted(tmp_path):
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    row = conv.assistant("ok", token_source="rendered")
    row["completion_logprobs"] = None
    (t,) = build(tmp_path, [row]).trajectories
    ids, mask, lps = t.completion_arrays()
    assert mask.tolist() == [1] * len(ids) and np.isnan(lps).all()
    assert t.token_source == "rendered"
    report = build(tmp_path / "again", [row]).report
    assert report.sampled_without_logprob == len(ids) and report.calls_without_logprobs == 1


def test_compact_storage_builds_the_same_trajectory_without_comparing(tmp_path):
    conv = Conversation(rollout_id="r1")
    rows = tool_session(conv, 3)
    conv.user("one more")  # drops reasoning: row 5 refers to a shorter prefix of row 4
    rows.append(conv.assistant("ok"))
    full = build(tmp_path / "full", rows)
    packed = build(tmp_path / "compact", compact(rows))
    assert [t.call_ids for t in packed.trajectories] == [t.call_ids for t in full.trajectories]
    assert [t.fork_cause for t in packed.trajectories] == [None, "history_rewrite"]
    for a, b in zip(full.trajectories, packed.trajectories):
        assert a.prompt.tolist() == b.prompt.tolist()
        for x, y in zip(a.completion_arrays(), b.completion_arrays()):
            np.testing.assert_array_equal(x, y)
    assert_aligned(packed.trajectories[0], rows[:4])
    assert packed.report.compact_fast_path == 3 and full.report.compact_fast_path == 0


def test_compact_references_to_unstitched_or_unknown_calls(tmp_path):
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    first = conv.assistant("", tool_calls=[("ls", {"path": "."})])
    cut = make_row(call_id="r1-cut", prompt_ids=first["prompt_token_ids"],
                   completion_ids=first["completion_token_ids"], status="client_disconnected",
                   request_hash="other")
    conv.tool("x")
    second = conv.assistant("done")
    rows = compact([cut, second])  # second refers to the disconnected call, never stitched
    orphan = dict(compact([first, second])[1], call_id="r1-orphan", prompt_prefix_call_id="gone",
                  request_hash="orphan")
    result = build(tmp_path, [first, *rows, orphan])
    (t,) = result.trajectories
    assert_aligned(t, [first, second])
    assert result.report.skipped == {"status_client_disconnected": 1, "unresolved_prompt": 1}
    assert "call r1-orphan: prompt prefix refers to unknown call gone" in result.report.problems


def test_duplicate_call_ids_are_used_once(tmp_path):
    conv = Conversation(rollout_id="r1")
    conv.user("go")
    row = conv.assistant("ok")
    write_parts(tmp_path, [row], "part-a")
    write_parts(tmp_path, [row], "part-a-copy")
    result = build_trajectories(tmp_path)
    (t,) = result.trajectories
    assert t.call_ids == [row["call_id"]] and result.report.skipped == {"duplicate_call_id": 1}


def test_a_call_log_part_in_out_is_never_deleted(tmp_path):
    from polar_train.trajectories.writer import write_trajectories

    conv = Conversation(rollout_id="r1")
    conv.user("go")
    row = conv.assistant("ok")
    calls_part = write_parts(tmp_path / "cap", [row], "part-00009")
    result = build_trajectories(tmp_path / "cap")
    (tmp_path / "out").mkdir()
    calls_part = calls_part.rename(tmp_path / "out" / calls_part.name)  # a call-log part in --out
    with pytest.raises(FileExistsError, match="holds a capture's call log"):  # (written beside it, it read as
        write_trajectories(result.trajectories, tmp_path / "out")  # a foreign part in the capture ever after)
    assert calls_part.exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["part-00009.parquet"]


def test_calls_without_a_rollout_are_no_retries_of_each_other(tmp_path):
    """A GRPO group's sessions all send the same first prompt: without rollout ids (an id the
    capture refused) they were taken for retries of one request, and all but one dropped."""
    rows = []
    for g in range(3):
        conv = Conversation(rollout_id=None, name=f"s{g}")
        conv.user("same task")
        rows.append(conv.assistant(f"answer {g}"))
    assert len({r["request_hash"] for r in rows}) == 1
    result = build(tmp_path, rows)
    assert result.report.skipped == {} and result.report.calls_used == 3
    assert len(result.trajectories) == 3


def test_the_fallback_resolver_reads_one_rollout_and_the_whole_log_only_when_needed(monkeypatch):
    """The stitcher asks the fallback for prompts whose reference it did not see (a superseded
    retry's row). It used to expand every prompt of the capture for the first such call; it now
    resolves that call's rollout, and the whole log only for a reference out of the rollout."""
    from polar_train.calllog import resolve_prompt_prefixes as real_resolve
    from polar_train.trajectories import build as build_module
    from tests.support.calls import calls_table, compact, make_row

    a = [make_row(call_id=f"a{k}", rollout_id="A", prompt_ids=list(range(50 + 3 * k)), completion_ids=[7, 8, 9])
         for k in range(4)]
    for k, row in enumerate(a):  # each prompt extends the previous call's prompt + completion
        row["prompt_token_ids"] = list(range(50)) + [7, 8, 9] * k
    b = [make_row(call_id=f"b{k}", rollout_id="B", prompt_ids=[900 + k] * 20, completion_ids=[1]) for k in range(3)]
    rows = compact(a) + [dict(r) for r in b]
    cross = make_row(call_id="x", rollout_id="B", prompt_ids=[5, 5], completion_ids=[1])
    cross.update(prompt_prefix_call_id="a1", prompt_prefix_len=53)  # refers into rollout A
    rows.append(cross)
    sizes = []

    def resolve(table):
        sizes.append(table.num_rows)
        return real_resolve(table)

    monkeypatch.setattr(build_module, "resolve_prompt_prefixes", resolve)
    full_prompt = build_module._fallback_resolver(calls_table(rows))
    assert list(full_prompt("a3")) == a[3]["prompt_token_ids"] and sizes == [4]  # rollout A only
    assert list(full_prompt("a2")) == a[2]["prompt_token_ids"] and sizes == [4]  # already resolved
    assert list(full_prompt("x")) == list(range(50)) + [7, 8, 9] + [5, 5]
    assert sizes == [4, 4, 8]  # rollout B could not resolve it: the whole log, once
    assert "unknown call" in full_prompt("nope") or "unresolved" in full_prompt("nope")


def test_a_summary_put_before_the_kept_task_is_compaction(tmp_path):
    """Pi compacts as [system, user(<summary>), user(task), ...]: the divergence lies inside the
    first user turn, which read as a new conversation. The task's turn, kept whole behind the
    summary, says compaction."""
    conv = Conversation(rollout_id="r1")
    rows = tool_session(conv, 3)
    task = conv.messages[1]
    conv.messages = [conv.messages[0], {"role": "user", "content": "<summary>ran ls 3 times</summary>"}, task]
    rows.append(conv.assistant("Continuing."))
    result = build(tmp_path, rows)
    assert [t.fork_cause for t in result.trajectories] == [None, "compaction"]
    assert_aligned(result.trajectories[1], rows[-1:])


def _listing_session(conv: Conversation, turns: int = 3) -> list[dict]:
    """The task, then ``turns`` tool calls each answered by a long listing (pieces long enough to
    be looked for in a later prompt)."""
    conv.user("fix the failing test")
    rows = []
    for k in range(turns):
        rows.append(conv.assistant(f"step {k}", tool_calls=[("ls", {"path": f"dir{k}"})]))
        conv.tool(f"file{k}.py\n" + "\n".join(f"line {k}.{j} of a long listing" for j in range(8)))
    return rows


def test_a_summary_that_replaced_the_task_but_kept_recent_turns_is_compaction(tmp_path):
    """Pi 0.73 after a context-limit error: [system, user(<summary>), the last assistant and tool
    turns]. The task's turn is gone, so it read as a new conversation (the label side requests
    get); the recent turns it kept say compaction. A sub-agent with the same system and tools and
    nothing of the parent's turns stays a new conversation."""
    conv = Conversation(rollout_id="r1")
    rows = _listing_session(conv)
    kept = conv.messages[-2:]  # the last assistant turn and its tool result
    conv.messages = [conv.messages[0], {"role": "user", "content": "<summary>listed dir0 and dir1</summary>"}, *kept]
    rows.append(conv.assistant("Continuing."))
    sub = Conversation(rollout_id="r1", name="sub")  # the same system prompt and tools, its own task
    sub.user("list the tests")
    rows.append(sub.assistant("", tool_calls=[("ls", {"path": "tests"})]))
    result = build(tmp_path, rows)
    causes = {t.call_ids[0]: t.fork_cause for t in result.trajectories}
    assert causes == {rows[0]["call_id"]: None, rows[3]["call_id"]: "compaction", rows[4]["call_id"]: "new_conversation"}
    assert_aligned(result.trajectories[1], rows[3:4])


def _claude_code_compaction(final_reply: str | None = None):
    """Claude Code compacting: the summary call sends the same system and tools with the history
    but its last turn and a summary request; after it the summary replaces the task and the last
    turn is kept verbatim (a tool call with its result, or the final reply)."""
    import copy

    conv = Conversation(rollout_id="r1")
    conv.user("Print the numbers one to two hundred in two steps.")
    rows = [conv.assistant("", tool_calls=[("ls", {"path": "part one of the numbers"})])]
    conv.tool(" ".join(str(i) for i in range(1, 101)))
    rows.append(conv.assistant("", tool_calls=[("ls", {"path": "part two of the numbers"})]))
    conv.tool(" ".join(str(i) for i in range(101, 201)))
    if final_reply is not None:
        rows.append(conv.assistant(final_reply))
    kept = conv.messages[-1:] if final_reply is not None else conv.messages[-2:]
    summary = Conversation(rollout_id="r1", name="summary")
    summary.messages = copy.deepcopy(conv.messages[:-1] if final_reply is not None else conv.messages[:-2])
    summary.user("Your task is to create a detailed summary of the conversation so far.")
    rows.append(summary.assistant("<summary>The user wants numbers printed; part one is done.</summary>"))
    post = Conversation(rollout_id="r1", name="post")
    post.messages = [conv.messages[0], {"role": "user", "content": "This session is being continued. Summary: numbers."},
                     *kept]
    return rows, post


def test_claude_codes_summary_call_does_not_hide_its_compaction(tmp_path):
    """The summary call forks from the conversation as a rewrite of its history, and that closed
    the conversation: the compacted prompt, compared with the summary call alone, read as a new
    conversation, and with more calls than the task's own it took the main label from it."""
    rows, post = _claude_code_compaction()
    main_calls = len(rows) - 1
    post.user("go on")
    for k in range(main_calls + 1):  # more calls after the compaction than before it
        rows.append(post.assistant("", tool_calls=[("ls", {"path": f"after {k}"})]))
        post.tool(f"listing {k}")
    result = build(tmp_path, rows)
    causes = [(t.fork_cause, len(t.call_ids)) for t in result.trajectories]
    assert causes == [(None, main_calls), ("compaction", 1), ("compaction", main_calls + 1)]
    assert_aligned(result.trajectories[2], rows[main_calls + 1:])


def test_a_short_kept_reply_says_compaction(tmp_path):
    """Claude Code keeps the last turn however short: a 12-token final reply was below the 16
    tokens a kept piece needed, and the compaction read as a new conversation."""
    rows, post = _claude_code_compaction(final_reply="All three commands ran: alpha, beta, gamma.")
    assert 8 <= len(rows[2]["completion_token_ids"]) < 16
    post.user("Run them again please.")
    rows.append(post.assistant("Done again."))
    result = build(tmp_path, rows)
    main, _summary, after = result.trajectories  # the summary call's own label depends on lengths
    assert (main.fork_cause, after.fork_cause) == (None, "compaction")


def test_a_side_request_that_rewrites_the_history_leaves_the_conversation_open(tmp_path):
    """A side request sending the history without its last turn (a rewrite of it) closed the
    conversation it left: the harness's next call, going on from the whole history, forked
    again instead of extending it."""
    rows, _post = _claude_code_compaction()
    main = Conversation(rollout_id="r1")  # the same conversation as the rows', going on
    main.user("Print the numbers one to two hundred in two steps.")
    main.assistant("", tool_calls=[("ls", {"path": "part one of the numbers"})])
    main.tool(" ".join(str(i) for i in range(1, 101)))
    main.assistant("", tool_calls=[("ls", {"path": "part two of the numbers"})])
    main.tool(" ".join(str(i) for i in range(101, 201)))
    rows.append(main.assistant("All two hundred printed."))  # the main conversation goes on
    result = build(tmp_path, rows)
    assert [(t.fork_cause, len(t.call_ids)) for t in result.trajectories] == [(None, 3), ("compaction", 1)]
    assert_aligned(result.trajectories[0], rows[:2] + rows[3:])


def test_a_conversation_that_goes_on_beside_a_rewrite_of_it_stays_open(tmp_path):
    """A side agent sends the history without its last turn (a rewrite) and goes on beside the
    main conversation: its going on closed the main one, whose next call forked as a compaction."""
    import copy

    main = Conversation(rollout_id="r1")
    main.user("Print the numbers one to two hundred in two steps.")
    rows = [main.assistant("", tool_calls=[("ls", {"path": "part one of the numbers"})])]
    main.tool(" ".join(str(i) for i in range(1, 101)))
    rows.append(main.assistant("", tool_calls=[("ls", {"path": "part two of the numbers"})]))
    side = Conversation(rollout_id="r1", name="side")
    side.messages = copy.deepcopy(main.messages[:-1])
    side.user("Review what was done so far, in detail, and list every step taken.")
    rows.append(side.assistant("", tool_calls=[("ls", {"path": "review notes"})]))
    main.tool(" ".join(str(i) for i in range(101, 201)))
    rows.append(main.assistant("", tool_calls=[("ls", {"path": "part three of the numbers"})]))  # main goes on
    side.tool("notes: none yet")
    rows.append(side.assistant("The review is done: two steps, both listings."))  # the side agent goes on
    main.tool("done")
    rows.append(main.assistant("All numbers printed."))
    result = build(tmp_path, rows)
    by_cause = {t.fork_cause: t.call_ids for t in result.trajectories}
    assert by_cause[None] == [rows[0]["call_id"], rows[1]["call_id"], rows[3]["call_id"], rows[5]["call_id"]]
    assert len(result.trajectories) == 2


def test_chained_rewrites_keep_one_conversation_open(tmp_path, monkeypatch):
    """Each call drops the reasoning of the one before (a history rewrite per turn): a rewrite
    gone on from closes the conversation it left, so the open ones do not pile up to the cap."""
    from polar_train.trajectories import stitch

    monkeypatch.setattr(stitch, "MAX_OPEN_PER_ROLLOUT", 3)
    conv = Conversation(rollout_id="r1")
    rows = []
    for k in range(8):
        conv.user(f"question {k}")
        rows.append(conv.assistant(f"answer {k}", reasoning=f"thinking about {k}"))
    result = build(tmp_path, rows)
    assert [t.fork_cause for t in result.trajectories] == [None] + ["history_rewrite"] * 7
    assert result.report.closed_at_cap == 0


def test_a_summary_after_the_task_longer_than_what_it_replaced_is_compaction(tmp_path):
    """Codex compacts as [system, the task's own user turn, user(summary)]: the turns after the
    task are gone. With a summary longer than those turns the prompt did not shrink, and the fork
    read as a history rewrite."""
    conv = Conversation(rollout_id="r1")
    rows = _listing_session(conv)
    summary = "Another model worked on this. " + " ".join(f"Point {i}: dir{i % 3} was listed." for i in range(120))
    conv.messages = [conv.messages[0], conv.messages[1], {"role": "user", "content": summary}]
    rows.append(conv.assistant("Continuing."))
    before = rows[-2]
    assert len(rows[-1]["prompt_token_ids"]) > len(before["prompt_token_ids"]) + len(before["completion_token_ids"])
    result = build(tmp_path, rows)
    assert [t.fork_cause for t in result.trajectories] == [None, "compaction"]


def test_a_rewrite_that_keeps_the_later_turns_stays_a_history_rewrite(tmp_path):
    """An argument re-serialised in an early reply (Claude Code adds a default) or the last user
    message edited: the turns after it are kept, or there is only one to miss."""
    conv = Conversation(rollout_id="r1")
    rows = _listing_session(conv)
    conv.messages[2]["tool_calls"][0]["function"]["arguments"] = json.dumps({"path": "dir0", "all": False})
    conv.user("and the docs too, with every detail of the listings")
    rows.append(conv.assistant("Docs done."))
    edited = Conversation(rollout_id="r2")
    edited.user("fix the failing test")
    rows.append(edited.assistant("Which one? There are three failing tests in the suite."))
    edited.user("the first")
    rows.append(edited.assistant("Fixed the first failing test, in test_calc.py, by correcting add()."))
    assert len(rows[-1]["completion_token_ids"]) >= 8  # a reply long enough to be looked for
    edited.messages[-1] = {"role": "user", "content": "the first one, in test_calc.py, and nothing else at all"}
    rows.append(edited.assistant("Fixed it."))
    result = build(tmp_path, rows)
    causes = {(t.rollout_id, t.fork_cause) for t in result.trajectories}
    assert causes == {("r1", None), ("r1", "history_rewrite"), ("r2", None), ("r2", "history_rewrite")}


def test_a_side_request_sent_first_does_not_take_the_main_conversations_place(tmp_path):
    """Claude Code's title call may reach the proxy just before the agent's first call: the title
    became the rollout's main trajectory (fork_cause null) and the agent's episode the "new
    conversation". The conversation with more calls is the main one."""
    title = Conversation(rollout_id="r1", name="title", system="Write a title.", tools=[])
    title.user("fix add in calc.py")
    main = Conversation(rollout_id="r1", name="main")
    rows = [title.assistant("Fix add")] + tool_session(main, 2)
    result = build(tmp_path, rows)
    causes = {t.call_ids[0]: t.fork_cause for t in result.trajectories}
    assert causes == {rows[0]["call_id"]: "new_conversation", rows[1]["call_id"]: None}
    assert [t.trajectory_id for t in result.trajectories] == ["r1#0", "r1#1"]  # still in time order
    assert result.report.forks == {"new_conversation": 1}


def test_a_side_request_with_the_same_user_text_is_no_compaction(tmp_path):
    """The title call carries the user's own words: the agent's longer system and tools moved the
    same user turn along, which the compaction rule took for a summary put before it."""
    title = Conversation(rollout_id="r1", name="title", system="Write a title.", tools=[])
    main = Conversation(rollout_id="r1", name="main")
    title.user("fix the failing test")  # what tool_session's user says
    rows = [title.assistant("Fix test")] + tool_session(main, 2)
    result = build(tmp_path, rows)
    causes = {t.call_ids[0]: t.fork_cause for t in result.trajectories}
    assert causes == {rows[0]["call_id"]: "new_conversation", rows[1]["call_id"]: None}


def test_a_new_tool_list_is_no_compaction(tmp_path):
    """A changed system prompt or tool list differs where a sub-agent differs from its parent (before
    the first user turn): a new conversation, never the compaction the moved user turn suggested."""
    conv = Conversation(rollout_id="r1")
    rows = tool_session(conv, 1)
    conv.tools = conv.tools + [{"type": "function", "function": {"name": "cat", "parameters": {"type": "object"}}}]
    conv.user("and now?")
    rows.append(conv.assistant("Done."))
    result = build(tmp_path, rows)
    assert [t.fork_cause for t in result.trajectories] == [None, "new_conversation"]


@pytest.mark.parametrize("rollout", [None, "many"])
def test_many_live_conversations_in_one_pool_still_merge(tmp_path, rollout, monkeypatch):
    """Calls arriving in turn from more live conversations than the builder followed (32 in one
    rollout, 128 anonymous) closed each other's trajectories: nothing merged (a probe sent 140
    anonymous two-call sessions and got 280 one-call rollouts). Over the cap, it is reported."""
    from polar_train.trajectories import stitch

    n = 140 if rollout is None else 40  # above the old caps (128 anonymous, 32 in a rollout)
    convs = [Conversation(rollout_id=rollout, system=f"You are agent {i}.", name=f"s{i}") for i in range(n)]
    rows = []
    for i, conv in enumerate(convs):
        conv.user(f"task {i}")
        rows.append(conv.assistant("", tool_calls=[("ls", {"path": str(i)})]))
    for i, conv in enumerate(convs):  # the second calls in the same order: each pool full of the others
        conv.tool(f"file{i}.txt")
        rows.append(conv.assistant(f"done {i}"))
    result = build(tmp_path / "under", rows)
    assert len(result.trajectories) == n and result.report.merge_ratio == 2.0
    assert result.report.closed_at_cap == 0
    monkeypatch.setattr(stitch, "MAX_OPEN_PER_ROLLOUT", n // 2)
    monkeypatch.setattr(stitch, "MAX_OPEN_ANONYMOUS", n // 2)
    result = build(tmp_path / "over", rows)
    assert result.report.closed_at_cap > 0 and len(result.trajectories) > n
    assert "closed at the cap" in result.report.table()


def test_rendered_calls_the_server_counted_otherwise_are_counted_in_the_report(tmp_path):
    """Claude Code's rows are rendered (no server ids); one whose token count the server reported
    otherwise trained ids that are not what was sampled, and only inspect said so."""
    conv = Conversation(rollout_id="r1")
    rows = tool_session(conv, 2, token_source="rendered")
    rows[1]["usage_match"] = False
    rows[2]["usage_match"], rows[2]["token_source"] = False, "server"  # server ids are exact (n > 1 counts all)
    result = build(tmp_path, rows)
    assert result.report.usage_mismatch_calls == 1
    assert "1 calls whose rendered ids the server counted otherwise" in result.report.table()
    assert result.report.to_json()["usage_mismatch_calls"] == 1


@pytest.mark.parametrize("reply, cut", [("Fine \U0001F9EA", 3), ("\U0001F9EA", 1), ("\U0001F9EA", 2)],
                         ids=["after-text", "whole-reply-1", "whole-reply-2"])
@pytest.mark.parametrize("realign", [False, True])
def test_a_reply_cut_inside_a_character_goes_on_as_its_text_did(tmp_path, realign, reply, cut):
    """A reply cut by max_tokens inside a character (an emoji's first bytes): the server's text
    leaves those ids out - with the space their first id carries - as vLLM's detokenizer does, and
    the client sends back the text it got. The next prompt lacks ids the model sampled but no
    earlier turn changed: it forked as a ``history_rewrite``, and ``--realign`` could not continue."""
    from polar_train.server.detokenizer import Detokenizer

    conv = Conversation(rollout_id="r1")
    tok = conv.tok
    conv.user("greet with an emoji")
    sampled = encode(tok, reply)[:cut]  # "Fine", " \xf0\x9f", "\xa7", "\xaa"; the emoji: 3 ids alone
    said = Detokenizer(tok, skip_special_tokens=True).feed(sampled)
    assert said == reply.split(" ")[0].replace("\U0001F9EA", "")  # what the server returned for the cut reply
    first = conv.assistant(said, completion_ids=sampled, finish_reason="length")
    conv.user("again")
    second = conv.assistant("Oui.")
    _assert_continued_as_retokenization(tmp_path, [first, second], realign)


def test_withheld_at_end_counts_the_ids_after_the_last_whole_character():
    from polar_train.trajectories.tokenbytes import default_token_bytes, withheld_at_end

    tok, tb = chat_tokenizer(), default_token_bytes()
    whole = encode(tok, "Fine \U0001F9EA")
    assert [withheld_at_end(tb, whole[:n]) for n in range(1, len(whole) + 1)] == [0, 1, 2, 0]
    emoji = encode(tok, "\U0001F9EA")
    assert [withheld_at_end(tb, emoji[:n]) for n in range(1, len(emoji) + 1)] == [1, 2, 0]  # the whole reply
    assert withheld_at_end(tb, encode(tok, "ok") + [IM_END_ID]) == 0 and withheld_at_end(tb, []) == 0
    assert withheld_at_end(tb, encode(tok, "\U0001F9EA")[:1] + [10 ** 9]) == 0  # an id that names no token


def test_calls_without_a_temperature_or_with_top_p_below_one_are_noted(tmp_path):
    """A chat call without temperature or top_p: vLLM then samples with the model's
    generation_config.json (Qwen3's: 0.6, top_k 20, top_p 0.95) and the trainer, told nothing,
    took raw logprobs at 1; top_p < 1 was recorded in the calls and never said."""
    rows = tool_session(Conversation(rollout_id="r1"), 2, temperature=None)
    rows[1]["top_p"] = 0.5
    notes = build(tmp_path / "a", rows).report.notes
    assert notes == [
        "3 of 3 calls left temperature or top_p to the server: vLLM then samples with the model's "
        "generation_config.json (Qwen3's: temperature 0.6, top_k 20, top_p 0.95) unless started with "
        "--generation-config vllm, which train cannot see (docs/train.md, Which server settings give correct ratios)",
        "1 of 3 calls were sampled with top_p < 1: the trainer cannot reproduce the truncated distribution their "
        "tokens came from (recorded logprobs are of the whole one), so the GRPO ratio and importance weights are "
        "biased (capture with top_p 1)"]
    assert build(tmp_path / "b", tool_session(Conversation(rollout_id="r1"), 2)).report.notes == []


def test_a_sessions_fork_never_joins_another_sessions_rollout():
    """Two anonymous sessions naming themselves, the same first prompt and reply (a deterministic
    first tool call); C's next call not yet there. B's fork (its tool result re-rendered) extended
    C's trajectory through the search across pools, and B's rest trained under C's reward (a
    review): a call that names its session goes on only from calls that name none."""
    from polar_train.trajectories.stitch import Call, Stitcher

    end = 151645
    first = np.array([151644, 10, 11, 12, 13, end, 151644, 20, 21, 22, end, 151644, 30])
    reply = np.array([40, 41, 42, end])

    def call(cid: str, session: str, prompt: np.ndarray) -> Call:
        completion = np.array([60, 61, end])
        return Call(call_id=cid, rollout_id=None, task_id="t", model="m", temperature=1.0, token_source="server",
                    finish_reason="stop", prompt=prompt.astype(np.int32), completion=completion.astype(np.int32),
                    logprobs=np.zeros(3, np.float32), session_id=session)

    s = Stitcher()
    s.add(dataclasses.replace(call("b1", "s-b", first), completion=reply.astype(np.int32),
                              logprobs=np.zeros(4, np.float32)))
    s.add(dataclasses.replace(call("c1", "s-c", first), completion=reply.astype(np.int32),
                              logprobs=np.zeros(4, np.float32)))
    s.add(call("b2", "s-b", np.concatenate([first, reply, [151644, 50, 51, end, 151644, 30]])))
    s.add(call("b3", "s-b", np.concatenate([first, reply, [151644, 50, 52, end, 151644, 30]])))  # B's fork
    rollout = {cid: t.rollout_id for t in s.trajectories for cid in t.call_ids}
    assert rollout["b3"] == rollout["b2"] == rollout["b1"] == "conv-b1" and rollout["c1"] == "conv-c1"
