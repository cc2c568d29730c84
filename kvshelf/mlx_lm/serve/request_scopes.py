"""Which request scope (tenant + salt) a prompt-cache call belongs to, on mlx-lm's generation thread.

Why this is needed: mlx-lm's generator calls the prompt cache with a model key and tokens only. A fetch always
follows, on the generation thread, the tokenization of its own request (batched or single: ``_tokenize`` then
``fetch_nearest_cache``), so the generator's ``tokenize_request`` hook announces the request's scope
(``announce``) and the next fetch takes it (``take``). Inserts are harder: a batch inserts the caches of its rows
at segment ends and when a row finishes, interleaved with other requests, with nothing but the tokens. So every
fetch also records ``(scope, fetched tokens)`` as *in flight*; an insert belongs to the in-flight requests whose
tokens it extends (a finished row: prompt + generated) or that extend it (a segment end: a prefix of the prompt).

Never a wrong scope: when the matching in-flight requests have more than one scope (two tenants sent the same
prompt at the same moment), or none matches once scoped requests exist, ``scope_of`` returns None and the caller
stores nothing; an insert that is not stored costs a later prefill, one stored under the wrong tenant would leak.
A finished row's insert ends its request's record; records of requests that never insert (a client that went
away) are dropped oldest first past ``max_in_flight``.
"""

from __future__ import annotations

import threading
from array import array
from collections import deque
from collections.abc import Sequence


class RequestScopes:
    """The generation thread's announced scope and the in-flight requests' (scope, tokens)."""

    def __init__(self, max_in_flight: int = 256):
        self.max_in_flight = max_in_flight
        self._announced = threading.local()
        self._in_flight: deque[tuple[str, array]] = deque()
        self._lock = threading.Lock()
        self.scoped_seen = False  # a non-default scope was fetched: unmatched inserts are no longer the default's
        self.ambiguous = 0  # inserts stored nowhere because their scope could not be told

    def announce(self, scope: str) -> None:
        """The request just tokenized on this thread has ``scope``; its fetch comes next."""
        self._announced.scope = scope

    def take(self, tokens: Sequence[int]) -> str:
        """The scope of the fetch of ``tokens`` on this thread (the announced one, default ``""``), recorded as in
        flight until its finished insert."""
        scope = getattr(self._announced, "scope", "")
        self._announced.scope = ""
        with self._lock:
            self.scoped_seen = self.scoped_seen or scope != ""
            self._in_flight.append((scope, array("q", tokens)))
            while len(self._in_flight) > self.max_in_flight:
                self._in_flight.popleft()
        return scope

    def scope_of(self, tokens: Sequence[int]) -> str | None:
        """The scope an insert of ``tokens`` is stored under, or None when it cannot be told."""
        t = array("q", tokens)
        with self._lock:
            matches = [(i, scope, p) for i, (scope, p) in enumerate(self._in_flight)
                       if (len(t) >= len(p) and t[:len(p)] == p) or (len(t) < len(p) and p[:len(t)] == t)]
            scopes = {scope for _, scope, _ in matches}
            if len(scopes) != 1:
                if not matches and not self.scoped_seen:
                    return ""  # no tenants in play (the library use, a server without them): as before
                self.ambiguous += 1
                return None
            finished = [(len(p), i) for i, _, p in matches if len(t) >= len(p)]
            if finished:  # a finished row: its request is done (the longest prompt it extends)
                del self._in_flight[max(finished)[1]]
            return scopes.pop()


__all__ = ["RequestScopes"]
