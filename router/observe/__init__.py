"""Observation: scraping engine /metrics, and the router's own Prometheus metrics."""
