"""OpenAI Responses (``/v1/responses``, Codex CLI): injection, stripping, reassembly.

vLLM (0.32) returns server-exact ids here only when asked: ``enable_response_messages: true``
puts ``input_messages`` / ``output_messages`` (``[{message, tokens, type: raw_message_tokens}]``)
into the final response (streaming: only into ``response.completed``), and logprobs need
``include: ["message.output_text.logprobs"]`` plus ``top_logprobs``. Without those flags the
server sends ``input_messages: null``, ``top_logprobs: null``, ``logprobs: null`` in finished
content parts and ``logprobs: []`` in deltas; stripping restores exactly that.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ..wire.errors import ApiError
from ..wire.lax import lax_bool_or_none, lax_int, lax_true
from ..wire.responses import (CUSTOM_INPUT_KEY, NAMESPACE_SEPARATOR, chat_tools, input_messages,
                              request_template_kwargs)
from .byte_text import byte_text
from .id_arrays import as_list, parse_ids
from .grammar import LOGPROB_LIST, STR, TEXT_LOGPROB_ENTRIES, text_ids_end
from .json_members import (SKIPPED, EchoCache, Member, PrefixCache, Skipper, as_dict, members, objects, remember,
                           replacements, skippers, splice_bytes, unique)
from .parsed import Injection, ParsedCall, as_float, as_int, error_text, int_list
from .sse import named_event_data

API = "openai.responses"
#: The event that ends a stream (what the row calls its final event; also .incomplete / .failed).
FINAL_EVENT = "response.completed"
INJECTS = True
LOGPROBS_INCLUDE = "message.output_text.logprobs"
FINAL_EVENTS = ("response.completed", "response.incomplete", "response.failed")
#: A response with one of these statuses holds no finished call (``incomplete`` does: a length cut).
FAILED_STATUSES = ("failed", "cancelled")


def inject(body: dict[str, Any]) -> Injection:
    include = body.get("include") if isinstance(body.get("include"), list) else []
    asked = {
        "response_messages": lax_true(body.get("enable_response_messages")),
        "logprobs": LOGPROBS_INCLUDE in include,
        "has_top_logprobs": "top_logprobs" in body,
        # as the server reads and echoes it ("1" is 1)
        "top_logprobs": 0 if body.get("top_logprobs") is None  # (null is read as 0, and echoed so)
        else body.get("top_logprobs") if lax_int(body.get("top_logprobs")) is None
        else lax_int(body.get("top_logprobs")),
    }
    new = dict(body)
    changed = False
    # a value the server refuses stays as sent (its 400 for the client; the field is no Optional one:
    # null too), and no logprobs are asked for where the client's top_logprobs, unread without them,
    # might then be refused (past the server's --max-logprobs, -1): any but 0
    messages = body.get("enable_response_messages", False)
    if not asked["response_messages"] and messages is not None and lax_bool_or_none(messages):
        new["enable_response_messages"] = True
        changed = True
    top_unread = body.get("top_logprobs") is not None and lax_int(body.get("top_logprobs")) != 0
    if not asked["logprobs"] and isinstance(body.get("include"), (list, type(None))) and not top_unread:
        new["include"] = [*include, LOGPROBS_INCLUDE]
        changed = True
    if body.get("top_logprobs") is None:  # a value the server refuses is its to answer (a 400)
        new["top_logprobs"] = 0
        changed = True
    return Injection(new, asked, changed)


def _strip_content(content: Any) -> bool:
    changed = False
    for part in content if isinstance(content, list) else ():
        if isinstance(part, dict) and isinstance(part.get("logprobs"), list) and part["logprobs"]:
            part["logprobs"] = None
            changed = True
    return changed


def _response_changes(resp: dict[str, Any], asked: dict[str, Any]) -> dict[str, Any]:
    """The members of a response object that must go back to what the client would have got
    without our injection (key -> new value; the output's parts lose their logprobs in place)."""
    changes: dict[str, Any] = {}
    if not asked.get("response_messages"):
        for key in ("input_messages", "output_messages"):
            if resp.get(key) is not None:
                changes[key] = None
    # vLLM echoes the logprobs it sampled with: none unless the client asked for them ("top_logprobs":
    # 0 sent without the include is echoed null), the client's own value where it did
    if not asked.get("logprobs") and resp.get("top_logprobs") is not None:
        changes["top_logprobs"] = None
    elif asked.get("logprobs") and asked.get("has_top_logprobs") and resp.get("top_logprobs") != asked.get("top_logprobs"):
        changes["top_logprobs"] = asked.get("top_logprobs")
    if not asked.get("logprobs"):
        output = resp.get("output")
        stripped = False
        for item in output if isinstance(output, list) else ():
            if isinstance(item, dict):
                stripped |= _strip_content(item.get("content"))  # every item, no short cut
        if stripped:
            changes["output"] = output
    return changes


def _strip_response(resp: dict[str, Any], asked: dict[str, Any]) -> bool:
    changes = _response_changes(resp, asked)
    resp.update(changes)
    return bool(changes)


def strip(obj: dict[str, Any], asked: dict[str, Any]) -> bool:
    """Remove injected fields from a response body or a stream event (in place)."""
    if obj.get("object") == "response":
        return _strip_response(obj, asked)
    changed = False
    if isinstance(obj.get("response"), dict):
        changed |= _strip_response(obj["response"], asked)
    if not asked.get("logprobs"):
        kind = obj.get("type")
        if kind == "response.output_text.delta" and obj.get("logprobs"):
            obj["logprobs"] = []
            changed = True
        if isinstance(obj.get("part"), dict):
            changed |= _strip_content([obj["part"]])
        if isinstance(obj.get("item"), dict):
            changed |= _strip_content(obj["item"].get("content"))
    return changed


# vLLM 0.32's text delta event, exactly (compact JSON, its key order; strings, numbers and the
# logprobs list matched by their grammar, nothing loosely). Group 1: the logprobs list.
_TEXT_DELTA = re.compile(
    rb'event: response\.output_text\.delta\ndata: \{"content_index":\d+,"delta":' + STR + rb',"item_id":' + STR
    + rb',"logprobs":(' + LOGPROB_LIST + rb')'
    + rb',"output_index":\d+,"sequence_number":\d+,"type":"response\.output_text\.delta"\}\n\n')


# The envelope events (response.created, .in_progress, .completed, ...) as vLLM 0.32 writes them:
# {"response": {...}, "sequence_number": n, "type": "..."}, compact, one data line.
_ENVELOPE_EVENT = b"event: response."
_ENVELOPE_DATA = '{"response":'
_ENVELOPE_DATA_LINE = b"data: " + _ENVELOPE_DATA.encode()
_ENVELOPE_TAIL = re.compile(r',"sequence_number":(0|[1-9][0-9]*+),"type":"(response\.[a-z_]+)"\}')
_ENVELOPE_TAIL_BYTES = re.compile(_ENVELOPE_TAIL.pattern.encode())
# A list of raw message tokens (every prompt token id: tens of thousands, and the rendered prompt's
# text) is proven well-formed instead of parsed: the client gets it as sent, or as null. By pieces:
# json's own C string scanner for each message's text, C string methods for its ids
# (:func:`~.grammar.text_ids_end`), the fixed keys by comparison; the grammar's regex took ~1 ms
# per 10,000 ids, parsing them more.
_RAW_MESSAGE_HEAD = '{"message":"'
_RAW_MESSAGE_TOKENS = ',"tokens":'
_RAW_MESSAGE_TAIL = ',"type":"raw_message_tokens"}'
_scan_string = json.decoder.scanstring  # json.loads' own (C): strict, as loads is


def _skip_raw_messages(text: str, pos: int, read: list[dict[str, Any]] | None = None) -> int | None:
    """The end of a list of vLLM's raw message tokens at ``pos`` in its exact compact shape
    (``[{"message":STR,"tokens":[ids],"type":"raw_message_tokens"},...]``), else None. With
    ``read``, each message is also appended to it as ``json.loads`` reads it, its ids as an
    ``int32`` array (the row worker: :func:`final_event_json`; None also for ids past int32)."""
    if not text.startswith("[", pos):
        return None
    i = pos + 1
    if text.startswith("]", i):
        return i + 1
    while text.startswith(_RAW_MESSAGE_HEAD, i):
        try:
            message, i = _scan_string(text, i + len(_RAW_MESSAGE_HEAD))
        except ValueError:  # a broken string: the JSON path decides
            return None
        if not text.startswith(_RAW_MESSAGE_TOKENS, i):
            return None
        start = i + len(_RAW_MESSAGE_TOKENS)
        i = text_ids_end(text, start)
        if i is None or not text.startswith(_RAW_MESSAGE_TAIL, i):
            return None
        if read is not None:
            ids = parse_ids(text[start + 1:i - 1])
            if ids is None:
                return None
            read.append({"message": message, "tokens": ids, "type": "raw_message_tokens"})
        i += len(_RAW_MESSAGE_TAIL)
        if text.startswith("]", i):
            return i + 1
        if not text.startswith(",", i):
            return None
        i += 1
    return None


#: The request members vLLM echoes in every envelope event that a session repeats call after call.
ECHOED = {"instructions": EchoCache(), "tools": EchoCache()}
#: The same members in the requests themselves (as the harness writes them: other text than vLLM's),
#: and the conversation, resent one turn longer with every call.
REQUEST_ECHOED = {"instructions": EchoCache(), "tools": EchoCache(), "input": PrefixCache()}


def _envelope_skip(echoes: dict[str, EchoCache]) -> dict[str, Skipper]:
    """What a walk of a response object skips: raw message tokens by grammar, echoes by cache."""
    return {"input_messages": _skip_raw_messages, "output_messages": _skip_raw_messages, **skippers(echoes)}


_ENVELOPE_SKIP = _envelope_skip(ECHOED)

# The part and item events (response.content_part.done, response.output_item.done) and the final
# response repeat the output text's logprobs, one entry per sampled token; a list of entries is
# proven well-formed by a strict grammar instead of parsed, as it becomes null.
_LOGPROB_ENTRIES = re.compile(TEXT_LOGPROB_ENTRIES)
_PART_EVENTS = (b"event: response.content_part.done\ndata: {", b"event: response.output_item.done\ndata: {")

Cut = tuple[int, int, str]


def _skip_logprobs(text: str, pos: int) -> int | None:
    m = _LOGPROB_ENTRIES.match(text, pos)
    return m.end() if m is not None else None


class _ProvenLogprobs(EchoCache):
    """The logprob lists one stream has proven well-formed: a part's list comes again in
    ``response.output_item.done`` and in the final response, the same text each time.

    Why: the grammar proves ~4.5 entries per microsecond; a 1,000-token answer's list took ~0.22
    ms per event, three times per call. A remembered list is a proven array, which ends at its own
    ``]``: text that starts with it at a position holds exactly that value there (as in
    :class:`~.json_members.EchoCache`)."""

    def __init__(self) -> None:
        super().__init__(size=4)

    def skip(self, text: str, pos: int) -> int | None:
        """A :data:`~.json_members.Skipper` for ``logprobs``: a remembered list, else the grammar."""
        end = super().skip(text, pos)
        if end is None:
            end = _skip_logprobs(text, pos)
            if end is not None:
                self.remember(text, pos, end)
        return end


class _PartWalk:
    """Walks the output parts inside an event (a part, an item's content, a response's output)
    member by member, remembers each container's objects by where it starts, and gives the splices
    that null their logprobs as :func:`_strip_content` would (None: a repeated key somewhere, where
    only the JSON path knows which value counts). The parts' logprob lists are proven, not parsed
    (by ``proven``, the stream's own memory of them, or afresh)."""

    def __init__(self, proven: _ProvenLogprobs | None = None) -> None:
        self.walked: dict[int, list[list[Member]]] = {}
        self.part_skip = {"logprobs": (proven or _ProvenLogprobs()).skip}

    def part(self, text: str, pos: int) -> int:
        found, end = members(text, pos, self.part_skip)
        self.walked[pos] = [found]
        return end

    def item(self, text: str, pos: int) -> int:
        found, end = members(text, pos, {"content": self.content})
        self.walked[pos] = [found]
        return end

    def content(self, text: str, pos: int) -> int | None:
        if text[pos:pos + 1] != "[":
            return None  # parsed as it is: the JSON path ignores content that is not a list
        parts, end = objects(text, pos, self.part_skip)
        self.walked[pos] = parts
        return end

    def output(self, text: str, pos: int) -> int | None:
        if text[pos:pos + 1] != "[":
            return None
        items, end = objects(text, pos, {"content": self.content})
        self.walked[pos] = items
        return end

    def part_cuts(self, start: int) -> list[Cut] | None:
        cuts = []
        for part in self.walked[start]:
            if not unique(part):
                return None
            cuts += [(m.start, m.end, "null") for m in part if m.key == "logprobs"
                     and (m.value is SKIPPED or (isinstance(m.value, list) and m.value))]
        return cuts

    def item_cuts(self, start: int) -> list[Cut] | None:
        cuts: list[Cut] = []
        for item in self.walked[start]:
            more = self.nested_cuts(item, {"content": self.part_cuts}) if unique(item) else None
            if more is None:
                return None
            cuts += more
        return cuts

    def nested_cuts(self, found: list[Member], how: dict[str, Callable[[int], list[Cut] | None]]) -> list[Cut] | None:
        """The cuts inside each walked member of ``found`` whose key is in ``how``."""
        cuts: list[Cut] = []
        for m in found:
            if m.value is SKIPPED and m.key in how:
                more = how[m.key](m.start)
                if more is None:
                    return None
                cuts += more
        return cuts


def _one_data_line(raw: bytes, prefix: bytes | tuple[bytes, ...]) -> int | None:
    """Where the data of ``event: ...\\ndata: ...\\n\\n`` starts, for an event that starts with
    ``prefix`` (None: any other shape)."""
    return named_event_data(raw) if raw.startswith(prefix) else None


def _envelope_data(raw: bytes, prefix: bytes | tuple[bytes, ...]) -> int | None:
    """Where the data of an envelope event (``{"response":...``, one data line) starts, else None."""
    head = _one_data_line(raw, prefix)
    return head if head is not None and raw.startswith(_ENVELOPE_DATA_LINE, head - 6) else None


def _walk_envelope(raw: bytes, head: int, skip: dict[str, Skipper],
                   echoes: dict[str, EchoCache]) -> tuple[str, list[Member], int] | None:
    """The envelope's data as text of one character per byte (:func:`~.byte_text.byte_text`), its
    response object's members and where the object ends (None: not UTF-8 or not a well-formed
    object); the echoed members it parsed are remembered."""
    text = byte_text(raw[head:-2])
    if text is None:
        return None
    try:
        found, end = members(text, len(_ENVELOPE_DATA), skip)
    except ValueError:
        return None
    remember(echoes, text, found)
    return text, found, end


class _LastResponse:
    """The response object of a stream's last walked envelope event, as sent and as stripped.

    Why: vLLM writes ``response.created`` and ``response.in_progress`` with the same response
    object, byte for byte (tens of KiB with Codex's echo); the second costs one comparison."""

    def __init__(self) -> None:
        self.sent = self.stripped = b""


def _strip_envelope(raw: bytes, asked: dict[str, Any], last: _LastResponse | None = None,
                    proven: _ProvenLogprobs | None = None) -> bytes | None:
    """An envelope event with only the changed members of its response object re-encoded (None:
    not this shape, use the JSON path).

    Why: vLLM echoes the request in every envelope event (Codex's instructions and tool schemas,
    tens of KiB), and ``response.completed`` adds every prompt token id. The response object is
    walked member by member with json's own scanner (:mod:`.json_members`), the raw message tokens
    proven well-formed instead of parsed, the echoed instructions and tools skipped when an
    earlier event held the same text (:class:`~.json_members.EchoCache`), and only what
    :func:`_response_changes` names is replaced; the output's parts lose their logprobs by splices
    too (:class:`_PartWalk`). The event's head and tail are checked exactly and no key of the
    response object may repeat, so the JSON path changes the same object (the event has no other
    member), the result parses to what the JSON path gives, and an event it leaves alone passes
    byte for byte.
    """
    head = _envelope_data(raw, _ENVELOPE_EVENT)
    if head is None:
        return None
    start = head + len(_ENVELOPE_DATA)
    if last is not None and last.sent and raw.startswith(last.sent, start):
        end = start + len(last.sent)  # the same object: what follows it must be the tail
        if _ENVELOPE_TAIL_BYTES.fullmatch(raw, end, len(raw) - 2) is not None:
            return raw if last.stripped is last.sent else raw[:start] + last.stripped + raw[end:]
    walk = _PartWalk(proven)
    walked = _walk_envelope(raw, head, _ENVELOPE_SKIP if asked.get("logprobs")
                            else {**_ENVELOPE_SKIP, "output": walk.output}, ECHOED)
    if walked is None:
        return None
    text, found, end = walked
    if _ENVELOPE_TAIL.fullmatch(text, end) is None or not unique(found):
        return None  # a repeated key: only the JSON path knows which value counts
    changes = _response_changes(as_dict(found), asked)  # a walked output is no list here: unchanged
    if not changes.keys() <= {m.key for m in found}:
        return None  # a member to add, not replace: the JSON path does that
    cuts = walk.nested_cuts(found, {"output": walk.item_cuts})
    if cuts is None:
        return None
    cuts += replacements(found, changes)
    out = splice_bytes(raw, cuts, head) if cuts else raw
    if out is None:
        return None
    if last is not None:
        tail = len(text) - end + 2  # bytes after the object: the tail is ASCII
        last.sent = raw[start:len(raw) - tail]
        last.stripped = out[start:len(out) - tail] if cuts else last.sent
    return out


def _strip_part_event(raw: bytes, proven: _ProvenLogprobs | None = None) -> bytes | None:
    """A part or item event with its parts' logprobs nulled, parsing everything but them (None: not
    this shape, use the JSON path); only when the client did not ask for logprobs.

    The event's object and the part (``part``) or the item and its parts (``item.content``) are
    walked member by member (:class:`_PartWalk`); no key may repeat, and the event must be neither
    a response object nor a text delta - then the JSON path (:func:`strip`) nulls exactly the lists
    spliced here.
    """
    head = _one_data_line(raw, _PART_EVENTS)
    if head is None:
        return None
    walk = _PartWalk(proven)
    text = byte_text(raw[head:-2])  # one character per byte, as the envelopes: their logprob lists compare
    if text is None:
        return None
    try:
        found, end = members(text, 0, {"part": walk.part, "item": walk.item})
    except ValueError:  # also a content list with something other than objects in it
        return None
    obj = as_dict(found)
    if end != len(text) or not unique(found) or "object" in obj or "response" in obj \
            or obj.get("type") == "response.output_text.delta":
        return None
    cuts = walk.nested_cuts(found, {"part": walk.part_cuts, "item": walk.item_cuts})
    if cuts is None:
        return None
    if not cuts:
        return raw
    return splice_bytes(raw, cuts, head)


#: Events shorter than this go the JSON path: walking members costs ~1 us of Python per member,
#: parsing and re-serialising ~25-35 us per KiB in C; they break even near 2 KiB (a 0.6 KiB
#: response.created: 23 us JSON, 46 us walked; 20 KiB: 510 us JSON, 180 us walked).
WALK_FROM_BYTES = 2048


#: What :func:`strip` acts on: the keys ``response``, ``part``, ``item`` (``"response"`` is also
#: the value an ``object`` key needs), the one type whose ``logprobs`` it empties. An event whose
#: bytes hold none of them - and no ``\u`` escape, which could spell one - is left unchanged.
_STRIPPED_KEYS = (b'"response"', b'"part"', b'"item"', b"output_text.delta", b"\\u")


def _never_stripped(raw: bytes) -> bool:
    """Whether the JSON path would hand ``raw`` on as it is, whatever it parses to: nothing in it
    can name what :func:`strip` changes. Why: vLLM's ``output_text.done`` carries
    ``"logprobs":[]``, so the tap's marker test sent it to ``json.loads`` only to leave it alone
    (37 us median on the proxy's loop; it holds the whole answer's text)."""
    return not any(key in raw for key in _STRIPPED_KEYS)


def event_stripper(asked: dict[str, Any], walk_from: int = WALK_FROM_BYTES) -> Callable[[bytes], bytes | None]:
    """The stream hot path: a function that strips one event without parsing all of it (None: not
    handled, use the JSON path).

    Text deltas (one per sampled token): the injected ``logprobs`` are emptied by a splice; the
    whole event must match :data:`_TEXT_DELTA`, a strict grammar of vLLM's shape, so the result
    equals :func:`strip` + re-serialisation while every other byte stays as sent. Envelope events
    (:func:`_strip_envelope`; an envelope whose response object is the previous one's, as
    ``.in_progress`` repeats ``.created``, gets the same answer without a walk) and part/item
    events (:func:`_strip_part_event`) of ``walk_from`` bytes or more are walked member by member
    (a logprob list proven once is recognised in the item and the final response:
    :class:`_ProvenLogprobs`). Other events go the JSON way, unless nothing in them can name what
    :func:`strip` changes (:func:`_never_stripped`): those pass as they are.
    """
    match = _TEXT_DELTA.fullmatch
    last, proven = _LastResponse(), _ProvenLogprobs()

    def strip_event(raw: bytes) -> bytes | None:
        m = match(raw)
        if m is None:
            if len(raw) >= walk_from:
                if raw.startswith(_PART_EVENTS):
                    return None if asked.get("logprobs") else _strip_part_event(raw, proven)
                out = _strip_envelope(raw, asked, last, proven)
                if out is not None:
                    return out
            return raw if _never_stripped(raw) else None
        if asked.get("logprobs"):
            return raw
        a, b = m.span(1)
        return raw if b - a == 2 else b"".join((raw[:a], b"[]", raw[b:]))

    return strip_event


def sampling(request: dict[str, Any]) -> tuple[float | None, float | None]:
    return as_float(request.get("temperature")), as_float(request.get("top_p"))


def _concat_tokens(messages: Any) -> list[int] | np.ndarray | None:
    """The ids of a list of raw message tokens, one after the other (an array where the row worker
    read them as arrays: :func:`final_event_json`)."""
    if not isinstance(messages, list) or not messages:
        return None
    parts: list[Any] = []
    for m in messages:
        ids = m.get("tokens") if isinstance(m, dict) else None
        ids = ids if isinstance(ids, np.ndarray) else int_list(ids)
        if ids is None:
            return None
        parts.append(ids)
    if len(parts) == 1:
        return parts[0]
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.concatenate(parts)
    out: list[int] = []
    for p in parts:
        out.extend(as_list(p))
    return out


def parse_response(resp: dict[str, Any]) -> ParsedCall:
    """Fields of a final response object (non-streamed body or the final event's ``response``)."""
    parsed = ParsedCall(model=resp.get("model") if isinstance(resp.get("model"), str) else None)
    parsed.prompt_ids = _concat_tokens(resp.get("input_messages"))
    parsed.completion_ids = _concat_tokens(resp.get("output_messages"))
    usage = resp.get("usage")
    if isinstance(usage, dict):
        parsed.usage_prompt_tokens = as_int(usage.get("input_tokens"))
        parsed.usage_completion_tokens = as_int(usage.get("output_tokens"))
    texts: list[str] = []
    said = False  # a message item: the client sends it back (its text, "" too, a content of its own)
    reasoning: list[str] = []
    tool_calls: list[dict[str, Any]] = []
    lps: list[float] | None = []
    output = resp.get("output")
    for item in output if isinstance(output, list) else ():
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "message":
            said = True
            content = item.get("content")
            for part in content if isinstance(content, list) else ():
                if not isinstance(part, dict):
                    continue
                if isinstance(part.get("text"), str):
                    texts.append(part["text"])
                if lps is not None:
                    if isinstance(part.get("logprobs"), list):
                        for lp in part["logprobs"]:
                            v = lp.get("logprob") if isinstance(lp, dict) else None
                            if isinstance(v, (int, float)) and not isinstance(v, bool):
                                lps.append(float(v))
                            else:
                                lps = None
                                break
                    else:
                        lps = None
        elif kind == "reasoning":
            parts = [p for key in ("content", "summary") if isinstance(item.get(key), list) for p in item[key]]
            for part in parts:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    reasoning.append(part["text"])
        elif kind in ("function_call", "custom_tool_call"):
            tool_calls.append(_tool_call(item))
    ids = parsed.completion_ids
    if lps and ids is not None and len(lps) == len(ids):
        parsed.completion_logprobs = lps
    elif (lps and ids is not None and len(lps) == len(ids) - 1 and resp.get("status") == "completed"
          and not tool_calls and not reasoning):
        # vLLM reports logprobs for output_text only, so the end-of-turn token that closes a
        # completed answer has none: NaN there (= "the server reported none"), the rest aligned
        parsed.completion_logprobs = [*lps, float("nan")]
    elif lps and not tool_calls and not reasoning:  # (with those: text logprobs only, as documented)
        # another count (vLLM 0.32 streamed a long answer with one logprob short, where a token held
        # half a character): which token lacks one is unknown, so the row keeps none and says why
        parsed.completion_logprobs = lps
    status = resp.get("status")
    details = resp.get("incomplete_details") if isinstance(resp.get("incomplete_details"), dict) else {}
    if status in FAILED_STATUSES:
        err = resp.get("error")
        parsed.server_error = (f"the response {status}: {error_text(err)}" if err
                               else f"the response ended with status {status}")
    if status == "completed":
        parsed.finish_reason = "tool_calls" if tool_calls else "stop"
        parsed.stopped = True
    elif status == "incomplete":
        parsed.finish_reason = "length" if details.get("reason") == "max_output_tokens" else str(details.get("reason"))
    elif isinstance(status, str):
        parsed.finish_reason = status
    parsed.tool_call_count = len(tool_calls)
    # (no message item: no content - none, not "", which a template reading parts takes as a text)
    assistant: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if said else None}
    if reasoning:
        assistant["reasoning"] = "".join(reasoning)
    if tool_calls:
        assistant["tool_calls"] = tool_calls
    parsed.assistant = assistant
    parsed.response = resp
    return parsed


