"""OpenAI Codex CLI (``codex exec``) against any Responses-API server, through the proxy.

Why a ``config.toml`` model provider: it is how a user points Codex at their own server
(``wire_api = "responses"``); the key is named by ``env_key`` and only lives in the environment.
Codex trusts the proxy's CA through ``CODEX_CA_CERTIFICATE``/``SSL_CERT_FILE`` (it does not read
``NODE_EXTRA_CA_CERTS``: the CLI is a native binary).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .base import Harness, ModelServer, Proxy, compacting_window

#: Name of the environment variable that carries the API key (``env_key`` in config.toml).
API_KEY_ENV = "POLAR_API_KEY"
PROVIDER = "polar"
LAST_MESSAGE_FILE = "last-message.txt"


def _toml_value(value: object) -> str:
    """TOML for the scalars/lists we write (JSON strings are valid TOML basic strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def config_toml(server: ModelServer, extra: dict[str, object] | None = None) -> str:
    """The private ``$CODEX_HOME/config.toml``: one model provider, no update check, no analytics."""
    top = {"model": server.model, "model_provider": PROVIDER, "check_for_update_on_startup": False,
           **(extra or {})}
    lines = [f"{k} = {_toml_value(v)}" for k, v in top.items()]
    lines += ["", f"[model_providers.{PROVIDER}]", f'name = "{PROVIDER}"',
              f"base_url = {_toml_value(server.base_url + '/v1')}", 'wire_api = "responses"',
              f'env_key = "{API_KEY_ENV}"', "", "[analytics]", "enabled = false", ""]
    return "\n".join(lines)


#: System prompt of the model-catalog entry (Codex requires one there; its built-in prompt is not
#: reachable from config). Short on purpose: it names the two tools the model edits with.
DEFAULT_BASE_INSTRUCTIONS = (
    "You are Codex, a coding agent running in a terminal in the user's repository. Run commands with "
    "exec_command and edit files with apply_patch. Be precise and concise."
)
MODEL_CATALOG_FILE = "model_catalog.json"


def model_catalog(model: str, base_instructions: str) -> dict:
    """A ``model_catalog_json`` with one entry for ``model`` that asks for the freeform apply_patch tool.

    Why: for a model it does not know, Codex 0.171 offers no apply_patch at all; an entry with
    ``apply_patch_tool_type = "freeform"`` makes it offer the ``custom`` (grammar) tool, as it does for
    OpenAI's models. These are the fields Codex refuses the file without (checked on 0.171.0).
    """
    return {"models": [{
        "slug": model, "display_name": model, "apply_patch_tool_type": "freeform",
        "supported_reasoning_levels": [], "shell_type": "shell_command", "visibility": "list",
        "supported_in_api": True, "priority": 1, "support_verbosity": False,
        "truncation_policy": {"mode": "tokens", "limit": 10000}, "experimental_supported_tools": [],
        "prefer_websockets": False, "base_instructions": base_instructions,
    }]}


@dataclass
class Codex(Harness):
    """``codex exec`` non-interactively: no approvals, no sandbox (CI has none), stdin closed.

    ``freeform_apply_patch``: describe the model in a model catalog so that Codex also offers its
    ``apply_patch`` tool (a ``custom`` tool with a Lark grammar), with ``base_instructions`` as the
    system prompt. Off: Codex's fallback for unknown models (its own prompt, no apply_patch).

    ``context_window``: ``model_context_window`` in config.toml, so that Codex compacts the
    conversation before the server refuses it (None: the server's ``max_model_len``, asked the
    way the session reaches it; left out where the server does not say, or says less than
    :data:`~polar_train.harnesses.base.MIN_COMPACTING_WINDOW`). Without it, Codex knows
    no window for a model it does not know: a session past the server's context length ended in
    the server's 400 instead of a compaction.
    """

    extra_config: dict[str, object] = field(default_factory=dict)
    freeform_apply_patch: bool = False
    context_window: int | None = None
    base_instructions: str = DEFAULT_BASE_INSTRUCTIONS

    def __post_init__(self) -> None:
        self.name, self.binary = "codex", "codex"
        self.first_request_tokens = 8800  # a probe: 8,692-8,772

    def configure(self, home: Path, server: ModelServer, proxy: Proxy | None) -> dict[str, str]:
        codex_home = home / ".codex"
        codex_home.mkdir(parents=True, exist_ok=True)
        extra = dict(self.extra_config)
        if "model_context_window" not in extra:
            if window := compacting_window(self.context_window, server, proxy):
                extra["model_context_window"] = window
        if self.freeform_apply_patch:
            catalog = codex_home / MODEL_CATALOG_FILE
            catalog.write_text(json.dumps(model_catalog(server.model, self.base_instructions), indent=2), "utf-8")
            extra["model_catalog_json"] = str(catalog)
        (codex_home / "config.toml").write_text(config_toml(server, extra), "utf-8")
        env = {"CODEX_HOME": str(codex_home), API_KEY_ENV: server.api_key}
        if proxy is not None and proxy.ca_cert is not None:
            env["CODEX_CA_CERTIFICATE"] = str(proxy.ca_cert)
            env["SSL_CERT_FILE"] = str(proxy.ca_cert)
        return env

    def command(self, exe: Path, prompt: str, workdir: Path, home: Path, server: ModelServer) -> list[str]:
        return [str(exe), "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                "--ephemeral", "--color", "never", "-C", str(workdir),
                "-o", str(home / LAST_MESSAGE_FILE), "--", prompt]

    def final_message(self, stdout: str, home: Path) -> str:
        path = home / LAST_MESSAGE_FILE
        return path.read_text("utf-8").strip() if path.exists() else stdout.strip()
