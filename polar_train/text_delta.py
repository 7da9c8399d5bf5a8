"""A text as a delta of an earlier one: copies of the earlier text's blocks, with new text between.

Why: an agent's request k+1 resends request k's conversation plus the new turn, the tool
definitions and the options after it, and some harnesses rewrite a little everywhere (Codex writes
its per-call metadata at the end in another key order each call; Claude Code moves a cache marker
to the newest message). A common prefix and suffix alone then miss the tool definitions (~18 KB a
Codex call); copies of long blocks catch them. The compact call log stores request and response
texts this way (``request_json`` holds the new text, ``request_json_delta`` the plan; the same for
``response_json``), and the reader rebuilds them.

A plan is a flat list of triples ``(copy_start, copy_len, literal_len)``: the text is, triple after
triple, ``old[copy_start:copy_start + copy_len]`` followed by the next ``literal_len`` characters
of the literals. Positions count characters (Python's ``str`` indices).
"""

from __future__ import annotations

import numpy as np

#: Characters of the earlier text looked up in the new one to find a block both hold.
ANCHOR = 32
#: A block shorter than this is not worth a triple (12 bytes and a lookup).
MIN_BLOCK = 64
#: Anchors tried per region: the blocks they extend to are taken, the longest first, as long as
#: they keep their order in both texts; the gaps between them are searched the same way.
ANCHORS_PER_REGION = 16
#: At most this many blocks per text (12 bytes each in the plan).
MAX_BLOCKS = 4096
#: Characters the anchor lookups of one text may scan, per character of the two texts: a bound
#: for texts that share many short pieces and no long one (a plan is then mostly new text anyway).
SCAN_BUDGET = 64


class BadDelta(ValueError):
    """A plan that does not fit its earlier text or its literals (the message says how)."""


def _code_points(text: str) -> np.ndarray:
    """The characters of ``text`` as numbers (one byte each where it is ASCII, the common case)."""
    if text.isascii():
        return np.frombuffer(text.encode("ascii"), dtype=np.uint8)
    # surrogatepass: a lone surrogate is one character too
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)


def equal_run(x: np.ndarray, y: np.ndarray) -> int:
    """How many leading elements of two equally long arrays are equal (compared in growing slices:
    the cost follows the run, not the arrays' length)."""
    start, step = 0, 256
    while start < len(x):
        end = min(len(x), start + step)
        diff = np.flatnonzero(x[start:end] != y[start:end])
        if diff.size:
            return start + int(diff[0])
        start, step = end, step * 4
    return len(x)


