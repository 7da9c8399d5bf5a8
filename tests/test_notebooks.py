"""The notebooks run top to bottom in CI: on the committed sample data (drawing their plots), and - through
their environment variables POLAR_CAPTURE, POLAR_REWARDS, POLAR_RUN, POLAR_TRAJECTORIES - on the kinds of
input a user has: a capture with failed calls, a one-call rollout and streamed calls without usage; a capture
of rendered (Anthropic messages) calls only; a capture of failed calls only; a run that did not finish; a run
whose summary names its trajectories and has no logprob mismatch. The inputs are made from the sample's own
Parquet and metrics, so each execution takes seconds."""

from __future__ import annotations

import json
import os
import re
from datetime import timedelta
from pathlib import Path

import nbformat
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from nbclient import NotebookClient

from polar_train.calllog import read_calls
from polar_train.inspect import summarize
from polar_train.schema import CALL_LOG_SCHEMA
from polar_train.trajectories import BuildOptions, build_trajectories

ROOT = Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"  # the kernel's working directory, as in `jupyter lab notebooks/`
NOTEBOOKS = sorted(NB_DIR.glob("*.ipynb"))
SAMPLE = ROOT / "data" / "samples" / "demo"
ENV_VARS = ("POLAR_CAPTURE", "POLAR_REWARDS", "POLAR_RUN", "POLAR_TRAJECTORIES")
CAPTURE_NB = "01_explore_capture.ipynb"
RUN_NB = "02_training_run.ipynb"
DIFF = "sampling/sampling_logp_difference/mean"


def execute(name: str, monkeypatch: pytest.MonkeyPatch, **env: str | Path) -> nbformat.NotebookNode:
    """Run notebook ``name`` from a clean slate with only ``env`` of its variables set; any cell error raises."""
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, str(value))  # the kernel inherits this process's environment
    nb = nbformat.read(NB_DIR / name, as_version=4)
    for cell in nb.cells:  # no committed output may hide an error
        if cell.cell_type == "code":
            cell.outputs = []
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NB_DIR)}}).execute()
    return nb


def outputs(nb: nbformat.NotebookNode) -> list[dict]:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]


def text(nb: nbformat.NotebookNode) -> str:
    """What the notebook printed and displayed as text (stderr too)."""
    parts = []
    for o in outputs(nb):
        if o.get("output_type") == "stream":
            parts.append(o["text"])
        elif "text/plain" in o.get("data", {}):
            parts.append(o["data"]["text/plain"])
    return "\n".join(parts)


def plots(nb: nbformat.NotebookNode) -> int:
    return sum("image/png" in o.get("data", {}) for o in outputs(nb))


def inspect_tokens(capture: Path) -> tuple[int, int]:
    """(prompt, completion) tokens in all, read off the per-api table of `polar-train inspect`."""
    lines = summarize(read_calls(capture), top=0).splitlines()
    start = lines.index("per api") + 1
    header = lines[start].split()
    rows = [line.split() for line in lines[start + 2:] if line.strip()]
    rows = rows[:next((i for i, r in enumerate(rows) if len(r) != len(header)), len(rows))]
    return (sum(int(r[header.index("prompt_tok")]) for r in rows),
            sum(int(r[header.index("completion_tok")]) for r in rows))


# --- inputs made from the sample --------------------------------------------------------------------

def _write_capture(folder: Path, rows: list[dict]) -> Path:
    (folder / "calls").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=CALL_LOG_SCHEMA), folder / "calls" / "part-00000.parquet")
    return folder


def _error_row(template: dict, call_id: str, rollout: str, status: str, error: str) -> dict:
    row = {name: None for name in CALL_LOG_SCHEMA.names}
    row.update(call_id=call_id, rollout_id=rollout, api="openai.chat", method="POST", path="/v1/chat/completions",
               model="nope", attempt=1, stream=False, status=status, error=error, token_source="none",
               http_status=404 if status == "upstream_error" else None,
               started_at=template["started_at"] + timedelta(seconds=1),
               finished_at=template["started_at"] + timedelta(seconds=2))
    return row


def _rendered(row: dict) -> dict:
    """The call as the addon records an Anthropic messages call: ids rendered, no sampler logprobs."""
    return {**row, "api": "anthropic.messages", "path": "/v1/messages", "token_source": "rendered",
            "completion_logprobs": []}


