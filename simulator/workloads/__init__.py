"""Seeded workloads (``generate``) and the open-loop client that replays them (``client``)."""
