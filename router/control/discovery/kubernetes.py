"""Groups from Kubernetes: an InferencePool (or a plain label selector) and the Pods it selects.

The pool (``inference.networking.k8s.io/v1`` ``InferencePool``) names the pods by
``spec.selector.matchLabels`` and the ports they serve on by ``spec.targetPorts[].number``: one
serving address per (pod IP, target port), as Gateway API Inference Extension pickers do. Without a
pool, a label selector and target ports are given directly (``--endpoint-selector`` /
``--endpoint-target-ports`` in the reference picker).

Each source is listed, then watched from the list's ``resourceVersion`` with bookmarks. Any failure
(``410 Gone`` when that version was compacted away, a dropped connection, an API error) is logged
in one line and followed, after a capped exponential backoff with jitter, by a fresh LIST: the
list is the only way to learn what was missed, so the snapshot after it is complete again. The
watch is given a server-side timeout; a watch that ends at that timeout resumes from the last
version seen without a LIST, as client-go's reflector does.

Pods become ``Member``s:

* readiness is the ``Ready`` condition; a pod with a ``deletionTimestamp`` or the annotation
  ``pd-router.io/drain: "true"`` is kept as a *draining* member (no new requests, in-flight ones
  finish) rather than dropped; a pod without an IP yet is skipped;
* the role is the llm-d label ``llm-d.ai/role`` (``prefill``, ``decode``, ``prefill-decode``, and
  ``both``, its deprecated alias); an unlabelled pod decodes, as in llm-d (that is what lets a
  monolithic deployment work); a pod with another role (``encode``, ...) is skipped;
* the annotation ``llm-d.ai/active-ports`` (legacy ``inference.networking.k8s.io/active-ports``),
  a comma-separated port list, limits which target ports the pod serves on;
* a P/D sidecar fronts a serving address when a container (or a restartable init container) names
  that port ``pd-sidecar`` (or ``pd-sidecar-<anything>``, for data-parallel ranks; the Helm
  chart's sidecar snippet does), or every address of a pod annotated
  ``pd-router.io/pd-sidecar: "true"`` (another sidecar, such as llm-d's); behind Envoy, pairs end
  only there (``extproc.pd_pairs: auto``);
* a pod's engine publishes KV events (precise mode) where its annotation ``pd-router.io/kv-events``
  says (``tcp://{ip}:5557``, or vLLM's own ``tcp://*:5557``: the host is the pod's IP), else on a
  container port named ``kv-events``, else where the configured template says; its replay socket
  likewise (``pd-router.io/kv-events-replay``, ``kv-replay``). A pod serving several ports runs
  data-parallel ranks: rank r on its r-th port (ascending), publishing on those ports plus r;
* a LeaderWorkerSet group is one group: ``leaderworkerset.sigs.k8s.io/group-key`` joins its pods
  (``group-index`` is reused when LWS recreates a group, the key is not),
  ``leaderworkerset.sigs.k8s.io/worker-index`` is the rank (0 = the leader) and the annotation
  ``leaderworkerset.sigs.k8s.io/size`` the number of ranks; a pod outside any group is a group of
  one, keyed by its name.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from kubernetes_asyncio import watch
from kubernetes_asyncio.client import ApiClient, CoreV1Api, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException

from kvindex.aio import stop_task
from router.control.discovery.kube_client import api_client
from router.control.topology import GroupSpec, Member, Publish, Role
from router.server.config import (
    KV_EVENTS_ANNOTATION,
    KV_EVENTS_PORT_NAME,
    KV_REPLAY_ANNOTATION,
    KV_REPLAY_PORT_NAME,
    KVEventsConfig,
    pod_endpoint,
)

log = logging.getLogger(__name__)

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
POOL_PLURAL = "inferencepools"

ROLE_LABEL = "llm-d.ai/role"
ACTIVE_PORTS_ANNOTATIONS = ("llm-d.ai/active-ports", "inference.networking.k8s.io/active-ports")
LWS_GROUP_KEY = "leaderworkerset.sigs.k8s.io/group-key"
LWS_WORKER_INDEX = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_SIZE = "leaderworkerset.sigs.k8s.io/size"
REVISION_LABELS = (
    "leaderworkerset.sigs.k8s.io/template-revision-hash",
    "pod-template-hash",  # Deployment / ReplicaSet
    "controller-revision-hash",  # StatefulSet / DaemonSet
)
LINK_LABEL = "pd-router.io/link"
DRAIN_ANNOTATION = "pd-router.io/drain"
SCALE_DECISION_ANNOTATION = "pd-router.io/scale-decision"
SIDECAR_ANNOTATION = "pd-router.io/pd-sidecar"
SIDECAR_PORT_NAME = "pd-sidecar"

_ROLES: dict[str, Role] = {
    "prefill": "prefill",
    "decode": "decode",
    "prefill-decode": "prefill-decode",
    "both": "prefill-decode",  # deprecated llm-d spelling of prefill-decode
}

# A watch that ends before this share of its server-side timeout was closed by something else
# (a proxy, an apiserver restart): events may have been lost, so it counts as a failure.
_EARLY_END_SHARE = 0.9
# Extra client-side read allowance beyond the server-side watch timeout: the apiserver sends the
# end of the stream at the timeout, so silence beyond it means a dead connection.
_READ_GRACE_S = 30.0

Handler = Callable[[str, dict[str, Any]], Awaitable[None]]
ListHandler = Callable[[list[dict[str, Any]]], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class _Target:
    """Which pods the pool holds and the ports each serves on."""

    selector: tuple[tuple[str, str], ...]  # sorted matchLabels
    ports: tuple[int, ...]

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.selector)

    def watch_selector(self) -> str:
        # Multi-node TP/PP pools select `worker-index: "0"` so that only leaders (the ranks that
        # serve HTTP) become endpoints; watched as is, the workers would be invisible and a group
        # could never be seen complete. The watch therefore drops that key and ``_member`` gives
        # the pods outside the full selector no address.
        return ",".join(f"{key}={value}" for key, value in self.selector if key != LWS_WORKER_INDEX)


@dataclass(frozen=True, slots=True)
class KVEventTemplates:
    """Where a pod's engine publishes KV events when neither its annotations nor its port names say:
    ``{ip}`` (or a wildcard host) is the pod's IP; None: nowhere."""

    endpoint: str | None = None
    replay_endpoint: str | None = None


