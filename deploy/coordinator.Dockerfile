# The coordinator image: `python -m coordinator`, the project's base install only (no torch,
# numba or numpy), about 120 MB of Python packages on top of the base image.
#
#   docker build -f deploy/coordinator.Dockerfile -t sparseloco/coordinator .
#   docker run -v $PWD/run.toml:/etc/sparseloco/run.toml:ro -v coord-state:/var/lib/sparseloco \
#       -p 127.0.0.1:8700:8700 sparseloco/coordinator
#
# Context: the repository root (.dockerignore keeps it to the sources). Build arguments:
#   BASE_IMAGE    any Debian-like image with python3 (3.11+) and its venv module
#   PIP_NO_INDEX  1: install only from deploy/offline/wheels (a wheelhouse made on the host)
# A CA bundle at deploy/offline/ca.crt, if present, is the one pip trusts during the build
# (for a build machine behind a TLS-inspecting proxy). Neither lands in the final image.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG PIP_NO_INDEX=0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
COPY deploy/offline/ /offline/
COPY pyproject.toml README.md /src/
COPY protocol /src/protocol
COPY coordinator /src/coordinator
COPY node /src/node
RUN set -eu; \
    if [ -f /offline/ca.crt ]; then export PIP_CERT=/offline/ca.crt; fi; \
    mkdir -p /offline/wheels; \
    python3 -m venv /opt/sparseloco; \
    /opt/sparseloco/bin/pip install --find-links /offline/wheels /src; \
    if /opt/sparseloco/bin/python -c 'import torch' 2>/dev/null; then \
        echo 'torch must not be in the coordinator image' >&2; exit 1; \
    fi; \
    /opt/sparseloco/bin/python -m coordinator --help >/dev/null

FROM ${BASE_IMAGE}
RUN useradd --system --uid 10001 --user-group --no-create-home \
        --home-dir /var/lib/sparseloco sparseloco \
    && install -d -o sparseloco -g sparseloco -m 0750 /var/lib/sparseloco \
    && install -d -m 0755 /etc/sparseloco
COPY --from=build /opt/sparseloco /opt/sparseloco
ENV PATH=/opt/sparseloco/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
USER sparseloco
WORKDIR /var/lib/sparseloco
EXPOSE 8700
# Listen on every address of the container; publish the port on the host's loopback (or a
# private address) and put TLS in front of it (deploy/README.md). SIGTERM stops it cleanly.
ENTRYPOINT ["/opt/sparseloco/bin/python", "-m", "coordinator"]
CMD ["--config", "/etc/sparseloco/run.toml", "--host", "0.0.0.0", "--state-dir", "/var/lib/sparseloco"]
