#!/usr/bin/env bash
# deploy/compose-test.sh: build the images and run docker-compose.yml end to end, on a machine
# that reaches Debian's package mirror and PyPI but no container registry.
#
#   sudo bash deploy/compose-test.sh        (CI runs it from .ci/run, as root)
#
# 1. installs docker.io, docker-compose and debootstrap from Debian if missing, and starts
#    dockerd if no engine answers (and stops it again at the end);
# 2. makes the base image locally, since Docker Hub is out of reach: debootstrap a minimal
#    Debian bookworm with python3, python3-venv and ca-certificates and `docker import` it as
#    $BASE_IMAGE, which the Dockerfiles take through their BASE_IMAGE argument;
# 3. puts this machine's CA bundle in deploy/offline/ca.crt and builds the coordinator image
#    online: pip inside the build resolves against PyPI, trusting that bundle;
# 4. makes a wheelhouse here (the CPU torch wheel pip finds on this machine, every other
#    dependency of the node and the store, setuptools for building the project), links it into
#    deploy/offline/wheels and builds the store and node images offline from it;
# 5. `docker-compose up`s the store, the coordinator and two nodes, waits until the run's last
#    round closed and both nodes exited 0, checks that every closed round's fingerprints are
#    identical (deploy/compose_check.py, through the coordinator's GET /v1/status) and prints a
#    summary;
# 6. runs the systemd units for real: a container with systemd as PID 1 (the node image plus
#    Debian's systemd), the units and env files installed as deploy/README.md says, a store, the
#    coordinator (killed once with SIGKILL: it must come back) and two node instances; checks
#    that both nodes exit 0 and that their fingerprints agree;
# 7. always `docker-compose down -v`, removes that container and empties deploy/offline/
#    again; on any failure it shows the logs and exits non-zero.
#
# Kept between runs on one machine: the base image, the wheelhouse ($CACHE/wheels) and
# Docker's build cache. Environment: SPARSELOCO_REBUILD_BASE=1 (debootstrap again),
# DEBIAN_MIRROR, SPARSELOCO_COMPOSE_RUN_TIMEOUT_S (default 600 s for the run itself).
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=sparseloco-compose-test
BASE_IMAGE=sparseloco/debian-python:bookworm
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
TORCH_VERSION=2.13.0 # the README's install command; the node image gets this CPU build
RUN_TIMEOUT_S=${SPARSELOCO_COMPOSE_RUN_TIMEOUT_S:-600}
CACHE=/var/cache/sparseloco-compose-test
WORK=$(mktemp -d /tmp/sparseloco-compose-test.XXXXXX)
T0=$(date +%s)
DOCKERD_PID=
COMPOSE_UP=
SYSTEMD_BOX=

say() { printf '== compose-test [%4ss] %s\n' "$(($(date +%s) - T0))" "$*"; }
fail() {
    printf '\n!! compose-test FAILED: %s\n\n' "$*" >&2
    exit 1
}
# Runs a long step with its output in a log file; on failure shows the end of it and fails.
logged() {
    local name=$1
    shift
    if ! "$@" >"$WORK/$name.log" 2>&1; then
        echo "---- last 80 lines of $name.log:" >&2
        tail -n 80 "$WORK/$name.log" >&2
        fail "$name: '$*' exited non-zero"
    fi
}
# deploy/offline/ is this script's scratch space (git ignores all of it but its .gitignore).
clear_offline() { find deploy/offline -mindepth 1 -maxdepth 1 ! -name .gitignore -exec rm -rf {} +; }

cleanup() {
    local code=$?
    set +e
    if [ -n "$COMPOSE_UP" ]; then
        if [ "$code" != 0 ]; then
            echo "---- docker-compose ps:" >&2
            compose ps >&2
            echo "---- docker-compose logs (the nodes and the coordinator: last 150 lines each):" >&2
            compose logs --no-color --tail=150 coordinator node-a node-b >&2
            echo "---- docker-compose logs (the store: last 30 lines):" >&2
            compose logs --no-color --tail=30 store >&2
        fi
        say "docker-compose down -v"
        compose down -v --remove-orphans >"$WORK/down.log" 2>&1 || cat "$WORK/down.log" >&2
    fi
    if [ -n "$SYSTEMD_BOX" ]; then
        if [ "$code" != 0 ]; then
            echo "---- journal of the systemd container (last 120 lines):" >&2
            "$DOCKER" exec "$SYSTEMD_BOX" journalctl --no-pager -n 120 >&2
        fi
        "$DOCKER" rm -f "$SYSTEMD_BOX" >/dev/null
    fi
    if [ -n "$DOCKERD_PID" ]; then
        say "stopping the dockerd this script started (pid $DOCKERD_PID)"
        kill -TERM "$DOCKERD_PID" 2>/dev/null
        for _ in $(seq 30); do
            kill -0 "$DOCKERD_PID" 2>/dev/null || break
            sleep 1
        done
    fi
    clear_offline
    # debootstrap may leave /proc or /sys mounted in a root file system it did not finish.
    awk -v w="$WORK/" 'index($2, w) == 1 {print $2}' /proc/mounts | sort -r | xargs -r umount -l
    rm -rf --one-file-system "$WORK"
    if [ "$code" = 0 ]; then say "passed"; else say "FAILED (exit $code)"; fi
    exit "$code"
}
trap cleanup EXIT