@pytest.fixture(scope="module")
def sample_calls() -> list[dict]:
    return sorted(read_calls(SAMPLE / "captures").to_pylist(), key=lambda r: (r["rollout_id"], r["started_at"]))


@pytest.fixture(scope="module")
def mixed_capture(sample_calls, tmp_path_factory) -> Path:
    """Failed calls (null ids), a one-call rollout, a streamed rollout without usage, a rendered rollout."""
    rollouts = sorted({r["rollout_id"] for r in sample_calls})
    one, no_usage, rendered = rollouts[:3]
    rows = []
    for r in sample_calls:
        if r["rollout_id"] == one and any(x["rollout_id"] == one for x in rows):
            continue  # keep only its first call
        if r["rollout_id"] == no_usage:  # streamed chat without stream_options.include_usage
            r = {**r, "stream": True, "usage_prompt_tokens": None, "usage_completion_tokens": None, "usage_match": None}
        if r["rollout_id"] == rendered:
            r = _rendered(r)
        rows.append(r)
    rows.append(_error_row(sample_calls[-1], "err-1", "r-error", "upstream_error",
                           'HTTP 404: {"error": {"message": "The model `nope` does not exist."}}'))
    return _write_capture(tmp_path_factory.mktemp("mixed") / "capture", rows)


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory) -> dict[str, Path]:
    lines = [json.loads(line) for line in (SAMPLE / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in lines if "train_runtime" not in r]
    base = tmp_path_factory.mktemp("runs")
    # killed during step 4: three steps logged, no end line, no train_summary.json; step 2 had no sampler logprobs
    unfinished = base / "unfinished" / "run"
    unfinished.mkdir(parents=True)
    kept = [dict(r) for r in steps[:3]]
    kept[1][DIFF] = None
    (unfinished / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    # finished, rendered tokens only: no mismatch on any step; the summary names its trajectories (absolute)
    finished = base / "finished" / "run"
    finished.mkdir(parents=True)
    (finished / "metrics.jsonl").write_text("".join(
        json.dumps({**r, DIFF: None} if "train_runtime" not in r else r) + "\n" for r in lines))
    summary = json.loads((SAMPLE / "run" / "train_summary.json").read_text())
    summary.update(trajectories=str(SAMPLE / "trajectories"), adapter=str(finished / "adapter"),
                   logprob_mismatch_first_step=None, logprob_mismatch_first_epoch_mean=None)
    (finished / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return {"unfinished": unfinished, "finished": finished}


# --- the sample -------------------------------------------------------------------------------------

def test_there_are_notebooks() -> None:
    assert {p.name for p in NOTEBOOKS} >= {CAPTURE_NB, RUN_NB}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes_and_plots(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb = execute(path.name, monkeypatch)
    assert plots(nb), f"{path.name} drew no plot"
    out = text(nb)
    if path.name == CAPTURE_NB:  # the notebook's build is `polar-train build`'s (no --realign): the committed report
        report = json.loads((SAMPLE / "trajectories" / "_build_report.json").read_text())
        truncated = report.get("truncated_trajectories")
        assert re.search(rf"^trajectories\s+{report['trajectories']}"
                         + (rf" \({truncated} end at the length limit\)" if truncated else "") + "$", out, re.M), out
        forks = ", ".join(f"{k} {v}" for k, v in sorted(report["forks"].items(), key=lambda kv: (-kv[1], kv[0])))
        assert re.search(rf"^forks by cause\s+{forks}$", out, re.M), out
        assert f"calls in {Path('data/samples/demo/captures')} " in out  # shown repository-relative
    if path.name == RUN_NB:
        table = [o["data"]["text/plain"] for o in outputs(nb) if "text/plain" in o.get("data", {})]
        assert table and "NaN" not in table[0], "the end-of-training line of metrics.jsonl shows up as a step"
        assert "build report of data/samples/demo/trajectories (next to the run)" in out


# --- a user's own data ------------------------------------------------------------------------------

def test_capture_notebook_on_failed_calls_one_call_rollouts_and_missing_usage(
        mixed_capture: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rewards = "data/samples/demo/rewards.jsonl"  # relative: taken from the repository root, not notebooks/
    nb = execute(CAPTURE_NB, monkeypatch, POLAR_CAPTURE=mixed_capture, POLAR_REWARDS=rewards)
    out = text(nb)
    assert f"calls in {mixed_capture} " in out and f"rewards: {rewards}" in out
    assert "1 failed call(s)" in out
    prompt, completion = inspect_tokens(mixed_capture)
    assert f"{prompt} prompt and {completion} completion tokens in all" in out  # as `polar-train inspect` counts
    assert "on 29 of 29 call(s) that report usage; 2 call(s) report none" in out
    assert "1 of 16 rollout(s) hold a single call" in out
    assert re.search(r"^\d+ of 15 consecutive pair\(s\) of calls the build used extend token-exactly;", out, re.M), out
    expected = build_trajectories(mixed_capture, BuildOptions(rewards=ROOT / rewards)).report.table()
    assert expected in out, "the notebook's build differs from `polar-train build CAPTURE --rewards REWARDS`"
    assert "without a sampler logprob (rendered calls" in out
    assert plots(nb) == 2


def test_capture_notebook_on_rendered_calls_only(sample_calls, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    capture = _write_capture(tmp_path / "messages", [_rendered(r) for r in sample_calls])
    nb = execute(CAPTURE_NB, monkeypatch, POLAR_CAPTURE=capture)
    out = text(nb)
    assert "384 trainable token(s) in 31 trajectories; 384 (100%) without a sampler logprob" in out
    assert "no POLAR_REWARDS: trajectories are built without rewards" in out
    assert "built without rewards" in out
    assert plots(nb) == 2



def test_capture_notebook_on_calls_without_rollout_ids(sample_calls, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls without a rollout id were one rollout here ("0 of 1 rollout(s) hold a single call",
    calls of different conversations paired as turns) where the build grouped them into 16; then
    each was a rollout of its own ("32 of 32 hold a single call", "nothing extends"), against the
    build's report printed above it: the pairs are the build's conversations now."""
    capture = _write_capture(tmp_path / "anonymous", [dict(r, rollout_id=None) for r in sample_calls])
    out = text(execute(CAPTURE_NB, monkeypatch, POLAR_CAPTURE=capture))
    n = len(sample_calls)
    assert f"{n} call(s) without a rollout id: counted one rollout each here" in out
    assert re.search(r"^rollouts\s+16$", out, re.M), out  # the build's conversations
    # (the sample's second prompts are retokenized: the build's conversations are its own guess)
    assert re.search(r"^\d+ of 16 rollout\(s\) hold a single call$", out, re.M), out
    assert re.search(r"^\d+ of 16 consecutive pair\(s\) of calls the build used extend token-exactly;", out, re.M), out


def test_capture_notebook_counts_a_part_copied_twice_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A part copied inside calls/: inspect counted each call once, the notebook twice (64 calls,
    twice the tokens) and paired calls with their own copies."""
    import shutil

    capture = tmp_path / "copied"
    shutil.copytree(SAMPLE / "captures", capture)
    part = sorted((capture / "calls").rglob("part-*.parquet"))[0]
    shutil.copy(part, part.with_name("part-copy-" + part.name.removeprefix("part-")))
    out = text(execute(CAPTURE_NB, monkeypatch, POLAR_CAPTURE=capture))
    calls = pq.read_table(part).num_rows
    assert f"{calls} rows repeat a call id already read (a part copied twice?): each call counted once" in out
    prompt, completion = inspect_tokens(SAMPLE / "captures")  # (the sample is one part: all of it copied)
    assert f"{prompt} prompt and {completion} completion tokens in all" in out
    assert "0 of 16 rollout(s) hold a single call" in out  # not paired with their own copies
    assert "1 of 16 consecutive pair(s) of calls the build used extend token-exactly;" in out

def test_capture_notebook_on_failed_calls_only(sample_calls, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    capture = _write_capture(tmp_path / "errors", [
        _error_row(sample_calls[0], "err-1", "r1", "upstream_error", "HTTP 404: no such model"),
        _error_row(sample_calls[0], "err-2", "r2", "proxy_error", "connection refused")])
    out = text(execute(CAPTURE_NB, monkeypatch, POLAR_CAPTURE=capture))
    assert "2 failed call(s)" in out
    assert "no successful call with token ids among the 2 call(s)" in out
    assert "no trajectory could be built" in out and "no trajectories: nothing to show" in out


def test_capture_notebook_on_a_folder_whose_parts_are_all_unreadable(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """No part read: it said no successful call among 0 calls, "all failed or text only"."""
    (tmp_path / "cap" / "calls").mkdir(parents=True)
    (tmp_path / "cap" / "calls" / "part-1.parquet").write_bytes(b"PAR1 cut short")
    out = text(execute(CAPTURE_NB, monkeypatch, POLAR_CAPTURE=tmp_path / "cap"))
    assert "no call was read from" in out and "(see the skipped parts above)" in out
    assert "all failed or text only" not in out


def test_run_notebook_on_an_unfinished_run(run_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    nb = execute(RUN_NB, monkeypatch, POLAR_RUN=run_dirs["unfinished"])
    out = text(nb)
    assert "holds no readable train_summary.json: the run did not finish" in out
    assert "metrics.jsonl has 3 step(s)" in out
    assert "no build report in" in out and "the build report is not shown" in out
    assert "1 of 3 step(s) have no |logp trainer - logp sampler|" in out
    assert "mismatch at step 1 (metrics.jsonl" in out
    assert plots(nb) == 1



def test_run_notebook_does_not_judge_the_capture_by_a_mismatch_measured_after_updates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 1 of rendered calls only: the first mismatch is measured after an update, and the
    policy's own movement is in it - the notebook blamed the capture or the model for 0.18 nats
    of a high learning rate (a probe), or called a small one "token-exact"."""
    lines = [json.loads(line) for line in (SAMPLE / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    run = tmp_path / "run"
    run.mkdir()
    rows = [dict(r) for r in lines]
    rows[0][DIFF] = None
    rows[1][DIFF] = 0.184
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((SAMPLE / "run" / "train_summary.json").read_text())
    summary.update(trajectories=str(SAMPLE / "trajectories"), adapter=str(run / "adapter"),
                   logprob_mismatch_first_step=None, logprob_mismatch_first_measured=0.184,
                   logprob_mismatch_first_measured_after_updates=1)
    (run / "train_summary.json").write_text(json.dumps(summary))
    out = text(execute(RUN_NB, monkeypatch, POLAR_RUN=run))
    assert ("mismatch at the first step with sampler logprobs (train_summary.json): 0.184, measured after 1 update(s): "
            "the policy's own movement is in it, so it does not tell whether the capture was token-exact; above 0.1 "
            "it is likely another model than the sampler's (or a high learning_rate)") in out
    assert "above float noise" not in out and "token-exact)" not in out
    (run / "train_summary.json").unlink()  # unfinished: metrics.jsonl alone
    rows[1][DIFF] = 2e-4
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if "train_runtime" not in r))
    out = text(execute(RUN_NB, monkeypatch, POLAR_RUN=run))
    assert ("mismatch at step 2 (metrics.jsonl; the first with sampler logprobs): 0.0002, measured after 1 update(s): "
            "the policy's own movement is in it, so it does not tell whether the capture was token-exact\n") in out


def test_run_notebook_on_runs_that_ended_early_or_late(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe's runs: the newest checkpoint folder was offered for --resume though its save was cut
    short (the trainer refuses it); a run that finished training without its summary was called
    unfinished; a run stopped before step 1 (its marker, no metrics.jsonl) was said not to be a run;
    a summary cut off and a metrics line that is no record were tracebacks."""
    lines = (SAMPLE / "run" / "metrics.jsonl").read_text().splitlines()
    early = tmp_path / "early"  # three steps logged, checkpoint-2 complete, checkpoint-3 cut short
    early.mkdir()
    (early / "metrics.jsonl").write_text("\n".join(lines[:3] + ["[1, 2]", "\udcff"]) + "\n", errors="surrogateescape")
    (early / "checkpoint-2").mkdir()
    (early / "checkpoint-2" / "trainer_state.json").write_text('{"global_step": 2}')
    (early / "checkpoint-2" / "adapter_model.safetensors").write_bytes(b"")
    (early / "checkpoint-3").mkdir()
    nb = execute(RUN_NB, monkeypatch, POLAR_RUN=early)
    out = text(nb)
    assert "2 unreadable line(s) in metrics.jsonl skipped" in out
    assert "not resumable: checkpoint-3 (no readable trainer_state.json" in out
    assert "not resumable: checkpoint-2 (adapter_model.safetensors cut short or unreadable" in out
    assert "No complete checkpoint was saved: nothing to resume." in out

    late = tmp_path / "late"  # finished training; the summary cut off when the disk filled
    late.mkdir()
    (late / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (late / "train_summary.json").write_text((SAMPLE / "run" / "train_summary.json").read_text()[:60])
    out = text(execute(RUN_NB, monkeypatch, POLAR_RUN=late))
    assert "train_summary.json is unreadable (" in out
    assert "training finished (the end line of metrics.jsonl:" in out
    assert "no adapter was saved, and no checkpoint holds the weights" in out

    stopped = tmp_path / "stopped"  # Ctrl-C before step 1: the run marker only
    stopped.mkdir()
    (stopped / ".polar-train-run").write_text("{}\n")
    out = text(execute(RUN_NB, monkeypatch, POLAR_RUN=stopped))
    assert "No metrics.jsonl yet (stopped before its first step)." in out  # not "metrics.jsonl has 0 step(s)"
    assert "metrics.jsonl holds no optimizer step yet" in out

    ended = tmp_path / "ended"  # the end-of-training line alone: "finished", then "no step yet"
    ended.mkdir()
    (ended / "metrics.jsonl").write_text(lines[-1] + "\n")
    out = text(execute(RUN_NB, monkeypatch, POLAR_RUN=ended))
    assert "training finished" in out and "metrics.jsonl holds no optimizer step (only the end-of-training line)" in out


def _checkpoint(run: Path, step: int, value: float) -> None:
    """A checkpoint --resume would take: its adapter weights all ``value``."""
    import torch
    from safetensors.torch import save_file

    folder = run / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    save_file({"base_model.model.q_proj.lora_B.weight": torch.full((2, 2), value)},
              str(folder / "adapter_model.safetensors"))
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    torch.save({}, folder / "optimizer.pt")


def test_run_notebook_on_a_diverged_a_running_and_a_resumed_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe: a run that diverged was shown healthy (NaN logged as null, read as "no sampler
    logprob"; a loss plot with a gap) and its newest checkpoint, all NaN, was offered to go on from;
    a run still loading or training was called stopped; a resumed run's train_loss (TRL's mean over
    the resumed steps) was shown as the run's."""
    from polar_train.folder_lock import hold_folder_lock
    from polar_train.train.cli import RUN_LOCK

    lines = [json.loads(x) for x in (SAMPLE / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in lines if "train_runtime" not in r]
    diverged = tmp_path / "diverged"
    diverged.mkdir()
    rows = [steps[0], steps[1], {**steps[2], "loss": None, DIFF: None, "non_finite": ["loss", DIFF]},
            {"step": 4, "epoch": 1.0, "error": "training diverged at step 4: non-finite adapter weights (2 of 2 "
                                                "tensors, e.g. x); stopped before saving them"}]
    (diverged / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _checkpoint(diverged, 2, 0.5)
    _checkpoint(diverged, 3, float("nan"))  # (an earlier version saved it)
    out = text(execute(RUN_NB, monkeypatch, POLAR_RUN=diverged))
    assert "not resumable: checkpoint-3 (adapter_model.safetensors holds non-finite weights (the run diverged))" in out
    assert "the run stopped at step 4: training diverged at step 4: non-finite adapter weights" in out
    assert f"checkpoint-2 holds the last finite weights: a new run goes on from them with `--set init_adapter=" \
           f"{diverged / 'checkpoint-2'}`" in out
    assert ("1 step(s) logged NaN or infinite values (null in metrics.jsonl, left out of the plots): "
            f"step 3: loss, {DIFF}") in out
    assert "have no |logp trainer - logp sampler|" not in out  # its null was a NaN, not a step without logprobs
    assert "continue with" not in out

    running = tmp_path / "running"
    running.mkdir()
    (running / ".polar-train-run").write_text("{}\n")
    with hold_folder_lock(running, RUN_LOCK, "busy"):  # (this process: the notebook's kernel is another)
        out = text(execute(RUN_NB, monkeypatch, POLAR_RUN=running))
    assert f"the run is still going (process {os.getpid()} holds its lock)" in out
    assert "stopped before its first step" not in out

    resumed = tmp_path / "resumed"
    resumed.mkdir()
    (resumed / "metrics.jsonl").write_text((SAMPLE / "run" / "metrics.jsonl").read_text())
    summary = json.loads((SAMPLE / "run" / "train_summary.json").read_text())
    (resumed / "train_summary.json").write_text(json.dumps({**summary, "resumed_from": str(resumed / "checkpoint-1")}))
    out = text(execute(RUN_NB, monkeypatch, POLAR_RUN=resumed))
    assert f"resumed from {resumed / 'checkpoint-1'}: its train_loss is the mean of the resumed steps only" in out


@pytest.mark.parametrize("marker", [None, "", '{"model": "/m", "data": "abc", "trajectories": 8}'])
def test_run_notebook_advises_a_resume_only_where_train_takes_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   marker: str | None) -> None:
    """An unfinished run of a version that wrote no marker (or an empty one) was told to `--resume`,
    which train refuses: nothing to check the resume against (a probe). Its weights go on in a new run."""
    lines = (SAMPLE / "run" / "metrics.jsonl").read_text().splitlines()
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(x for x in lines[:2]) + "\n")
    _checkpoint(run, 2, 0.5)
    if marker is not None:
        (run / ".polar-train-run").write_text(marker)
    out = text(execute(RUN_NB, monkeypatch, POLAR_RUN=run))
    if marker and "model" in marker:
        assert "Last complete checkpoint: checkpoint-2 (continue with `polar-train train ... --output RUN --resume`)" in out
    else:
        assert ("Last complete checkpoint: checkpoint-2; this run cannot be resumed (its .polar-train-run is missing or "
                "records no model and data: train cannot check a resume against it): a new run goes on from its weights "
                f"with `--set init_adapter={run / 'checkpoint-2'} --output NEW`") in out
        assert "--resume" not in out


def test_run_notebook_finds_an_unfinished_runs_trajectories_by_its_marker(
        run_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker held a count and a hash, not the data's folder: an interrupted run always needed
    POLAR_TRAJECTORIES."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dirs["unfinished"], run)
    (run / ".polar-train-run").write_text(json.dumps({"trajectories": 31, "trajectories_folder":
                                                      str(SAMPLE / "trajectories")}) + "\n")
    out = text(execute(RUN_NB, monkeypatch, POLAR_RUN=run))
    assert "build report of data/samples/demo/trajectories (the run's .polar-train-run)" in out
    assert "sampled token(s) of the build without a sampler logprob" in out

@pytest.mark.parametrize("report", ['{"realign": false, "realigned_ca', "[]"])
def test_run_notebook_on_a_damaged_build_report_still_plots_the_run(
        run_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, report: str) -> None:
    """A build report cut short (a full disk) or holding no object ended the cell that also draws the
    reward, loss and mismatch plots in a JSONDecodeError/AttributeError (a probe): the whole run hidden."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(run_dirs["unfinished"], run)
    (tmp_path / "trajectories").mkdir()
    (tmp_path / "trajectories" / "_build_report.json").write_text(report)
    nb = execute(RUN_NB, monkeypatch, POLAR_RUN=run)
    out = text(nb)
    why = "JSONDecodeError: " if report.startswith("{") else "no JSON object"
    assert f"unreadable build report {tmp_path / 'trajectories' / '_build_report.json'} (next to the run; {why}" in out
    assert "shown as if there were none" in out and plots(nb) >= 1


def test_run_notebook_reads_the_trajectories_its_summary_names(run_dirs: dict[str, Path],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert not (run_dirs["finished"].parent / "trajectories").exists()
    nb = execute(RUN_NB, monkeypatch, POLAR_RUN=run_dirs["finished"])
    out = text(nb)
    assert "build report of data/samples/demo/trajectories (train_summary.json)" in out
    assert "first-step mismatch: none" in out
    assert "8 of 8 step(s) have no |logp trainer - logp sampler|" in out
    assert plots(nb) == 1


def test_run_notebook_shows_no_build_report_of_a_folder_rebuilt_since_the_run(
        run_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe: after the run, the trajectories folder was built again with --realign; the notebook
    showed that build's report ("realign on, 15 realigned calls") as the data the run trained on."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text((run_dirs["finished"] / "metrics.jsonl").read_text())
    summary = json.loads((run_dirs["finished"] / "train_summary.json").read_text())
    build_id = json.loads((SAMPLE / "trajectories" / "_build_report.json").read_text())["build_id"]
    for trained, shown in ((["0123456789abcdef0123456789abcdef"], False), ([build_id], True)):
        summary["data"]["build_ids"] = trained
        (run / "train_summary.json").write_text(json.dumps(summary))
        out = text(execute(RUN_NB, monkeypatch, POLAR_RUN=run))
        if shown:
            assert "build report of data/samples/demo/trajectories (train_summary.json): realign off" in out
        else:
            assert (f"build report of data/samples/demo/trajectories (train_summary.json) is of build {build_id}, not "
                    "of the build the run trained on (0123456789abcdef0123456789abcdef): the folder was rebuilt "
                    "since; not shown") in out
            assert "so the build report is not shown" in out and "realign off" not in out
    # the report of the build trained on, named by POLAR_TRAJECTORIES (a copy kept), is shown: as the hint says
    copy = tmp_path / "kept"
    copy.mkdir()
    for f in (SAMPLE / "trajectories").iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    summary["data"]["build_ids"] = ["0123456789abcdef0123456789abcdef"]
    (run / "train_summary.json").write_text(json.dumps(summary))
    report = json.loads((copy / "_build_report.json").read_text())
    (copy / "_build_report.json").write_text(json.dumps({**report, "build_id": "0123456789abcdef0123456789abcdef"}))
    out = text(execute(RUN_NB, monkeypatch, POLAR_RUN=run, POLAR_TRAJECTORIES=copy))
    assert "data/samples/demo/trajectories (train_summary.json) is of build" in out
    assert f"build report of {copy} (POLAR_TRAJECTORIES): realign off" in out


def test_a_missing_folder_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nbclient.exceptions import CellExecutionError

    with pytest.raises(CellExecutionError, match="no metrics.jsonl in .*POLAR_RUN names"):
        execute(RUN_NB, monkeypatch, POLAR_RUN=tmp_path / "nothing")


def test_a_wrong_folder_is_one_line_that_says_what_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe: an empty capture folder (a proxy that has written nothing yet) was the reader's
    traceback, a trajectories folder given as the run "held no metrics.jsonl", and every refusal
    came with a traceback of the notebook's own code."""
    from nbclient.exceptions import CellExecutionError

    empty = tmp_path / "empty"
    (empty / "calls").mkdir(parents=True)
    def shown_error(caught: pytest.ExceptionInfo) -> str:
        """What the notebook showed under the failing cell's source (colours taken out)."""
        return re.sub(r"\x1b\[[0-9;]*m", "", str(caught.value)).split("\n------------------\n")[-1]

    with pytest.raises(CellExecutionError) as caught:
        execute(CAPTURE_NB, monkeypatch, POLAR_CAPTURE=empty)
    shown = shown_error(caught)
    assert shown.strip().startswith(f"InputError: no call-log parts (*.parquet) in {empty / 'calls'}; no capture "
                                    "proxy has started here"), shown
    assert "(POLAR_CAPTURE names the polar_out folder of the addon)" in shown and "Traceback" not in shown
    with pytest.raises(CellExecutionError) as caught:
        execute(RUN_NB, monkeypatch, POLAR_RUN=SAMPLE / "trajectories")
    shown = shown_error(caught)
    assert shown.strip().startswith(f"InputError: {SAMPLE / 'trajectories'} holds trajectories (what polar-train "
                                    "build writes), not a training run: POLAR_RUN names the --output folder"), shown
    assert "Traceback" not in shown


def test_the_run_notebook_names_the_run_it_shows(monkeypatch: pytest.MonkeyPatch) -> None:
    out = text(execute(RUN_NB, monkeypatch))
    assert out.startswith("run data/samples/demo/run: {'steps': ")


def test_capture_notebook_names_compact_prompts_it_cannot_rebuild(sample_calls, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe: a compact capture whose earlier part was gone printed a "skipped:" line per call
    and still counted those calls (and their missing prompts) as read, unlike inspect."""
    from tests.support.calls import compact

    rows = compact(sample_calls)  # each call's prompt refers to the call before it
    capture = tmp_path / "compact"
    (capture / "calls").mkdir(parents=True)
    for name, part in (("part-a", rows[:1]), ("part-b", rows[1:])):
        pq.write_table(pa.Table.from_pylist(part, schema=CALL_LOG_SCHEMA), capture / "calls" / f"{name}.parquet")
    (capture / "calls" / "part-a.parquet").unlink()  # the part the second call refers to
    out = text(execute(CAPTURE_NB, monkeypatch, POLAR_CAPTURE=capture))
    # (each refers to the one before: all but the first are lost with it)
    assert f"{len(rows) - 1} call(s) whose compact prompt cannot be rebuilt (the part it refers to is missing): " \
           "their prompt tokens are not counted and the build leaves them out, e.g. " in out
    assert "skipped: call " not in out
