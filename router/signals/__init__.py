"""Signals for autoscalers and dashboards: pool saturation and load per role (``docs/architecture.md``)."""
