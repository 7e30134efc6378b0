# pd-router: the picker (`pd-router serve`) and the decode sidecar (`pd-router sidecar`), as the
# Helm chart (helm/pd-router) runs them: non-root (65532), read-only root filesystem.
#   docker build -t ghcr.io/pd-router/pd-router:0.1.0 .
# BASE is any image with Python >= 3.11 and its venv module (python3 -m venv), groupadd and useradd:
# the registry's python:3.11-slim by default, or a Debian bookworm root filesystem with python3 and
# python3-venv (.ci/build-image makes one from Debian's packages, for machines without a registry).
ARG BASE=python:3.11-slim
FROM ${BASE}

# NUMBA_CACHE_DIR: the compiled cost model's loops (router/scheduling/costmodel/compiled.py) are
# cached under /tmp, the one writable place (the chart's emptyDir): a container restarted in the
# same pod loads them instead of compiling them again (a few seconds at start).
ENV PYTHONDONTWRITEBYTECODE=1 \
    NUMBA_CACHE_DIR=/tmp/numba-cache \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/pd-router/bin:$PATH

# For the build only (neither is kept in the image's environment): another package index, and,
# behind a TLS-intercepting proxy, its CA bundle mounted into the build (podman build -v) and
# named by PIP_CERT (empty: pip's own CA bundle).
ARG PIP_INDEX_URL=https://pypi.org/simple
ARG PIP_CERT=

# In a virtualenv: the same on every base (Debian's own python3 refuses `pip install` outside one).
# The dependencies first, read from pyproject.toml, so a rebuild after a source change reuses their
# layer; then the package. simulator is installed too: the CLI loads its `demo` and `sim` commands.
WORKDIR /src
COPY pyproject.toml README.md ./
RUN python3 -m venv /opt/pd-router \
 && python3 -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
print("\n".join(p["dependencies"] + p["optional-dependencies"]["fast"]))' > /tmp/requirements.txt \
 && /opt/pd-router/bin/pip install -r /tmp/requirements.txt \
 && rm /tmp/requirements.txt
COPY router ./router
COPY kvindex ./kvindex
COPY simulator ./simulator
RUN /opt/pd-router/bin/pip install --no-deps '.[fast]' \
 && /opt/pd-router/bin/pip check \
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
