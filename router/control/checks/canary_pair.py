"""``canary_pair``: for P/D, the real prefill → decode exchange (``kv_transfer_params``) with a peer
of the other role that real traffic could use (the pool's candidate mask: admitted, fresh, not
ejected): a KV connector that only works one way fails. A decode group without such a peer skips it
(it can serve alone); a prefill group waits for a decode peer (it is only ever used in a pair), so
decode pods are admitted first. When the pair fails and the peer cannot answer a canary on its own
either, the peer failed, not the group: the next peer is tried, and no failed canary is charged to
the group's pacing."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from router.control.checks.base import CANARY_HEADER, DefaultOn, GateFailed, ReadyCheck, has_choices, serving
from router.http.exchange import Leg, UpstreamError, decode_body

if TYPE_CHECKING:
    from router.control.gate import Gate
    from router.control.topology import GroupSpec

MAX_PAIR_PEERS = 3  # peers a pair canary tries before it gives up for this run


async def canary_pair(gate: Gate, group: GroupSpec) -> str:
    roles = {m.role for m in group.members if m.addresses}
    if roles <= {"prefill-decode"}:
        return "not a P/D role: skipped"
    address = serving(group)[0]
    own = "prefill" if "prefill" in roles else "decode"
    peers = gate.peers("decode" if own == "prefill" else "prefill", exclude=group.key)
    if not peers:
        return _no_peer(own)
    recent = await gate.pace(group, "canary_pair")
    if recent is not None:
        return recent
    body: dict[str, Any] = {
        "model": gate.settings.model,
        "prompt": "ping",
        "max_tokens": gate.settings.canary_max_tokens,
    }
    leg = Leg("/v1/completions", {CANARY_HEADER: "1"})
    for peer in peers[:MAX_PAIR_PEERS]:
        prefill, decode = (address, peer) if own == "prefill" else (peer, address)
        try:
            params, _ = await gate.exchange.prefill(prefill, leg, body)
            answer = await gate.decode_once(decode, leg, decode_body(body, params))
        except UpstreamError as exc:
            failure = f"pair {prefill} -> {decode}: {exc.reason}"
        else:
            if has_choices(answer):
                gate.passed(group, "canary_pair")
                return f"pair {prefill} -> {decode}"
            failure = f"pair {prefill} -> {decode}: the decode leg answered without choices"
        # A peer that cannot answer on its own failed the pair, not this group: try the next.
        if await _answers_alone(gate, peer):
            raise GateFailed(failure)
    # Every peer tried was down: no verdict on this group, and no canary charged to it.
    gate.forget(group, "canary_pair")
    return _no_peer(own)


def _no_peer(own: str) -> str:
    # A decode pod can serve on its own (local prefill); a prefill pod is only ever useful in a
    # pair, so it waits for a decode peer to prove its connector against.
    if own == "prefill":
        raise GateFailed("no healthy decode peer to run the pair canary with yet")
    return "no healthy prefill peer yet: skipped"


async def _answers_alone(gate: Gate, address: str) -> bool:
    try:
        return has_choices(await gate.ping(address, f"peer {address}"))
    except GateFailed:
        return False


CHECK = ReadyCheck("canary_pair", 60, DefaultOn(("kubernetes",)), canary_pair)
