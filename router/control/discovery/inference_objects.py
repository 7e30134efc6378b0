"""The pool's InferenceObjectives and InferenceModelRewrites, read from the cluster and followed live.

Both kinds moved from the Inference Extension (``inference.networking.x-k8s.io``) to llm-d
(``llm-d.ai``); each group serves them as ``v1alpha2``. Per kind, the ``llm-d.ai`` objects count
whenever that group's kind is installed, and the legacy group's objects of that kind are ignored
then (as llm-d's picker does when both CRDs are installed); a kind installed in neither group is
no error: its LIST answers 404, which is logged once and asked again every ``absent_retry_s``
(a CRD installed later is picked up then; a CRD deleted ends its watch, and the re-list's 404
drops its objects). Only objects in the pool's namespace whose ``spec.poolRef`` (or one of
``spec.poolRefs``, llm-d's newer form) names our InferencePool count; ``spec.poolSelector`` is
not followed. An object that cannot be read is skipped with one log line per version.

The wire formats, as the CRDs define them:

* ``InferenceObjective``: ``spec.priority`` (an integer, higher is served first, negative allowed;
  unset is 0). The older ``spec.criticality`` (``Critical``/``Standard``/``Sheddable``) counts as
  1/0/-1 when no priority is set. Requests name an objective by its ``metadata.name`` in
  ``x-gateway-inference-objective``.
* ``InferenceModelRewrite``: ``spec.rules[]``, each ``matches[].model.{type: Exact, value}`` (no
  match: the rule applies to every model) and ``targets[].{modelRewrite, weight}`` (weights on all
  targets or on none: then equal). Precedence, as the API states it: an exact match before a rule
  for every model; between objects, the oldest (``metadata.creationTimestamp``) first; within one
  object, list order.

The watch publishes ``ClusterPolicy`` snapshots: once every kind has been listed, then on each
change. ``router.server.compose`` applies them to the request flow.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from kubernetes_asyncio import watch
from kubernetes_asyncio.client import ApiClient, CustomObjectsApi
from kubernetes_asyncio.client.exceptions import ApiException

from kvindex.aio import stop_task
from router.control.discovery.kube_client import api_client
from router.request.rewrite import MAX_MODEL_NAME

log = logging.getLogger(__name__)

LLM_D_GROUP = "llm-d.ai"
LEGACY_GROUP = "inference.networking.x-k8s.io"
SERVED_VERSION = "v1alpha2"  # what both groups serve (and store) for both kinds
CRITICALITY_PRIORITY = {"Critical": 1, "Standard": 0, "Sheddable": -1}
MAX_WEIGHT = 1_000_000  # the CRD's bound on a target's weight

# One rewrite rule as ``router.request.rewrite.ModelRewrites`` takes it: (rule name, the requested
# model or None for every model, [(target model, weight), ...]).
RewriteRuleSpec = tuple[str, str | None, tuple[tuple[str, float], ...]]
Object = dict[str, Any]

# A watch that ends before this share of its server-side timeout was closed by something else
# (an apiserver restart, the CRD deleted): events may have been lost, so the kind is listed again.
_EARLY_END_SHARE = 0.9
_READ_GRACE_S = 30.0  # client-side read allowance beyond the server-side watch timeout


@dataclass(frozen=True, slots=True)
class CustomKind:
    """A namespaced custom resource kind under one API group."""

    group: str
    plural: str
    kind: str
    version: str = SERVED_VERSION

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{self.group}"


OBJECTIVE_KINDS = (
    CustomKind(LLM_D_GROUP, "inferenceobjectives", "InferenceObjective"),
    CustomKind(LEGACY_GROUP, "inferenceobjectives", "InferenceObjective"),
)
REWRITE_KINDS = (
    CustomKind(LLM_D_GROUP, "inferencemodelrewrites", "InferenceModelRewrite"),
    CustomKind(LEGACY_GROUP, "inferencemodelrewrites", "InferenceModelRewrite"),
)


@dataclass(frozen=True, slots=True)
class ClusterPolicy:
    """What the cluster says about the pool: each objective's priority, and the rewrite rules in
    precedence order."""

    objectives: Mapping[str, int]
    rewrites: tuple[RewriteRuleSpec, ...]


class MalformedObject(ValueError):
    """An object the CRD's schema should not have let through (or a newer shape): skipped."""


