"""The three real harnesses, unmodified, through the real mitmdump + our addon, against the scripted server.

Each harness solves data/repos/calc in five scripted turns (data/scenarios/fix-add.yaml): read two
files at once (with reasoning), run the failing test (~15 KB of output), edit (with reasoning), run
the test again, answer. What is checked, per harness:

* the session exits 0 and really ran its tools: the repo's own test passes afterwards;
* every model call is exactly one row under the session's rollout id, in turn order, ``status=ok``
  (the count is checked against an independent witness addon in the same mitmdump);
* the prompt of call k+1 starts with prompt + completion of call k, token for token, except where a
  harness rewrites history — stated per harness in ``HISTORY_REWRITES`` and located precisely;
* the harness's final answer and its change to the repo are the same with and without the proxy;
* two concurrent sessions through one proxy land on two rollouts with no row mixed up.
"""

from __future__ import annotations

import json
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from polar_train.harnesses import HarnessRun, ModelServer, Proxy, get_harness
from tests.support.harness import (FINAL_ANSWER, SCENARIOS, TASK_PROMPT, call_rows, capture_proxy,
                                   first_divergence, make_task_repo, repo_diff, repo_test_passes,
                                   require_harnesses)
from tests.support.procs import polar_server
from tests.support.tls_front import tls_front

pytestmark = pytest.mark.timeout(600)

HARNESS_NAMES = ("codex", "claude-code", "pi")
#: Single-session variants: each harness as configured by default, plus Codex with its freeform
#: apply_patch tool (a model-catalog entry; the scenario then edits with a patch).
VARIANTS: dict[str, tuple[str, dict]] = {"codex": ("codex", {}), "codex-apply-patch": ("codex", {"freeform_apply_patch": True}),
                                         "claude-code": ("claude-code", {}), "pi": ("pi", {})}
API = {"codex": "openai.responses", "codex-apply-patch": "openai.responses", "claude-code": "anthropic.messages",
       "pi": "openai.chat"}
SCRIPTED_TURNS = 5
#: Variants whose proxy stores prompts and request texts compactly (``polar_prompt_delta``): every
#: check below then reads them back through the resolver - Codex's instructions + tools + history,
#: and Claude Code's cache marker that moves to the newest message each turn.
COMPACT = {"codex-apply-patch", "claude-code"}
REASONING = ("The test fails, so add() is probably wrong. I will read the code and the test first.",
             "add() returns a - b but must return a + b.")

#: Where the prompt of call k+1 does NOT start with prompt(k) + completion(k), and why: turn k's
#: tool-call text as the harness sends it back differs from what the model generated.
#: * Claude Code re-serialises every tool_use ``input`` and adds the Edit tool's default:
#:   ``{"file_path": …}`` comes back as ``{"replace_all": false, "file_path": …}`` (turn 2).
#: * Codex sends ``arguments`` and reasoning items back byte for byte; Pi sends ``arguments`` back
#:   through ``JSON.stringify`` (compact) and ``reasoning_content`` as received — both
#:   prefix-stable as long as the server's arguments text is what the template renders.
HISTORY_REWRITES: dict[str, dict[int, str]] = {
    "codex": {},
    "codex-apply-patch": {},
    "claude-code": {2: '"replace_all": false'},
    "pi": {},
}


@dataclass
class Session:
    harness: str  # the variant (a key of VARIANTS)
    rollout_id: str
    run: HarnessRun
    repo: Path
    rows: list[dict]
    witnessed: list[dict]
    captures: Path | None = None


@pytest.fixture(scope="module")
def scripted_server(tiny_model_dir: Path, logs_dir: Path):
    with polar_server(tiny_model_dir, logs_dir, extra=["--script", str(SCENARIOS), "--served-model-name", "tiny",
                                                              "--max-model-len", "65536"]) as base:
        yield base


#: A distinctive key: no file the session leaves behind may contain it (the server ignores it).
API_KEY = f"polar-test-key-{uuid.uuid4().hex}"


def run_session(variant: str, server: str, work: Path, proxy: Proxy | None) -> tuple[HarnessRun, Path]:
    repo = make_task_repo(work / "repo")
    name, options = VARIANTS[variant]
    run = get_harness(name, **options).run(repo, TASK_PROMPT, ModelServer(server, model="tiny", api_key=API_KEY),
                                           proxy, home=work / "home", timeout=240)
    return run, repo


