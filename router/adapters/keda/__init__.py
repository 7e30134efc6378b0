"""KEDA external scaler: per-role signals over KEDA's gRPC contract (``proto/externalscaler.proto``)."""
