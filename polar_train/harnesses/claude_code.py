"""Claude Code (``claude -p``) against any Anthropic-Messages server, through the proxy.

Why ``--allowedTools`` and not ``--dangerously-skip-permissions``: the latter is refused when
running as root (CI containers), the former pre-approves exactly the tools a session may use.
``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`` turns off telemetry, error reports, update checks and
the extra model calls (titles), so every call the proxy sees is a turn of the agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .base import Harness, ModelServer, Proxy, compacting, served_window

#: Claude Code raises a smaller auto-compaction window to this; a server's shorter context is
#: reached through the percentage instead.
CLAUDE_MIN_WINDOW = 100_000
#: Compact at this share of the server's context, leaving room for the reply.
COMPACT_AT = 0.8
#: The variables that set the threshold: the caller's own (``--env``) win over ours.
COMPACT_ENV = ("CLAUDE_CODE_AUTO_COMPACT_WINDOW", "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE")
#: Claude Code asks ``max_tokens: 32000`` of a model it does not know; a vLLM-style server refuses
#: a budget above its context length ("max_tokens=32000 cannot be greater than max_model_len").
DEFAULT_MAX_TOKENS = 32000
OUTPUT_ENV = "CLAUDE_CODE_MAX_OUTPUT_TOKENS"


def output_cap(window: int | None) -> int | None:
    """The output budget for a server context of ``window`` tokens: a quarter of it where Claude
    Code's default would be refused (a probe: sessions then ran at 6k-16k, each call refused
    before); None where the default fits or the window is unknown."""
    return max(1, window // 4) if window and window < DEFAULT_MAX_TOKENS else None


def compaction_env(window: int) -> dict[str, str]:
    """Claude Code's auto-compaction settings for a server context of ``window`` tokens: without
    them it assumes a window of 200k tokens for a model it does not know, and a session past the
    server's context ends in the server's 400 instead of a compaction."""
    if window >= CLAUDE_MIN_WINDOW / COMPACT_AT:
        return {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(window)}
    return {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(CLAUDE_MIN_WINDOW),
            "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": f"{100 * COMPACT_AT * window / CLAUDE_MIN_WINDOW:.2f}"}


@dataclass
class ClaudeCode(Harness):
    """``claude -p PROMPT``; ``tools`` limits the built-in tools offered (None = Claude's defaults).

    ``context_window``: the server's context length, from which the auto-compaction threshold is
    set (:func:`compaction_env`; None: asked from the server the way the session reaches it; left
    to Claude Code where the server does not say or says less than :data:`~polar_train.harnesses.base.MIN_COMPACTING_WINDOW`).
    """

    tools: tuple[str, ...] | None = ("Bash", "Read", "Edit")
    allowed_tools: tuple[str, ...] = ("Bash", "Read", "Edit")
    max_output_tokens: int | None = None
    extra_args: list[str] = field(default_factory=list)
    context_window: int | None = None
    overridable_env: tuple[str, ...] = field(init=False, default=(*COMPACT_ENV, OUTPUT_ENV))

    def __post_init__(self) -> None:
        self.name, self.binary = "claude-code", "claude"
        self.first_request_tokens = 3000  # with the Bash, Read, Edit tools (a probe: 3,003)

    def configure(self, home: Path, server: ModelServer, proxy: Proxy | None) -> dict[str, str]:
        config_dir = home / ".claude"
        config_dir.mkdir(parents=True, exist_ok=True)
        env = {
            "CLAUDE_CONFIG_DIR": str(config_dir),
            "ANTHROPIC_BASE_URL": server.base_url,
            "ANTHROPIC_API_KEY": server.api_key,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_AUTOUPDATER": "1",
            "DISABLE_ERROR_REPORTING": "1",
        }
        served = self.context_window or served_window(server, proxy)
        cap = self.max_output_tokens if self.max_output_tokens is not None else output_cap(served)
        if cap is not None:
            env[OUTPUT_ENV] = str(cap)
        if window := compacting(served):  # the server asked once for both settings
            env.update(compaction_env(window))
        return env

    def command(self, exe: Path, prompt: str, workdir: Path, home: Path, server: ModelServer) -> list[str]:
        argv = [str(exe), "-p", "--model", server.model, "--output-format", "text",
                "--no-session-persistence", "--allowedTools", " ".join(self.allowed_tools)]
        if self.tools is not None:
            argv += ["--tools", ",".join(self.tools)]
        return [*argv, *self.extra_args, "--", prompt]
