#!/usr/bin/env bash
# Deploy the rollout-worker fleet of one region (infra/regions/overlays/REGION) to the current
# Kubernetes context, with the run's config and the worker image set at deploy time.
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
EOF
}

log() { printf '==> %s\n' "$*" >&2; }
die() { printf 'deploy-region: %s\n' "$*" >&2; exit 1; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd -P)"
overlays="$here/regions/overlays"

region="" config="" image="" run="" context="" dry_run=0 wait_rollout=1 timeout="10m"
while [[ $# -gt 0 ]]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
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