@pytest.fixture(scope="module", params=list(VARIANTS))
def proxied(request, scripted_server: str, tiny_model_dir: Path, tmp_path_factory) -> Session:
    """One session of the harness through mitmdump + addon (its own proxy: all rows are its own)."""
    name = request.param
    require_harnesses(VARIANTS[name][0])
    work = tmp_path_factory.mktemp(f"{name}-proxied")
    rollout = f"{name}-{uuid.uuid4().hex[:8]}"
    options = {"polar_prompt_delta": "true"} if name in COMPACT else None
    with capture_proxy(work, tiny_model_dir, options=options) as px:
        run, repo = run_session(name, scripted_server, work, Proxy(px.port, rollout, px.ca_cert))
    return Session(name, rollout, run, repo, call_rows(px.out), px.witnessed_model_flows(), captures=px.out)


def assistant_turns(api: str, request: dict) -> int:
    """Assistant turns in a request (a run of assistant-side items counts once)."""
    if api == "openai.responses":
        items = request.get("input") or []
        flags = [it.get("type") in ("reasoning", "function_call", "custom_tool_call")
                 or (it.get("type", "message") == "message" and it.get("role") == "assistant") for it in items]
    else:
        flags = [m.get("role") == "assistant" for m in request.get("messages") or []]
    return sum(1 for i, f in enumerate(flags) if f and (i == 0 or not flags[i - 1]))


def test_session_exits_0_and_really_runs_its_tools(proxied: Session) -> None:
    assert proxied.run.ok, proxied.run.describe()
    assert proxied.run.final_message == FINAL_ANSWER
    passed, output = repo_test_passes(proxied.repo)
    assert passed, f"the repo's test still fails after the {proxied.harness} session:\n{output[-2000:]}"
    assert "+    return a + b" in repo_diff(proxied.repo)


#: The tool calls each session makes, as the harness itself sends them back: (item/block type, name).
TOOLS_USED = {
    "codex": {("function_call", "exec_command")},
    "codex-apply-patch": {("function_call", "exec_command"), ("custom_tool_call", "apply_patch")},
    "claude-code": {("tool_use", "Read"), ("tool_use", "Bash"), ("tool_use", "Edit")},
    "pi": {("function", "read"), ("function", "bash"), ("function", "edit")},
}


def tool_calls_in_history(api: str, request: dict) -> set[tuple[str, str]]:
    """(type, name) of every tool call in the conversation history of a request."""
    if api == "openai.responses":
        return {(it["type"], it["name"]) for it in request.get("input") or []
                if it.get("type") in ("function_call", "custom_tool_call")}
    found = set()
    for m in request.get("messages") or []:
        if m.get("role") != "assistant":
            continue
        if api == "anthropic.messages":
            found |= {(b["type"], b["name"]) for b in m.get("content") or [] if isinstance(b, dict)
                      and b.get("type") == "tool_use"}
        else:
            found |= {(c["type"], c["function"]["name"]) for c in m.get("tool_calls") or []}
    return found


def test_the_harness_used_its_own_tools(proxied: Session) -> None:
    assert proxied.rows, "no rows"
    last = proxied.rows[-1]
    assert tool_calls_in_history(last["api"], json.loads(last["request_json"])) == TOOLS_USED[proxied.harness]


def test_no_file_holds_the_api_key_or_the_proxy_credentials(proxied: Session) -> None:
    """Config, session state and the repo after a run: the key and the proxy URL live only in env."""
    secrets = (API_KEY, f"{proxied.rollout_id}:x@")
    for root in (proxied.run.home, proxied.repo):
        for path in (p for p in root.rglob("*") if p.is_file()):
            data = path.read_bytes()
            assert not any(s.encode() in data for s in secrets), path


