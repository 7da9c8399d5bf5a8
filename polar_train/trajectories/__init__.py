"""Call logs → GRPO-ready trajectories: stitching (``stitch``), rewards and groups (``rewards``),
the build report (``report``) and the Parquet writer (``writer``). ``build`` ties them together."""

from __future__ import annotations

from .build import BuildOptions, BuildOptionsError, BuildResult, build_trajectories

__all__ = ["BuildOptions", "BuildOptionsError", "BuildResult", "build_trajectories"]
