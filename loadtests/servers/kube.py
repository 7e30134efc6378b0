"""An in-process fake Kubernetes API server speaking Kubernetes' JSON, for discovery tests and
benchmarks (no cluster here).

It keeps pods and InferencePools, and any namespaced custom kind a test installs (``install``:
``inferenceobjectives.llm-d.ai`` and the like, 404 until installed, as for a missing CRD), answers
LISTs (with ``labelSelector`` / ``fieldSelector``) and streams watches as newline-delimited events.
Watches replay the events after the ``resourceVersion`` they start from, as the apiserver's watch
cache does, so a test never races a LIST→WATCH hand-over. Tests push events, bookmarks,
``410 Gone`` and cut connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from kubernetes_asyncio.client import ApiClient, Configuration

NS = "llm"
POOLS_PATH = "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"
LWS_KEY = "leaderworkerset.sigs.k8s.io/group-key"
LWS_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"
LWS_REVISION = "leaderworkerset.sigs.k8s.io/template-revision-hash"

Object = dict[str, Any]


# -- the fake API server ---------------------------------------------------------------------


class _Cut:
    """Abort the connection without ending the chunked body."""


class _End:
    """End the stream cleanly."""


@dataclass(eq=False)
class _Stream:
    kind: str
    match: Callable[[Object], bool]
    queue: asyncio.Queue[bytes | _Cut | _End] = field(default_factory=asyncio.Queue)


@dataclass
class _Change:
    version: int
    old: Object | None
    new: Object | None


def _labels(obj: Object) -> dict[str, str]:
    return obj["metadata"].get("labels") or {}


def _status(code: int, reason: str, message: str) -> Object:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Object]] = {"pods": {}, "pools": {}}
        self.history: dict[str, list[_Change]] = {"pods": [], "pools": []}
        self.compacted: dict[str, int] = {"pods": 0, "pools": 0}
        self.streams: list[_Stream] = []
        self.requests: list[tuple[str, str, dict[str, str]]] = []  # (kind, list|watch, query)
        self.pools_installed = True
        self.version = 100
        self.port = 0
        self.clients: list[ApiClient] = []

        self.custom: dict[str, tuple[str, str]] = {}  # installed custom kind -> (apiVersion, kind)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get(f"/api/v1/namespaces/{NS}/pods", self._pods)
        app.router.add_get(POOLS_PATH.format(ns=NS), self._pools)
        app.router.add_get(POOLS_PATH.format(ns=NS) + "/{name}", self._pool)
        app.router.add_get(f"/apis/{{group}}/{{version}}/namespaces/{NS}/{{plural}}", self._custom_objects)
        return app

    def install(self, group: str, version: str, plural: str, kind: str) -> str:
        """Serve a custom kind (its CRD was applied); returns its key for ``put``/``delete``:
        ``<plural>.<group>``, the CRD's own name."""
        key = f"{plural}.{group}"
        self.custom[key] = (f"{group}/{version}", kind)
        for table, empty in ((self.objects, {}), (self.history, []), (self.compacted, 0)):
            table.setdefault(key, empty)  # type: ignore[arg-type]
        return key

    def uninstall(self, key: str) -> None:
        """The CRD was deleted: its objects go, LISTs answer 404 and open watches end."""
        del self.custom[key]
        self.objects[key].clear()
        for stream in self._open(key):
            stream.queue.put_nowait(_End())

    def client(self) -> ApiClient:
        api = ApiClient(Configuration(host=f"http://127.0.0.1:{self.port}"))
        self.clients.append(api)
        return api

    # What tests change.

    def put(self, kind: str, obj: Object, notify: bool = True) -> None:
        """Create or replace an object; ``notify=False`` hides the change from open watches."""
        obj = copy.deepcopy(obj)
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        old = self.objects[kind].get(obj["metadata"]["name"])
        self.objects[kind][obj["metadata"]["name"]] = obj
        if notify:
            self._change(kind, _Change(self.version, old, obj))

    def delete(self, kind: str, name: str) -> None:
        old = self.objects[kind].pop(name)
        self.version += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self.version)
        self._change(kind, _Change(self.version, gone, None))

    def bookmark(self, kind: str) -> None:
        self.version += 1
        event = {
            "type": "BOOKMARK",
            "object": {"kind": "Pod", "metadata": {"resourceVersion": str(self.version)}},
        }
        for stream in self._open(kind):
            stream.queue.put_nowait(orjson.dumps(event) + b"\n")

    def expire(self, kind: str) -> None:
        """Compact history: open watches get a 410 ERROR event, as the apiserver sends them."""
        self.compacted[kind] = self.version
        status = _status(410, "Expired", f"too old resource version: 1 ({self.version})")
        for stream in self._open(kind):
            stream.queue.put_nowait(orjson.dumps({"type": "ERROR", "object": status}) + b"\n")
            stream.queue.put_nowait(_End())

    def cut(self, kind: str) -> None:
        for stream in self._open(kind):
            stream.queue.put_nowait(_Cut())

    def end_all(self) -> None:
        for stream in self.streams:
            stream.queue.put_nowait(_End())

    def watching(self, kind: str) -> int:
        return len(self._open(kind))

    def calls(self, kind: str, verb: str) -> list[dict[str, str]]:
        return [query for k, v, query in self.requests if k == kind and v == verb]

    # The API.

    async def _pods(self, request: web.Request) -> web.StreamResponse:
        wanted = dict(
            pair.split("=", 1) for pair in request.query.get("labelSelector", "").split(",") if pair
        )
        return await self._serve(
            "pods",
            request,
            lambda pod: all(_labels(pod).get(k) == v for k, v in wanted.items()),
            "PodList",
            "v1",
        )

    async def _pools(self, request: web.Request) -> web.StreamResponse:
        if not self.pools_installed:
            self.requests.append(("pools", "refused", dict(request.query)))
            return web.json_response(
                _status(404, "NotFound", "the server could not find the requested resource"), status=404
            )
        field_selector = request.query.get("fieldSelector", "")
        name = field_selector.removeprefix("metadata.name=") if field_selector else None
        return await self._serve(
            "pools",
            request,
            lambda pool: name is None or pool["metadata"]["name"] == name,
            "InferencePoolList",
            "inference.networking.k8s.io/v1",
        )

    async def _custom_objects(self, request: web.Request) -> web.StreamResponse:
        info = request.match_info
        key = f"{info['plural']}.{info['group']}"
        installed = self.custom.get(key)
        if installed is None or installed[0] != f"{info['group']}/{info['version']}":
            self.requests.append((key, "refused", dict(request.query)))
            return web.json_response(
                _status(404, "NotFound", "the server could not find the requested resource"), status=404
            )
        api_version, kind = installed
        return await self._serve(key, request, lambda _: True, f"{kind}List", api_version)

    async def _pool(self, request: web.Request) -> web.Response:
        pool = self.objects["pools"].get(request.match_info["name"]) if self.pools_installed else None
        if pool is None:
            return web.json_response(_status(404, "NotFound", "inferencepools not found"), status=404)
        return web.json_response(pool)

    async def _serve(
        self,
        kind: str,
        request: web.Request,
        match: Callable[[Object], bool],
        list_kind: str,
        api_version: str,
    ) -> web.StreamResponse:
        query = dict(request.query)
        if query.get("watch", "").lower() not in ("true", "1"):
            self.requests.append((kind, "list", query))
            items = [obj for obj in self.objects[kind].values() if match(obj)]
            body = {
                "kind": list_kind,
                "apiVersion": api_version,
                "metadata": {"resourceVersion": str(self.version)},
            }
            return web.json_response({**body, "items": items})
        self.requests.append((kind, "watch", query))
        stream = _Stream(kind, match)
        since = int(query.get("resourceVersion") or self.version)
        if since < self.compacted[kind]:
            status = _status(410, "Expired", f"too old resource version: {since} ({self.compacted[kind]})")
            stream.queue.put_nowait(orjson.dumps({"type": "ERROR", "object": status}) + b"\n")
            stream.queue.put_nowait(_End())
        else:
            for change in self.history[kind]:
                if change.version > since:
                    self._offer(stream, change)
        self.streams.append(stream)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(query.get("timeoutSeconds") or 3600)
        try:
            while True:
                if request.transport is None or request.transport.is_closing():
                    return response  # the client went away
                if loop.time() >= deadline:
                    break  # the server-side watch timeout: a clean end
                try:
                    # Short waits: aiohttp does not cancel a handler whose client disconnected.
                    item = await asyncio.wait_for(stream.queue.get(), 0.05)
                except TimeoutError:
                    continue
                if isinstance(item, _End):
                    break
                if isinstance(item, _Cut):
                    assert request.transport is not None
                    request.transport.abort()
                    return response
                await response.write(item)
            await response.write_eof()
        except ConnectionResetError:
            pass  # the client closed the watch (a cancelled discovery): nothing left to answer
        finally:
            self.streams.remove(stream)
        return response

    def _open(self, kind: str) -> list[_Stream]:
        return [stream for stream in self.streams if stream.kind == kind]

    def _change(self, kind: str, change: _Change) -> None:
        self.history[kind].append(change)
        for stream in self._open(kind):
            self._offer(stream, change)

    @staticmethod
    def _offer(stream: _Stream, change: _Change) -> None:
        # A selector watch sees an object enter (ADDED) and leave (DELETED) its selection.
        was = change.old is not None and stream.match(change.old)
        now = change.new is not None and stream.match(change.new)
        if change.new is None:
            kind, obj = "DELETED", change.old
        elif was and now:
            kind, obj = "MODIFIED", change.new
        elif now:
            kind, obj = "ADDED", change.new
        elif was:
            kind, obj = "DELETED", change.new
        else:
            return
        if kind == "DELETED" and not was:
            return
        stream.queue.put_nowait(orjson.dumps({"type": kind, "object": obj}) + b"\n")