class _Blocks:
    """Blocks (new_start, old_start, length) that ``new`` and ``old`` both hold, found greedily."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self.a, self.b = _code_points(old), _code_points(new)

    def run_forward(self, o: int, n: int, old_end: int, new_end: int) -> int:
        m = min(old_end - o, new_end - n)
        return equal_run(self.a[o:o + m], self.b[n:n + m]) if m > 0 else 0

    def run_back(self, o: int, n: int, old_start: int, new_start: int) -> int:
        m = min(o - old_start, n - new_start)
        return equal_run(self.a[o - m:o][::-1], self.b[n - m:n][::-1]) if m > 0 else 0

    def find(self) -> list[tuple[int, int, int]]:
        old, new = self.old, self.new
        prefix = self.run_forward(0, 0, len(old), len(new))
        suffix = self.run_back(len(old), len(new), prefix, prefix)
        blocks = [(0, 0, prefix)] if prefix else []
        if suffix:
            blocks.append((len(new) - suffix, len(old) - suffix, suffix))
        regions = [(prefix, len(old) - suffix, prefix, len(new) - suffix)]
        budget = SCAN_BUDGET * (len(old) + len(new))
        while regions and len(blocks) < MAX_BLOCKS and budget > 0:
            o_lo, o_hi, n_lo, n_hi = regions.pop()
            if o_hi - o_lo < MIN_BLOCK or n_hi - n_lo < MIN_BLOCK:
                continue
            found, scanned = self.region_blocks(o_lo, o_hi, n_lo, n_hi)
            budget -= scanned
            if not found:
                continue
            found = found[:MAX_BLOCKS - len(blocks)]  # in order: the gaps below stay right
            blocks += found
            # the gaps between the blocks found are regions of their own
            ends = [(o_lo, n_lo), *((o + length, n + length) for n, o, length in found)]
            starts = [*((o, n) for n, o, _ in found), (o_hi, n_hi)]
            regions += [(o_end, o_start, n_end, n_start) for (o_end, n_end), (o_start, n_start) in zip(ends, starts)]
        return sorted(blocks)

    def region_blocks(self, o_lo: int, o_hi: int, n_lo: int, n_hi: int) -> tuple[list[tuple[int, int, int]], int]:
        """Blocks found from anchors spread over the old region, the longest first as long as they
        keep their order in both texts; and how many characters the lookups scanned."""
        old, new = self.old, self.new
        hits: list[tuple[int, int, int]] = []
        scanned = 0
        shift = n_lo - o_lo  # where the old text's blocks are in the new one, as far as known
        step = max(ANCHOR, (o_hi - o_lo - ANCHOR) // ANCHORS_PER_REGION)
        for o in range(o_lo, o_hi - ANCHOR + 1, step):
            if hits and hits[-1][1] <= o and o + ANCHOR <= hits[-1][1] + hits[-1][2]:
                continue  # inside the block the previous anchor found
            anchor, n = old[o:o + ANCHOR], o + shift
            # first where the text would be if nothing moved: a repeated phrase ("You are ... "
            # x 40) is found at its first occurrence otherwise, a block out of step with the rest
            if not (n_lo <= n <= n_hi - ANCHOR and new.startswith(anchor, n)):
                n = new.find(anchor, n_lo, n_hi)
                scanned += n - n_lo + ANCHOR if n >= 0 else n_hi - n_lo
            if n < 0:
                continue
            shift = n - o
            back = self.run_back(o, n, o_lo, n_lo)
            hits.append((n - back, o - back, back + self.run_forward(o, n, o_hi, n_hi)))
        chosen: list[tuple[int, int, int]] = []
        for n, o, length in sorted(hits, key=lambda hit: -hit[2]):
            if length < MIN_BLOCK:
                break
            if all(n + length <= cn and o + length <= co or cn + cl <= n and co + cl <= o for cn, co, cl in chosen):
                chosen.append((n, o, length))
        return sorted(chosen), scanned


def text_delta(old: str, new: str) -> tuple[list[int], str, int]:
    """(plan, literals, copied): ``new`` as copies of ``old``'s blocks and new text, and how many of
    its characters are copies. Blocks are in order in both texts (what moved is new text)."""
    plan, literals, pos, copied = [0, 0, 0], [], 0, 0
    for n, o, length in _Blocks(old, new).find():
        plan[-1] = n - pos  # the new text before this block follows the previous copy
        literals.append(new[pos:n])
        plan += [o, length, 0]
        pos, copied = n + length, copied + length
    plan[-1] = len(new) - pos
    literals.append(new[pos:])
    if plan[:3] == [0, 0, 0]:  # the text starts with a copy
        plan = plan[3:]
    return plan, "".join(literals), copied


def delta_length(old_length: int, plan: list[int], literal_length: int) -> int:
    """How long the text a plan describes is, the plan checked against an earlier text of
    ``old_length`` and ``literal_length`` new characters (:class:`BadDelta` if it does not fit):
    a reader can tell that a text can be rebuilt without building it."""
    if len(plan) % 3 or any(v is None for v in plan):
        raise BadDelta(f"a delta of {len(plan)} numbers (nulls: {sum(v is None for v in plan)}) is not a list "
                       "of (start, length, new) triples")
    used = copied = 0
    for i in range(0, len(plan), 3):
        start, length, fresh = plan[i:i + 3]
        if start < 0 or length < 0 or fresh < 0 or start + length > old_length or used + fresh > literal_length:
            raise BadDelta(f"triple {i // 3} ({start}, {length}, {fresh}) does not fit the {old_length} characters "
                           f"it copies from and the {literal_length} new ones")
        used, copied = used + fresh, copied + length
    if used != literal_length:
        raise BadDelta(f"the delta uses {used} of {literal_length} new characters")
    return copied + used


def apply_text_delta(old: str, plan: list[int], literals: str) -> str:
    """The text ``plan`` and ``literals`` describe over ``old``; :class:`BadDelta` if they do not fit."""
    delta_length(len(old), plan, len(literals))
    pieces, used = [], 0
    for i in range(0, len(plan), 3):
        start, length, fresh = plan[i:i + 3]
        pieces += [old[start:start + length], literals[used:used + fresh]]
        used += fresh
    return "".join(pieces)