def kv_event_publisher(
    pod: Mapping[str, Any], ip: str, templates: KVEventTemplates = KVEventTemplates()
) -> tuple[KVEventsConfig | None, list[str]]:
    """Where the engine of ``pod`` (at ``ip``) publishes KV events, or None, and the problems found
    on the way (an annotation that is no endpoint: ignored, the next source is tried)."""
    annotations: Mapping[str, str] = (pod.get("metadata") or {}).get("annotations") or {}
    ports: dict[str, int] = {}
    for name, port in _named_ports(pod):
        ports.setdefault(name, port)  # the first so named, in the pod's order
    problems: list[str] = []

    def resolve(annotation: str, port_name: str, template: str | None) -> str | None:
        given = annotations.get(annotation)
        if given:
            endpoint = pod_endpoint(str(given), ip)
            if endpoint is not None:
                return endpoint
            problems.append(f"annotation {annotation}={given!r} is not tcp://host:port")
        if port_name in ports:
            return pod_endpoint(f"tcp://{{ip}}:{ports[port_name]}", ip)
        return None if template is None else pod_endpoint(template, ip)

    endpoint = resolve(KV_EVENTS_ANNOTATION, KV_EVENTS_PORT_NAME, templates.endpoint)
    if endpoint is None:
        return None, problems
    replay = resolve(KV_REPLAY_ANNOTATION, KV_REPLAY_PORT_NAME, templates.replay_endpoint)
    return KVEventsConfig(endpoint=endpoint, replay_endpoint=replay), problems


class _WatchEndedEarly(Exception):
    """The API server (or something in between) closed the watch before its timeout."""


