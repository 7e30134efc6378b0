"""KubernetesDiscovery against an in-process fake API server speaking Kubernetes' JSON.

The fake keeps pods and InferencePools, answers LISTs (with ``labelSelector`` /
``fieldSelector``) and streams watches as newline-delimited events. Watches replay the events
after the ``resourceVersion`` they start from, as the apiserver's watch cache does, so a test
never races the discovery's LIST→WATCH hand-over. Tests push events, bookmarks, ``410 Gone`` and
cut connections into the open watches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from helpers import eventually
from kubernetes_asyncio.client import ApiClient

from loadtests.servers.kube import (
    LWS_INDEX,
    LWS_KEY,
    LWS_REVISION,
    LWS_SIZE,
    NS,
    FakeKube,
    pod,
    pool,
    serving,
)
from router.control.discovery.kubernetes import KubernetesDiscovery, KVEventTemplates, kv_event_publisher
from router.control.topology import GroupSpec, Member
from router.server.config import ConfigError, KVEventsConfig, parse_config


class Recorder:
    def __init__(self) -> None:
        self.snapshots: list[list[GroupSpec]] = []

    def __call__(self, groups: list[GroupSpec]) -> None:
        self.snapshots.append(groups)

    @property
    def groups(self) -> dict[str, GroupSpec]:
        return {group.key: group for group in self.snapshots[-1]} if self.snapshots else {}

    def member(self, name: str) -> Member | None:
        return next((m for g in self.groups.values() for m in g.members if m.name == name), None)


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    async with serving() as fake:
        yield fake


def discovery(kube: FakeKube, **options: Any) -> KubernetesDiscovery:
    options.setdefault("pool_name", None if "selector" in options else "qwen")
    return KubernetesDiscovery(kube.client, NS, backoff_initial_s=0.01, backoff_max_s=0.05, **options)


@contextlib.asynccontextmanager
async def running(source: KubernetesDiscovery) -> AsyncIterator[Recorder]:
    recorder = Recorder()
    task = asyncio.create_task(source.run(recorder))
    try:
        yield recorder
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=2)
        assert task.cancelled(), "run() ended by itself instead of running until cancelled"


async def grows(recorder: Recorder, count: int, what: str) -> None:
    await eventually(lambda: len(recorder.snapshots) >= count, timeout_s=2, what=what)


# -- the tests -------------------------------------------------------------------------------


async def test_the_first_snapshot_has_every_group_role_address_and_revision(
    kube: FakeKube, caplog: pytest.LogCaptureFixture
) -> None:
    kube.put("pools", pool(ports=(8000, 8001)))
    kube.put("pods", pod("plain", "10.0.0.1", labels={"pod-template-hash": "7d9f"}, image_id="x"))
    kube.put(
        "pods",
        pod(
            "both",
            "10.0.0.2",
            labels={"llm-d.ai/role": "both", "pd-router.io/link": "rack-a"},
            annotations={"llm-d.ai/active-ports": "8001", "pd-router.io/scale-decision": "wva-42"},
            image_id="docker-pullable://vllm/vllm-openai@sha256:abc",
        ),
    )
    kube.put(
        "pods",
        pod(
            "prefill",
            "10.0.0.3",
            labels={"llm-d.ai/role": "prefill", "controller-revision-hash": "sts-5"},
            annotations={"inference.networking.k8s.io/active-ports": "8000, 9999"},
        ),
    )
    kube.put("pods", pod("image-only", "fd00::7", labels={"llm-d.ai/role": "decode"}))
    kube.put("pods", pod("encoder", "10.0.0.5", labels={"llm-d.ai/role": "encode"}))
    kube.put("pods", pod("pending", None))
    kube.put("pods", pod("elsewhere", "10.0.0.9", labels={"app": "other"}))
    source = discovery(kube)
    assert not source.synced
    with caplog.at_level(logging.WARNING, logger="router.control.discovery.kubernetes"):
        async with running(source) as seen:
            await eventually(lambda: source.synced, timeout_s=2, what="synced")
            await eventually(lambda: kube.watching("pods") == 1, timeout_s=2, what="the pod watch")
            assert len(seen.snapshots) == 1
            groups = seen.groups
            assert sorted(groups) == ["both", "image-only", "plain", "prefill"]
            assert all(g.expected_size == 1 and len(g.members) == 1 and g.complete for g in groups.values())
            assert groups["plain"].members[0] == Member(
                name="plain",
                identity="uid-plain",
                rank=0,
                ready=True,
                addresses=("10.0.0.1:8000", "10.0.0.1:8001"),
                revision="7d9f",
                role="decode",
            )
            both = groups["both"].members[0]
            assert (both.role, both.addresses, both.link) == ("prefill-decode", ("10.0.0.2:8001",), "rack-a")
            assert (both.revision, both.scale_decision) == ("sha256:abc", "wva-42")
            prefill = groups["prefill"].members[0]
            assert (prefill.role, prefill.addresses, prefill.revision) == (
                "prefill",
                ("10.0.0.3:8000",),
                "sts-5",
            )
            image_only = groups["image-only"].members[0]
            assert image_only.addresses == ("[fd00::7]:8000", "[fd00::7]:8001")
            assert image_only.revision == "vllm/vllm-openai:v0.11.0"
            # Later events re-derive the snapshot; the encode pod is still named only once.
            kube.put("pods", pod("late", "10.0.0.6"))
            await grows(seen, 2, "the snapshot with the new pod")
    assert [r.getMessage() for r in caplog.records].count(
        "pod encoder has role 'encode', which is not routed here; skipping it"
    ) == 1
    (pod_list,) = kube.calls("pods", "list")
    assert pod_list["labelSelector"] == "app=vllm"
    first_watch = kube.calls("pods", "watch")[0]
    assert first_watch["allowWatchBookmarks"].lower() == "true"
    assert first_watch["resourceVersion"] == str(kube.version - 1)
    assert kube.calls("pools", "list")[0]["fieldSelector"] == "metadata.name=qwen"


async def test_ready_not_ready_deleted_and_draining(kube: FakeKube) -> None:
    kube.put("pools", pool())
    kube.put("pods", pod("a", "10.0.0.1"))
    source = discovery(kube)
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        kube.put("pods", pod("a", "10.0.0.1", ready=False))
        await grows(seen, 2, "not ready")
        member = seen.member("a")
        assert member is not None and not member.ready and not seen.groups["a"].complete
        kube.put("pods", pod("a", "10.0.0.1", ready=True))
        await grows(seen, 3, "ready again")
        assert seen.groups["a"].complete and not seen.groups["a"].draining
        kube.put("pods", pod("a", "10.0.0.1", deleting=True))
        await grows(seen, 4, "terminating")
        member = seen.member("a")
        assert member is not None and member.draining and member.addresses == ("10.0.0.1:8000",)
        kube.put("pods", pod("b", "10.0.0.2", annotations={"pd-router.io/drain": "true"}))
        await grows(seen, 5, "b drained by annotation")
        assert seen.groups["b"].draining
        kube.delete("pods", "a")
        await grows(seen, 6, "a deleted")
        assert sorted(seen.groups) == ["b"]


def with_ports(
    obj: dict[str, Any], kind: str, container: str, ports: list[tuple[str, int]]
) -> dict[str, Any]:
    """``obj`` (a pod) with a ``kind`` container (containers, initContainers) serving ``ports``."""
    entries = [{"name": name, "containerPort": number, "protocol": "TCP"} for name, number in ports]
    obj["spec"].setdefault(kind, []).append({"name": container, "image": "pd-router:1", "ports": entries})
    return obj


async def test_a_sidecar_fronts_the_addresses_its_port_name_or_the_annotation_says(kube: FakeKube) -> None:
    kube.put("pools", pool(ports=(8000, 8001)))
    kube.put("pods", with_ports(pod("named", "10.0.0.1"), "containers", "pd", [("pd-sidecar", 8001)]))
    # A restartable init container (a native sidecar) and one port name per data-parallel rank.
    ranks = [("pd-sidecar-0", 8000), ("pd-sidecar-1", 8001)]
    kube.put("pods", with_ports(pod("ranks", "10.0.0.2"), "initContainers", "pd", ranks))
    kube.put("pods", pod("annotated", "10.0.0.3", annotations={"pd-router.io/pd-sidecar": "true"}))
    kube.put("pods", with_ports(pod("vllm-only", "10.0.0.4"), "containers", "engine", [("http", 8000)]))
    source = discovery(kube)
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        fronted = {name: seen.member(name).sidecars for name in ("named", "ranks", "annotated", "vllm-only")}
        assert fronted == {
            "named": ("10.0.0.1:8001",),
            "ranks": ("10.0.0.2:8000", "10.0.0.2:8001"),
            "annotated": ("10.0.0.3:8000", "10.0.0.3:8001"),
            "vllm-only": (),
        }
        kube.put("pods", pod("annotated", "10.0.0.3"))  # the annotation removed on the running pod
        await grows(seen, 2, "the annotation gone")
        assert seen.member("annotated").sidecars == ()


async def test_a_leaderworkerset_group_and_a_replaced_rank(kube: FakeKube) -> None:
    # Multi-node TP: the pool selects only leaders; the workers must still be seen.
    kube.put("pools", pool(selector={"app": "vllm", LWS_INDEX: "0"}))
    group = {LWS_KEY: "g1", LWS_REVISION: "rev-1"}
    size = {LWS_SIZE: "2"}
    kube.put("pods", pod("lws-0", "10.0.1.1", labels={**group, LWS_INDEX: "0"}, annotations=size))
    kube.put("pods", pod("lws-0-1", "10.0.1.2", labels={**group, LWS_INDEX: "1"}, annotations=size))
    kube.put("pods", pod("loner", "10.0.1.3", labels={LWS_INDEX: "1"}))  # outside the pool, in no group
    source = discovery(kube)
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        assert sorted(seen.groups) == ["g1"]
        g1 = seen.groups["g1"]
        assert g1.expected_size == 2 and g1.complete
        leader, worker = g1.members
        assert (leader.name, leader.rank, leader.addresses) == ("lws-0", 0, ("10.0.1.1:8000",))
        assert (worker.name, worker.rank, worker.addresses, worker.identity) == (
            "lws-0-1",
            1,
            (),
            "uid-lws-0-1",
        )
        assert worker.revision == "rev-1"
        before = g1.fingerprint()
        kube.delete("pods", "lws-0-1")
        await grows(seen, 2, "the worker gone")
        assert not seen.groups["g1"].complete
        replaced = pod(
            "lws-0-1", "10.0.1.7", uid="uid-new", labels={**group, LWS_INDEX: "1"}, annotations=size
        )
        kube.put("pods", replaced)
        await grows(seen, 3, "the worker back")
        assert seen.groups["g1"].complete
        assert seen.groups["g1"].fingerprint() != before
    assert kube.calls("pods", "list")[0]["labelSelector"] == "app=vllm"


async def test_every_rank_serves_when_workers_serve(kube: FakeKube) -> None:
    kube.put("pools", pool(ports=(8000, 8001)))
    labels = {LWS_KEY: "ep", "llm-d.ai/role": "decode"}
    for rank in range(2):
        kube.put(
            "pods",
            pod(
                f"ep-{rank}",
                f"10.0.2.{rank}",
                labels={**labels, LWS_INDEX: str(rank)},
                annotations={LWS_SIZE: "2"},
            ),
        )
    source = discovery(kube, workers_serve=True)
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        assert [m.addresses for m in seen.groups["ep"].members] == [
            ("10.0.2.0:8000", "10.0.2.0:8001"),
            ("10.0.2.1:8000", "10.0.2.1:8001"),
        ]


async def test_a_group_label_other_than_the_lws_key(kube: FakeKube) -> None:
    kube.put("pools", pool())
    kube.put("pods", pod("x", "10.0.3.1", labels={"replica": "r1"}))
    kube.put(
        "pods", pod("y", "10.0.3.2", labels={"replica": "r1", LWS_INDEX: "1"}, annotations={LWS_SIZE: "2"})
    )
    source = discovery(kube, group_label="replica")
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        assert [(m.name, m.rank, bool(m.addresses)) for m in seen.groups["r1"].members] == [
            ("x", 0, True),
            ("y", 1, False),
        ]
        assert seen.groups["r1"].expected_size == 2


async def test_a_bookmark_publishes_nothing(kube: FakeKube) -> None:
    kube.put("pools", pool())
    kube.put("pods", pod("a"))
    source = discovery(kube)
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        await eventually(lambda: kube.watching("pods") == 1, timeout_s=2, what="the pod watch")
        kube.bookmark("pods")
        kube.put("pods", pod("a"))  # an unchanged pod: a MODIFIED event, the same snapshot
        kube.put("pods", pod("b", "10.0.0.2"))
        await grows(seen, 2, "b")
        assert len(seen.snapshots) == 2 and sorted(seen.groups) == ["a", "b"]


async def test_gone_relists_and_sees_what_the_watch_missed(kube: FakeKube) -> None:
    kube.put("pools", pool())
    kube.put("pods", pod("a"))
    source = discovery(kube)
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        await eventually(lambda: kube.watching("pods") == 1, timeout_s=2, what="the pod watch")
        kube.put("pods", pod("missed", "10.0.0.2"), notify=False)
        kube.expire("pods")
        await grows(seen, 2, "the re-list")
        assert sorted(seen.groups) == ["a", "missed"]
        assert len(kube.calls("pods", "list")) == 2
        # The watch after the re-list delivers again.
        await eventually(lambda: kube.watching("pods") == 1, timeout_s=2, what="the new pod watch")
        kube.delete("pods", "a")
        await grows(seen, 3, "a deleted")
        assert sorted(seen.groups) == ["missed"]


async def test_a_dropped_connection_relists(kube: FakeKube) -> None:
    kube.put("pools", pool())
    kube.put("pods", pod("a"))
    source = discovery(kube)
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        await eventually(lambda: kube.watching("pods") == 1, timeout_s=2, what="the pod watch")
        kube.put("pods", pod("missed", "10.0.0.2"), notify=False)
        kube.cut("pods")
        await grows(seen, 2, "the re-list")
        assert sorted(seen.groups) == ["a", "missed"]
        assert len(kube.calls("pods", "list")) == 2
        assert source.synced


async def test_a_watch_that_times_out_resumes_without_a_list(kube: FakeKube) -> None:
    kube.put("pools", pool())
    kube.put("pods", pod("a"))
    source = discovery(kube, watch_timeout_s=1)
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        await eventually(lambda: kube.watching("pods") == 1, timeout_s=2, what="the pod watch")
        kube.bookmark("pods")
        bookmark = str(kube.version)
        await eventually(lambda: len(kube.calls("pods", "watch")) == 2, timeout_s=3, what="the second watch")
        assert kube.calls("pods", "watch")[1]["resourceVersion"] == bookmark
        assert kube.calls("pods", "watch")[1]["timeoutSeconds"] == "1"
        assert len(kube.calls("pods", "list")) == 1
        assert len(seen.snapshots) == 1


async def test_a_new_pool_selector_selects_a_new_pod_set_and_ports_follow(kube: FakeKube) -> None:
    kube.put("pools", pool(selector={"app": "vllm", "model": "a"}))
    kube.put("pods", pod("a1", "10.0.4.1", labels={"model": "a"}))
    kube.put("pods", pod("b1", "10.0.4.2", labels={"model": "b"}))
    source = discovery(kube)
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        assert sorted(seen.groups) == ["a1"]
        kube.put("pools", pool(selector={"app": "vllm", "model": "b"}))
        await grows(seen, 2, "the new pod set")
        assert sorted(seen.groups) == ["b1"]
        assert kube.calls("pods", "list")[-1]["labelSelector"] == "app=vllm,model=b"
        await eventually(lambda: kube.watching("pods") == 1, timeout_s=2, what="one pod watch")
        lists = len(kube.calls("pods", "list"))
        kube.put("pools", pool(selector={"app": "vllm", "model": "b"}, ports=(8000, 8002)))
        await grows(seen, 3, "the new ports")
        assert seen.groups["b1"].members[0].addresses == ("10.0.4.2:8000", "10.0.4.2:8002")
        assert len(kube.calls("pods", "list")) == lists
        kube.delete("pools", "qwen")
        await grows(seen, 4, "the pool gone")
        assert seen.snapshots[-1] == []


async def test_a_missing_pool_keeps_it_unsynced_until_it_exists(kube: FakeKube) -> None:
    kube.pools_installed = False  # the CRD itself is missing: 404 on the LIST
    kube.put("pods", pod("a"))
    source = discovery(kube)
    async with running(source) as seen:
        await eventually(lambda: len(kube.calls("pools", "refused")) >= 3, timeout_s=2, what="retries")
        assert not source.synced and seen.snapshots == []
        assert not kube.calls("pods", "list")
        kube.pools_installed = True  # installed, but the pool does not exist yet
        await eventually(lambda: kube.watching("pools") == 1, timeout_s=2, what="the pool watch")
        assert not source.synced and seen.snapshots == []
        kube.put("pools", pool())
        await grows(seen, 1, "the first snapshot")
        assert source.synced and sorted(seen.groups) == ["a"]


async def test_selector_mode_needs_no_pool(kube: FakeKube) -> None:
    kube.pools_installed = False
    kube.put("pods", pod("a", "10.0.5.1", labels={"tier": "gpu"}))
    kube.put("pods", pod("b", "10.0.5.2"))
    source = discovery(kube, selector={"app": "vllm", "tier": "gpu"}, target_ports=[8200, 8201])
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        assert seen.groups["a"].members[0].addresses == ("10.0.5.1:8200", "10.0.5.1:8201")
        assert sorted(seen.groups) == ["a"]
        kube.put("pods", pod("c", "10.0.5.3", labels={"tier": "gpu"}))
        await grows(seen, 2, "c")
        assert sorted(seen.groups) == ["a", "c"]
    assert not kube.calls("pools", "list") and not kube.calls("pools", "refused")
    assert kube.calls("pods", "list")[0]["labelSelector"] == "app=vllm,tier=gpu"


async def test_cancelling_closes_the_client_it_made_and_leaves_a_given_one_open(kube: FakeKube) -> None:
    kube.put("pools", pool())
    kube.put("pods", pod("a"))
    source = discovery(kube)
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        await eventually(
            lambda: kube.watching("pods") == 1 and kube.watching("pools") == 1, timeout_s=2, what="watches"
        )
    (made,) = kube.clients
    assert made.rest_client.pool_manager.closed
    await eventually(lambda: kube.watching("pods") == 0, timeout_s=2, what="the watch connection closed")

    given = kube.client()
    try:
        source = KubernetesDiscovery(given, NS, pool_name="qwen", backoff_initial_s=0.01)
        async with running(source) as seen:
            await grows(seen, 1, "the first snapshot")
        assert not given.rest_client.pool_manager.closed
    finally:
        await given.close()


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"pool_name": "p", "selector": {"a": "b"}, "target_ports": [1]},
        {"selector": {"a": "b"}},
        {"pool_name": "p", "target_ports": [8000]},
        {"selector": {"a": "b"}, "target_ports": [0]},
        {"pool_name": "p", "watch_timeout_s": 0},
    ],
)
def test_the_constructor_refuses_ambiguous_sources(options: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        KubernetesDiscovery(lambda: ApiClient(), NS, **options)


async def test_a_restarted_container_is_a_new_identity_so_a_new_epoch(kube: FakeKube) -> None:
    """Same pod, same UID, but its vLLM container restarted: the engine lost its KV cache and reloaded
    the model, so the rank's identity (and the group's fingerprint) changes and it is gated again."""
    kube.put("pools", pool())
    kube.put("pods", pod("p0", "10.0.0.1"))
    source = discovery(kube)
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        before = seen.groups["p0"]
        assert before.members[0].identity == "uid-p0"
        restarted = pod("p0", "10.0.0.1")
        restarted["status"]["containerStatuses"][1]["restartCount"] = 1
        kube.put("pods", restarted)
        await grows(seen, 2, "the restart")
        after = seen.groups["p0"]
        assert after.members[0].identity == "uid-p0#1"
        assert after.members[0].addresses == before.members[0].addresses
        assert after.fingerprint() != before.fingerprint()


# -- where a pod's engine publishes KV events: its annotation, a port so named, the template --------

TEMPLATES = KVEventTemplates("tcp://{ip}:5557", "tcp://{ip}:5558")
NO_TEMPLATES = KVEventTemplates()


def publisher(obj: dict[str, Any], templates: KVEventTemplates = NO_TEMPLATES) -> KVEventsConfig | None:
    found, problems = kv_event_publisher(obj, obj["status"]["podIP"], templates)
    assert not problems
    return found


def test_the_annotation_names_the_publisher_with_the_pods_ip_or_vllms_own_wildcard() -> None:
    annotated = pod(
        "a",
        "10.0.0.5",
        annotations={
            "pd-router.io/kv-events": "tcp://{ip}:6000",
            "pd-router.io/kv-events-replay": "tcp://*:6001",
        },
    )
    assert publisher(annotated, TEMPLATES) == KVEventsConfig(
        endpoint="tcp://10.0.0.5:6000", replay_endpoint="tcp://10.0.0.5:6001"
    )
    literal = pod("b", "10.0.0.6", annotations={"pd-router.io/kv-events": "tcp://10.9.9.9:7000"})
    # The replay socket is the template's: each address is found on its own.
    assert publisher(literal, TEMPLATES) == KVEventsConfig(
        endpoint="tcp://10.9.9.9:7000", replay_endpoint="tcp://10.0.0.6:5558"
    )
    v6 = pod("c", "fd00::5", annotations={"pd-router.io/kv-events": "tcp://0.0.0.0:5557"})
    assert publisher(v6) == KVEventsConfig(endpoint="tcp://[fd00::5]:5557")


def test_a_port_named_kv_events_comes_before_the_template() -> None:
    named = with_ports(pod("a", "10.0.0.5"), "containers", "vllm", [("http", 8000), ("kv-events", 6100)])
    assert publisher(named, TEMPLATES) == KVEventsConfig(
        endpoint="tcp://10.0.0.5:6100", replay_endpoint="tcp://10.0.0.5:5558"
    )
    both = with_ports(
        pod("b", "10.0.0.6"), "initContainers", "relay", [("kv-events", 6100), ("kv-replay", 6101)]
    )
    assert publisher(both) == KVEventsConfig(
        endpoint="tcp://10.0.0.6:6100", replay_endpoint="tcp://10.0.0.6:6101"
    )
    # The annotation wins over the port.
    annotated = with_ports(
        pod("c", "10.0.0.7", annotations={"pd-router.io/kv-events": "tcp://{ip}:6200"}),
        "containers",
        "vllm",
        [("kv-events", 6100)],
    )
    assert publisher(annotated).endpoint == "tcp://10.0.0.7:6200"  # type: ignore[union-attr]


def test_the_template_last_and_nothing_without_one() -> None:
    plain = pod("a", "10.0.0.5")
    assert publisher(plain, TEMPLATES) == KVEventsConfig(
        endpoint="tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558"
    )
    assert publisher(plain, KVEventTemplates("tcp://{ip}:5557")) == KVEventsConfig(
        endpoint="tcp://10.0.0.5:5557"
    )
    assert publisher(plain) is None
    # A replay socket alone is no publisher.
    replay_only = pod("b", "10.0.0.6", annotations={"pd-router.io/kv-events-replay": "tcp://{ip}:5558"})
    assert publisher(replay_only) is None


def test_an_annotation_that_is_no_endpoint_is_reported_and_the_next_source_is_used() -> None:
    wrong = pod("a", "10.0.0.5", annotations={"pd-router.io/kv-events": "10.0.0.5:5557"})
    found, problems = kv_event_publisher(wrong, "10.0.0.5", TEMPLATES)
    assert found == KVEventsConfig(endpoint="tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558")
    assert problems == ["annotation pd-router.io/kv-events='10.0.0.5:5557' is not tcp://host:port"]


@pytest.mark.parametrize(
    "template",
    ["tcp://10.0.0.9:5557", "tcp://{ip}", "{ip}:5557", "ipc:///tmp/{ip}", "tcp://{ip}:70000"],
)
def test_a_template_must_name_each_pods_own_tcp_endpoint(template: str) -> None:
    data = {"model": "m", "kubernetes": {"pool_name": "qwen", "kv_events_endpoint": template}}
    with pytest.raises(ConfigError, match=r"kubernetes\.kv_events_endpoint: must be tcp://"):
        parse_config(data)


async def test_discovery_reports_each_members_publisher_and_a_change_is_a_new_fingerprint(
    kube: FakeKube,
) -> None:
    kube.put("pools", pool(ports=(8000,)))
    kube.put("pods", pod("annotated", "10.0.0.1", annotations={"pd-router.io/kv-events": "tcp://*:6000"}))
    kube.put("pods", pod("templated", "10.0.0.2"))
    source = discovery(kube, kv_events=KVEventTemplates("tcp://{ip}:5557"))
    async with running(source) as seen:
        await grows(seen, 1, "the first snapshot")
        assert seen.member("annotated").kv_events == (KVEventsConfig(endpoint="tcp://10.0.0.1:6000"),)
        assert seen.member("templated").kv_events == (KVEventsConfig(endpoint="tcp://10.0.0.2:5557"),)
        before = seen.groups["annotated"].fingerprint()
        kube.put("pods", pod("annotated", "10.0.0.1", annotations={"pd-router.io/kv-events": "tcp://*:6010"}))
        await grows(seen, 2, "the annotation changed")
        assert seen.member("annotated").kv_events == (KVEventsConfig(endpoint="tcp://10.0.0.1:6010"),)
        # Another stream is unknown until proven complete: a new epoch, gated again.
        assert seen.groups["annotated"].fingerprint() != before


async def test_a_pod_serving_data_parallel_ranks_has_a_publisher_per_rank(kube: FakeKube) -> None:
    """vLLM's rank r serves on the r-th port and publishes on the publisher's port + r (its replay
    socket too), whatever order the pool lists the ports in."""
    kube.put("pools", pool(ports=(8002, 8000, 8001)))
    annotations = {"pd-router.io/kv-events": "tcp://*:5557", "pd-router.io/kv-events-replay": "tcp://*:5600"}
    kube.put("pods", pod("ranks", "10.0.0.1", annotations=annotations))
    async with running(discovery(kube)) as seen:
        await grows(seen, 1, "the first snapshot")
        member = seen.member("ranks")
        assert dict(zip(member.addresses, member.kv_events, strict=True)) == {
            f"10.0.0.1:{8000 + r}": KVEventsConfig(
                endpoint=f"tcp://10.0.0.1:{5557 + r}", replay_endpoint=f"tcp://10.0.0.1:{5600 + r}"
            )
            for r in range(3)
        }