# ---------------------------------------------------------------------------------- 1. tools
[ "$(id -u)" = 0 ] || fail "run as root: it installs packages and starts dockerd"
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    say "apt-get install ${missing[*]}"
    logged apt-update apt-get update -q
    logged apt-install env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi
# Debian's client matches Debian's engine; another docker earlier on PATH may be newer.
DOCKER=/usr/bin/docker
[ -x "$DOCKER" ] || DOCKER=$(command -v docker)
compose() { docker-compose -p "$PROJECT" -f docker-compose.yml "$@"; }

if ! "$DOCKER" info >/dev/null 2>&1; then
    say "starting dockerd"
    dockerd >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do
        "$DOCKER" info >/dev/null 2>&1 && break
        kill -0 "$DOCKERD_PID" 2>/dev/null || break
        sleep 1
    done
    if ! "$DOCKER" info >/dev/null 2>&1; then
        echo "---- dockerd log:" >&2
        tail -n 60 "$WORK/dockerd.log" >&2
        fail "NO DOCKER ENGINE: dockerd did not start on this machine, so the images and \
docker-compose.yml were NOT tested (see the log above)"
    fi
fi
say "docker engine $("$DOCKER" version -f '{{.Server.Version}}'), docker-compose $(docker-compose version --short)"

# ----------------------------------------------------------------------------- 2. base image
if [ "${SPARSELOCO_REBUILD_BASE:-0}" = 1 ] || ! "$DOCKER" image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
    say "debootstrap $SUITE (python3, python3-venv, ca-certificates) from $MIRROR"
    rootfs=$WORK/rootfs
    logged debootstrap debootstrap --variant=minbase \
        --include=python3,python3-venv,ca-certificates "$SUITE" "$rootfs" "$MIRROR"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    say "docker import as $BASE_IMAGE"
    tar -C "$rootfs" -c . | "$DOCKER" import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["python3"]' \
        - "$BASE_IMAGE" >/dev/null
    rm -rf --one-file-system "$rootfs"
else
    say "base image $BASE_IMAGE already here (SPARSELOCO_REBUILD_BASE=1 makes it again)"
fi
"$DOCKER" run --rm "$BASE_IMAGE" python3 -c \
    'import sys, venv; print("   base image: python", sys.version.split()[0])'

# ------------------------------------------------------------------- 3. the coordinator image
token() { python3 -c "import secrets; print(secrets.token_hex($1))"; }
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
SPARSELOCO_STORE_ACCESS_KEY=ci$(token 8)
SPARSELOCO_STORE_SECRET_KEY=$(token 20)
SPARSELOCO_NODE_A_TOKEN=$(token 16)
SPARSELOCO_NODE_B_TOKEN=$(token 16)
SPARSELOCO_COORDINATOR_PORT=$(free_port)
SPARSELOCO_COORDINATOR_BIND=127.0.0.1
SPARSELOCO_BASE_IMAGE=$BASE_IMAGE
export SPARSELOCO_STORE_ACCESS_KEY SPARSELOCO_STORE_SECRET_KEY SPARSELOCO_NODE_A_TOKEN \
    SPARSELOCO_NODE_B_TOKEN SPARSELOCO_COORDINATOR_PORT SPARSELOCO_COORDINATOR_BIND \
    SPARSELOCO_BASE_IMAGE
logged compose-config compose config -q

clear_offline
ca=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
[ -f "$ca" ] || ca=/etc/ssl/certs/ca-certificates.crt
cp "$ca" deploy/offline/ca.crt
say "build coordinator: online, pip against PyPI inside the build, trusting $ca"
SPARSELOCO_PIP_NO_INDEX=0 logged build-coordinator compose build coordinator
"$DOCKER" run --rm --entrypoint python sparseloco/coordinator:dev -c \
    'import importlib.util as u, sys; bad = [m for m in ("torch", "numba", "numpy") if u.find_spec(m)]; sys.exit(f"it has {bad}" if bad else 0)' ||
    fail "the coordinator image carries the node's dependencies"