def references_pool(spec: Mapping[str, Any], pool_name: str) -> bool:
    """True when ``spec.poolRef`` or one of ``spec.poolRefs`` names the InferencePool ``pool_name``.

    The reference's group is not compared: its default differs per CRD (``llm-d.ai``,
    ``inference.networking.k8s.io``) while the pool followed is the one named in our namespace."""
    refs = [spec.get("poolRef"), *(spec.get("poolRefs") or ())]
    return any(
        isinstance(ref, dict)
        and ref.get("name") == pool_name
        and ref.get("kind", "InferencePool") == "InferencePool"
        for ref in refs
    )


def objective_priority(spec: Mapping[str, Any]) -> int:
    """An InferenceObjective's priority: ``priority``, else its ``criticality``, else 0."""
    priority = spec.get("priority")
    if priority is not None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise MalformedObject(f"spec.priority must be an integer, not {priority!r}")
        return priority
    criticality = spec.get("criticality")
    if criticality is None:
        return 0
    if criticality not in CRITICALITY_PRIORITY:
        raise MalformedObject(f"spec.criticality must be one of {', '.join(CRITICALITY_PRIORITY)}")
    return CRITICALITY_PRIORITY[criticality]


def rewrite_rules(name: str, spec: Mapping[str, Any]) -> list[tuple[bool, int, RewriteRuleSpec]]:
    """An InferenceModelRewrite's rules as (for every model, position, rule spec) each, one spec
    per matched model name; every rule is named ``name`` (the object's) in metrics."""
    rules = spec.get("rules")
    if not isinstance(rules, list):
        raise MalformedObject("spec.rules must be a list")
    out: list[tuple[bool, int, RewriteRuleSpec]] = []
    for position, rule in enumerate(rules):
        where = f"spec.rules[{position}]"
        if not isinstance(rule, dict):
            raise MalformedObject(f"{where} must be an object")
        targets = _targets(rule.get("targets"), where)
        matches = rule.get("matches") or []
        if not isinstance(matches, list):
            raise MalformedObject(f"{where}.matches must be a list")
        if not matches:
            out.append((True, position, (name, None, targets)))
        for index, match in enumerate(matches):
            model = match.get("model") if isinstance(match, dict) else None
            value = model.get("value") if isinstance(model, dict) else None
            if not isinstance(value, str) or not value:
                raise MalformedObject(f"{where}.matches[{index}].model.value must name a model")
            if model.get("type", "Exact") != "Exact":  # type: ignore[union-attr]
                raise MalformedObject(f"{where}.matches[{index}].model.type must be Exact")
            out.append((False, position, (name, value, targets)))
    return out


def _targets(targets: object, where: str) -> tuple[tuple[str, float], ...]:
    if not isinstance(targets, list) or not targets:
        raise MalformedObject(f"{where}.targets must list at least one target")
    models, weights = [], []
    for index, target in enumerate(targets):
        model = target.get("modelRewrite") if isinstance(target, dict) else None
        if not isinstance(model, str) or not 0 < len(model) <= MAX_MODEL_NAME:
            raise MalformedObject(f"{where}.targets[{index}].modelRewrite must name a model")
        weight = target.get("weight")  # type: ignore[union-attr]
        is_count = isinstance(weight, int) and not isinstance(weight, bool)
        if weight is not None and not (is_count and 1 <= weight <= MAX_WEIGHT):
            raise MalformedObject(f"{where}.targets[{index}].weight must be an integer in 1..{MAX_WEIGHT}")
        models.append(model)
        weights.append(weight)
    if all(weight is None for weight in weights):
        weights = [1] * len(models)
    elif any(weight is None for weight in weights):
        raise MalformedObject(f"{where}.targets: set a weight on every target or on none")
    return tuple((model, float(weight)) for model, weight in zip(models, weights, strict=True))


