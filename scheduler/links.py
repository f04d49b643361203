"""The copies expected in flight on each shared host link (PCIe switch), for the contention estimate."""

from __future__ import annotations


class LinkCopies:
    """Copies expected in flight per shared host link (`GpuSpec.link`): request id -> (start, end)
    of its load's host-to-GPU copy, the load's last `transfer_time_s` (a load from disk spends its
    first seconds starting and reading, not copying). Added at a dispatch that loads (or swaps in)
    on a GPU with a link, taken out when the request leaves its slot; entries past their end are
    pruned as they are read."""

    __slots__ = ("_by_link",)

    def __init__(self) -> None:
        self._by_link: dict[str, dict[str, tuple[float, float]]] = {}

    def any(self) -> bool:
        """Whether any link has a copy (while none has, placement need not weigh links)."""
        return any(self._by_link.values())

    def on(self, link: str) -> bool:
        """Whether `link` has a copy recorded (some may be over: `overlapping` prunes them)."""
        return bool(self._by_link.get(link))

    def add(self, link: str, request_id: str, start_s: float, end_s: float) -> None:
        self._by_link.setdefault(link, {})[request_id] = (start_s, end_s)

    def end(self, link: str | None, request_id: str) -> None:
        """The request left its slot (or its dispatch was undone): its copy is no longer expected."""
        if link is not None and link in self._by_link:
            self._by_link[link].pop(request_id, None)

    def overlapping(self, link: str, start_s: float, end_s: float, now: float) -> int:
        """Copies on `link` whose window meets [start_s, end_s]; those over by `now` are pruned."""
        copies = self._by_link.get(link)
        if not copies:
            return 0
        for request_id in [r for r, (_, until_s) in copies.items() if until_s <= now]:
            del copies[request_id]
        return sum(1 for since_s, until_s in copies.values() if since_s < end_s and until_s > start_s)
