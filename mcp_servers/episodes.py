"""Per-episode tool state: which episode a call belongs to, and a bounded store of each episode's state.

A stateful server (the offline Slack workspace) keeps one state per episode, so that the episodes of
a GRPO group never see each other's writes. The pool sets `current_episode` around each call it makes
into an in-process server; the server reads it to pick the state. Episode id None means the shared
state (calls made outside any episode, e.g. task validation). A server registers how to drop an
episode's state with `on_end_episode`; the pool calls it when the episode ends.
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

# The episode the current tool call belongs to; None = shared state.
current_episode: ContextVar[str | None] = ContextVar("mcprl_current_episode", default=None)

EndEpisode = Callable[[str], Awaitable[None]]
_end_hooks: weakref.WeakKeyDictionary[Any, EndEpisode] = weakref.WeakKeyDictionary()


def on_end_episode(server: Any, hook: EndEpisode) -> None:
    """Register how `server` (a FastMCP instance) drops one episode's state."""
    _end_hooks[server] = hook


def end_episode_hook(server: Any) -> EndEpisode | None:
    """The server's hook, or None for a server without per-episode state."""
    return _end_hooks.get(server)


class EpisodeStates(Generic[T]):
    """Each live episode's state, at most `max_live` of them: the oldest episode is evicted to make room.

    An episode whose trainer never ended it (a crashed runner) would otherwise hold its state forever.
    Eviction logs a warning, since an evicted episode that is still running starts over from the fixture.
    """

    def __init__(self, owner: str, max_live: int) -> None:
        self.owner = owner
        self.max_live = max_live
        self._states: OrderedDict[str, T] = OrderedDict()

    def get(self, episode_id: str) -> T | None:
        return self._states.get(episode_id)

    def add(self, episode_id: str, state: T) -> list[T]:
        """Store a new episode's state; returns the states evicted to make room (the caller closes them)."""
        self._states[episode_id] = state
        evicted = []
        while len(self._states) > self.max_live:
            old_id, old = self._states.popitem(last=False)
            log.warning(
                "%s: more than %d live episodes; dropping the state of the oldest, %r (end episodes when they close)",
                self.owner, self.max_live, old_id,
            )  # fmt: skip
            evicted.append(old)
        return evicted

    def pop(self, episode_id: str) -> T | None:
        return self._states.pop(episode_id, None)

    def pop_all(self) -> list[T]:
        states = list(self._states.values())
        self._states.clear()
        return states

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, episode_id: object) -> bool:
        return episode_id in self._states