def _tool_call(item: dict[str, Any]) -> dict[str, Any]:
    """A ``function_call`` / ``custom_tool_call`` output item as a chat tool call (vLLM's conversion)."""
    name = item.get("name") or ""
    if item.get("type") == "custom_tool_call":
        args = json.dumps({CUSTOM_INPUT_KEY: item.get("input") or ""}, ensure_ascii=False)
    else:
        args = item.get("arguments") or ""
        if item.get("namespace"):
            name = f"{item['namespace']}{NAMESPACE_SEPARATOR}{name}"
    return {"id": item.get("call_id"), "type": "function", "function": {"name": name, "arguments": args}}


def parse_body(obj: dict[str, Any]) -> ParsedCall:
    """A non-streamed response. A body without an ``output`` list is no response object (a gateway
    answering its error with HTTP 200): it was an ``ok`` row with an empty completion, built into a
    trajectory (a probe)."""
    parsed = parse_response(obj)
    if not isinstance(obj.get("output"), list):
        if obj.get("error"):
            parsed.server_error = f"the server reported an error: {error_text(obj['error'])}"
        parsed.error = "response has no output list (not a Responses object)"
    return parsed


def parse_stream(events: list[tuple[str | None, Any]], done: bool) -> ParsedCall:
    """Use the final event's response; a truncated stream is rebuilt from its text deltas."""
    final = None
    text: list[str] = []
    server_error = None
    for name, obj in events:
        if not isinstance(obj, dict):
            continue
        kind = obj.get("type") or name
        if kind == "error" and server_error is None:  # the stream's own failure: it ends here
            err = obj.get("error") if isinstance(obj.get("error"), dict) else \
                {"message": obj.get("message"), "code": obj.get("code")}
            server_error = f"the server reported an error mid-stream: {error_text(err)}"
        elif kind in FINAL_EVENTS and isinstance(obj.get("response"), dict):
            final = obj["response"]
        elif kind == "response.output_text.delta" and isinstance(obj.get("delta"), str):
            text.append(obj["delta"])
    if final is not None:
        parsed = parse_response(final)
        parsed.complete = True
        parsed.server_error = server_error or parsed.server_error
        return parsed
    parsed = ParsedCall(complete=False, assistant={"role": "assistant", "content": "".join(text)})
    parsed.response = {"object": "response", "status": "failed" if server_error else "truncated",
                       "output_text": "".join(text)}
    parsed.server_error = server_error
    return parsed


