"""Claude Code (``claude -p``) against any Anthropic-Messages server, through the proxy.

Why ``--allowedTools`` and not ``--dangerously-skip-permissions``: the latter is refused when
running as root (CI containers), the former pre-approves exactly the tools a session may use.
``CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`` turns off telemetry, error reports, update checks and
the extra model calls (titles), so every call the proxy sees is a turn of the agent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .base import Harness, ModelServer, Proxy


@dataclass
class ClaudeCode(Harness):
    """``claude -p PROMPT``; ``tools`` limits the built-in tools offered (None = Claude's defaults)."""

    tools: tuple[str, ...] | None = ("Bash", "Read", "Edit")
    allowed_tools: tuple[str, ...] = ("Bash", "Read", "Edit")
    max_output_tokens: int | None = None
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.name, self.binary = "claude-code", "claude"

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
        if self.max_output_tokens is not None:
            env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = str(self.max_output_tokens)
        return env

    def command(self, exe: Path, prompt: str, workdir: Path, home: Path, server: ModelServer) -> list[str]:
        argv = [str(exe), "-p", "--model", server.model, "--output-format", "text",
                "--no-session-persistence", "--allowedTools", " ".join(self.allowed_tools)]
        if self.tools is not None:
            argv += ["--tools", ",".join(self.tools)]
        return [*argv, *self.extra_args, "--", prompt]
