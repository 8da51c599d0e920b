# The node image, CPU: `sparseloco node` with the CPU build of torch (about 1 GB of Python
# packages; the default PyPI torch would be a multi-GB CUDA build, see node-cuda.Dockerfile).
#
#   docker build -f deploy/node.Dockerfile -t sparseloco/node .
#   docker run -e SPARSELOCO_NODE_COORDINATOR=https://coord.example \
#       -e SPARSELOCO_NODE_TOKEN=... -v node-state:/var/lib/sparseloco sparseloco/node
#
# Context: the repository root. Build arguments:
#   BASE_IMAGE       any Debian-like image with python3 (3.11+) and its venv module
#   TORCH_VERSION    the torch release (keep it equal to the README's install command)
#   TORCH_INDEX_URL  where the CPU build of torch comes from
#   PIP_NO_INDEX     1: install only from deploy/offline/wheels, which must then hold the CPU
#                    torch wheel and every dependency (deploy/compose-test.sh makes one)
# A CA bundle at deploy/offline/ca.crt, if present, is the one pip trusts during the build.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG PIP_NO_INDEX=0
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
COPY deploy/offline/ /offline/
# torch alone first, from the CPU index (or the wheelhouse): the project's range then finds it
# installed and pip never reaches for the CUDA build. Its own layer, so that source changes
# do not reinstall it.
RUN set -eu; \
    if [ -f /offline/ca.crt ]; then export PIP_CERT=/offline/ca.crt; fi; \
    mkdir -p /offline/wheels; \
    python3 -m venv /opt/sparseloco; \
    /opt/sparseloco/bin/pip install --find-links /offline/wheels \
        --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
COPY pyproject.toml README.md /src/
COPY protocol /src/protocol
COPY coordinator /src/coordinator
COPY node /src/node
RUN set -eu; \
    if [ -f /offline/ca.crt ]; then export PIP_CERT=/offline/ca.crt; fi; \
    /opt/sparseloco/bin/pip install --find-links /offline/wheels "/src[node]"; \
    /opt/sparseloco/bin/python -c 'import torch, sys; sys.exit(torch.version.cuda is not None)'; \
    /opt/sparseloco/bin/sparseloco node --help >/dev/null

FROM ${BASE_IMAGE}
RUN useradd --system --uid 10001 --user-group --no-create-home \
        --home-dir /var/lib/sparseloco sparseloco \
    && install -d -o sparseloco -g sparseloco -m 0750 /var/lib/sparseloco \
    && install -d -o sparseloco -g sparseloco -m 0755 /var/cache/sparseloco
COPY --from=build /opt/sparseloco /opt/sparseloco
# numba caches compiled kernels beside their modules unless told otherwise; site-packages is
# not writable by the node's user, so the cache goes to a directory that is.
ENV PATH=/opt/sparseloco/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NUMBA_CACHE_DIR=/var/cache/sparseloco/numba \
    MPLCONFIGDIR=/var/cache/sparseloco/matplotlib \
    SPARSELOCO_NODE_STATE_DIR=/var/lib/sparseloco
USER sparseloco
WORKDIR /var/lib/sparseloco
# The coordinator URL and the token come from the environment (SPARSELOCO_NODE_COORDINATOR,
# SPARSELOCO_NODE_TOKEN); SIGTERM makes the node leave the run, save and exit 0.
ENTRYPOINT ["/opt/sparseloco/bin/sparseloco", "node"]
