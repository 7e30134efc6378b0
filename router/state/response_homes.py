"""Which engine gave each Responses API answer.

vLLM keeps the conversation it stored with an answer (``store``) in that engine's memory; a request
naming the answer as ``previous_response_id`` can only be served there (another engine answers
404). The flow remembers each answer's engine; a filter sends the follow-up back to it. Bounded:
the oldest answers are forgotten first, as their engines forget them too.

With several picker replicas the follow-up may reach another replica than the one that routed the
answer: with ``index.redis`` each answer's engine is also written to Redis (``{ns}:resp:<id>``, for
the index's TTL) and a replica that does not know an id reads it there before the pick
(``ResponseHomeLookup``), within the lookup timeout. Redis trouble never fails a request: the
follow-up is then routed on load, and the engine answers whether it knows the conversation.
"""

from __future__ import annotations

from collections import OrderedDict

from router.request.types import RouteRequest
from router.state.shared_homes import SharedHomes, keep_newest


class ResponseHomes:
    def __init__(self, max_entries: int = 100_000) -> None:
        self.max_entries = max_entries
        self.shared: SharedHomes | None = None  # with index.redis
        self._homes: OrderedDict[str, str] = OrderedDict()  # response id -> endpoint id

    def remember(self, response_id: str, endpoint_id: str) -> None:
        self._keep(response_id, endpoint_id)
        if self.shared is not None:
            self.shared.publish(response_id, endpoint_id)

    def home(self, response_id: str) -> str | None:
        """The endpoint that gave answer ``response_id``, if it is known here."""
        return self._homes.get(response_id)

    async def look_up(self, response_id: str) -> None:
        """Learn from the other replicas where ``response_id`` was answered, if it is not known here."""
        if self.shared is not None and response_id not in self._homes:
            endpoint_id = await self.shared.fetch(response_id)
            if endpoint_id is not None:
                self._keep(response_id, endpoint_id)

    def _keep(self, response_id: str, endpoint_id: str) -> None:
        keep_newest(self._homes, response_id, endpoint_id, self.max_entries)

    def __len__(self) -> int:
        return len(self._homes)


class ResponseHomeLookup:
    """Producer: a follow-up's stored answer, looked up among the other replicas' before the pick."""

    name = "response_home"
    fills = False

    def __init__(self, homes: ResponseHomes) -> None:
        self.homes = homes

    def wanted(self, request: RouteRequest) -> bool:
        return request.previous_response_id is not None

    async def produce(self, request: RouteRequest) -> None:
        if request.previous_response_id is not None:
            await self.homes.look_up(request.previous_response_id)