def test_every_model_call_is_one_ok_row_in_order(proxied: Session) -> None:
    rows = proxied.rows
    assert len(proxied.witnessed) == SCRIPTED_TURNS, proxied.witnessed
    assert len(rows) == len(proxied.witnessed), [(r["path"], r["status"]) for r in rows]
    assert {r["rollout_id"] for r in rows} == {proxied.rollout_id}
    assert {r["rollout_source"] for r in rows} == {"proxy_auth"}
    assert [r["status"] for r in rows] == ["ok"] * len(rows), [r["error"] for r in rows]
    assert {r["api"] for r in rows} == {API[proxied.harness]}
    assert len({r["call_id"] for r in rows}) == len(rows)
    # In order: the k-th row (by start time) is the request that already holds k assistant turns.
    turns = [assistant_turns(r["api"], json.loads(r["request_json"])) for r in rows]
    assert turns == list(range(SCRIPTED_TURNS))
    for r in rows:
        assert r["prompt_token_ids"] and r["completion_token_ids"], r["call_id"]
        # Logprobs are optional per API (the Anthropic wire has none); where present, one per token.
        assert r["completion_logprobs"] is None or len(r["completion_logprobs"]) in (0, len(r["completion_token_ids"]))


def test_rows_name_the_harness_session(proxied: Session) -> None:
    """Codex and Claude Code name their session in a header on every call (what tells a rollout id
    reused for a second session from a sub-agent in `build`); Pi names none."""
    sessions = {r["client_session_id"] for r in proxied.rows}
    if proxied.harness == "pi":
        assert sessions == {None}
    else:
        assert len(sessions) == 1 and None not in sessions, sessions


def test_rows_count_the_tool_calls(proxied: Session) -> None:
    assert [r["tool_call_count"] for r in proxied.rows] == [2, 1, 1, 1, 0]


def test_prompt_of_next_call_extends_prompt_and_completion(proxied: Session, tiny_tokenizer) -> None:
    """The evidence the trajectory builder relies on, with each exception located and explained."""
    rows = proxied.rows
    assert len(rows) == SCRIPTED_TURNS
    missing = [k for k, r in enumerate(rows) if not r["prompt_token_ids"] or not r["completion_token_ids"]]
    assert not missing, f"calls without token ids: {missing} ({[rows[k]['status'] for k in missing]})"
    diverged: dict[int, str] = {}
    for k in range(len(rows) - 1):
        before = list(rows[k]["prompt_token_ids"]) + list(rows[k]["completion_token_ids"])
        after = list(rows[k + 1]["prompt_token_ids"])
        at = first_divergence(before, after)
        if at is None:
            continue
        # A rewrite must lie inside call k's completion (the earlier prompt is never rewritten) ...
        prompt_len = len(rows[k]["prompt_token_ids"])
        assert at >= prompt_len, (f"{proxied.harness}: call {k + 1} rewrote the prompt of call {k} at token "
                                  f"{at}: {tiny_tokenizer.decode(after[max(0, at - 20):at + 20])!r}")
        # ... and is shown from a few tokens before the first differing one.
        diverged[k] = tiny_tokenizer.decode(after[at - 3:at + 40])
    expected = HISTORY_REWRITES[proxied.harness]
    assert set(diverged) == set(expected), {k: v for k, v in diverged.items()}
    for k, marker in expected.items():
        assert marker in diverged[k], (k, diverged[k])
    # Reasoning is not dropped: every scripted turn comes after the last user message, so the
    # template keeps both reasoning blocks in the last prompt (all three harnesses send them back).
    last_prompt = tiny_tokenizer.decode(rows[-1]["prompt_token_ids"])
    for reasoning in REASONING:
        assert f"<think>\n{reasoning}\n</think>" in last_prompt, reasoning


def test_output_is_the_same_without_the_proxy(proxied: Session, scripted_server: str, tmp_path: Path) -> None:
    run, repo = run_session(proxied.harness, scripted_server, tmp_path, proxy=None)
    assert run.ok, run.describe()
    assert run.final_message == proxied.run.final_message
    assert run.stdout.strip() == proxied.run.stdout.strip()
    assert repo_diff(repo) == repo_diff(proxied.repo)
    assert repo_test_passes(repo)[0]


