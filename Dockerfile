# pd-router: the picker (`pd-router serve`) and the decode sidecar (`pd-router sidecar`), as the
# Helm chart (helm/pd-router) runs them: non-root (65532), read-only root filesystem.
#   docker build -t ghcr.io/pd-router/pd-router:0.1.0 .
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# simulator is installed too: the CLI loads its `demo` and `sim` commands (entry points).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY router ./router
COPY kvindex ./kvindex
COPY simulator ./simulator
RUN pip install '.[fast]' \
 && rm -rf /src

RUN groupadd --gid 65532 pd-router \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin pd-router

WORKDIR /
USER 65532:65532
# ext_proc, gRPC health, metrics, KEDA external scaler (the sidecar listens on its --port)
EXPOSE 9002 9003 9090 9004
ENTRYPOINT ["pd-router"]
CMD ["--help"]
