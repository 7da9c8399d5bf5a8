"""One completion as every wire format sees it: tokens arriving (sampled or scripted), their text,
and the incremental parse into reasoning / content / tool-call deltas.

Why shared: chat, responses and messages differ only in how they print these events, so the same
tokens give the same text and tool calls on every API, streaming or not.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from .detokenizer import Detokenizer
from .engine import Engine, Finish, SamplingParams, TokenStep  # noqa: F401 - Finish re-exported
from .hermes_stream import HermesStream, ToolCallDelta, partial_tag_overlap
from .parse import THINK_END, THINK_START, parse_turn, split_reasoning


#: Generation threads running now, with their stop events: a server's stop ends them (see
#: :func:`stop_generation`) - a stream cut at a stop left its thread sampling after the event loop
#: closed, and the process aborted (SIGABRT) as the interpreter went down under it.
_RUNNING: dict[threading.Thread, threading.Event] = {}


def stop_generation(timeout_s: float) -> None:
    """Ask every generation thread to stop and wait up to ``timeout_s`` for them (each checks its
    stop event between tokens)."""
    for stop in list(_RUNNING.values()):
        stop.set()
    for thread in list(_RUNNING):
        thread.join(timeout_s)


async def iterate_in_thread(make: Callable[[Callable[[], bool]], Iterator[TokenStep]],
                            delay_s: float = 0.0) -> AsyncIterator[TokenStep]:
    """Run a blocking token iterator in a worker thread and yield its items as they come.

    When the consumer stops early (client gone), the worker sees ``cancelled()`` and ends.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()
    done = object()

    def put(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop closed (the server stopped): nobody reads any more
            stop.set()

    def work() -> None:
        try:
            for item in make(stop.is_set):
                put(item)
                if stop.is_set():
                    break
        except BaseException as exc:  # forwarded to the request, which answers with an error
            put(exc)
        finally:
            put(done)
            _RUNNING.pop(threading.current_thread(), None)

    thread = threading.Thread(target=work, name="polar-generate", daemon=True)
    _RUNNING[thread] = stop
    thread.start()
    try:
        first = True
        while True:
            item = await queue.get()
            if item is done:
                return
            if isinstance(item, BaseException):
                raise item
            # always give the loop a turn: a queue that is never empty would otherwise starve
            # other tasks (the disconnect watch of a non-streamed request among them)
            await asyncio.sleep(delay_s if delay_s and isinstance(item, TokenStep) and not first else 0)
            first = False
            yield item
    finally:
        stop.set()


@dataclass
class Delta:
    """What one step adds: text deltas and the tool calls' streamed pieces."""

    reasoning: str = ""
    content: str = ""
    #: the tool-call entries vLLM's hermes parser streams now (chat's ``delta.tool_calls``)
    call_deltas: list[ToolCallDelta] = field(default_factory=list)

    def empty(self) -> bool:
        """Nothing for a chat delta (a call's closing adds none: its pieces went before)."""
        return not (self.reasoning or self.content or self.call_deltas)


class CompletionState:
    """Accumulates tokens; ``push`` returns the parse delta they add (prefix-safe while streaming)."""

    def __init__(self, engine: Engine, tools_enabled: bool,
                 params: SamplingParams | None = None) -> None:
        self.engine = engine
        self.tools_enabled = tools_enabled
        #: text a stream holds back because it may be the start of a stop string (vLLM's)
        self.holdback = params.stream_holdback if params is not None else 0
        self.detokenizer = Detokenizer(engine.tokenizer,
                                       params.skip_special_tokens if params is not None else True)
        self.steps: list[TokenStep] = []
        self.finish: Finish | None = None
        self.sent_reasoning = ""
        self.sent_content = ""
        self.hermes = HermesStream()
        self.text = ""
        self.parsed = None

    @property
    def token_ids(self) -> list[int]:
        return [s.token_id for s in self.steps]

    def _text_ids(self) -> list[int]:
        ids = self.token_ids
        if self.finish is not None and self.finish.drop_last:
            return ids[:-1]  # a stop token is not part of the text (unless asked to be)
        if ids and ids[-1] in self.engine.stop_token_ids:
            ids = ids[:-1]  # vLLM never prints the model's stop token in the text
        return ids

    def _decode(self) -> str:
        # vLLM's incremental text: it never ends in half a character, and tokens that never
        # complete one are left out (" \xf0\x9f" at the end drops its space too)
        text = self.detokenizer.feed(self._text_ids())
        if self.finish is not None and self.finish.text_end is not None:
            return text[:self.finish.text_end]
        if self.finish is not None and isinstance(self.finish.stop_reason, str):
            cut = text.find(self.finish.stop_reason)
            if cut >= 0:
                text = text[:cut]
        return text

    def _split(self, text: str) -> tuple[str | None, str]:
        """(reasoning, content text) that can be sent now: the content text only grows from
        step to step (a think block is reasoning once it opened with ``<think>``)."""
        if text and THINK_START.startswith(text) and text != THINK_START:
            return None, ""
        if not text.startswith(THINK_START):
            return None, text
        body = text[len(THINK_START):]
        if THINK_END not in body:
            r = body.lstrip("\n")
            return r[: len(r) - partial_tag_overlap(r, THINK_END)].rstrip("\n"), ""
        reasoning, rest = split_reasoning(text)
        if rest == "" and not body.endswith(THINK_END + "\n\n"):
            return reasoning, ""
        return reasoning, rest

    def push(self, step: TokenStep) -> Delta:
        """Add one token; returns what it adds (everything left when it is the last one)."""
        step.before = tuple(s.token_id for s in self.steps[-4:])
        self.steps.append(step)
        if step.finish is not None:
            self.finish = step.finish
            return self._final_delta()
        text = self._decode()
        if self.holdback:
            text = text[:max(0, len(text) - self.holdback)]
        reasoning, content = self._split(text)
        return self._diff(reasoning or "", content)

    def _diff(self, reasoning: str, content: str, finished: bool = False) -> Delta:
        """The step's delta from the sendable reasoning and the content text so far: with tools,
        the content and the calls' pieces as vLLM's streaming hermes parser sends them."""
        d = Delta()
        if reasoning.startswith(self.sent_reasoning) and len(reasoning) > len(self.sent_reasoning):
            d.reasoning = reasoning[len(self.sent_reasoning):]
            self.sent_reasoning = reasoning
        if self.tools_enabled:
            piece, d.call_deltas = self.hermes.feed(content, finished)
            d.content = piece or ""
        elif content.startswith(self.sent_content) and len(content) > len(self.sent_content):
            d.content = content[len(self.sent_content):]
            self.sent_content = content
        return d

    def _final_delta(self) -> Delta:
        self.text = self._decode()
        self.parsed = parse_turn(self.text, self.tools_enabled)
        _, content = split_reasoning(self.text)
        return self._diff(self.parsed.reasoning or "", content, finished=True)

    def final(self):
        """The complete parse (after the Finish was pushed), as vLLM's non-streamed parser reads the
        text: its calls have ids of their own (a stream's entries are no final response's)."""
        return self.parsed

    @property
    def completion_text(self) -> str:
        return self.text