@pytest.mark.parametrize("variant", ["codex", "pi"])  # the harnesses whose calls get fields injected
def test_a_session_that_sees_the_injected_fields_runs_the_same(variant: str, scripted_server: str,
                                                               tiny_model_dir: Path, tmp_path: Path) -> None:
    """``polar_strip=false``: the harness receives the token ids and logprobs the proxy asked for
    (vLLM's extra members) and must run as it does through the stripping proxy, with the same
    call log."""
    require_harnesses(VARIANTS[variant][0])
    rows = {}
    for strip in ("true", "false"):
        work = tmp_path / f"strip-{strip}"
        rollout = f"{variant}-strip-{strip}-{uuid.uuid4().hex[:6]}"
        with capture_proxy(work, tiny_model_dir, options={"polar_strip": strip}) as px:
            run, repo = run_session(variant, scripted_server, work, Proxy(px.port, rollout, px.ca_cert))
        assert run.ok, run.describe()
        assert run.final_message == FINAL_ANSWER and repo_test_passes(repo)[0]
        rows[strip] = call_rows(px.out, rollout)
        witnessed = px.witnessed_model_flows()
        assert len(rows[strip]) == len(witnessed) == SCRIPTED_TURNS
        # what reached the harness: the server's ids in every answer without stripping, in none with it
        assert [f["ids_seen"] for f in witnessed] == [strip == "false"] * SCRIPTED_TURNS
        assert {(r["status"], r["token_source"], r["injected"]) for r in rows[strip]} == {("ok", "server", True)}
    for a, b in zip(rows["true"], rows["false"], strict=True):  # the same scripted turns: the same tokens out
        assert a["completion_token_ids"] == b["completion_token_ids"]
        assert len(a["completion_logprobs"]) == len(b["completion_logprobs"])


@pytest.mark.parametrize("name", HARNESS_NAMES)
def test_two_concurrent_sessions_land_on_two_rollouts(name: str, scripted_server: str, tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    """Over ``https://``: the rollout id is then only on each CONNECT, never on the requests inside.

    So the addon must keep it per client connection, with two sessions' tunnels open at once; and
    each harness must trust the proxy's CA through its own variable (Codex: CODEX_CA_CERTIFICATE,
    Node harnesses: NODE_EXTRA_CA_CERTS).
    """
    require_harnesses(name)
    rollouts = [f"{name}-a-{uuid.uuid4().hex[:6]}", f"{name}-b-{uuid.uuid4().hex[:6]}"]
    port = int(scripted_server.rsplit(":", 1)[1])
    with tls_front(port, tmp_path) as https_server, \
            capture_proxy(tmp_path, tiny_model_dir, upstream_self_signed=True) as px:
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(run_session, name, https_server, tmp_path / r,
                                   Proxy(px.port, r, px.ca_cert)) for r in rollouts]
            results = [f.result() for f in futures]
    for (run, repo), r in zip(results, rollouts):
        assert run.ok, run.describe()
        assert repo_test_passes(repo)[0]
    rows = call_rows(px.out)
    assert len(rows) == len(px.witnessed_model_flows()) == 2 * SCRIPTED_TURNS
    for (run, repo), r in zip(results, rollouts):
        mine = [row for row in rows if row["rollout_id"] == r]
        assert len(mine) == SCRIPTED_TURNS
        assert {row["rollout_source"] for row in mine} == {"proxy_auth"}
        assert {row["status"] for row in mine} == {"ok"}
        # No row mixed up: each of its requests carries its own work directory, never the other's.
        other = str(results[1 - rollouts.index(r)][1])
        for row in mine:
            assert str(repo) in row["request_json"] and other not in row["request_json"], row["call_id"]
        turns = [assistant_turns(row["api"], json.loads(row["request_json"])) for row in mine]
        assert turns == list(range(SCRIPTED_TURNS))
    # each session names itself (Pi names none): one rollout id reused for both would be said by build
    sessions = [{row["client_session_id"] for row in rows if row["rollout_id"] == r} for r in rollouts]
    if name == "pi":
        assert sessions == [{None}, {None}]
    else:
        assert all(len(s) == 1 and None not in s for s in sessions) and sessions[0] != sessions[1], sessions


#: What the builder must make of each session: (trajectories, fork causes). Claude Code re-sends its
#: Edit call with ``"replace_all": false`` inserted, so the prompt after that turn no longer starts
#: with the sampled call: a ``history_rewrite`` fork. The others only append.
EXPECTED_TRAJECTORIES = {"claude-code": (2, {"history_rewrite": 1})}


