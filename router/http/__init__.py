"""What the proxy adapter and the sidecar share over HTTP: header rules, the client body read, the
engine session, and the two-leg prefill → decode exchange (``docs/architecture.md``)."""
