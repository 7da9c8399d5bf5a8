"""The three real coding-agent harnesses, unmodified, run non-interactively through our proxy.

``get_harness("codex" | "claude-code" | "pi")`` returns a runner; ``runner.run(workdir, prompt,
ModelServer(url, model), Proxy(port, rollout_id, ca_cert))`` runs one session and returns a
:class:`HarnessRun`.
"""

from __future__ import annotations

from .base import DEFAULT_API_KEY, Harness, HarnessError, HarnessRun, ModelServer, Proxy, find_binary
from .claude_code import ClaudeCode
from .codex import Codex
from .pi import Pi

HARNESSES: dict[str, type[Harness]] = {"codex": Codex, "claude-code": ClaudeCode, "pi": Pi}


def get_harness(name: str, **options) -> Harness:
    """A runner for harness ``name`` (a clear error for an unknown name)."""
    try:
        cls = HARNESSES[name]
    except KeyError:
        raise HarnessError(f"unknown harness {name!r}; choose one of {', '.join(HARNESSES)}") from None
    return cls(**options)


__all__ = ["DEFAULT_API_KEY", "HARNESSES", "ClaudeCode", "Codex", "Harness", "HarnessError", "HarnessRun",
           "ModelServer", "Pi", "Proxy", "find_binary", "get_harness"]
