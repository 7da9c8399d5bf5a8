"""``polar-train build CAPTURES --out DIR``: call logs → trajectory Parquet + build_report.json.

Why exit codes this way: a capture with some bad parts or rows still yields useful data, so the
build writes what it can and reports the rest (exit 0); only when nothing could be built does it
exit non-zero (2 for unusable input, 1 when no trajectory came out of readable input).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPORT_NAME = "build_report.json"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _cmd_build(args: argparse.Namespace) -> int:
    from .cli import UserError
    from .trajectories import BuildOptions, build_trajectories
    from .trajectories.writer import write_json, write_trajectories

    out = Path(args.out)
    captures = Path(args.captures)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out is a file, not a folder: {out}")
    if captures.exists():
        from .calllog import part_folder

        parts = part_folder(captures)
        target = out.resolve()
        if parts.is_file():  # one part: a rebuild replaces the part-*.parquet files in --out
            if target == parts.parent.resolve():
                raise UserError(f"--out {out} is the folder of {captures}; choose another folder")
        elif target in (captures.resolve(), parts.resolve()) or parts.resolve() in target.parents:
            raise UserError(f"--out {out} is inside the capture folder {captures}; choose another folder")
    options = BuildOptions(realign=args.realign, reward_mode=args.reward_mode,
                           rewards=args.rewards, tasks=args.tasks, tokenizer=args.tokenizer)
    try:
        result = build_trajectories(args.captures, options)
    except ValueError as exc:  # CallLogError, RewardFileError: one clear line
        raise UserError(str(exc)) from None
    report = result.report
    if not result.trajectories:
        print(report.table())
        print(f"polar-train build: error: no trajectory could be built from {args.captures}"
              " (see skipped rows and problems above)", file=sys.stderr)
        return 1
    parts = write_trajectories(result.trajectories, out, rows_per_part=args.rows_per_part)
    report.out = str(out)
    report.output_parts = [p.name for p in parts]
    write_json(out / REPORT_NAME, report.to_json())
    print(report.table())
    print(f"wrote {len(result.trajectories)} trajectories in {len(parts)} part(s) to {out}"
          f" (report: {out / REPORT_NAME})")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "build", help="stitch captured calls into GRPO-ready trajectories (Parquet)",
        description="Read the call log under CAPTURES, stitch calls into trajectories by token "
                    "prefix, attach rewards and task groups, and write Parquet parts plus "
                    f"{REPORT_NAME} under --out.")
    p.add_argument("captures", help="capture folder (holding calls/*.parquet) or a folder of parts")
    p.add_argument("--out", required=True, help="output folder for part-*.parquet and the report")
    p.add_argument("--rewards", help="JSONL/CSV/Parquet with rollout_id, reward[, task_id]")
    p.add_argument("--tasks", help="JSONL/CSV/Parquet with rollout_id, task_id (the GRPO group)")
    p.add_argument("--reward-mode", choices=("broadcast", "split"), default="broadcast",
                   help="broadcast: each trajectory of a rollout gets its reward; split: the "
                        "reward is divided among them (default: broadcast)")
    p.add_argument("--realign", action="store_true",
                   help="continue a trajectory across BPE drift (re-rendered completion "
                        "tokenised differently) instead of forking; marks it realigned")
    p.add_argument("--tokenizer", help="model folder whose tokenizer compares token bytes "
                                       "(default: the built-in Qwen3.5 tokenizer)")
    p.add_argument("--rows-per-part", type=_positive_int, default=2000,
                   help="trajectories per Parquet part (default: 2000)")
    p.set_defaults(func=_cmd_build)