#: The envelope events :func:`parse_stream` never reads (the final event repeats what they hold).
_OPENING_EVENTS = ("response.created", "response.in_progress")
_OPENING_PREFIXES = tuple(f"event: {name}\n".encode() for name in _OPENING_EVENTS)
#: The row worker's own echo cache: it sees vLLM's text of the same members again and again.
PARSE_ECHOED = {"instructions": EchoCache(), "tools": EchoCache()}
_PARSE_SKIP = _envelope_skip(PARSE_ECHOED)


def unused_event(raw: bytes, walk_from: int = WALK_FROM_BYTES) -> bool:
    """Whether the row worker may leave this event unparsed: a ``response.created`` or
    ``.in_progress`` event (named so and typed so) in vLLM's envelope shape whose data the member
    walk proves to be well-formed JSON - what parsing it would have told, since
    :func:`parse_stream` uses only the final event and text deltas.

    Why: each of them echoes the request's instructions and tools (tens of KiB for Codex);
    ``json.loads`` of both was about a third of the worker's time per Codex-sized call, the walk
    skips the echoed text it has already seen (:data:`PARSE_ECHOED`). False sends the event the
    usual way (parsed, or counted as malformed); so do events under ``walk_from`` bytes, where
    parsing is as cheap."""
    head = _envelope_data(raw, _OPENING_PREFIXES) if len(raw) >= walk_from else None
    walked = _walk_envelope(raw, head, _PARSE_SKIP, PARSE_ECHOED) if head is not None else None
    if walked is None:
        return False
    text, _, end = walked
    tail = _ENVELOPE_TAIL.fullmatch(text, end)
    return tail is not None and raw.startswith(f"event: {tail[2]}\n".encode())


