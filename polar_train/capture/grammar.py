"""Regular expressions for pieces of compact JSON as vLLM writes its stream events: bytes
patterns for raw events, str patterns (``TEXT_*``) for decoded text.

Why: the stream fast paths (``event_stripper`` in the format modules) prove an event has vLLM's
exact shape before splicing ``null`` / ``[]`` over an injected value; strings, numbers and the
logprob entries are matched by their grammar, so nothing in a token's text can fake a key. A raw
line break is never part of a match: in SSE it would end the data line.
"""

from __future__ import annotations

# Possessive quantifiers (*+, ++): these pieces never need to give characters back, and a prompt's
# ids run to tens of thousands (the possessive INTS matches 200 KB of ids ~25 % faster).
STR = rb'"[^"\\\r\n]*+(?:\\[^\r\n][^"\\\r\n]*+)*+"'
NUM = rb'(?:-?(?:\d++(?:\.\d++)?(?:[eE][-+]?\d++)?|Infinity)|NaN|null)'
INTS = rb'\[(?:\d++(?:,\d++)*+)?\]'
_BYTES = rb'(?:,"bytes":(?:' + INTS + rb'|null))?'
_TOP = rb'\{"token":' + STR + rb',"logprob":' + NUM + _BYTES + rb'\}'
#: One sampled token's logprob entry (chat's ``logprobs.content[i]``, Responses' ``logprobs[i]``).
LOGPROB_ENTRY = (rb'\{"token":' + STR + rb',"logprob":' + NUM + _BYTES
                 + rb',"top_logprobs":\[(?:' + _TOP + rb'(?:,' + _TOP + rb')*)?\]\}')
#: A list of such entries.
LOGPROB_LIST = rb'\[(?:' + LOGPROB_ENTRY + rb'(?:,' + LOGPROB_ENTRY + rb')*)?\]'

# The same pieces for decoded text (str patterns), strict as ``json.loads``: no raw control
# characters, only JSON's escapes, no leading zeros. Used where a value is skipped instead of
# parsed (``json_members`` skippers), so what they accept json.loads accepts.
TEXT_STR = r'"[^"\\\x00-\x1f]*+(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*+)*+"'
TEXT_NUM = r'(?:-?(?:(?:0|[1-9]\d*+)(?:\.\d++)?(?:[eE][-+]?\d++)?|Infinity)|NaN)'
TEXT_IDS = r'\[(?:(?:0|[1-9]\d*+)(?:,(?:0|[1-9]\d*+))*+)?\]'
_TEXT_RAW_MESSAGE = r'\{"message":' + TEXT_STR + r',"tokens":' + TEXT_IDS + r',"type":"raw_message_tokens"\}'
#: A list of vLLM's raw message tokens (Responses ``input_messages`` / ``output_messages``).
TEXT_RAW_MESSAGES = r'\[(?:' + _TEXT_RAW_MESSAGE + r'(?:,' + _TEXT_RAW_MESSAGE + r')*+)?\]'
_TEXT_BYTES = r'(?:,"bytes":(?:' + TEXT_IDS + r'|null))?'
_TEXT_TOP = r'\{"token":' + TEXT_STR + _TEXT_BYTES + r',"logprob":' + TEXT_NUM + r'\}'
_TEXT_ENTRY = (r'\{"token":' + TEXT_STR + _TEXT_BYTES + r',"logprob":' + TEXT_NUM
               + r',"top_logprobs":\[(?:' + _TEXT_TOP + r'(?:,' + _TEXT_TOP + r')*+)?\]\}')
#: A non-empty list of Responses logprob entries in vLLM's key order (``bytes`` after ``token``).
TEXT_LOGPROB_ENTRIES = r'\[' + _TEXT_ENTRY + r'(?:,' + _TEXT_ENTRY + r')*+\]'
