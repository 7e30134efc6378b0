"""Simulated vLLM engines, shipped with pd-router for ``pd-router sim`` and ``pd-router demo``: the
OpenAI API, vLLM's metrics and KV events, P/D roles, a prefix cache and a batching time model
(``engine``); a fleet whose replicas start, turn Ready and roll (``fleet``); the same engines and
the router in one process on a virtual clock (``virtual_clock``, ``local_net``); seeded workloads
and the open-loop client (``workloads/``)."""