_FINAL_PREFIXES = {f"event: {name}\n".encode(): name for name in FINAL_EVENTS}
#: A final event smaller than this is parsed as JSON: it holds too few ids to matter.
IDS_ARRAY_FROM_BYTES = 8192


def final_event_json(raw: bytes) -> tuple[str, dict[str, Any]] | None:
    """The row worker's reading of a final event (``response.completed`` ...): its name and what
    ``json.loads`` makes of its data, except that the raw message tokens' ids are ``int32`` arrays
    (:mod:`~.id_arrays`); None for any other event or shape (then it is parsed as JSON).

    The response object is read member by member with json's own scanner (so every value but the
    ids is exactly json.loads'), the raw message tokens by their grammar, the tail exactly; a
    repeated key keeps its last value, as json.loads does. Only for a call whose raw message tokens
    the client did not ask for: they are stripped before the row's ``response_json`` is written."""
    if len(raw) < IDS_ARRAY_FROM_BYTES:
        return None
    eol = raw.find(b"\n") + 1
    name = _FINAL_PREFIXES.get(raw[:eol])
    head = _envelope_data(raw, raw[:eol]) if name is not None else None
    if head is None:
        return None
    try:
        text = raw[head:-2].decode("utf-8")
    except UnicodeDecodeError:
        return None  # the JSON path reads it with U+FFFD
    read: dict[int, list[dict[str, Any]]] = {}

    def messages(text: str, pos: int) -> int | None:
        read[pos] = []
        return _skip_raw_messages(text, pos, read[pos])

    try:
        found, end = members(text, len(_ENVELOPE_DATA), {"input_messages": messages, "output_messages": messages})
    except ValueError:
        return None
    tail = _ENVELOPE_TAIL.fullmatch(text, end)
    if tail is None:
        return None
    response = {m.key: read[m.start] if m.value is SKIPPED else m.value for m in found}
    return name, {"response": response, "sequence_number": int(tail[1]), "type": tail[2]}


def ids_reader(state: Any) -> Callable[[bytes], tuple[str, dict[str, Any]] | None] | None:
    """How the row worker reads the final event: ids as arrays where the row will not keep them
    (injected and not asked for by the client: stripped before ``response_json``), else as JSON."""
    asked = getattr(state, "asked", None) or {}
    return final_event_json if getattr(state, "injected", False) and not asked.get("response_messages") else None


def is_done_event(name: str | None, data: str | None) -> bool:
    return name in FINAL_EVENTS


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for part in content if isinstance(content, list) else ():
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            parts.append(part["text"])
    return "".join(parts)


def to_chat(request: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Chat messages and tools of a Responses request, converted exactly as the server does
    (:mod:`polar_train.wire.responses`), for rendering when the server gave no ids."""
    try:
        messages = input_messages(request)
        tools = chat_tools(request.get("tools") or [])
    except ApiError as exc:
        raise ValueError(f"cannot convert the request to chat messages: {exc.message}") from None
    return messages, tools or None


def template_kwargs(request: dict[str, Any]) -> dict[str, Any]:
    """The template kwargs vLLM renders this request with (its ``reasoning.effort``), for rendering."""
    return request_template_kwargs(request)
