"""Real servers the suite and the benchmarks start on loopback ports (Envoy, redis-server,
``pd-router serve`` replicas to signal and restart), and a fake Kubernetes API server."""
