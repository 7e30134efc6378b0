"""Real servers the suite and the benchmarks start on loopback ports (Envoy, redis-server), and a
fake Kubernetes API server."""
