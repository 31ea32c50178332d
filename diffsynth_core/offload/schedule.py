"""Which units to prefetch: the execution order, learned from the previous step.

Every use of a unit is a key ``(unit, phase, n)`` with phase ``F`` (forward), ``R`` (recompute
inside backward) or ``B`` (backward) and ``n`` counting earlier uses of the same (unit, phase) in
this step (a module called twice per forward has two keys).  We remember, for each key, the key
that followed it last time; the prefetch window of a use is the next ``depth`` distinct units along
that chain.  This learns forward order, reverse backward order, recompute order and repeated calls
alike, and re-learns by itself when the order changes (a different code path, inference after
training).
"""

from __future__ import annotations

Key = tuple[int, str, int]


class SuccessorSchedule:
    def __init__(self) -> None:
        self.next: dict[Key, Key] = {}
        self.prev: Key | None = None
        self.count: dict[tuple[int, str], int] = {}  # uses of (unit, phase) so far this step

    def seed(self, order: list[int]) -> None:
        """A first guess before anything ran: forward in ``order``, backward in reverse."""
        fwd = [(i, "F", 0) for i in order]
        bwd = [(i, "B", 0) for i in reversed(order)]
        chain = fwd + bwd
        for a, b in zip(chain, chain[1:]):
            self.next.setdefault(a, b)

    def observe(self, unit: int, phase: str) -> Key:
        """Record a use; returns its key (for ``window``)."""
        if self.prev is not None and self.prev[:2] == (unit, phase):
            return self.prev  # the same use again (e.g. backward hook, then the recompute's hooks)
        n = self.count.get((unit, phase), 0)
        self.count[(unit, phase)] = n + 1
        key = (unit, phase, n)
        if self.prev is not None:
            self.next[self.prev] = key
        self.prev = key
        return key

    def end_step(self) -> None:
        """No link from the last use of a step to the first of the next (nothing crosses a step);
        a seeded guess after the last use is dropped too."""
        if self.prev is not None:
            self.next.pop(self.prev, None)
        self.prev = None
        self.count = {}

    def window(self, key: Key, depth: int, streamed: set[int]) -> list[Key]:
        """The next ``depth`` distinct streamed units after ``key`` (their first upcoming use)."""
        out: list[Key] = []
        seen = {key[0]}
        cur = key
        for _ in range(8 * depth + 16):  # a chain may revisit resident units; bound the walk
            if len(out) >= depth:
                break
            cur = self.next.get(cur)
            if cur is None or cur == key:
                break
            if cur[0] in streamed and cur[0] not in seen:
                seen.add(cur[0])
                out.append(cur)
        return out
