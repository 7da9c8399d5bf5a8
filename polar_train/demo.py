"""``polar-train demo``: the whole loop on an embedded default, on CPU, in minutes.

capture (server → mitmdump + addon) → build (trajectories, rewards, groups) → train (GRPO + LoRA)
→ serve the adapter and capture again, so the reward before and after training is measured the
same way. Why a command and not a shell script: it must run the same on any machine with
``make demo``, start and stop its servers by pid, and fail with one clear line when a step fails.
Every step is the real command a user runs (``polar-train serve``, ``mitmdump -s
addons/polar_capture.py``, ``polar-train build``, ``polar-train train``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from .cli import UserError
from .installed import NotInstalled, addon_script, mitmdump_command, polar_train_command
from .paths import cannot_write_folder, holds_other_files, user_path
from .tiny_model import MAX_FINAL_NORM_WEIGHT


#: The embedded default: tasks a tiny model can be rewarded on. The verifier rewards plain Latin
#: text (the share of the reply's characters that are ASCII letters or spaces): a random model
#: writes every script of the 248k vocabulary, so the reward varies among samples and can rise.
TASKS = [
    ("greet", "Say hello to the user in plain English."),
    ("list", "List three fruits."),
    ("explain", "Explain what a unit test is."),
    ("name", "Suggest a name for a cat."),
]
FOLLOW_UP = "Thanks. Now say it once more, shorter."
SYSTEM = "You are a helpful assistant. Answer in plain English."

#: The context length the demo serves its tiny model with (``polar-train serve --max-model-len``).
MODEL_LEN = 4096
#: ``--max-tokens`` that fit MODEL_LEN: a session's second call holds ~60 prompt tokens, the first
#: reply re-tokenised (measured 1024 sampled tokens -> ~1050) and its own reply: 1024 -> ~2130.
MAX_TOKENS = MODEL_LEN // 4
#: ``--learning-rate`` above this is no LoRA fine-tuning: Adam moves every weight by about the
#: learning rate per step, and huge ones overflow to nan (a server 500 a round later).
MAX_LEARNING_RATE = 1.0


def latin_share(text: str) -> float:
    """The demo's verifier: share of characters that are ASCII letters or spaces (0 for empty)."""
    if not text:
        return 0.0
    return sum(1 for ch in text if ch == " " or ("a" <= ch.lower() <= "z")) / len(text)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 - loopback only
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def post_json(url: str, body: dict, headers: dict[str, str] | None = None, timeout: float = 300) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback only
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raise UserError(f"POST {url} answered {exc.code}: {exc.read()[:300]!r}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:  # (http.client's RemoteDisconnected is an
        # OSError: a proxy or server that died or restarted mid-call ended the demo in a traceback)
        reason = getattr(exc, "reason", None) or exc
        raise UserError(f"POST {url} failed: {reason} (see the server and proxy logs under the round's "
                        "logs/ folder)") from None


@contextlib.contextmanager
def running(args: list[str], log: Path, ready_url: str | None = None, ready_port: int | None = None,
            what: str = "process", timeout: float = 180) -> Iterator[subprocess.Popen]:
    """Start a child process, wait until it answers, stop it (SIGTERM to its group) afterwards."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise UserError(f"{what} exited with code {proc.returncode}; see {log}")
            if ready_url and _get(ready_url):
                break
            if ready_port:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", ready_port)) == 0:
                        break
            if time.monotonic() > deadline:
                raise UserError(f"{what} did not become ready in {timeout:.0f}s; see {log}")
            time.sleep(0.2)  # polling a readiness probe
        yield proc
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _run(args: list[str], what: str) -> None:
    own = polar_train_command()  # shown as the command a user types, not as this interpreter runs it
    shown = ["polar-train", *args[len(own):]] if args[:len(own)] == own else [Path(args[0]).name, *args[1:]]
    print(f"  $ {' '.join(shown)}", flush=True)
    rc = subprocess.call(args, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    if rc != 0:
        raise UserError(f"{what} failed with exit code {rc}")


@dataclass
class DemoConfig:
    """The embedded default of ``make demo`` (every field is a command-line option)."""

    workdir: Path = Path("runs/demo")
    rounds: int = 1
    group_size: int = 4
    max_tokens: int = 12
    temperature: float = 1.0
    #: One epoch: the builder forks most sessions of the peaked model, so a round has ~30
    #: trajectories = 8 GRPO rows of 4 (one row per step). 4 steps (half an epoch) rose less.
    train_steps: int = 8
    #: 5e-3 rose faster but fell back in round 2 (measured, docs/demo.md).
    learning_rate: float = 1e-3
    #: 16: a peaked random policy (entropy ≈ 2 nats) whose samples differ a lot in reward (group
    #: std ≈ 0.2-0.3), so GRPO gets advantages; 8 is ~uniform (11.5 nats, std ≈ 0.02), 32 is
    #: deterministic (std 0).
    final_norm_weight: float = 16.0


def _rollout(proxy: str, rollout_id: str, task_id: str, prompt: str, cfg: DemoConfig, seed: int,
             model: str = "tiny") -> float:
    """One agent session of two model calls to ``model`` (the served name); returns the verifier's reward."""
    headers = {"x-polar-rollout": rollout_id, "x-polar-task": task_id}
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}]
    texts = []
    for turn in range(2):
        body = {"model": model, "messages": messages, "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature, "top_p": 1.0, "seed": seed * 10 + turn}
        reply = post_json(proxy + "/v1/chat/completions", body, headers)
        text = reply["choices"][0]["message"]["content"] or ""
        texts.append(text)
        messages = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": FOLLOW_UP}]
    return sum(latin_share(t) for t in texts) / len(texts)


def capture_round(cfg: DemoConfig, model_dir: Path, adapter: Path | None, out: Path, round_no: int) -> float:
    """Serve (with the adapter so far), capture G sessions per task through the proxy; mean reward."""
    serve_port, proxy_port = _free_port(), _free_port()
    # each policy under a name of its own (docs/train.md, Round after round): every call's `model` says
    # which one sampled it, and train's `data: sampled by` line tells the rounds apart
    served = "tiny" if adapter is None else f"round{round_no - 1}-adapter"
    serve = [*polar_train_command(), "serve", "--model", str(model_dir), "--port", str(serve_port),
             "--served-model-name", served, "--max-model-len", str(MODEL_LEN)] + (["--adapter", str(adapter)] if adapter else [])
    mitm = [*mitmdump_command(), "-s", str(addon_script()), "--listen-host", "127.0.0.1",
            "--mode", f"reverse:http://127.0.0.1:{serve_port}@{proxy_port}",
            "--set", f"polar_out={out / 'captures'}", "--set", f"polar_tokenizer={model_dir}",
            "--set", "flow_detail=0"]
    rewards: list[dict] = []
    # mitmproxy writes a CA with its private key into its confdir; the demo's reverse proxy speaks
    # plain HTTP and needs none of it: a temporary confdir, removed with the proxy (docs/hardening.md)
    with running(serve, out / "logs" / "serve.log", ready_url=f"http://127.0.0.1:{serve_port}/health",
                 what="polar-train serve"), tempfile.TemporaryDirectory(prefix="polar-demo-mitmproxy-") as conf:
        with running([*mitm, "--set", f"confdir={conf}"], out / "logs" / "mitmdump.log", ready_port=proxy_port,
                     what="mitmdump"):
            proxy = f"http://127.0.0.1:{proxy_port}"
            jobs = [(f"r{round_no}-{task}-{g}", task, prompt, g)
                    for task, prompt in TASKS for g in range(cfg.group_size)]
            # One session after the other: the server serialises forward steps anyway, and a fixed
            # call order makes the trajectories' order, hence the training run, reproducible (with
            # concurrent sessions the same seeds gave round-1 rewards of 0.495 and 0.668).
            results = [_rollout(proxy, rid, task, prompt, cfg, seed=1000 * round_no + 17 * g + len(prompt), model=served)
                       for rid, task, prompt, g in jobs]
            rewards = [{"rollout_id": j[0], "task_id": j[1], "reward": r} for j, r in zip(jobs, results)]
        # mitmdump got SIGTERM: its addon closed the last Parquet part before exiting
    with open(out / "rewards.jsonl", "w") as fh:
        for r in rewards:
            fh.write(json.dumps(r) + "\n")
    return sum(r["reward"] for r in rewards) / len(rewards)


def _built_spec(model_dir: Path) -> dict | None:
    """The spec a previous run built its tiny model with (None: none there, or unreadable)."""
    try:
        return json.loads((model_dir / "polar_tiny_model.json").read_text())
    except (OSError, ValueError):
        return None


def show_one_call(captures: Path) -> None:
    """Print the first captured call at token level: what the proxy recorded from the server."""
    from .calllog import read_calls

    rows = read_calls(captures).sort_by("started_at").slice(0, 1).to_pylist()
    if not rows:
        raise UserError(f"no call was captured in {captures}")
    row = rows[0]
    lps = [round(x, 3) for x in (row["completion_logprobs"] or [])]
    print(f"  one captured call ({row['api']}, rollout {row['rollout_id']}, token_source {row['token_source']}):")
    print(f"    prompt_token_ids     {row['prompt_token_ids']}")
    print(f"    completion_token_ids {row['completion_token_ids']}")
    print(f"    completion_logprobs  {lps}", flush=True)


#: Marks a folder as a demo's work folder, which a later demo may overwrite.
WORKDIR_MARKER = ".polar-demo"
#: The name of each round's folder in it.
ROUND_FOLDER = re.compile(r"round\d+")


def remove_earlier_results(work: Path) -> None:
    """Remove an earlier demo's ``round<N>/`` folders and summary before this one starts: a rerun
    with fewer ``--rounds`` left the later rounds beside the new ones, captured by an adapter that
    was replaced, and an interrupted rerun left the earlier summary and rounds beside its own."""
    import shutil

    (work / "demo_summary.json").unlink(missing_ok=True)
    for stale in work.iterdir():
        if stale.is_dir() and ROUND_FOLDER.fullmatch(stale.name):
            shutil.rmtree(stale)


def run_demo(cfg: DemoConfig) -> int:
    from .tiny_model import TinyModelSpec, write_tiny_model

    started = time.monotonic()
    work = cfg.workdir
    work.mkdir(parents=True, exist_ok=True)
    (work / WORKDIR_MARKER).touch()  # a later demo may write here again (see _check)
    model_dir = work / "tiny-model"
    spec = TinyModelSpec(final_norm_weight=cfg.final_norm_weight)
    if _built_spec(model_dir) != asdict(spec):
        print(f"[model] building the tiny model in {model_dir} (final norm weight "
              f"{cfg.final_norm_weight:g})", flush=True)
        write_tiny_model(model_dir, spec)
    remove_earlier_results(work)
    adapter: Path | None = None
    history = []
    for r in range(cfg.rounds + 1):
        out = work / f"round{r}"
        label = "baseline" if r == 0 else f"after training round {r}"
        print(f"[round {r}] capture {len(TASKS)} tasks x {cfg.group_size} sessions through the proxy "
              f"({label})", flush=True)
        reward = capture_round(cfg, model_dir, adapter, out, r)
        history.append(reward)
        print(f"[round {r}] mean reward {reward:.3f}", flush=True)
        if r == 0:
            show_one_call(out / "captures")
        if r == cfg.rounds:
            break
        _run([*polar_train_command(), "inspect", str(out / "captures")], "polar-train inspect")
        _run([*polar_train_command(), "build", str(out / "captures"), "--out", str(out / "trajectories"),
              "--rewards", str(out / "rewards.jsonl")], "polar-train build")
        sets = {"temperature": cfg.temperature, "max_steps": cfg.train_steps, "learning_rate": cfg.learning_rate,
                "num_generations": cfg.group_size, "loss_type": "cispo", "epsilon_high": 5.0,
                "report_to": "none", "save_steps": 1000}
        if adapter:
            sets["init_adapter"] = str(adapter)
        cmd = [*polar_train_command(), "train", str(out / "trajectories"), "--model", str(model_dir),
               "--output", str(out / "run")]
        for k, v in sets.items():
            cmd += ["--set", f"{k}={v}"]
        _run(cmd, "polar-train train")
        adapter = out / "run" / "adapter"
    print("\nround  mean reward (share of plain Latin text in the replies)")
    for r, reward in enumerate(history):
        print(f"{r:>5}  {reward:.3f}" + ("  (baseline)" if r == 0 else f"  ({reward - history[0]:+.3f})"))
    elapsed = time.monotonic() - started
    (work / "demo_summary.json").write_text(json.dumps(
        {"mean_reward_by_round": history, "seconds": round(elapsed, 1),
         "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}}, indent=2) + "\n")
    print(f"\ncaptures, trajectories, metrics and adapters are under {work}/round*/ "
          f"({elapsed:.0f} s in all)")
    return 0


def _check(args: argparse.Namespace) -> Path:
    """Refuse settings that cannot make a demo before anything starts, not after a model is built
    and a round captured (a GRPO group needs two sessions to compare; 0 rounds captures the
    baseline only; ``inf`` and ``nan`` parse as floats). Returns the work folder, ``~`` expanded."""
    for name, value, low, high in (("--rounds", args.rounds, 0, None), ("--group-size", args.group_size, 2, None),
                                   ("--max-tokens", args.max_tokens, 1, MAX_TOKENS),
                                   ("--train-steps", args.train_steps, 1, None)):
        if value < low:
            raise UserError(f"{name}: at least {low}, got {value}")
        if high is not None and value > high:
            raise UserError(f"{name}: at most {high} (the demo serves a {MODEL_LEN}-token context, and a "
                            f"session's second call holds its first reply too), got {value}")
    for name, value, high in (("--learning-rate", args.learning_rate, MAX_LEARNING_RATE),
                              ("--final-norm-weight", args.final_norm_weight, MAX_FINAL_NORM_WEIGHT)):
        if not value > 0:  # also nan
            raise UserError(f"{name}: more than 0, got {value:g}")
        if not value <= high:
            raise UserError(f"{name}: at most {high:g}, got {value!r}")  # (:g printed 1.0000001 as 1)
    try:  # a wheel without its addon: found now, not after the model is built and a server started
        addon_script()
    except NotInstalled as exc:
        raise UserError(str(exc)) from None
    work = Path(args.workdir).expanduser()
    if work.exists() and not work.is_dir():
        raise UserError(f"--workdir is a file, not a folder: {work}")
    if (problem := cannot_write_folder(work, "--workdir")) is not None:  # a read-only file system: a traceback
        raise UserError(problem)
    # the demo replaces round<N>/, tiny-model/ and demo_summary.json in it: someone else's would be lost
    if holds_other_files(work, WORKDIR_MARKER) and not _unmarked_demo(work):
        raise UserError(f"--workdir {work} is not empty and holds no earlier demo (no {WORKDIR_MARKER} marker): "
                        "give a new or empty folder")
    return work


def _unmarked_demo(work: Path) -> bool:
    """Whether ``work`` is a demo's from before the marker (2026-12-04): only what a demo writes, and
    its tiny model or its summary (by its keys) to say so. A folder that merely held a file named
    demo_summary.json - a copy of data/samples/demo, a user's own - was taken for one, and its
    summary and round<N>/ folders deleted (a probe)."""
    names = {entry.name for entry in work.iterdir()}
    if not all(n in ("demo_summary.json", "tiny-model") or ROUND_FOLDER.fullmatch(n) for n in names):
        return False
    if (work / "tiny-model" / "polar_tiny_model.json").is_file():
        return True
    try:
        summary = json.loads((work / "demo_summary.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(summary, dict) and {"mean_reward_by_round", "config"} <= summary.keys()


def _cmd(args: argparse.Namespace) -> int:
    cfg = DemoConfig(workdir=_check(args), rounds=args.rounds, group_size=args.group_size,
                     max_tokens=args.max_tokens, train_steps=args.train_steps,
                     learning_rate=args.learning_rate, final_norm_weight=args.final_norm_weight)
    return run_demo(cfg)


def add_parser(sub: argparse._SubParsersAction) -> None:
    d = DemoConfig()
    p = sub.add_parser("demo", help="capture → build → train → capture again, on CPU (the embedded default)")
    p.add_argument("--workdir", default=str(d.workdir), type=user_path,
                   help=f"where the demo writes (default: {d.workdir})")
    p.add_argument("--rounds", type=int, default=d.rounds, help=f"training rounds (0: capture the baseline only; default: {d.rounds})")
    p.add_argument("--group-size", type=int, default=d.group_size, help=f"sessions per task (GRPO group; default: {d.group_size})")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"tokens per model call, at most {MAX_TOKENS} (default: {d.max_tokens})")
    p.add_argument("--train-steps", type=int, default=d.train_steps, help=f"optimizer steps per round (default: {d.train_steps})")
    p.add_argument("--learning-rate", type=float, default=d.learning_rate,
                   help=f"LoRA learning rate, at most {MAX_LEARNING_RATE:g} (default: {d.learning_rate:g})")
    p.add_argument("--final-norm-weight", type=float, default=d.final_norm_weight,
                   help="final RMSNorm weight of the tiny model: how peaked its random policy is, at most "
                        f"{MAX_FINAL_NORM_WEIGHT:g} (default: {d.final_norm_weight:g}; the model is rebuilt "
                        "when it changes)")
    p.set_defaults(func=_cmd)
