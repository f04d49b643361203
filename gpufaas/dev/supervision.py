"""When to restart a crashed component: exponential backoff, forgiven after a stable run. Pure:
time is passed in; the local cluster's supervisor (gpufaas.dev.local_cluster) does the restarting."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Backoff:
    """A component that exits is restarted after `first_s`, then twice as long after each exit
    that follows a short run, up to `max_s`; one that ran `stable_s` or longer starts afresh."""

    first_s: float = 0.2
    factor: float = 2.0
    max_s: float = 10.0
    stable_s: float = 30.0

    def __post_init__(self) -> None:
        if not (0 < self.first_s <= self.max_s and self.factor >= 1 and self.stable_s >= 0):
            raise ValueError(f"a backoff needs 0 < first_s <= max_s, factor >= 1 and stable_s >= 0, got {self}")


@dataclass
class Supervision:
    """The restart schedule of named components.

    `started(name, now)` when a component (re)starts; `exited(name, now)` when it is seen gone,
    which answers when to restart it; `due(now)` the components whose restart time has come
    (each handed out once); `restarts[name]` how many times each was restarted.
    """

    backoff: Backoff = field(default_factory=Backoff)
    restarts: dict[str, int] = field(default_factory=dict)
    _started_at: dict[str, float] = field(default_factory=dict)
    _delay_s: dict[str, float] = field(default_factory=dict)
    _restart_at: dict[str, float] = field(default_factory=dict)

    def started(self, name: str, now: float) -> None:
        self._started_at[name] = now

    def exited(self, name: str, now: float) -> float:
        """Record that `name` is gone; returns when it should be restarted (idempotent until then)."""
        if name in self._restart_at:
            return self._restart_at[name]
        ran_s = now - self._started_at.get(name, now)
        previous = self._delay_s.get(name)
        if previous is None or ran_s >= self.backoff.stable_s:
            delay = self.backoff.first_s
        else:
            delay = min(self.backoff.max_s, previous * self.backoff.factor)
        self._delay_s[name] = delay
        self._restart_at[name] = now + delay
        return now + delay

    def waiting(self, name: str) -> bool:
        """Whether `name` is gone and waiting for its restart."""
        return name in self._restart_at

    def due(self, now: float) -> list[str]:
        ready = sorted((at, name) for name, at in self._restart_at.items() if at <= now)
        for _, name in ready:
            del self._restart_at[name]
            self.restarts[name] = self.restarts.get(name, 0) + 1
        return [name for _, name in ready]
