"""KV-transfer cost from a prefill link class to each decode candidate: an (L, kd) matrix.

``transfer[l, d] = latency[l, link_d] + bytes_d / bandwidth[l, link_d]`` where
``bytes_d = (prompt_tokens - cached_on_d) * kv_bytes_per_token``: a decode pod that already holds
the prompt's leading blocks (multi-turn chat) only receives the rest. Rows are link *classes*
(labels), not pods: every prefill pod with the same label pays the same transfer, which lets the
picker reduce the P×D problem exactly to (link classes)×D. Units: seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from router.scheduling.costmodel.view import EngineModel, RequestCtx


@dataclass(frozen=True, slots=True)
class LinkTable:
    latency_s: np.ndarray  # (L, L)
    bytes_per_s: np.ndarray  # (L, L)

    @classmethod
    def build(
        cls,
        labels: dict[str, int],
        same: tuple[float, float],
        default: tuple[float, float],
        pairs: dict[tuple[str, str], tuple[float, float]],
    ) -> LinkTable:
        """``same``/``default``/``pairs`` values are (latency_s, bytes_per_s); pairs are symmetric."""
        n = max(len(labels), 1)
        latency = np.full((n, n), default[0])
        bandwidth = np.full((n, n), default[1])
        np.fill_diagonal(latency, same[0])
        np.fill_diagonal(bandwidth, same[1])
        for (a, b), (lat, bw) in pairs.items():
            if a in labels and b in labels:
                i, j = labels[a], labels[b]
                latency[i, j] = latency[j, i] = lat
                bandwidth[i, j] = bandwidth[j, i] = bw
        return cls(latency, bandwidth)


@dataclass(frozen=True, slots=True)
class LinkCosts:
    """The configured link costs, (latency_s, bytes_per_s) each; ``table`` lays them over labels."""

    same: tuple[float, float]
    default: tuple[float, float]
    pairs: tuple[tuple[tuple[str, str], tuple[float, float]], ...] = ()

    def between(self, a: str, b: str) -> tuple[float, float]:
        """(latency_s, bytes_per_s) between labels ``a`` and ``b``, as ``table`` lays them out."""
        if a == b:
            return self.same
        for (x, y), cost in self.pairs:
            if {x, y} == {a, b}:
                return cost
        return self.default

    def table(self, labels: dict[str, int]) -> LinkTable:
        return LinkTable.build(labels, same=self.same, default=self.default, pairs=dict(self.pairs))


class LinkOverlay(Protocol):
    """Link costs laid over the configured ones (learned from answers: ``router/signals/links.py``)."""

    version: int  # changes whenever ``costs`` would answer differently

    def costs(self, prior: LinkCosts) -> LinkCosts: ...


def transfer_bytes(cached: np.ndarray, ctx: RequestCtx, model: EngineModel) -> np.ndarray:
    """Bytes to send to each decode pod (``cached``: ``prefix.cached_tokens`` of the decode pods)."""
    return (ctx.prompt_tokens - cached) * float(model.kv_bytes_per_token)


def transfer_s(
    table: LinkTable, prefill_links: np.ndarray, decode_links: np.ndarray, decode_bytes: np.ndarray
) -> np.ndarray:
    """(len(prefill_links), kd) seconds to move ``decode_bytes`` from each link class to each D."""
    latency = table.latency_s[prefill_links][:, decode_links]
    bandwidth = table.bytes_per_s[prefill_links][:, decode_links]
    return seconds(latency, bandwidth, decode_bytes)


def seconds(latency_s: np.ndarray, bytes_per_s: np.ndarray, decode_bytes: np.ndarray) -> np.ndarray:
    """``transfer_s`` from the table's (L, kd) slices, when a caller keeps them between picks."""
    return latency_s + decode_bytes[None, :] / bytes_per_s