class KubernetesDiscovery:
    """Groups from an InferencePool's pods (or a label selector's), as full snapshots.

    ``api_client`` is either a factory called inside ``run`` (the discovery owns that client and
    closes it when ``run`` ends) or a configured ``ApiClient`` that stays the caller's to close.
    Give ``pool_name`` to follow an InferencePool, or ``selector`` and ``target_ports`` instead.
    ``group_label`` joins pods into groups (default: the LeaderWorkerSet group key);
    ``workers_serve`` gives ranks other than 0 their addresses too (wide expert parallelism, where
    every rank serves; in multi-node TP/PP only the leader does). ``kv_events``: where pods publish
    KV events when their annotations and port names do not say.
    """

    name = "kubernetes"

    def __init__(
        self,
        api_client: ApiClient | Callable[[], ApiClient],
        namespace: str,
        *,
        pool_name: str | None = None,
        selector: Mapping[str, str] | None = None,
        target_ports: Sequence[int] = (),
        group_label: str = LWS_GROUP_KEY,
        workers_serve: bool = False,
        kv_events: KVEventTemplates = KVEventTemplates(),
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 30.0,
    ) -> None:
        if (pool_name is None) == (selector is None):
            raise ValueError("give either pool_name or selector (with target_ports), not both or neither")
        if selector is not None and not target_ports:
            raise ValueError("a selector needs target_ports")
        if pool_name is not None and target_ports:
            raise ValueError("target_ports come from the InferencePool when pool_name is given")
        if any(not 0 < port < 65536 for port in target_ports):
            raise ValueError(f"target ports must be in 1..65535: {list(target_ports)}")
        if backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s")
        if watch_timeout_s < 1:
            raise ValueError("watch_timeout_s is whole seconds, at least 1")
        self._api_client = api_client
        self._namespace = namespace
        self._pool_name = pool_name
        self._group_label = group_label
        self._workers_serve = workers_serve
        self._kv_events = kv_events
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        self._rng = random.Random()
        self.synced = False

        self._target: _Target | None = None
        if selector is not None:
            self._target = _Target(tuple(sorted(selector.items())), tuple(dict.fromkeys(target_ports)))
        self._pods: dict[str, dict[str, Any]] = {}  # pod name -> the pod as the API returned it
        self._pods_listed = False  # the pods of the current target have been listed
        self._pods_task: asyncio.Task[None] | None = None
        self._core: CoreV1Api | None = None
        self._publish: Publish | None = None
        self._last: tuple[GroupSpec, ...] | None = None
        self._role_warned: set[str] = set()  # pod UIDs already logged for an unknown role
        self._kv_warned: set[str] = set()  # pod UIDs already logged for their KV-event publisher
        self._pool_missing_logged = False

    async def run(self, publish: Publish) -> None:
        self._publish = publish
        async with api_client(self._api_client) as client:
            self._core = CoreV1Api(client)
            try:
                if self._pool_name is None:
                    assert self._target is not None
                    await self._pods_loop(self._target)
                else:
                    await self._pool_loop(CustomObjectsApi(client), self._pool_name)
            finally:
                await self._stop_pods()

    # -- the InferencePool -------------------------------------------------------------------

    async def _pool_loop(self, api: CustomObjectsApi, pool_name: str) -> None:
        # A field selector turns "watch one object" into list+watch of a one-item collection: a
        # pool that does not exist yet is an empty list, and its creation arrives as ADDED.
        args = (POOL_GROUP, POOL_VERSION, self._namespace, POOL_PLURAL)
        kwargs = {"field_selector": f"metadata.name={pool_name}"}

        async def on_list(items: list[dict[str, Any]]) -> None:
            pool = next((item for item in items if _name(item) == pool_name), None)
            await self._set_pool(pool)

        async def on_event(kind: str, obj: dict[str, Any]) -> None:
            if _name(obj) == pool_name:
                await self._set_pool(None if kind == "DELETED" else obj)

        await self._list_and_watch(
            f"InferencePool {self._namespace}/{pool_name}",
            api.list_namespaced_custom_object,
            args,
            kwargs,
            on_list,
            on_event,
        )

    async def _set_pool(self, pool: dict[str, Any] | None) -> None:
        target = self._target_of(pool) if pool is not None else None
        if pool is None:
            if not self._pool_missing_logged:
                log.warning(
                    "InferencePool %s/%s not found; waiting for it (not synced until it exists)",
                    self._namespace,
                    self._pool_name,
                )
                self._pool_missing_logged = True
        else:
            self._pool_missing_logged = False
        if target == self._target:
            return
        previous, self._target = self._target, target
        if target is None:
            # The pool is gone (or unusable): it holds no endpoints any more.
            await self._stop_pods()
            self._pods.clear()
            self._pods_listed = False
            if self.synced:
                self._emit(())
        elif previous is None or target.watch_selector() != previous.watch_selector():
            await self._stop_pods()
            self._pods.clear()
            self._pods_listed = False
            self._pods_task = asyncio.create_task(self._pods_loop(target), name="kubernetes-discovery-pods")
        else:
            # The watched pod set is the same: only ports or the full selector changed.
            self._maybe_publish()

    def _target_of(self, pool: dict[str, Any]) -> _Target | None:
        spec = pool.get("spec") or {}
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        try:
            ports = tuple(dict.fromkeys(int(entry["number"]) for entry in spec.get("targetPorts") or ()))
        except (KeyError, TypeError, ValueError):
            ports = ()
        if not ports or not isinstance(labels, dict):
            log.warning(
                "InferencePool %s/%s has no usable spec.selector.matchLabels / spec.targetPorts; ignoring it",
                self._namespace,
                self._pool_name,
            )
            return None
        return _Target(tuple(sorted((str(k), str(v)) for k, v in labels.items())), ports)

    # -- the pods ----------------------------------------------------------------------------

    async def _pods_loop(self, target: _Target) -> None:
        assert self._core is not None
        kwargs = {"label_selector": target.watch_selector()}

        async def on_list(items: list[dict[str, Any]]) -> None:
            self._pods = {name: pod for pod in items if (name := _name(pod))}
            self._pods_listed = True
            self._maybe_publish()

        async def on_event(kind: str, pod: dict[str, Any]) -> None:
            name = _name(pod)
            if not name:
                return
            if kind == "DELETED":
                self._pods.pop(name, None)
            else:
                self._pods[name] = pod
            self._maybe_publish()

        what = f"pods in {self._namespace} ({kwargs['label_selector'] or 'all'})"
        await self._list_and_watch(
            what, self._core.list_namespaced_pod, (self._namespace,), kwargs, on_list, on_event
        )

    async def _stop_pods(self) -> None:
        task, self._pods_task = self._pods_task, None
        if task is not None:
            await stop_task(task)  # its CancelledError is not ours to raise

    # -- list + watch ------------------------------------------------------------------------

    async def _list_and_watch(
        self,
        what: str,
        list_fn: Callable[..., Awaitable[Any]],
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        on_list: ListHandler,
        on_event: Handler,
    ) -> None:
        loop = asyncio.get_running_loop()
        version: str | None = None  # None: LIST before watching
        failures = 0
        while True:
            try:
                if version is None:
                    body = await self._list(list_fn, args, kwargs)
                    await on_list(list(body.get("items") or ()))
                    version = str(body["metadata"]["resourceVersion"])
                started = loop.time()
                # "object" keeps events as the API's JSON dicts, the same shape the LIST returns.
                async with watch.Watch(return_type="object") as stream:
                    events = stream.stream(
                        list_fn,
                        *args,
                        **kwargs,
                        resource_version=version,
                        allow_watch_bookmarks=True,
                        timeout_seconds=self._watch_timeout_s,
                        _request_timeout=(self._request_timeout_s, self._watch_timeout_s + _READ_GRACE_S),
                    )
                    async for event in events:
                        failures = 0
                        kind = event["type"]
                        if kind in ("ADDED", "MODIFIED", "DELETED"):
                            await on_event(kind, event["raw_object"])
                    version = stream.resource_version or version
                if loop.time() - started < self._watch_timeout_s * _EARLY_END_SHARE:
                    raise _WatchEndedEarly("the watch connection was closed early")
                failures = 0  # a watch that lasted its full term: the API server is healthy
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                delay = self._backoff(failures)
                failures += 1
                log.warning(
                    "list/watch of %s failed: %s; listing again in %.2fs", what, _describe(exc), delay
                )
                version = None
                await asyncio.sleep(delay)

    async def _list(
        self, list_fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> dict[str, Any]:
        # The raw JSON, not the generated models: events arrive as dicts anyway, and building V1Pod
        # objects for a large pool costs far more than reading the few fields used here.
        response = await list_fn(
            *args, **kwargs, _preload_content=False, _request_timeout=self._request_timeout_s
        )
        try:
            data = await response.read()
            if not 200 <= response.status < 300:
                raise ApiException(status=response.status, reason=_status_reason(data) or response.reason)
            body = orjson.loads(data)
        finally:
            response.release()
        if not isinstance(body, dict) or "resourceVersion" not in (body.get("metadata") or {}):
            raise ValueError("the LIST answer has no metadata.resourceVersion")
        return body

    def _backoff(self, failures: int) -> float:
        ceiling = min(self._backoff_max_s, self._backoff_initial_s * 2.0 ** min(failures, 32))
        # Jitter keeps a fleet of routers from re-listing in lockstep after an apiserver restart.
        return ceiling * (0.5 + 0.5 * self._rng.random())

    # -- snapshots ---------------------------------------------------------------------------

    def _maybe_publish(self) -> None:
        if self._target is None or not self._pods_listed:
            return
        self._emit(self._snapshot(self._target))

    def _emit(self, groups: tuple[GroupSpec, ...]) -> None:
        if groups == self._last:
            return
        assert self._publish is not None
        self._publish(list(groups))
        self._last = groups
        self.synced = True

    def _snapshot(self, target: _Target) -> tuple[GroupSpec, ...]:
        members: dict[str, list[Member]] = {}
        sizes: dict[str, int] = {}
        for pod in self._pods.values():
            found = self._member(pod, target)
            if found is None:
                continue
            key, size, member = found
            members.setdefault(key, []).append(member)
            sizes[key] = max(sizes.get(key, 1), size)
        present = {_uid(pod) for pod in self._pods.values()}
        self._role_warned &= present
        self._kv_warned &= present
        return tuple(
            GroupSpec(key, sizes[key], tuple(sorted(members[key], key=lambda m: (m.rank, m.name))))
            for key in sorted(members)
        )

    def _member(self, pod: dict[str, Any], target: _Target) -> tuple[str, int, Member] | None:
        """(group key, expected size, member) for one pod, or None when it is not a rank."""
        meta = pod.get("metadata") or {}
        status = pod.get("status") or {}
        name = str(meta.get("name") or "")
        labels: dict[str, str] = meta.get("labels") or {}
        annotations: dict[str, str] = meta.get("annotations") or {}
        ip = status.get("podIP")
        if not name or not ip:
            return None
        role = _ROLES.get(labels.get(ROLE_LABEL) or "decode")
        if role is None:
            uid = _uid(pod)
            if uid not in self._role_warned:
                self._role_warned.add(uid)
                log.warning(
                    "pod %s has role %r, which is not routed here; skipping it", name, labels[ROLE_LABEL]
                )
            return None
        in_pool = target.matches(labels)
        group = labels.get(self._group_label)
        if not in_pool and group is None:
            # Selected only because the watch drops the worker-index key, and not part of a group.
            return None
        rank = _int(labels.get(LWS_WORKER_INDEX), 0)
        serves = in_pool and (rank == 0 or self._workers_serve)
        ports = _active_ports(target.ports, annotations) if serves else []
        fronted = _sidecar_ports(pod, annotations, ports)
        kv_events = self._kv_event_publishers(pod, name, ip, ports)
        member = Member(
            name=name,
            identity=_identity(pod, status),
            rank=rank,
            ready=_ready(status),
            addresses=tuple(_address(ip, port) for port in ports),
            sidecars=tuple(_address(ip, port) for port in ports if port in fronted),
            revision=_revision(pod, labels),
            role=role,
            link=labels.get(LINK_LABEL) or "default",
            draining=meta.get("deletionTimestamp") is not None
            or str(annotations.get(DRAIN_ANNOTATION, "")).lower() == "true",
            scale_decision=annotations.get(SCALE_DECISION_ANNOTATION) or None,
            kv_events=kv_events,
        )
        return group or name, max(1, _int(annotations.get(LWS_SIZE), 1)), member

    def _kv_event_publishers(
        self, pod: Mapping[str, Any], name: str, ip: str, ports: Sequence[int]
    ) -> tuple[KVEventsConfig, ...]:
        """Its engines' KV-event publishers, one per serving port (none when it has none); problems
        logged once per pod.

        A pod serving several ports runs vLLM's data-parallel ranks, rank r on the r-th port in
        ascending order; each rank publishes on the publisher's port plus r (its replay socket too).
        """
        if not ports:
            return ()
        found, problems = kv_event_publisher(pod, ip, self._kv_events)
        uid = _uid(pod)
        if problems and uid not in self._kv_warned:
            self._kv_warned.add(uid)
            log.warning("pod %s: %s", name, "; ".join(problems))
        if found is None:
            return ()
        by_port = {port: rank_publisher(found, rank) for rank, port in enumerate(sorted(ports))}
        return tuple(by_port[port] for port in ports)


def rank_publisher(base: KVEventsConfig, rank: int) -> KVEventsConfig:
    """Where data-parallel rank ``rank`` publishes, given rank 0's publisher (vLLM adds the rank to
    both sockets' ports)."""
    if rank == 0:
        return base
    replay = None if base.replay_endpoint is None else _port_plus(base.replay_endpoint, rank)
    return base.model_copy(update={"endpoint": _port_plus(base.endpoint, rank), "replay_endpoint": replay})


def _port_plus(endpoint: str, offset: int) -> str:
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + offset}"


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _uid(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return str(meta.get("uid") or meta.get("name") or "")


def _identity(pod: Mapping[str, Any], status: Mapping[str, Any]) -> str:
    """The pod's UID, and how often its containers restarted: a restarted container is a new engine
    (its KV cache and model reloaded), so a new group epoch, gated again."""
    restarts = sum(_int(c.get("restartCount"), 0) for c in status.get("containerStatuses") or ())
    return _uid(pod) if restarts == 0 else f"{_uid(pod)}#{restarts}"


def _int(value: object, default: int) -> int:
    try:
        return int(str(value)) if value is not None else default
    except ValueError:
        return default


def _ready(status: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def _active_ports(ports: Iterable[int], annotations: Mapping[str, str]) -> list[int]:
    value = next((annotations[key] for key in ACTIVE_PORTS_ANNOTATIONS if key in annotations), None)
    if value is None:
        return list(ports)
    active = {_int(part.strip(), -1) for part in str(value).split(",") if part.strip()}
    return [port for port in ports if port in active]


def _sidecar_ports(pod: Mapping[str, Any], annotations: Mapping[str, str], ports: list[int]) -> set[int]:
    """Which of ``ports`` a P/D sidecar listens on: all with the annotation, else those named so."""
    if str(annotations.get(SIDECAR_ANNOTATION, "")).lower() == "true":
        return set(ports)
    named = {
        port
        for name, port in _named_ports(pod)
        if name == SIDECAR_PORT_NAME or name.startswith(SIDECAR_PORT_NAME + "-")
    }
    return named.intersection(ports)


def _named_ports(pod: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(name, container port) of every named port of the containers and (restartable) init
    containers, in the pod's order."""
    spec = pod.get("spec") or {}
    return [
        (str(port["name"]), _int(port.get("containerPort"), -1))
        for container in (*(spec.get("containers") or ()), *(spec.get("initContainers") or ()))
        for port in container.get("ports") or ()
        if port.get("name")
    ]


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _revision(pod: Mapping[str, Any], labels: Mapping[str, str]) -> str | None:
    for label in REVISION_LABELS:
        if labels.get(label):
            return labels[label]
    containers = (pod.get("spec") or {}).get("containers") or ()
    if not containers:
        return None
    first = containers[0]
    # Statuses are not in spec order: find the first container's by name.
    statuses = (pod.get("status") or {}).get("containerStatuses") or ()
    image_id = next((s.get("imageID") for s in statuses if s.get("name") == first.get("name")), None)
    if image_id:
        # "docker-pullable://repo@sha256:…", "repo@sha256:…" or "sha256:…": the digest is what
        # identifies the artifact, whatever tag or registry mirror it was pulled through.
        return str(image_id).rpartition("@")[2].rpartition("://")[2]
    return first.get("image") or None


def _status_reason(data: bytes) -> str | None:
    try:
        status = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return f"{status.get('reason')}: {status.get('message')}" if isinstance(status, dict) else None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        if exc.status == 410:
            return "resourceVersion too old (410 Gone)"
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
