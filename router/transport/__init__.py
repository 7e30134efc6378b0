"""The HTTP/2 gRPC server the ext_proc and health listeners run on."""
