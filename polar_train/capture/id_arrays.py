"""A prompt's token ids read by the row worker as an array, not as Python ints.

Why: vLLM sends every prompt id to a call that asks (chat's first chunk, Responses' raw message
tokens in the final event): ~8,000 for a Codex-sized call, tens of thousands with a long history.
Parsed by ``json.loads`` each becomes a Python int (~65 ns), is checked (~20 ns) and converted by
Arrow again (~25 ns): about a millisecond of the worker's CPU per call, and most of it with a long
history. Once the list is proven compact non-negative integers (:func:`~.grammar.ids_end`), numpy
reads the digits in C and Arrow takes the array as it is.

A row's id columns may therefore hold an ``int32`` array where they held a list; both mean the
same to Arrow. Only the row worker reads ids so, and only where the client does not get them back
(they are stripped from what the row's ``response_json`` keeps).
"""

from __future__ import annotations

import numpy as np

#: Ids past this cannot be stored in the call log's int32 columns: such a list is parsed as JSON
#: (and its row kept by the writer as a proxy_error saying why).
_INT32_END = 2**31


def parse_ids(digits: bytes | str) -> np.ndarray | None:
    """The ids of a proven list (the text between its brackets: digits and single commas) as an
    ``int32`` array; None when one of them does not fit int32 (numpy saturates past int64, which
    this catches too)."""
    if not digits:
        return np.zeros(0, np.int32)
    values = np.fromstring(digits, dtype=np.int64, sep=",")
    if values.size and int(values.max()) >= _INT32_END:
        return None
    return values.astype(np.int32)


def as_list(ids: object) -> object:
    """``ids`` as a list where it is an array (for code that concatenates or compares lists)."""
    return ids.tolist() if isinstance(ids, np.ndarray) else ids
