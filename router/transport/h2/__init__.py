"""The HTTP/2 gRPC server the ext_proc, health and KEDA listeners run on."""
