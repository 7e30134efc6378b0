"""The HTTP/2 gRPC server the ext_proc, health and KEDA listeners run on (``h2``, its limits in
``H2Limits``), and its TLS (``tls``: a server context from PEM files, reloaded when they change)."""