def test_compact_storage_holds_each_request_once(proxied: Session) -> None:
    """With ``polar_prompt_delta`` every call after the first stores its prompt and its request and
    response texts as deltas of the call before it, and the texts read back whole (the checks
    above parse them)."""
    from polar_train.calllog import read_call_log

    stored = sorted(read_call_log(proxied.captures, resolve_prompts=False).table.to_pylist(),
                    key=lambda r: r["started_at"])
    columns = ("prompt_prefix_call_id", "request_json_base_call_id", "response_json_base_call_id")
    if proxied.harness not in COMPACT:
        assert all(r[c] is None for r in stored for c in columns)
        return
    # requests resend instructions, tools and history, and Codex's replies (Responses) echo the
    # instructions and tools: stored once, they are a fraction of what every call sent. (Claude
    # Code's replies share less than a delta is worth: stored whole.)
    compact = [*columns[:2], *(columns[2:] if API[proxied.harness] == "openai.responses" else ())]
    for column in compact:
        assert [r[column] for r in stored] == [None] + [r["call_id"] for r in stored[:-1]], column
    for column in ("request_json", "response_json"):
        whole = [r[column] for r in proxied.rows]
        assert all(json.loads(text) for text in whole)
        if f"{column}_base_call_id" in compact:
            new = sum(len(r[column]) for r in stored[1:])
            assert new < sum(len(text) for text in whole[1:]) / 4, (column, new, [len(t) for t in whole])


def test_builder_stitches_the_session(proxied: Session) -> None:
    """The real session's call log becomes GRPO-ready trajectories: every call is used, sampled tokens
    are trained with the logprob the server reported, and a fork appears only where the harness
    rewrote its history."""
    import numpy as np

    from polar_train.trajectories import BuildOptions, build_trajectories
    from polar_train.trajectories.writer import trajectories_table

    result = build_trajectories(proxied.captures, BuildOptions())
    n_expected, forks = EXPECTED_TRAJECTORIES.get(proxied.harness, (1, {}))
    report = result.report.to_json()
    assert len(result.trajectories) == n_expected, result.report.table()
    assert {k: v for k, v in report["forks"].items() if v} == forks, result.report.table()
    table = trajectories_table(result.trajectories).to_pylist()
    assert sum(t["num_calls"] for t in table) == SCRIPTED_TURNS
    assert all(t["rollout_id"] == proxied.rollout_id for t in table)
    by_id = {r["call_id"]: r for r in proxied.rows}
    for t in table:
        mask = np.asarray(t["loss_mask"])
        lps = np.asarray(t["logprobs"], dtype=np.float64)
        completion = np.asarray(t["completion_ids"])
        calls = [by_id[c] for c in t["call_ids"]]
        sampled = np.concatenate([np.asarray(c["completion_token_ids"]) for c in calls])
        recorded = np.concatenate([np.asarray(c["completion_logprobs"] or [np.nan] * len(c["completion_token_ids"]),
                                              dtype=np.float64) for c in calls])
        # trained tokens are exactly the sampled ones, in order, each with the logprob the server
        # reported (NaN where the wire carried none: Anthropic messages, Responses tool-call turns)
        assert np.array_equal(completion[mask == 1], sampled)
        assert np.allclose(lps[mask == 1], recorded, equal_nan=True, atol=0)
        assert np.isnan(lps[mask == 0]).all()


def test_the_commands_proxy_check_reaches_the_server_and_records_no_row(scripted_server: str, tiny_model_dir: Path,
                                                                          tmp_path: Path) -> None:
    """`polar-train harness --proxy-port` sends one GET /v1/models through the proxy before the session
    (a wrong service there used to mean a silent wait until --timeout): through the real mitmdump +
    addon it reaches the server, gives Pi its context window, and is no row of the capture."""
    from polar_train.harnesses.base import server_models
    from polar_train.harnesses.pi import served_context_length

    with capture_proxy(tmp_path, tiny_model_dir) as px:
        models = server_models(ModelServer(scripted_server, model="tiny"), Proxy(px.port, "probe-1", px.ca_cert))
    assert served_context_length(models, "tiny") == 65536  # the server's --max-model-len
    flows = [json.loads(line) for line in px.witness_log.read_text().splitlines() if line.strip()]
    assert [(f["method"], f["path"]) for f in flows] == [("GET", "/v1/models")]  # it went through the proxy
    assert not list(px.out.rglob("*.parquet")) or call_rows(px.out) == []
