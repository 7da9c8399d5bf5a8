"""``polar-train build CAPTURES --out DIR``: call logs → trajectory Parquet + _build_report.json.

Why exit codes this way: a capture with some bad parts or rows still yields useful data, so the
build writes what it can and reports the rest (exit 0); only when nothing could be built does it
exit non-zero (2 for unusable input, 1 when no trajectory came out of readable input).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .paths import OLD_REPORT_NAME, REPORT_NAME, cannot_write_folder, user_path
from .terminal import printable


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _foreign_files(out: Path) -> str | None:
    """Why a build may not write into the existing folder ``out`` (None: it may).

    Why refuse: ``train`` reads every ``*.parquet`` under the folder, so a part there that no
    build wrote would be trained on (or fail the run); and a folder holding neither a report nor
    parts of a build is someone's folder, whose files a build could replace."""
    from .trajectories.writer import PART_GLOB, is_trajectory_part

    if not out.is_dir():
        return None
    entries = [p for p in out.iterdir() if not p.name.startswith(".")]
    ours = [p for p in out.glob(PART_GLOB) if p.is_file() and is_trajectory_part(p)]
    theirs = sorted(str(p.relative_to(out)) for p in out.rglob("*.parquet")
                    if p not in ours and not any(s.startswith(".") for s in p.relative_to(out).parts))
    if theirs:
        shown = ", ".join(theirs[:3]) + (f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
        return (f"--out {out} holds Parquet files no build wrote ({shown}), which `polar-train train` would "
                "read too: move them away or choose another folder")
    if entries and not ours and not any((out / name).is_file() for name in (REPORT_NAME, OLD_REPORT_NAME)):
        return (f"--out {out} is not empty and holds no earlier build (no {REPORT_NAME}, no trajectory parts): "
                "choose a new or empty folder")
    return None


def _check_out(out: Path, captures: Path) -> None:
    """Refuse an ``--out`` the build could not write, or should not: before the (long) read."""
    from .cli import UserError

    problem = cannot_write_folder(out, "--out")
    if problem:
        raise UserError(problem)
    if captures.exists():
        from .calllog import part_folder

        parts = part_folder(captures)
        target = out.resolve()
        if parts.is_file():  # one part: a rebuild replaces the part-*.parquet files in --out
            folder = parts.parent.resolve()
            if target == folder:
                raise UserError(f"--out {out} is the folder of {captures}; choose another folder")
            if folder.name == "calls":  # a part in a capture (POLAR_OUT/calls/): trajectories in it would be
                # read with its calls from then on (named as not a call log, or as a capture of another build)
                root = folder.parent
                if target == root or root in target.parents:
                    raise UserError(f"--out {out} is inside the capture folder {root} of {captures}; choose "
                                    "another folder")
        else:
            # the addon writes POLAR_OUT/calls/: given that calls/ folder, its capture folder is the parent
            folder, root = captures, captures.resolve()
            if root.name == "calls" and parts.resolve() == root:
                folder = root = root.parent
            if target == root or root in target.parents:
                raise UserError(f"--out {out} is inside the capture folder {folder}; choose another folder")
    problem = _foreign_files(out)
    if problem:
        raise UserError(problem)


def _cmd_build(args: argparse.Namespace) -> int:
    from .cli import UserError, said_interrupted, signal_status
    from .trajectories import BuildOptions

    if not args.out.strip():
        raise UserError("--out is empty; name the folder for the trajectories")
    if not args.captures.strip():
        raise UserError("CAPTURES is empty; name the capture folder")
    out = Path(args.out).expanduser()
    captures = Path(args.captures).expanduser()
    report_bytes: list[bytes] = []  # the report this build writes, once known
    try:  # from the checks on: an early Ctrl-C says what --out holds as a late one does
        _check_out(out, captures)
        options = BuildOptions(realign=args.realign, reward_mode=args.reward_mode,
                               rewards=args.rewards and Path(args.rewards).expanduser(),
                               tasks=args.tasks and Path(args.tasks).expanduser(),
                               tokenizer=args.tokenizer and Path(args.tokenizer).expanduser())
        return _build_and_write(captures, out, options, args, report_bytes)
    except (KeyboardInterrupt, SystemExit) as exc:
        if signal_status(exc) is None:
            raise  # not a signal
        # the swap of old parts for new ones holds the signal until it is done: either build is whole
        try:
            done = bool(report_bytes) and (out / REPORT_NAME).read_bytes() == report_bytes[0]
        except OSError:
            done = False
        shown = printable(out)
        state = (f"the new build is complete in {shown}" if done else
                 f"{shown} holds what it held before" if out.exists() else f"nothing was written to {shown}")
        print(f"polar-train build: interrupted; {state}", file=sys.stderr, flush=True)
        raise said_interrupted(exc) from None


def _build_and_write(captures: Path, out: Path, options, args: argparse.Namespace, report_bytes: list[bytes]) -> int:
    from .cli import UserError, print_out
    from .trajectories import build_trajectories
    from .trajectories.writer import json_bytes, new_build_id, part_paths, write_trajectories

    try:
        result = build_trajectories(captures, options)
    except ValueError as exc:  # CallLogError, RewardFileError: one clear line
        raise UserError(str(exc)) from None
    report = result.report
    if not result.trajectories:
        print_out(report.table(saved=False))
        above = [name for name, shown in (("skipped rows", report.skipped), ("problems", report.problems),
                                           ("notes", report.notes)) if shown]
        why = f"see {' and '.join(above)} above; " if above else ""
        if report.skipped.get("unresolved_prompt"):  # an archived calls/ folder built on its own, say
            why += ("compact prompts refer to calls in parts not read here - lost or damaged (the problems say), "
                    "or in another folder: build the folder that holds them too (a capture's parent folder reads "
                    "every calls/ folder under it); ")
        print(f"polar-train build: error: no trajectory could be built from {captures} "
              + (f"({why}`polar-train inspect {captures}` lists the calls)" if report.calls_read
                 else "(its parts hold no call)"), file=sys.stderr)
        return 1
    report.out = str(out)
    report.output_parts = [p.name for p in part_paths(out, len(result.trajectories), args.rows_per_part)]
    report.build_id = new_build_id()  # in each part's metadata too: the trainer refuses a mix of builds
    report_bytes.append(json_bytes(report.to_json()))
    try:
        parts = write_trajectories(result.trajectories, out, rows_per_part=args.rows_per_part,
                                   extra={REPORT_NAME: report_bytes[0]}, retire=(OLD_REPORT_NAME,),
                                   build_id=report.build_id, reward_mode=report.reward_mode)
    except FileExistsError as exc:
        raise UserError(str(exc)) from None
    except OSError as exc:
        state = "the folder holds what it held before" if out.exists() else "nothing was written"
        raise UserError(f"cannot write to --out {out}: {exc.strerror or exc}; {state}") from None
    print_out(f"{report.table()}\nwrote {len(result.trajectories)} trajectories in {len(parts)} part(s) to "
              f"{printable(out)} (report: {printable(out / REPORT_NAME)})")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "build", help="stitch captured calls into GRPO-ready trajectories (Parquet)",
        description="Read the call log under CAPTURES, stitch calls into trajectories by token "
                    "prefix, attach rewards and task groups, and write Parquet parts plus "
                    f"{REPORT_NAME} under --out.")
    p.add_argument("captures", type=user_path,
                   help="capture folder (holding calls/*.parquet) or a folder of parts; parts in "
                   "subfolders are read too, so a parent folder builds several captures together")
    p.add_argument("--out", required=True, type=user_path, help="output folder for part-*.parquet and the report")
    p.add_argument("--rewards", type=user_path, help="JSONL/CSV/Parquet with rollout_id, reward[, task_id]")
    p.add_argument("--tasks", type=user_path, help="JSONL/CSV/Parquet with rollout_id, task_id (the GRPO group)")
    p.add_argument("--reward-mode", choices=("broadcast", "split"), default="broadcast",
                   help="broadcast: each trajectory of a rollout gets its reward; split: the "
                        "reward is divided among them (default: broadcast)")
    p.add_argument("--realign", action="store_true",
                   help="continue a trajectory across BPE drift (re-rendered completion "
                        "tokenised differently) instead of forking; marks it realigned")
    p.add_argument("--tokenizer", type=user_path, help="model folder whose tokenizer compares token bytes "
                                       "(default: the built-in Qwen3.5 tokenizer)")
    p.add_argument("--rows-per-part", type=_positive_int, default=2000,
                   help="trajectories per Parquet part (default: 2000)")
    p.set_defaults(func=_cmd_build)