# -------------------------------------------------------------- 4. wheelhouse, store and node
mkdir -p "$CACHE/wheels"
python3 - >"$WORK/requirements.txt" <<'EOF'
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for req in project["dependencies"] + project["optional-dependencies"]["node"]:
    if not req.startswith("torch"):
        print(req)
print("setuptools>=69")
EOF
say "wheelhouse: pip download torch==$TORCH_VERSION and $(wc -l <"$WORK/requirements.txt") requirements into $CACHE/wheels"
logged pip-download python3 -m pip download --only-binary=:all: --dest "$CACHE/wheels" \
    "torch==$TORCH_VERSION" -r "$WORK/requirements.txt"
torch_wheel=$(find "$CACHE/wheels" -name "torch-$TORCH_VERSION+cpu-*.whl" | head -n 1)
[ -n "$torch_wheel" ] || fail "pip found no CPU build of torch $TORCH_VERSION on this machine \
(see 'pip config list'); refusing to build a node image with a CUDA one"
if find "$CACHE/wheels" -name 'nvidia_*' | grep -q .; then
    fail "the wheelhouse holds CUDA libraries (nvidia_*): a CUDA build of torch was resolved"
fi
# Hard links when the cache and the tree share a file system, a copy otherwise.
cp -al "$CACHE/wheels" deploy/offline/wheels 2>/dev/null || cp -a "$CACHE/wheels" deploy/offline/wheels
say "wheelhouse: $(find deploy/offline/wheels -name '*.whl' | wc -l) wheels, $(du -sh deploy/offline/wheels | cut -f1), torch: $(basename "$torch_wheel")"
say "build store and node: offline, the wheelhouse only"
SPARSELOCO_PIP_NO_INDEX=1 logged build-store-node compose build store node-a node-b
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}}  {{.Size}}' | grep -E '^sparseloco/' | sed 's/^/   /'

# ------------------------------------------------------------------------------------ 5. run
say "docker-compose up: store, coordinator (127.0.0.1:$SPARSELOCO_COORDINATOR_PORT), node-a, node-b"
COMPOSE_UP=1
logged compose-up compose up -d --no-build
python3 deploy/compose_check.py --url "http://127.0.0.1:$SPARSELOCO_COORDINATOR_PORT" \
    --project "$PROJECT" --docker "$DOCKER" --nodes node-a,node-b --timeout "$RUN_TIMEOUT_S" ||
    fail "the compose run did not finish with agreeing fingerprints"
say "docker-compose down -v"
logged compose-down compose down -v --remove-orphans
COMPOSE_UP=

# --------------------------------------------------------------- 6. the systemd units, for real
say "systemd: build a container with systemd as PID 1 from the node image"
sd=$WORK/systemd
mkdir -p "$sd"
cp deploy/systemd/sparseloco-coordinator.service deploy/systemd/sparseloco-node@.service "$sd/"
sed -e 's|^endpoint_url = .*|endpoint_url = "http://127.0.0.1:8333"|' -e 's|^host = .*|host = "127.0.0.1"|' \
    deploy/compose/run.toml >"$sd/run.toml"