# -- objects ---------------------------------------------------------------------------------


def pod(
    name: str,
    ip: str | None = "10.0.0.1",
    *,
    uid: str | None = None,
    labels: dict[str, str] | None = None,
    annotations: dict[str, str] | None = None,
    ready: bool = True,
    deleting: bool = False,
    image: str = "vllm/vllm-openai:v0.11.0",
    image_id: str | None = None,
) -> Object:
    metadata: Object = {
        "name": name,
        "namespace": NS,
        "uid": uid or f"uid-{name}",
        "creationTimestamp": "2026-11-30T10:00:00Z",
        "labels": {"app": "vllm", **(labels or {})},
        "annotations": annotations or {},
    }
    if deleting:
        metadata["deletionTimestamp"] = "2026-11-30T12:00:00Z"
        metadata["deletionGracePeriodSeconds"] = 30
    status: Object = {
        "phase": "Running",
        "hostIP": "192.168.0.10",
        "conditions": [
            {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-11-30T10:00:01Z"},
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "lastTransitionTime": "2026-11-30T10:01:00Z",
            },
            {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-11-30T10:00:00Z"},
        ],
        "containerStatuses": [
            {
                "name": "sidecar",
                "image": "pd-router:1",
                "imageID": "docker.io/pd-router@sha256:side",
                "ready": True,
            },
            {
                "name": "vllm",
                "image": image,
                "ready": ready,
                "restartCount": 0,
                **({"imageID": image_id} if image_id else {}),
            },
        ],
    }
    if ip is not None:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    spec = {"containers": [{"name": "vllm", "image": image}, {"name": "sidecar", "image": "pd-router:1"}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec, "status": status}


def pool(
    name: str = "qwen", selector: dict[str, str] | None = None, ports: tuple[int, ...] = (8000,)
) -> Object:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NS, "uid": f"uid-pool-{name}", "generation": 1},
        "spec": {
            "selector": {"matchLabels": selector if selector is not None else {"app": "vllm"}},
            "targetPorts": [{"number": port} for port in ports],
            "endpointPickerRef": {"name": "pd-router", "port": {"number": 9002}},
        },
    }


# -- running a discovery ---------------------------------------------------------------------


@contextlib.asynccontextmanager
async def serving() -> AsyncIterator[FakeKube]:
    """A FakeKube listening on a free loopback port."""
    fake = FakeKube()
    runner = web.AppRunner(fake.app(), shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    fake.port = runner.addresses[0][1]
    try:
        yield fake
    finally:
        fake.end_all()
        for api in fake.clients:  # the clients handed out: a test or benchmark need not close them
            await api.close()
        await runner.cleanup()
