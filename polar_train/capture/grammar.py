"""Byte-level regular expressions for pieces of compact JSON, as vLLM writes its stream events.

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
