"""Seeded workloads and the open-loop client that replays them."""
