"""Pi (``pi -p``) against any OpenAI Chat Completions server, through the proxy.

Why ``models.json``: it is Pi's documented way to add a provider (``api: openai-completions``); its
``apiKey`` field holds the *name* of an environment variable, so no key is written to disk.
``PI_OFFLINE=1`` stops update checks and install telemetry. The compat flags are the ones Pi's docs
give for vLLM/SGLang (no ``developer`` role, no ``reasoning_effort``). Why ``contextWindow`` is
the server's ``max_model_len``: a guess larger than the server's limit lets the session outgrow it,
and Pi then exits 0 with no answer after its compaction call fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from .base import Harness, ModelServer, Proxy, served_context_length, served_window  # noqa: F401 (re-exported)

API_KEY_ENV = "POLAR_API_KEY"
PROVIDER = "polar"
#: The context window when the server does not say its own (no ``max_model_len`` in /v1/models).
DEFAULT_CONTEXT_WINDOW = 65536


#: Pi's compaction defaults: it compacts when the context passes ``contextWindow - reserveTokens``,
#: keeps the last ``keepRecentTokens`` and asks the summary call for 0.8 x ``reserveTokens``.
PI_RESERVE_TOKENS, PI_KEEP_RECENT_TOKENS = 16384, 20000


def compaction_settings(window: int) -> dict[str, int]:
    """Pi's compaction settings for a server context of ``window`` tokens: a quarter of it each
    where the defaults do not fit. Below 64k the default reserve made Pi summarise after its
    answer (context > window - 16384) and ask that call for 13,107 tokens, which a 4k-16k server
    refused or spent; a quarter kept the sessions of a probe to their own calls from 8k up."""
    if window >= 4 * PI_RESERVE_TOKENS:
        return {}
    return {"reserveTokens": max(1, window // 4), "keepRecentTokens": max(1, window // 4)}


def context_window_of(server: ModelServer, proxy: Proxy | None = None) -> int:
    """:func:`served_window`, or :data:`DEFAULT_CONTEXT_WINDOW` where the server does not say."""
    return served_window(server, proxy) or DEFAULT_CONTEXT_WINDOW


def models_json(server: ModelServer, context_window: int, max_tokens: int, reasoning: bool) -> dict:
    """Pi's provider entry for one model on ``server``."""
    return {"providers": {PROVIDER: {
        "baseUrl": server.base_url + "/v1",
        "api": "openai-completions",
        "apiKey": API_KEY_ENV,
        "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
        "models": [{"id": server.model, "reasoning": reasoning, "contextWindow": context_window,
                    "maxTokens": max_tokens}],
    }}}


@dataclass
class Pi(Harness):
    """``pi -p --no-session``; ``context_window``: None asks the server (:func:`context_window_of`)."""

    tunnels: ClassVar[bool] = True
    context_window: int | None = None
    max_tokens: int = 1024
    reasoning: bool = True
    extra_args: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.name, self.binary = "pi", "pi"
        self.first_request_tokens = 1400  # a probe: 1,393
        self.smallest_context = 8192  # a probe's session ran from 6,144; 4,096 overflowed mid-session

    def configure(self, home: Path, server: ModelServer, proxy: Proxy | None) -> dict[str, str]:
        agent_dir = home / ".pi" / "agent"
        agent_dir.mkdir(parents=True, exist_ok=True)
        window = self.context_window or context_window_of(server, proxy)
        spec = models_json(server, window, self.max_tokens, self.reasoning)
        (agent_dir / "models.json").write_text(json.dumps(spec, indent=2) + "\n", "utf-8")
        _merge_settings(agent_dir, compaction_settings(window))
        return {"PI_CODING_AGENT_DIR": str(agent_dir), "PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1",
                "PI_TELEMETRY": "0", API_KEY_ENV: server.api_key}

    def command(self, exe: Path, prompt: str, workdir: Path, home: Path, server: ModelServer) -> list[str]:
        return [str(exe), "-p", "--no-session", "--provider", PROVIDER, "--model", server.model,
                *self.extra_args]

    def prompt_input(self, prompt: str) -> str | None:
        """Pi's parser has no ``--``: it refuses an argument that starts with ``-`` and reads one that
        starts with ``@`` as a file to attach. Piped stdin is taken as the message as it is (trimmed)."""
        return prompt


#: What polar-train last wrote into settings.json's ``compaction`` (a reused home's next session
#: replaces it; values the file held otherwise are the caller's and stay).
_WRITTEN = ".polar-compaction.json"


def _merge_settings(agent_dir: Path, compaction: dict[str, int]) -> None:
    """Put ``compaction`` values into Pi's settings.json where the caller sets none: a ``--home``
    of the caller's may hold settings of its own (they stay, and win). Values an earlier session
    wrote for another server are taken back first (they would hold a 4k server's reserve against a
    128k one)."""
    from .base import HarnessError

    path, written_path = agent_dir / "settings.json", agent_dir / _WRITTEN
    settings: object = {}
    try:
        written = json.loads(written_path.read_text("utf-8")) if written_path.exists() else {}
        if path.exists():
            settings = json.loads(path.read_text("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise HarnessError(f"{path if path.exists() else written_path}: not readable JSON ({exc}); "
                           "fix or remove it") from None
    if not isinstance(settings, dict) or not isinstance(settings.get("compaction", {}), dict):
        raise HarnessError(f"{path}: expected a JSON object with an object `compaction`; fix or remove it")
    if not compaction and not written:
        return  # nothing of ours there, nothing to add: the file is not touched
    own = dict(settings.get("compaction", {}))
    if isinstance(written, dict):
        own = {k: v for k, v in own.items() if not (k in written and written[k] == v)}
    ours = {k: v for k, v in compaction.items() if k not in own}
    merged = {**ours, **own}
    if merged:
        settings["compaction"] = merged
    else:
        settings.pop("compaction", None)
    path.write_text(json.dumps(settings, indent=2) + "\n", "utf-8")
    if ours:
        written_path.write_text(json.dumps(ours) + "\n", "utf-8")
    else:
        written_path.unlink(missing_ok=True)
