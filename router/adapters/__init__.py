"""Adapters: each translates one protocol (OpenAI HTTP, Envoy ext_proc, gRPC health) into the request flow."""
