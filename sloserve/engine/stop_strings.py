"""Incremental stop-string matching (an Aho-Corasick automaton over the stop strings).

The engine checks every request's stop strings after every token. Scanning each stop string
over a window of the text costs O(len(stop list)) per token on the engine thread, so one
request with a long list slows the whole batch. The automaton is built once per request and
then consumes each new character in amortised O(1), whatever the number of stop strings.

It also answers how much of the text's end could still grow into a stop string, which is
exactly what a stream must hold back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

_ROOT = 0


@dataclass(frozen=True)
class StopMatch:
    """A stop string found in the text: where it starts (a character offset) and which it is."""

    start: int
    stop: str


@dataclass
class _Node:
    children: dict[str, int] = field(default_factory=dict)
    depth: int = 0  # length of the prefix this node spells
    fail: int = _ROOT  # the node of the longest proper suffix that is also a prefix
    # The longest stop string ending here (directly or via fail links), as (length, index in
    # the stop list); a longer one starts earlier, which is the one that wins.
    output: Optional[tuple[int, int]] = None
    # Length of the longest suffix of this node's prefix that is a proper prefix of a stop string.
    pending: int = 0


class StopMatcher:
    """Finds stop strings in text that arrives a piece at a time.

    `feed` takes only the characters added since the last call (the text must be append-only)
    and reports, among the stop strings those characters complete, the one that starts first;
    on a tie, the one listed first (as a scan of each stop string with `str.find` would).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = list(stops)
        self._nodes: list[_Node] = [_Node()]
        for index, stop in enumerate(self._stops):
            self._insert(stop, index)
        self._link()
        self._state = _ROOT
        self._consumed = 0

    @property
    def consumed(self) -> int:
        """Characters fed so far; the next `feed` starts at this offset of the text."""
        return self._consumed

    @property
    def pending(self) -> int:
        """How many trailing characters could still become a stop string (what to hold back)."""
        return self._nodes[self._state].pending

    def feed(self, chars: str) -> Optional[StopMatch]:
        """Consume new characters; the earliest-starting stop string they complete, if any."""
        nodes = self._nodes
        state = self._state
        best: Optional[tuple[int, int]] = None  # (start, index)
        for offset, ch in enumerate(chars, self._consumed):
            node = nodes[state]
            while ch not in node.children and state != _ROOT:
                state = node.fail
                node = nodes[state]
            state = node.children.get(ch, _ROOT)
            out = nodes[state].output
            if out is not None:
                candidate = (offset + 1 - out[0], out[1])
                if best is None or candidate < best:
                    best = candidate
        self._state = state
        self._consumed += len(chars)
        if best is None:
            return None
        return StopMatch(best[0], self._stops[best[1]])

    # ---- construction --------------------------------------------------------------
    def _insert(self, stop: str, index: int) -> None:
        state = _ROOT
        for ch in stop:
            nxt = self._nodes[state].children.get(ch)
            if nxt is None:
                nxt = len(self._nodes)
                self._nodes.append(_Node(depth=self._nodes[state].depth + 1))
                self._nodes[state].children[ch] = nxt
            state = nxt
        node = self._nodes[state]
        if node.output is None:  # a duplicate keeps the first index
            node.output = (len(stop), index)

    def _link(self) -> None:
        """Fail links, inherited outputs and hold-back lengths, breadth first (parents before children)."""
        nodes = self._nodes
        nodes[_ROOT].pending = 0
        queue = [_ROOT]
        for state in queue:  # the list grows while we walk it
            node = nodes[state]
            for ch, child_id in node.children.items():
                child = nodes[child_id]
                if state != _ROOT:
                    f = node.fail
                    while ch not in nodes[f].children and f != _ROOT:
                        f = nodes[f].fail
                    child.fail = nodes[f].children.get(ch, _ROOT)
                if child.output is None:
                    child.output = nodes[child.fail].output
                # A node with children is a proper prefix of some stop string; a leaf is not.
                child.pending = child.depth if child.children else nodes[child.fail].pending
                queue.append(child_id)
