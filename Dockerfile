# rollbuf service image: `docker build -t rollbuf .` (README, docs/deployment.md#containers).
# One server process on 0.0.0.0:8000, as the unprivileged user `rollbuf`; the default store is the embedded
# SQLite file on the /data volume. tests/image builds and runs exactly this file (make image-test).

# The base image; a mirror or a pinned digest can stand in: --build-arg PYTHON_IMAGE=registry/python@sha256:...
ARG PYTHON_IMAGE=python:3.11-slim

# Build stage: a virtual environment in /opt/rollbuf, copied whole into the final image (no pip cache, no
# build files, nothing from this stage's layers but the environment).
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/rollbuf
WORKDIR /src
# Dependencies first, in their own layer, so that changes to the code or the README do not reinstall them:
# the project with empty packages (and an empty README), then the project itself removed again.
COPY pyproject.toml ./
RUN mkdir -p api trainer_client rollout_client demos \
    && touch README.md api/__init__.py trainer_client/__init__.py rollout_client/__init__.py demos/__init__.py \
    && /opt/rollbuf/bin/pip install . && /opt/rollbuf/bin/pip uninstall -y rollbuf
COPY README.md ./
COPY api ./api
COPY trainer_client ./trainer_client
COPY rollout_client ./rollout_client
COPY demos ./demos
# pip and setuptools leave with the build: the final image installs nothing.
RUN /opt/rollbuf/bin/pip install --no-deps . && /opt/rollbuf/bin/python -m pip uninstall -y -q pip setuptools

FROM ${PYTHON_IMAGE}
ARG VERSION=0.1.0
LABEL org.opencontainers.image.title="rollbuf" \
      org.opencontainers.image.description="A durable, fast experience buffer for LLM reinforcement learning, wire-compatible with the AtroposLib API." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.licenses="Apache-2.0"
# A fixed uid, so that a host directory mounted on /data can be given to it: chown 10001 DIR.
RUN groupadd --system --gid 10001 rollbuf \
    && useradd --system --uid 10001 --gid rollbuf --home-dir /data --no-create-home --shell /usr/sbin/nologin rollbuf \
    && mkdir /data && chown rollbuf:rollbuf /data
COPY --from=build /opt/rollbuf /opt/rollbuf
ENV PATH=/opt/rollbuf/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 \
    ROLLBUF_HOST=0.0.0.0 ROLLBUF_PORT=8000 ROLLBUF_STORE=sqlite:////data/rollbuf.db
USER rollbuf
WORKDIR /data
# Declared after the chown: a new named volume starts as a copy of /data, owned by rollbuf.
VOLUME ["/data"]
EXPOSE 8000
# Healthy = /readyz: the store answers a read within 2 s (503 otherwise); on ROLLBUF_PORT if that is changed.
# Docker keeps it; podman only with `podman build --format docker` (OCI images have no health check).
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/readyz' % os.environ.get('ROLLBUF_PORT', '8000'), timeout=2)"]
# SIGTERM (docker stop) ends the server cleanly: in-flight requests finish, the store closes.
STOPSIGNAL SIGTERM
CMD ["rollbuf", "serve"]
