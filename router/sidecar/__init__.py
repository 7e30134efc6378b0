"""``pd-router sidecar``: the decode-side P/D proxy of an Envoy/InferencePool deployment."""