class InferenceObjectsWatch:
    """Lists and watches both kinds under both groups in ``namespace``; ``publish`` gets a
    ``ClusterPolicy`` for the InferencePool ``pool_name`` whenever what counts changes.

    ``api_client`` is a configured ``ApiClient`` (the caller's to close) or a factory called in
    ``run`` (then closed when ``run`` ends)."""

    name = "inference-objects"

    def __init__(
        self,
        api_client: ApiClient | Callable[[], ApiClient],
        namespace: str,
        pool_name: str,
        publish: Callable[[ClusterPolicy], None],
        *,
        absent_retry_s: float = 30.0,
        backoff_initial_s: float = 0.5,
        backoff_max_s: float = 30.0,
        watch_timeout_s: int = 300,
        request_timeout_s: float = 30.0,
    ) -> None:
        if backoff_initial_s <= 0 or backoff_max_s < backoff_initial_s or absent_retry_s <= 0:
            raise ValueError("need 0 < backoff_initial_s <= backoff_max_s and absent_retry_s > 0")
        self._api_client = api_client
        self._namespace = namespace
        self._pool_name = pool_name
        self._publish = publish
        self._absent_retry_s = absent_retry_s
        self._backoff_initial_s = backoff_initial_s
        self._backoff_max_s = backoff_max_s
        self._watch_timeout_s = watch_timeout_s
        self._request_timeout_s = request_timeout_s
        self._rng = random.Random()
        kinds = (*OBJECTIVE_KINDS, *REWRITE_KINDS)
        self._objects: dict[CustomKind, dict[str, Object]] = {kind: {} for kind in kinds}
        self._installed: dict[CustomKind, bool | None] = dict.fromkeys(kinds)  # None: not listed yet
        self._skipped: set[tuple[str, str, str]] = set()  # (crd, name, resourceVersion) logged
        self.policy: ClusterPolicy | None = None  # the last one published

    async def run(self) -> None:
        async with api_client(self._api_client) as client:
            api = CustomObjectsApi(client)
            tasks = [
                asyncio.create_task(self._follow(api, kind), name=f"watch-{kind.crd_name}")
                for kind in self._objects
            ]
            try:
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    await stop_task(task)

    # -- what counts ---------------------------------------------------------------------------

    def _counted(self, kinds: tuple[CustomKind, ...]) -> tuple[CustomKind, list[Object]]:
        """The objects of the first group whose kind is installed (llm-d.ai before the legacy one)."""
        kind = next((kind for kind in kinds if self._installed[kind]), kinds[-1])
        return kind, list(self._objects[kind].values())

    def _snapshot(self) -> ClusterPolicy:
        objectives: dict[str, int] = {}
        kind, objects = self._counted(OBJECTIVE_KINDS)
        for obj in objects:
            spec = self._spec_for_pool(kind, obj)
            if spec is None:
                continue
            try:
                objectives[_name(obj)] = objective_priority(spec)
            except MalformedObject as exc:
                self._skip(kind, obj, str(exc))
        ranked: list[tuple[bool, str, str, int, RewriteRuleSpec]] = []
        kind, objects = self._counted(REWRITE_KINDS)
        for obj in objects:
            spec = self._spec_for_pool(kind, obj)
            if spec is None:
                continue
            try:
                rules = rewrite_rules(_name(obj), spec)
            except MalformedObject as exc:
                self._skip(kind, obj, str(exc))
                continue
            created = str((obj.get("metadata") or {}).get("creationTimestamp") or "")
            ranked.extend((generic, created, _name(obj), position, rule) for generic, position, rule in rules)
        # Exact matches first; then the oldest object (RFC 3339 UTC timestamps sort as text), its name
        # breaking a tie in the same second; then the object's own order.
        ranked.sort(key=lambda entry: entry[:4])
        return ClusterPolicy(objectives, tuple(entry[4] for entry in ranked))

    def _spec_for_pool(self, kind: CustomKind, obj: Object) -> Mapping[str, Any] | None:
        spec = obj.get("spec")
        if not isinstance(spec, dict):
            self._skip(kind, obj, "it has no spec")
            return None
        return spec if references_pool(spec, self._pool_name) else None

    def _skip(self, kind: CustomKind, obj: Object, why: str) -> None:
        meta = obj.get("metadata") or {}
        key = (kind.crd_name, _name(obj), str(meta.get("resourceVersion") or ""))
        if key not in self._skipped:
            self._skipped.add(key)
            log.warning("%s %s/%s (%s) skipped: %s", kind.kind, self._namespace, _name(obj), kind.group, why)

    def _changed(self) -> None:
        if any(installed is None for installed in self._installed.values()):
            return  # not every kind listed yet: a legacy object could still be overruled
        policy = self._snapshot()
        if policy != self.policy:
            self.policy = policy
            self._publish(policy)

    # -- list + watch --------------------------------------------------------------------------

    async def _follow(self, api: CustomObjectsApi, kind: CustomKind) -> None:
        loop = asyncio.get_running_loop()
        args = (kind.group, kind.version, self._namespace, kind.plural)
        version: str | None = None  # None: LIST before watching
        failures = 0
        while True:
            try:
                if version is None:
                    body = await self._list(api, args)
                    if body is None:
                        self._absent(kind)
                        await asyncio.sleep(self._absent_retry_s)
                        continue
                    self._listed(kind, list(body.get("items") or ()))
                    version = str(body["metadata"]["resourceVersion"])
                started = loop.time()
                async with watch.Watch(return_type="object") as stream:
                    events = stream.stream(
                        api.list_namespaced_custom_object,
                        *args,
                        resource_version=version,
                        allow_watch_bookmarks=True,
                        timeout_seconds=self._watch_timeout_s,
                        _request_timeout=(self._request_timeout_s, self._watch_timeout_s + _READ_GRACE_S),
                    )
                    async for event in events:
                        failures = 0
                        if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                            self._event(kind, event["type"], event["raw_object"])
                    version = stream.resource_version or version
                if loop.time() - started < self._watch_timeout_s * _EARLY_END_SHARE:
                    raise ConnectionError("the watch ended early")
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                ceiling = min(self._backoff_max_s, self._backoff_initial_s * 2.0 ** min(failures, 32))
                delay = ceiling * (0.5 + 0.5 * self._rng.random())  # jitter: replicas re-list apart
                failures += 1
                log.warning("list/watch of %s failed: %s; listing again in %.2fs", kind.crd_name, exc, delay)
                version = None
                await asyncio.sleep(delay)

    async def _list(self, api: CustomObjectsApi, args: tuple[str, ...]) -> dict[str, Any] | None:
        """The LIST answer as JSON, or None when the kind is not installed (404)."""
        response = await api.list_namespaced_custom_object(
            *args, _preload_content=False, _request_timeout=self._request_timeout_s
        )
        try:
            data = await response.read()
            if response.status == 404:
                return None
            if not 200 <= response.status < 300:
                raise ApiException(status=response.status, reason=response.reason)
            body = orjson.loads(data)
        finally:
            response.release()
        if not isinstance(body, dict) or "resourceVersion" not in (body.get("metadata") or {}):
            raise ValueError("the LIST answer has no metadata.resourceVersion")
        return body

    def _absent(self, kind: CustomKind) -> None:
        if self._installed[kind] is not False:
            log.info(
                "%s is not installed (404); asking again every %.0fs", kind.crd_name, self._absent_retry_s
            )
        self._installed[kind] = False
        self._objects[kind].clear()
        self._changed()

    def _listed(self, kind: CustomKind, items: list[Object]) -> None:
        if self._installed[kind] is False:
            log.info("%s is installed now", kind.crd_name)
        self._installed[kind] = True
        self._objects[kind] = {name: obj for obj in items if (name := _name(obj))}
        self._changed()

    def _event(self, kind: CustomKind, event: str, obj: Object) -> None:
        name = _name(obj)
        if not name:
            return
        if event == "DELETED":
            self._objects[kind].pop(name, None)
        else:
            self._objects[kind][name] = obj
        self._changed()


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")