# The env files are the examples with their values filled in; the node ids are the example's.
nodes=$(
    python3 - "$sd" <<'EOF'
import json, os, re, sys
from pathlib import Path

out = Path(sys.argv[1])
coord = Path("deploy/systemd/coordinator.env.example").read_text()
for field in ("ACCESS_KEY", "SECRET_KEY"):
    value = os.environ[f"SPARSELOCO_STORE_{field}"]
    coord = re.sub(rf"^(SPARSELOCO_COORD_STORAGE__{field})=.*$", rf"\1={value}", coord, flags=re.M)
(out / "coordinator.env").write_text(coord)
tokens = json.loads(re.search(r"^SPARSELOCO_COORD_TOKENS='(.*)'$", coord, re.M).group(1))
node = Path("deploy/systemd/node.env.example").read_text()
for name, token in tokens.items():
    text = re.sub(r"^(SPARSELOCO_NODE_COORDINATOR)=.*$", r"\1=http://127.0.0.1:8700", node, flags=re.M)
    text = re.sub(r"^(SPARSELOCO_NODE_TOKEN)=.*$", rf"\1={token}", text, flags=re.M)
    (out / f"node-{name}.env").write_text(text + "SPARSELOCO_NODE_THREADS=1\n")
print(",".join(tokens))
EOF
)
cat >"$sd/test-store.service" <<EOF
[Unit]
Description=weed mini on loopback, for this test only
[Service]
Environment=AWS_ACCESS_KEY_ID=$SPARSELOCO_STORE_ACCESS_KEY AWS_SECRET_ACCESS_KEY=$SPARSELOCO_STORE_SECRET_KEY
StateDirectory=test-store
ExecStart=/opt/sparseloco/bin/weed -logtostderr=true mini -dir=/var/lib/test-store -ip=127.0.0.1 -ip.bind=127.0.0.1 -bucket=sparseloco -admin.ui=false -webdav=false -s3.port.iceberg=0 -s3.port.lance=0 -master.telemetry=false
[Install]
WantedBy=multi-user.target
EOF
cat >"$sd/Dockerfile" <<'EOF'
FROM sparseloco/node:dev
USER root
RUN apt-get update -q \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends systemd systemd-sysv \
    && rm -rf /var/lib/apt/lists/*
# The units expect the install in /opt/sparseloco/venv; the node image has it in /opt/sparseloco.
RUN ln -s /opt/sparseloco /opt/sparseloco/venv && install -d -m 0755 /etc/sparseloco
COPY sparseloco-coordinator.service sparseloco-node@.service test-store.service /etc/systemd/system/
COPY run.toml coordinator.env node-*.env /etc/sparseloco/
RUN chmod 0600 /etc/sparseloco/*.env && systemctl enable test-store.service
ENV container=docker
STOPSIGNAL SIGRTMIN+3
ENTRYPOINT ["/lib/systemd/systemd"]
EOF
logged systemd-build "$DOCKER" build -t sparseloco/systemd-test:dev "$sd"
SYSTEMD_BOX=$PROJECT-systemd
"$DOCKER" rm -f "$SYSTEMD_BOX" >/dev/null 2>&1 || true
logged systemd-run "$DOCKER" run -d --name "$SYSTEMD_BOX" --cap-add SYS_ADMIN \
    --security-opt seccomp=unconfined --security-opt apparmor=unconfined --cgroupns=host \
    -v /sys/fs/cgroup:/sys/fs/cgroup:rw --tmpfs /run --tmpfs /run/lock --tmpfs /tmp \
    sparseloco/systemd-test:dev
sdexec() { "$DOCKER" exec "$SYSTEMD_BOX" "$@"; }
prop() { sdexec systemctl show -p "$2" --value "$1"; }
# Runs "$@" once a second until it succeeds, for at most $1 seconds.
await() {
    local limit=$1
    shift
    for _ in $(seq "$limit"); do
        "$@" >/dev/null 2>&1 && return 0
        sleep 1
    done
    return 1
}
answers() { sdexec python3 -c "import urllib.request as u; u.urlopen('$1', timeout=3)"; }
s3_up() { sdexec python3 -c 'import socket; socket.create_connection(("127.0.0.1", 8333), 3)'; }
booted() { sdexec systemctl is-system-running | grep -qE '^(running|degraded)$'; }
restarted_once() {
    [ "$(prop sparseloco-coordinator NRestarts)" = 1 ] && answers http://127.0.0.1:8700/openapi.json
}
nodes_done() {
    local unit
    for unit in ${nodes//,/ }; do
        case $(prop "sparseloco-node@$unit" ActiveState) in inactive | failed) ;; *) return 1 ;; esac
    done
}

await 60 booted || fail "systemd did not boot in the container"
await 60 s3_up || fail "the test store did not start"
say "systemd: start sparseloco-coordinator, then SIGKILL it: Restart=on-failure must bring it back"
sdexec systemctl start sparseloco-coordinator
await 60 answers http://127.0.0.1:8700/openapi.json || fail "sparseloco-coordinator did not answer"
sdexec systemctl kill -s KILL sparseloco-coordinator
await 60 restarted_once || fail "sparseloco-coordinator did not come back after SIGKILL"
say "systemd: coordinator back (NRestarts=1); start sparseloco-node@{$nodes}"
for unit in ${nodes//,/ }; do sdexec systemctl start "sparseloco-node@$unit"; done
await "$RUN_TIMEOUT_S" nodes_done || fail "the node units did not finish within $RUN_TIMEOUT_S s"
for unit in ${nodes//,/ }; do
    ended="$(prop "sparseloco-node@$unit" Result) $(prop "sparseloco-node@$unit" ExecMainStatus) $(prop "sparseloco-node@$unit" NRestarts)"
    [ "$ended" = "success 0 0" ] ||
        fail "sparseloco-node@$unit ended with (result, status, restarts) = ($ended)"
done
sdexec python3 -c "import sys, urllib.request as u; sys.stdout.write(u.urlopen('http://127.0.0.1:8700/v1/status?rounds=1000').read().decode())" \
    >"$WORK/systemd-status.json"
python3 deploy/compose_check.py --status-file "$WORK/systemd-status.json" --nodes "$nodes" ||
    fail "the nodes run by systemd disagree"
