"""Every per-endpoint feature, declared once: its name, where its value comes from, and what an
endpoint nobody has measured holds.

The pool allocates one numpy array per feature (``Pool.<name>``, indexed by slot); the scrape
parser (``router/observe/scrape.py``) reads each scraped feature from the vLLM metric names
declared here, and a scrape copies it into the pool; every candidate feature is gathered into
``router.scheduling.costmodel.view.Candidates`` under the same name for the cost terms.
Adding a feature, scraped or not, is one line here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Combine = Literal["sum", "mean", "capacity"]


@dataclass(frozen=True, slots=True)
class Scraped:
    """Where a feature comes from in an engine's ``/metrics``.

    ``metrics``: vLLM metric names, the current one first; a later (deprecated) name is read only
    when no earlier one is present. ``combine``: how several series of one metric (one per
    ``engine`` label when data-parallel ranks share an address) become one value: ``sum``,
    ``mean``, or ``capacity`` (``block_size × num_gpu_blocks`` from ``vllm:cache_config_info``'s
    labels, blocks summed). Absent, malformed or non-finite samples leave the value unknown.
    """

    metrics: tuple[str, ...]
    combine: Combine = "sum"


@dataclass(frozen=True, slots=True)
class Feature:
    name: str
    empty: float  # the value of a slot before anything is known; NaN = unknown, never 0
    dtype: type = np.float64
    scraped: Scraped | None = None  # read from the engine's /metrics on every scrape
    candidate: bool = True  # gathered into ``Candidates`` for scorers
    # A reservation other router replicas hold too: ``Pool.others_<name>`` (router/state/
    # shared_load.py) is added to this replica's own when candidates are gathered.
    shared: bool = False
    doc: str = ""


FEATURES: tuple[Feature, ...] = (
    # From the engine's /metrics; unknown (NaN) until scraped.
    Feature("running", math.nan, scraped=Scraped(("vllm:num_requests_running",)), doc="requests decoding"),
    Feature("waiting", math.nan, scraped=Scraped(("vllm:num_requests_waiting",)), doc="requests queued"),
    Feature(
        "kv_usage",
        math.nan,
        scraped=Scraped(("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"), "mean"),
        doc="KV cache in use, 0..1",
    ),
    Feature(
        "kv_capacity_tokens",
        math.nan,
        scraped=Scraped(("vllm:cache_config_info",), "capacity"),
        doc="KV cache size in tokens",
    ),
    Feature(
        "prefix_queries",
        math.nan,
        scraped=Scraped(
            (
                "vllm:prefix_cache_queries_total",
                "vllm:prefix_cache_queries",
                "vllm:gpu_prefix_cache_queries_total",
                "vllm:gpu_prefix_cache_queries",
            )
        ),
        candidate=False,
        doc="prompt tokens looked up in the prefix cache (counter)",
    ),
    Feature(
        "prefix_hits",
        math.nan,
        scraped=Scraped(
            (
                "vllm:prefix_cache_hits_total",
                "vllm:prefix_cache_hits",
                "vllm:gpu_prefix_cache_hits_total",
                "vllm:gpu_prefix_cache_hits",
            )
        ),
        candidate=False,
        doc="prompt tokens found in the prefix cache (counter)",
    ),
    # The router's own bookkeeping: exact between scrapes, zero when nothing is in flight.
    Feature(
        "queued_prefill_tokens", 0.0, shared=True, doc="uncached prompt tokens routed here, not yet prefilled"
    ),
    Feature("slowness", 1.0, doc="this engine's latency over the pool model's (router/signals/engines.py)"),
    Feature("reserved_kv_tokens", 0.0, shared=True, doc="KV tokens reserved by requests routed here"),
    Feature(
        "inflight_requests", 0, np.int64, shared=True, doc="requests routed here, from the pick to their end"
    ),
    Feature("queued_prefill_requests", 0, np.int64, candidate=False),
    Feature(
        "waiting_ours",
        0.0,
        doc="our requests not past their prefill here when it was last scraped: at most the share "
        "of its scraped waiting that is ours (those being prefilled count as running there)",
    ),
    Feature("decoding_requests", 0, np.int64, doc="ours past their prefill: decoding here"),
    Feature("decoding_kv_tokens", 0.0, doc="KV tokens reserved by those decoding here"),
    # Each prompt a pod computes stalls the answers it decodes (``terms/load.py`` ``stalled_tpot_s``).
    Feature(
        "prefill_rate",
        0.0,
        doc="uncached prompt tokens per second we routed here to be computed lately (decayed over "
        "picker.prefill_rate_window_ms, at each prompt and each scrape)",
    ),
    Feature("prefill_rate_at", math.nan, candidate=False, doc="when prefill_rate was last decayed"),
    # The decode batch and resident KV integrated over time (``Pool.advance_decode``): a stream's
    # time per token depends on their means while it decoded, not on their values at its pick.
    Feature("batch_seconds", 0.0, candidate=False, doc="∫ decode batch dt since the endpoint joined"),
    Feature("kv_token_seconds", 0.0, candidate=False, doc="∫ resident KV tokens dt since it joined"),
    Feature("decode_since", math.nan, candidate=False, doc="when the two integrals were brought up to date"),
    # Identity and state masks.
    Feature("link_index", 0, np.int64, doc="topology label, as an index into the link table"),
    Feature("can_prefill", False, np.bool_, doc="role prefill or prefill-decode"),
    Feature("can_decode", False, np.bool_, doc="role decode or prefill-decode"),
    Feature(
        "sidecar",
        False,
        np.bool_,
        doc="a P/D sidecar fronts it: behind a gateway, a pair may end on it (it runs the prefill leg)",
    ),
    Feature("last_scrape_ok", -math.inf, candidate=False),
    Feature("in_use", False, np.bool_, candidate=False),
    Feature("admitted", False, np.bool_, candidate=False),
    Feature("scraped", False, np.bool_, candidate=False),
    Feature("ejected", False, np.bool_, candidate=False),
    Feature(
        "kv_covered", False, np.bool_, candidate=False, doc="precise mode: the KV-event view is complete"
    ),
)

SCRAPED = tuple(f.name for f in FEATURES if f.scraped is not None)
CANDIDATE = tuple(f.name for f in FEATURES if f.candidate)
SHARED = tuple(f.name for f in FEATURES if f.shared)
