"""Prompt rendering of the server: defined in :mod:`polar_train.wire.render` (shared with the addon)."""

from ..wire.render import encode, function_tool, normalize_tool, render

__all__ = ["encode", "function_tool", "normalize_tool", "render"]
