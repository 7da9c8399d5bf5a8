"""Token ids from a chat template: for calls whose server returned none (Messages, hosted APIs).

Why the model's own tokenizer and template: vLLM renders the prompt with exactly that template and
tokenises without adding special tokens, so rendering the equivalent chat messages gives the ids the
server saw; ``usage`` counts (and optionally the server's ``/tokenize``) tell whether it did. The
completion is re-encoded from its text: exact for what the template prints, but a sampler may
have picked a non-canonical split of the same text, which ``usage_match`` then shows.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..wire.render import media_part, render

log = logging.getLogger("polar_capture")


class TokenizerUnavailable(ValueError):
    """``polar_tokenizer`` names a folder whose tokenizer does not load: said once in the log, and
    in each rendered call's row (``error``), without a traceback per call."""


class UnencodableText(ValueError):
    """A text holds a UTF-16 surrogate that no other one pairs with: no tokenizer encodes it (the
    call keeps no token ids; its row says why, without a traceback per call)."""


class UnrenderableMedia(ValueError):
    """A prompt holds an image (or audio, a file): a multimodal model's processor makes its tokens,
    which no chat template prints. Rendered without it, the call's ids were those of a prompt
    the model never saw, in an ``ok`` row that ``build`` trained on (a probe)."""


class UnrenderableReply(ValueError):
    """A reply the template cannot print as it was sampled: cut (``max_tokens``) inside a tool call
    or a think block - the template closes what the model never closed -, or rendered longer than
    the server counted. Rendered anyway, a cut Claude Code call was trained as a complete tool
    call the model never produced (a probe)."""


#: Finish reasons of a reply cut before its end (chat/Responses ``length``; Messages ``max_tokens``,
#: ``stop_sequence``).
CUT_REASONS = frozenset({"length", "max_tokens", "stop_sequence"})


def unsampled_rendering(assistant: dict[str, Any], finish_reason: str | None, surplus: str,
                        closing: str) -> str | None:
    """Why a reply's rendering holds tokens that were never sampled, or None. ``surplus``: the text
    of the rendered tokens past the server's count (empty where it counted as many or more)."""
    if finish_reason in CUT_REASONS and (
            assistant.get("tool_calls") or (assistant.get("reasoning") and not assistant.get("content"))):
        where = "a tool call" if assistant.get("tool_calls") else "its thinking"
        return (f"the reply was cut ({finish_reason}) inside {where}: the template would close what the model "
                "never closed")
    # vLLM's qwen3 reasoning parser makes all text before a </think> reasoning: a model that ended
    # its turn without closing its thinking answers with thinking only, which the template closes
    # (tokens past the server's count holding the </think>); one that closed it counted them
    if (assistant.get("reasoning") and not assistant.get("content") and not assistant.get("tool_calls")
            and "</think>" in surplus):
        return (f"the reply is thinking only and the server counted fewer tokens than the rendering, whose last ones "
                f"({surplus!r}) close the thinking: the model ended its turn without closing it")
    # vLLM's non-streamed parser returns a call cut before its </tool_call> as a whole one: the
    # tokens past the server's count are then the template's closing of the call (a text's
    # re-encoding may count more tokens than were sampled without any cut: not looked at)
    if assistant.get("tool_calls") and surplus and any(
            end.endswith(surplus) for end in (f"\n</tool_call>{closing.rstrip()}", "\n</tool_call>")):
        return (f"the reply was cut before its end: the server counted fewer tokens than the rendering, whose last "
                f"ones ({surplus!r}) close the call and the turn and were never sampled")
    return None


#: A UTF-16 surrogate that no other one pairs with (in a str only where JSON escaped it: ``"\\ud83d"``).
_LONE_SURROGATE = re.compile("[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]")


#: An empty think block at the start of a rendered turn (Qwen3's template prints one before the last
#: assistant turn whatever the reply held).
_EMPTY_THINK = re.compile(r"\A<think>\n*</think>\n\n")  # (not the reply's own leading spaces)


