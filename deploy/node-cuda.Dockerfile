# The node image, CUDA variant. UNTESTED: it has never been built or run. The machines this
# project is developed and tested on have no GPU, and its build would download several GB of
# CUDA wheels for nothing that could be checked there, so it is written to mirror
# node.Dockerfile (which CI builds and runs: deploy/compose-test.sh) and no more. Treat it as a
# starting point, and build and try it on a GPU host before relying on it.
#
# Two more things to know before using it:
# - The node daemon trains on the CPU today (the model is built on the CPU and never moved),
#   so this image runs exactly like the CPU one until the node learns to pick a CUDA device.
# - torch 2.13.0 from PyPI (Linux x86_64) is built for CUDA 13.0 and brings the CUDA runtime,
#   cuBLAS, cuDNN and NCCL as nvidia-* wheels (several GB); the host needs only an NVIDIA
#   driver recent enough for CUDA 13 and the NVIDIA Container Toolkit:
#       docker run --gpus all -e SPARSELOCO_NODE_COORDINATOR=... -e SPARSELOCO_NODE_TOKEN=... \
#           -v node-state:/var/lib/sparseloco sparseloco/node-cuda
#
#   docker build -f deploy/node-cuda.Dockerfile -t sparseloco/node-cuda .
#
# Build arguments as in node.Dockerfile; TORCH_INDEX_URL defaults to PyPI here (its Linux
# wheels are the CUDA ones). A base image with the CUDA toolkit is not needed for that reason.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG PIP_NO_INDEX=0
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
COPY deploy/offline/ /offline/
RUN set -eu; \
    if [ -f /offline/ca.crt ]; then export PIP_CERT=/offline/ca.crt; fi; \
    mkdir -p /offline/wheels; \
    python3 -m venv /opt/sparseloco; \
    /opt/sparseloco/bin/pip install --find-links /offline/wheels \
        --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"; \
    /opt/sparseloco/bin/python -c 'import torch, sys; sys.exit(torch.version.cuda is None)'
COPY pyproject.toml README.md /src/
COPY protocol /src/protocol
COPY coordinator /src/coordinator
COPY node /src/node
RUN set -eu; \
    if [ -f /offline/ca.crt ]; then export PIP_CERT=/offline/ca.crt; fi; \
    /opt/sparseloco/bin/pip install --find-links /offline/wheels "/src[node]"; \
    /opt/sparseloco/bin/sparseloco node --help >/dev/null

FROM ${BASE_IMAGE}
RUN useradd --system --uid 10001 --user-group --no-create-home \
        --home-dir /var/lib/sparseloco sparseloco \
    && install -d -o sparseloco -g sparseloco -m 0750 /var/lib/sparseloco \
    && install -d -o sparseloco -g sparseloco -m 0755 /var/cache/sparseloco
COPY --from=build /opt/sparseloco /opt/sparseloco
ENV PATH=/opt/sparseloco/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NUMBA_CACHE_DIR=/var/cache/sparseloco/numba \
    MPLCONFIGDIR=/var/cache/sparseloco/matplotlib \
    SPARSELOCO_NODE_STATE_DIR=/var/lib/sparseloco \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER sparseloco
WORKDIR /var/lib/sparseloco
ENTRYPOINT ["/opt/sparseloco/bin/sparseloco", "node"]
