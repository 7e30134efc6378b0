"""Which engine gave each Responses API answer.

vLLM keeps the conversation it stored with an answer (``store``) in that engine's memory; a request
naming the answer as ``previous_response_id`` can only be served there (another engine answers
404). The flow remembers each answer's engine; a filter sends the follow-up back to it. Bounded:
the oldest answers are forgotten first, as their engines forget them too.
"""

from __future__ import annotations

from collections import OrderedDict


class ResponseHomes:
    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self._homes: OrderedDict[str, str] = OrderedDict()  # response id -> endpoint id

    def remember(self, response_id: str, endpoint_id: str) -> None:
        self._homes[response_id] = endpoint_id
        self._homes.move_to_end(response_id)
        if len(self._homes) > self.max_entries:
            self._homes.popitem(last=False)

    def home(self, response_id: str) -> str | None:
        """The endpoint that gave answer ``response_id``, if it is still remembered."""
        return self._homes.get(response_id)

    def __len__(self) -> int:
        return len(self._homes)