def whole_code_points(text: str) -> str:
    """``text`` with each surrogate pair joined into its character. A server that cuts its stream
    by UTF-16 code unit (JavaScript's) sends an emoji as ``"A\\ud83d"`` then ``"\\ude00B"``: joined,
    the reply holds the pair, which the tokenizer refused (a TypeError, and the call lost its ids)."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")  # (the common case, in C: a search for surrogates cost ~6 ms per 1.2 M characters)
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le")
    except UnicodeDecodeError:
        lone = _LONE_SURROGATE.search(text)  # (what made the decode fail)
        where = f" (\\u{ord(lone.group()):04x} at character {lone.start()})" if lone else ""
        raise UnencodableText(f"the text holds an unpaired UTF-16 surrogate{where}, which no tokenizer encodes") from None


class Renderer:
    """Loads the tokenizer lazily (in the row worker, never on mitmproxy's event loop)."""

    def __init__(self, tokenizer_dir: str) -> None:
        self.tokenizer_dir = tokenizer_dir
        self._tok = None
        self._closing: str | None = None
        self._failed: str | None = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._failed is not None:
                raise TokenizerUnavailable(self._failed)
            if self._tok is None:
                from polar_train.model_load import first_line
                from polar_train.tokenizer import load_tokenizer

                try:
                    self._tok = load_tokenizer(Path(self.tokenizer_dir).expanduser())
                except Exception as exc:  # a broken folder: every later call gets the same answer at once
                    self._failed = f"polar_tokenizer {self.tokenizer_dir}: cannot load it: {first_line(exc)}"
                    log.error("polar_capture: %s; calls that need rendering get no token ids", self._failed)
                    raise TokenizerUnavailable(self._failed) from None
            return self._tok

    def preload(self) -> None:
        """Load the tokenizer before the first call needs it; a folder that does not load is said
        once (by :attr:`tokenizer`), not followed by a traceback of this job."""
        try:
            self.tokenizer
        except TokenizerUnavailable:
            pass

    def _template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                  add_generation_prompt: bool, kwargs: dict[str, Any] | None = None) -> str:
        """The server's own rendering (:func:`polar_train.wire.render.render`: vLLM's normalisation
        of tools and tool-call arguments, then the chat template, with the request's kwargs)."""
        return render(self.tokenizer, messages, tools, add_generation_prompt=add_generation_prompt, kwargs=kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(whole_code_points(text), add_special_tokens=False))

    def prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                   kwargs: dict[str, Any] | None = None) -> list[int]:
        if where := media_part(messages):
            raise UnrenderableMedia(f"the prompt holds a media part ({where}), whose tokens a multimodal model's "
                                    "processor makes, not its chat template")
        return self.encode(self._template(messages, tools, True, kwargs))

    def completion_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       assistant: dict[str, Any], stopped: bool, kwargs: dict[str, Any] | None = None) -> list[int]:
        """The assistant turn as the template prints it after the generation prompt.

        Ends with the end-of-turn token only when the model stopped by itself (``stopped``); the
        newline the template adds after it is never sampled, so it is dropped.
        """
        closing = self.turn_closing()
        prompt = self._template(messages, tools, True, kwargs)
        full = self._template([*messages, assistant], tools, False, kwargs)
        if full.startswith(prompt):
            suffix = full[len(prompt):]
            if not assistant.get("reasoning") and \
                    not str(assistant.get("content") or "").lstrip().startswith("<think>"):
                # a template that prints a think block before every last assistant turn (Qwen3's, an
                # empty one where the reply had no reasoning): the model sampled none of it (a probe:
                # 4 tokens per call trained that no sampler drew, and the next call's prompt, which
                # prints the turn without it, forked the session)
                suffix = _EMPTY_THINK.sub("", suffix, count=1)
            for end in (closing, closing.rstrip()):  # (a last turn the template ends without its newline)
                if end and suffix.endswith(end):
                    suffix = suffix[: -len(end)]
                    break
        else:  # a template that rewrites earlier turns: fall back to the text itself
            suffix = assistant.get("content") or ""
        ids = self.encode(suffix)
        if stopped and (end_ids := self.encode(closing)):
            ids.append(end_ids[0])
        return ids

    def turn_closing(self) -> str:
        """What the template prints after an assistant turn's text: ``<|im_end|>\n`` (ChatML),
        ``<end_of_turn>\n`` (Gemma), ``<|eot_id|>`` (Llama 3); its first token is the one the model
        samples to end the turn. Taken as the tokenizer's ``eos_token`` (+ newline), a Gemma or
        Llama-3 turn kept its closing in the completion, never sampled, and trained."""
        if self._closing is None:
            marker = "\u2063polar-turn-end\u2063"
            try:
                text = self._template([{"role": "user", "content": "x"}, {"role": "assistant", "content": marker}],
                                      None, False)
                closing = text[text.index(marker) + len(marker):] if marker in text else ""
            except Exception:  # noqa: BLE001 - a template that refuses this conversation: ChatML's
                closing = ""
            if not closing or not self.encode(closing):
                closing = f"{self.tokenizer.eos_token or '<|im_end|>'}\n"
            self._closing = closing
        return self._closing


