"""Run in the vLLM venv (``.venv-vllm/bin/python``): feed vLLM 0.32's own streaming hermes tool
parser the piece sequences read from stdin (a JSON list of lists of strings) and print, per piece,
the delta it returns (``null`` for none) - the reference tests/test_contract_vllm_hermes.py
compares polar_train.server.hermes_stream with."""

import json, sys
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser as P
class Tok:  # the parser only needs a tokenizer object to exist (it never reads its vocabulary here)
    def get_vocab(self): return {}
cases = json.load(sys.stdin)
out = []
for pieces in cases:
    p = P(Tok(), None)
    prev = ""
    res = []
    for k, piece in enumerate(pieces):
        cur = prev + piece
        m = p.extract_tool_calls_streaming(prev, cur, piece, [], [], [], None)
        if k == len(pieces) - 1 and m is not None and m.tool_calls and m.tool_calls[-1].function:
            # the stream's end (vllm/parser/abstract_parser.py finalize_generation)
            last = m.tool_calls[-1].function
            last.arguments = (last.arguments or "") + p.get_remaining_unstreamed_args()
        res.append(None if m is None else {"content": m.content, "tool_calls": [
            {"index": t.index, "name": (t.function.name if t.function else None),
             "arguments": (t.function.arguments if t.function else None), "has_id": t.id is not None}
            for t in m.tool_calls]})
        prev = cur
    out.append(res)
print(json.dumps(out))
