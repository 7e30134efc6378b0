"""Every per-endpoint feature, declared once: its name, where its value comes from, and what an
endpoint nobody has measured holds.

The pool allocates one numpy array per feature (``Pool.<name>``, indexed by slot); a scrape copies
each scraped feature from its ``EngineMetrics`` field; every candidate feature is gathered into
``scorers.base.Candidates`` under the same name for the scorers. Adding a feature is one line here
(plus, for a new scraped metric, its name in ``router/observe/scrape.py``'s table).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Feature:
    name: str
    empty: float  # the value of a slot before anything is known; NaN = unknown, never 0
    dtype: type = np.float64
    from_scrape: bool = False  # copied from the ``EngineMetrics`` field of the same name on every scrape
    candidate: bool = True  # gathered into ``Candidates`` for scorers
    doc: str = ""


FEATURES: tuple[Feature, ...] = (
    # From the engine's /metrics (vllm:num_requests_running, ...); unknown until scraped.
    Feature("running", math.nan, from_scrape=True, doc="requests decoding (vllm:num_requests_running)"),
    Feature("waiting", math.nan, from_scrape=True, doc="requests queued (vllm:num_requests_waiting)"),
    Feature("kv_usage", math.nan, from_scrape=True, doc="KV cache in use, 0..1 (vllm:kv_cache_usage_perc)"),
    Feature(
        "kv_capacity_tokens",
        math.nan,
        from_scrape=True,
        doc="block_size × num_gpu_blocks (vllm:cache_config_info)",
    ),
    # The router's own bookkeeping: exact between scrapes, zero when nothing is in flight.
    Feature("queued_prefill_tokens", 0.0, doc="uncached prompt tokens we routed, not yet prefilled"),
    Feature("reserved_kv_tokens", 0.0, doc="KV tokens reserved by requests we routed"),
    Feature("inflight_requests", 0, np.int64, doc="requests we routed that are decoding here"),
    Feature("queued_prefill_requests", 0, np.int64, candidate=False),
    # Identity and state masks.
    Feature("link_index", 0, np.int64, doc="topology label, as an index into the link table"),
    Feature("can_prefill", False, np.bool_, doc="role prefill or prefill-decode"),
    Feature("can_decode", False, np.bool_, doc="role decode or prefill-decode"),
    Feature("last_scrape_ok", -math.inf, candidate=False),
    Feature("in_use", False, np.bool_, candidate=False),
    Feature("admitted", False, np.bool_, candidate=False),
    Feature("scraped", False, np.bool_, candidate=False),
    Feature("ejected", False, np.bool_, candidate=False),
    Feature(
        "kv_covered", False, np.bool_, candidate=False, doc="precise mode: the KV-event view is complete"
    ),
)

SCRAPED = tuple(f.name for f in FEATURES if f.from_scrape)
CANDIDATE = tuple(f.name for f in FEATURES if f.candidate)