def server_tokenize(base_url: str, model: str | None, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None, timeout: float = 30, insecure: bool = False,
                    kwargs: dict[str, Any] | None = None) -> list[int]:
    """The upstream's own rendering of chat ``messages`` (vLLM and ``polar-train serve`` have it).

    Straight to the upstream, as the proxy reaches it: never through the ``HTTP(S)_PROXY`` of
    mitmdump's environment (a proxy there failed every check), and with ``insecure`` (mitmproxy's
    ``ssl_insecure``) trusting its certificate as the proxy does."""
    body: dict[str, Any] = {"messages": [_chat_api_message(m) for m in messages], "add_generation_prompt": True}
    if model:
        body["model"] = model
    if tools:
        body["tools"] = tools
    if kwargs:  # the request's template kwargs (its reasoning effort): the server renders with them too
        body["chat_template_kwargs"] = kwargs
    req = urllib.request.Request(base_url.rstrip("/") + "/tokenize", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
    if insecure:
        import ssl

        handlers.append(urllib.request.HTTPSHandler(context=ssl._create_unverified_context()))  # noqa: S323
    try:
        with urllib.request.build_opener(*handlers).open(req, timeout=timeout) as resp:  # noqa: S310 - the user's upstream
            data = json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # the server's own words, not only its status line
        raise ValueError(f"HTTP {exc.code}: {_error_message(exc.read())}") from None
    tokens = data.get("tokens")
    if not isinstance(tokens, list):
        raise ValueError("/tokenize answered without tokens")
    return [int(t) for t in tokens]


#: Responses content parts that hold plain text: vLLM's chat /tokenize takes them only as ``text``
#: (it refused every Codex call's check with a 400 on ``input_text``).
_TEXT_PARTS = ("input_text", "output_text")


def _chat_api_message(message: dict[str, Any]) -> dict[str, Any]:
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [{"type": "text", "text": p["text"]} if isinstance(p, dict) and p.get("type") in _TEXT_PARTS
             and isinstance(p.get("text"), str) else p for p in content]
    return {**message, "content": parts}


def _error_message(body: bytes, limit: int = 300) -> str:
    """An error body's ``error.message`` (vLLM's shape), else its text, cut to ``limit`` characters."""
    text = body.decode("utf-8", "replace")
    try:
        err = json.loads(text).get("error")
        text = err.get("message") if isinstance(err, dict) and isinstance(err.get("message"), str) else text
    except (ValueError, AttributeError):
        pass
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
