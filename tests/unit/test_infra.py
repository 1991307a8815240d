"""Deployment files: what a user of the compose stack and of the regional fleets relies on.

No Docker engine or cluster is needed: compose and Kubernetes files are parsed, overlays are
rendered with `kubectl kustomize` when kubectl is installed, and the deploy script runs with
--dry-run only.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
REGIONS = INFRA / "regions"
OVERLAYS = REGIONS / "overlays"
DEPLOY = INFRA / "deploy-region.sh"
RLBUS_SERVICES = {"prepare", "curator", "trainer", "worker"}
# Services on the rlbus image: the roles, and the one-shot job that creates the weights bucket.
IMAGE_SERVICES = RLBUS_SERVICES | {"bucket"}

needs_kubectl = pytest.mark.skipif(
    shutil.which("kubectl") is None,
    reason="kubectl not found: install kubectl (https://kubernetes.io/docs/tasks/tools/) to render infra/regions",
)


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def flag(command: list[str], name: str) -> str:
    assert name in command, f"{name} missing from {command}"
    return command[command.index(name) + 1]


def env(service: dict) -> dict[str, str]:
    return {k: str(v) for k, v in service.get("environment", {}).items()}


def region_names() -> list[str]:
    return sorted(p.name for p in OVERLAYS.iterdir() if (p / "kustomization.yaml").is_file())


def render(path: Path) -> list[dict]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(path)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


# --- docker-compose.yml -------------------------------------------------------------------------


def test_compose_has_the_stack(services: dict) -> None:
    assert {"kafka", "s3", "bucket", "prepare", "curator", "trainer", "worker"} <= set(services)


def command_line(service: dict) -> list[str]:
    """The rlbus argv of a service, also when a shell script wraps it."""
    command = service["command"]
    if service.get("entrypoint", [""])[0] == "/bin/sh":
        line = next(ln for ln in command[0].splitlines() if "rlbus " in ln)
        return line.split("rlbus ", 1)[1].split()
    return command


def test_every_rlbus_service_runs_the_image_built_from_infra_dockerfile(services: dict) -> None:
    built = {name for name, svc in services.items() if "build" in svc}
    assert built == IMAGE_SERVICES
    images = set()
    for name in IMAGE_SERVICES:
        svc = services[name]
        assert svc["build"]["context"] == "."
        assert svc["build"]["dockerfile"] == "infra/Dockerfile"
        assert (ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]).is_file()
        images.add(svc["image"])
    for name in RLBUS_SERVICES:
        assert command_line(services[name])[0] == name
    assert len(images) == 1, f"rlbus services must share one image tag, got {images}"


def test_kafka_is_single_node_kraft_without_zookeeper(services: dict) -> None:
    assert not any("zookeeper" in name or "zookeeper" in str(svc.get("image", "")) for name, svc in services.items())
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    kenv = env(kafka)
    assert not any("ZOOKEEPER" in key for key in kenv)
    assert set(kenv["KAFKA_PROCESS_ROLES"].split(",")) == {"broker", "controller"}
    assert kenv["CLUSTER_ID"]
    assert kenv["KAFKA_AUTO_CREATE_TOPICS_ENABLE"] == "false"
    assert int(kenv["KAFKA_MESSAGE_MAX_BYTES"]) == 8 * 1024 * 1024
    assert int(kenv["KAFKA_REPLICA_FETCH_MAX_BYTES"]) >= int(kenv["KAFKA_MESSAGE_MAX_BYTES"])
    # One listener for the compose network, one for the host and remote workers.
    advertised = kenv["KAFKA_ADVERTISED_LISTENERS"].split(",")
    assert len(advertised) == 2
    published = {p.rsplit(":", 2)[-1] for p in kafka["ports"]}
    assert any(a.rsplit(":", 1)[-1] in published for a in advertised)


def test_rlbus_roles_reach_the_broker_and_bucket_the_stack_provides(services: dict) -> None:
    advertised = env(services["kafka"])["KAFKA_ADVERTISED_LISTENERS"].split(",")
    internal = {a.split("://", 1)[1] for a in advertised}
    # The bucket job creates the bucket of the store URL it is given: the roles' store.
    created = services["bucket"]["command"][-1]
    assert created.startswith("s3://")
    s3_ports = {p.rsplit(":", 1)[-1] for p in services["s3"]["ports"]}
    for name in ("curator", "trainer", "worker"):
        assert flag(services[name]["command"], "--broker") in internal
    for name in ("trainer", "worker", "bucket"):
        endpoint = env(services[name])["AWS_ENDPOINT_URL"]
        host, port = endpoint.removeprefix("http://").split(":")
        assert host == "s3" and port in s3_ports, endpoint
    for name in ("trainer", "worker"):
        store = flag(services[name]["command"], "--store")
        assert store == created, f"{name} uses {store}, the bucket job creates the bucket of {created}"


def test_worker_is_an_attachable_scalable_rollout_worker(services: dict) -> None:
    worker = services["worker"]
    command = worker["command"]
    assert command[0] == "worker"
    assert flag(command, "--broker") and flag(command, "--store")
    assert worker["deploy"]["replicas"] >= 1
    # `--scale worker=N` fails with a fixed container name or a fixed host port.
    assert "container_name" not in worker
    assert "ports" not in worker


def kafka_for(environment: dict[str, str]):
    """The Kafka client settings a role builds from its container environment."""
    from rlbus.config import load_config

    return load_config(None, ["kafka.bootstrap_servers=kafka:19092"], environ=environment).kafka


def test_apache_kafka_client_settings_are_switched_on_for_every_role(services: dict) -> None:
    for name in ("curator", "trainer", "worker"):
        kafka = kafka_for(env(services[name]))
        assert kafka.consumer_conf("g")["partition.assignment.strategy"] == "cooperative-sticky"
        assert kafka.producer_conf()["enable.idempotence"] is True


def test_roles_start_after_what_they_need(services: dict) -> None:
    for name in ("curator", "trainer", "worker"):
        deps = services[name]["depends_on"]
        assert deps["kafka"]["condition"] == "service_healthy"
        assert deps["prepare"]["condition"] == "service_completed_successfully"
        assert deps["bucket"]["condition"] == "service_completed_successfully"
    # Workers read the run descriptor from the bucket; the trainer is healthy once it is there.
    assert services["worker"]["depends_on"]["trainer"]["condition"] == "service_healthy"
    assert flag(services["trainer"]["healthcheck"]["test"], "-c")
    assert services["trainer"]["healthcheck"]["test"][-1] == flag(services["trainer"]["command"], "--store")
    for name, svc in services.items():
        for dep, cond in svc.get("depends_on", {}).items():
            if cond["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{name} waits for {dep} to be healthy, which has no healthcheck"


# SeaweedFS evaluates `If-None-Match: *` and `If-Match` on PUT (3.97) atomically, under the object's
# owner filer or its write lock, since 4.29; rlbus's weight store relies on both.
SEAWEEDFS_ATOMIC_CONDITIONAL_WRITES = (4, 29)


def test_s3_server_keeps_conditional_writes_and_takes_the_credentials_the_roles_use(services: dict) -> None:
    s3 = services["s3"]
    repository, tag = s3["image"].rsplit(":", 1)
    assert repository == "chrislusf/seaweedfs", "another S3 server must support If-None-Match/If-Match on PUT"
    assert re.fullmatch(r"\d+\.\d+", tag), f"pin a release, not {tag!r}"
    assert tuple(int(part) for part in tag.split(".")) >= SEAWEEDFS_ATOMIC_CONDITIONAL_WRITES
    assert s3["command"][0] == "mini" and "-master.telemetry=false" in s3["command"]
    assert "localhost:8333/healthz" in " ".join(s3["healthcheck"]["test"])
    # The server's only identity is the one every rlbus service signs with.
    for name in IMAGE_SERVICES:
        role = env(services[name])
        for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            assert role[key] == env(s3)[key], f"{name}: {key} differs from the S3 server's"


def test_bucket_job_creates_the_store_bucket_and_keeps_an_existing_one(
    services: dict, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The compose file's one-shot bucket script, run here twice against the tests' SeaweedFS server
    (the stack's S3 server) with the stack's region; the tests' keys stand in for the stack's."""
    from tests.fixtures.s3 import ACCESS_KEY_ID, SECRET_ACCESS_KEY, s3_client

    job = services["bucket"]
    assert job["entrypoint"] == ["python", "-c"] and job["restart"] == "no"
    script, store = job["command"]
    for key, value in env(job).items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY)
    bucket = store.removeprefix("s3://").split("/", 1)[0]
    client = s3_client(s3_endpoint)
    if bucket in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.delete_bucket(Bucket=bucket)  # left by an earlier run of this test on the same server
    monkeypatch.setattr("sys.argv", ["-c", store])
    for _ in range(2):  # `docker compose up` again finds the bucket there
        exec(compile(script, "docker-compose.yml:bucket", "exec"), {"__name__": "__main__"})
    assert bucket in [b["Name"] for b in client.list_buckets()["Buckets"]]
    out = capsys.readouterr().out
    assert f"bucket: created {bucket}" in out and f"bucket: {bucket} already exists" in out, out


# Policies under which Docker restarts a container that exited 0.
RESTARTS_AFTER_SUCCESS = {"always", "unless-stopped"}


def test_finished_roles_stay_stopped(services: dict) -> None:
    # The trainer exits 0 when the run is done; the curator and every worker exit 0 once they read
    # its finish (or `rlbus stop`'s) record on the control topic (and on SIGTERM). Only a crash restarts them, so
    # the stack does not bring a finished run back, nor keep workers polling a run that is over.
    for name in ("curator", "trainer", "worker"):
        policy = services[name]["restart"]
        assert policy.split(":")[0] == "on-failure", f"{name} restarts with {policy!r}"
        assert services[name].get("deploy", {}).get("restart_policy", {}).get("condition") in (None, "on-failure")
    for name in ("prepare", "bucket"):
        assert services[name]["restart"] == "no"
    # The broker and the bucket stay up after the run: the results can still be read.
    for name in ("kafka", "s3"):
        assert services[name]["restart"] in RESTARTS_AFTER_SUCCESS


def test_roles_read_the_mounted_config_and_the_prepared_volume(services: dict) -> None:
    for name in ("prepare", "curator", "trainer"):
        svc = services[name]
        config = flag(command_line(svc), "--config")
        mounts = dict(v.split(":")[:2] for v in svc["volumes"] if v.startswith("./"))
        source = next(src for src, dst in mounts.items() if config.startswith(dst + "/"))
        assert (ROOT / source / Path(config).name).is_file(), f"{name} reads {config}, which is not in {source}"
    out = flag(command_line(services["prepare"]), "--out")
    assert flag(services["trainer"]["command"], "--model-dir").startswith(out + "/")
    assert flag(services["curator"]["command"], "--dataset").startswith(out + "/")
    volumes = {name: {v.split(":")[1]: v.split(":")[0] for v in services[name]["volumes"]} for name in RLBUS_SERVICES}
    assert volumes["prepare"]["/data"] == volumes["trainer"]["/data"] == volumes["curator"]["/data"]
    assert flag(services["trainer"]["command"], "--run-dir") in volumes["trainer"], (
        "checkpoints must outlive the container"
    )


def test_gpu_override_only_adds_devices() -> None:
    override = yaml.safe_load((INFRA / "compose.gpu.yml").read_text())["services"]
    assert set(override) == {"trainer", "worker"}
    for svc in override.values():
        assert "build" not in svc and "image" not in svc
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"


class _ComposeLoader(yaml.SafeLoader):
    """YAML with Compose's merge tags (`!reset`, `!override`), read as their plain values."""


for _tag in ("!reset", "!override"):
    _ComposeLoader.add_constructor(_tag, lambda loader, node: (
        loader.construct_sequence(node) if isinstance(node, yaml.SequenceNode)
        else loader.construct_mapping(node) if isinstance(node, yaml.MappingNode) else loader.construct_scalar(node)))


def _override(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_ComposeLoader)["services"]


def test_offline_override_runs_tansu_on_the_stacks_s3_and_tansu_client_settings_in_every_role(services: dict) -> None:
    override = _override(INFRA / "compose.offline.yml")
    broker = override["kafka"]["environment"]
    assert override["kafka"]["image"] == "rlbus-tansu:local" and override["s3"]["image"] == "rlbus-seaweedfs:local"
    # The log in the bucket unless STACK_TANSU_STORAGE says otherwise.
    assert broker["STORAGE_ENGINE"] == "${STACK_TANSU_STORAGE:-s3://tansu/}" and broker["AWS_ENDPOINT"] == "http://s3:8333"
    # The roles' --broker stays kafka:19092: the broker listens there.
    assert broker["LISTENER_URL"].endswith(":19092") and "-bucket=tansu" in override["s3"]["command"]
    for name in IMAGE_SERVICES:
        settings = override[name]["environment"]
        # cooperative-sticky never completes an assignment on Tansu 0.6
        assert settings["RLBUS_KAFKA__PARTITION_ASSIGNMENT_STRATEGY"] == "range", name
    assert set(override) == set(services), "a service of docker-compose.yml the offline override does not cover"


def test_the_stack_test_puts_every_service_on_the_host_network_on_loopback(services: dict) -> None:
    override = _override(ROOT / "tests" / "stack" / "compose.host.yml")
    assert set(override) == set(services), "a service the stack test would run on a container bridge"
    for name, svc in override.items():
        assert svc["network_mode"] == "host" and svc["ports"] == [], name
        assert set(svc["extra_hosts"]) == {"kafka:127.0.0.1", "s3:127.0.0.1"}, name
    assert override["kafka"]["environment"]["LISTENER_URL"] == "tcp://127.0.0.1:19092"
    assert "-ip.bind=127.0.0.1" in override["s3"]["command"]


def test_the_solver_verifier_override_runs_every_policy_of_its_config_apart_from_the_single_policy_run() -> None:
    override = _override(INFRA / "compose.solver-verifier.yml")
    trainer = override["trainer"]["command"]
    config = flag(trainer, "--config")
    assert (ROOT / "configs" / Path(config).name).is_file()
    policies = [p["name"] for p in tomllib.loads((ROOT / "configs" / Path(config).name).read_text())["policies"]]
    assert len(policies) == 2 and "for name in models" in trainer[0]  # one trainer per prepared policy
    assert flag(trainer, "--store") == flag(override["worker"]["command"], "--store") != "s3://rlbus/weights"
    for name in ("bucket", "prepare", "curator", "worker", "trainer"):
        assert "prepared-solver-verifier:/data" in override[name]["volumes"], name


# --- infra/Dockerfile ---------------------------------------------------------------------------


def test_dockerfile_installs_torch_first_and_runs_rlbus_unprivileged() -> None:
    text = (INFRA / "Dockerfile").read_text()
    assert re.search(r"^ARG TORCH_SPEC=torch==2\.13\.0$", text, re.M)
    assert re.search(r"^ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    assert text.index('"$TORCH_SPEC"') < text.index("requirements.txt")
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and not users[-1].startswith(("root", "0"))
    assert re.search(r'^ENTRYPOINT \[.*"rlbus"\]$', text, re.M)


def test_image_contains_every_package_of_the_distribution() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    dockerfile = (INFRA / "Dockerfile").read_text()
    copied = set(re.findall(r"^COPY (\w+)/ \1/$", dockerfile, re.M))
    allowed = set(re.findall(r"^!(\w+)/$", (INFRA / "Dockerfile.dockerignore").read_text(), re.M))
    assert packages <= copied, f"not copied into the image: {packages - copied}"
    assert packages <= allowed, f"excluded from the build context: {packages - allowed}"


# --- infra/regions ------------------------------------------------------------------------------


def k8s_documents() -> list[tuple[Path, dict]]:
    docs = []
    for path in sorted(REGIONS.rglob("*.yaml")):
        loaded = list(yaml.safe_load_all(path.read_text()))
        assert loaded, f"{path} is empty"
        docs += [(path, d) for d in loaded if d is not None]
    return docs


def check_deployment(where: object, deployment: dict) -> None:
    pod = deployment["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] > 0, where
    for container in pod["containers"]:
        resources = container["resources"]
        assert resources["requests"]["cpu"] and resources["requests"]["memory"], where
        assert resources["limits"]["memory"], where


def test_every_manifest_parses_and_every_deployment_is_bounded() -> None:
    docs = k8s_documents()
    assert docs
    deployments = [(path, d) for path, d in docs if d.get("kind") == "Deployment"]
    assert deployments
    for path, deployment in deployments:
        check_deployment(path, deployment)


def test_fleet_drain_budget_matches_compose(services: dict) -> None:
    (deployment,) = [d for _, d in k8s_documents()
                     if d.get("kind") == "Deployment" and d["metadata"]["name"] == "rlbus-worker"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert services["worker"]["stop_grace_period"] == f"{grace}s"


def test_there_are_two_example_regions() -> None:
    assert len(region_names()) >= 2


@needs_kubectl
@pytest.mark.parametrize("region", region_names())
def test_overlay_renders_a_complete_regional_fleet(region: str) -> None:
    docs = render(OVERLAYS / region)
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    check_deployment(region, deployment)
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"]["rlbus.dev/region"] == region
    assert deployment["spec"]["replicas"] >= 1
    assert configmap["data"]["region"] == region
    assert ":" in configmap["data"]["broker"] and configmap["data"]["store"].startswith("s3://")
    container = pod["spec"]["containers"][0]
    assert container["args"][0] == "worker"
    # Every ConfigMap key the pod reads must exist, or the pod never starts.
    for var in container["env"]:
        ref = var.get("valueFrom", {}).get("configMapKeyRef")
        if ref and not ref.get("optional"):
            assert ref["name"] == configmap["metadata"]["name"]
            assert ref["key"] in configmap["data"], f"{region}: ConfigMap lacks {ref['key']}"
    assert container["envFrom"][0]["secretRef"]["name"] == "rlbus-credentials"
    tolerated = {t["key"] for t in pod["spec"]["tolerations"]}
    spot_terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    spot_keys = {e["key"] for term in spot_terms["nodeSelectorTerms"] for e in term["matchExpressions"]}
    assert "rlbus.dev/preemptible" in tolerated & spot_keys
    # The worker's settings, as the pod's environment gives them, build clients the worker has.
    environment = {
        v["name"]: configmap["data"][v["valueFrom"]["configMapKeyRef"]["key"]]
        for v in container["env"]
        if v["name"].startswith("RLBUS_KAFKA__")
    }
    kafka = kafka_for(environment)
    assert kafka.producer_conf()["enable.idempotence"] is True
    assert kafka.consumer_conf("g")["partition.assignment.strategy"] == "cooperative-sticky"


def test_overlays_do_not_pin_replicas_under_the_autoscaler() -> None:
    for region in region_names():
        kustomization = yaml.safe_load((OVERLAYS / region / "kustomization.yaml").read_text())
        autoscaled = any("autoscale" in c for c in kustomization.get("components", []))
        assert not (autoscaled and "replicas" in kustomization), region


@needs_kubectl
def test_the_autoscaler_follows_the_status_of_the_run_it_is_deployed_for(tmp_path: Path) -> None:
    from tests.unit.test_validators import autoscaled_overlay

    docs = render(autoscaled_overlay(tmp_path))
    (scaled,) = [d for d in docs if d["kind"] == "ScaledObject"]
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    (service,) = [d for d in docs if d["kind"] == "Service"]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    (trigger,) = scaled["spec"]["triggers"]
    # The scaler reads the worker count `rlbus status --serve` recommends, from the status service.
    assert trigger["type"] == "metrics-api"
    assert trigger["metadata"]["valueLocation"] == "recommendation.target_workers"
    assert trigger["metadata"]["targetValue"] == "1"
    assert f"//{service['metadata']['name']}." in trigger["metadata"]["url"]
    assert trigger["metadata"]["url"].endswith(f":{service['spec']['ports'][0]['port']}/status")
    status = deployments["rlbus-fleet-status"]["spec"]["template"]["spec"]["containers"][0]
    assert status["args"][0] == "status" and status["args"][status["args"].index("--serve") + 1] == "8080"
    assert service["spec"]["selector"] == deployments["rlbus-fleet-status"]["spec"]["selector"]["matchLabels"]
    env = {v["name"]: v["valueFrom"]["configMapKeyRef"] for v in status["env"] if "valueFrom" in v}
    run_var = status["args"][status["args"].index("--run") + 1].strip("$()")
    assert configmap["data"][env[run_var]["key"]] == "r1" and env[run_var]["name"] == configmap["metadata"]["name"]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "rlbus-worker" and "rlbus-worker" in deployments


@needs_kubectl
def test_deploy_script_names_the_run_of_the_fleet() -> None:
    result = dry_run("eu-west", "--image", "registry.test/rlbus:1", "--run", "math-7")
    assert result.returncode == 0, result.stderr
    (configmap,) = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "ConfigMap"]
    assert configmap["data"]["run"] == "math-7"
    assert configmap["data"]["region"] == "eu-west"  # merged into the overlay's, not replacing it


# --- MirrorMaker 2 ------------------------------------------------------------------------------


def mirrormaker_config() -> dict[str, str]:
    config = {}
    for line in (REGIONS / "mirrormaker2.properties").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, value = (part.strip() for part in line.split("=", 1))
            config[key] = value.replace("\\\\", "\\")
    return config


def test_mirrormaker_moves_prompts_out_and_trajectories_back() -> None:
    config = mirrormaker_config()
    central, region = (c.strip() for c in config["clusters"].split(","))
    assert central == "central"
    outbound = [re.compile(p.strip()) for p in config[f"{central}->{region}.topics"].split(",")]
    inbound = [re.compile(p.strip()) for p in config[f"{region}->{central}.topics"].split(",")]
    assert config[f"{central}->{region}.enabled"] == config[f"{region}->{central}.enabled"] == "true"
    assert config["replication.policy.class"].endswith("IdentityReplicationPolicy")

    def mirrored(patterns: list[re.Pattern[str]], topic: str) -> bool:
        return any(p.fullmatch(topic) for p in patterns)

    for topic in ("math.prompts.policy-a", "math.prompts.debate", "math.control"):
        assert mirrored(outbound, topic) and not mirrored(inbound, topic), topic
    for topic in ("math.trajectories.policy-a", "math.dlq"):
        assert mirrored(inbound, topic) and not mirrored(outbound, topic), topic
    assert int(config[f"{region}.producer.max.request.size"]) >= 8 * 1024 * 1024


# --- infra/deploy-region.sh ---------------------------------------------------------------------


def test_deploy_script_is_valid_bash() -> None:
    assert "set -euo pipefail" in DEPLOY.read_text()
    subprocess.run(["bash", "-n", str(DEPLOY)], check=True, timeout=30)


def test_deploy_script_refuses_an_unknown_region() -> None:
    result = dry_run("atlantis", "--image", "registry.test/rlbus:1")
    assert result.returncode != 0
    assert "atlantis" in result.stderr and all(r in result.stderr for r in region_names())


def dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(DEPLOY), *args, "--dry-run"], capture_output=True, text=True, timeout=60)


@needs_kubectl
def test_deploy_script_dry_run_sets_the_image() -> None:
    result = dry_run("eu-west", "--image", "registry.test/rlbus:1")
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert deployment["metadata"]["namespace"] == configmap["metadata"]["namespace"] == "rlbus-eu-west"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.test/rlbus:1"
    assert "--config" not in container["args"]  # the workers read the run descriptor from the bucket


@needs_kubectl
def test_deploy_script_dry_run_can_ship_a_run_config(tmp_path: Path) -> None:
    config = tmp_path / "run.toml"
    config.write_text("# marker-7f3a\n")
    result = dry_run("eu-west", "--image", "registry.test/rlbus:1", "--config", str(config))
    assert result.returncode == 0, result.stderr
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (configmap,) = [d for d in docs if d["kind"] == "ConfigMap"]
    assert "marker-7f3a" in configmap["data"]["worker.toml"]
    pod = deployment["spec"]["template"]["spec"]
    path = flag(pod["containers"][0]["args"], "--config")
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]


@needs_kubectl
def test_deploy_script_refuses_to_deploy_without_an_image() -> None:
    result = dry_run("us-east")
    assert result.returncode != 0 and "--image" in result.stderr


# --- infra/terraform ----------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("terraform") is None, reason="terraform not installed")
def test_terraform_is_well_formed() -> None:
    result = subprocess.run(
        ["terraform", "fmt", "-check", "-recursive", str(INFRA / "terraform")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- infra/deploy-region.sh --local, infra/compose.region.yml -------------------------------------


def test_a_local_region_gets_a_config_that_reaches_the_hub_only_through_its_link(tmp_path: Path) -> None:
    from rlbus.config import load_config

    extra = tmp_path / "more.toml"
    extra.write_text("[replica]\nkeep_versions = 5\n")
    result = subprocess.run(
        ["bash", str(DEPLOY), "eu-west", "--local", "--hub-broker", "127.0.0.1:19092", "--hub-s3",
         "http://127.0.0.1:8333", "--hub-store", "s3://rlbus/weights", "--port-base", "32000", "--delay-ms", "50",
         "--rate-mbit", "200", "--config", str(extra), "--dry-run"],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "RLBUS_REGION_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    cfg = load_config(tmp_path / "eu-west" / "region.toml", [], environ={})
    assert cfg.kafka.bootstrap_servers == "127.0.0.1:32000"  # the link's Kafka route, not the hub's broker
    assert cfg.worker.region == "eu-west" and cfg.worker.replica_wait_s == 30
    hub, replica = cfg.worker.hub_store, cfg.store
    assert (hub.bucket, hub.prefix, hub.endpoint_url) == ("rlbus", "weights", "http://127.0.0.1:32001")  # the link
    assert (replica.prefix, replica.endpoint_url) == ("weights", "http://127.0.0.1:32002")  # the region's bucket
    assert cfg.replica.keep_versions == 5


def test_the_local_region_needs_the_hubs_addresses(tmp_path: Path) -> None:
    result = subprocess.run(["bash", str(DEPLOY), "eu-west", "--local", "--hub-s3", "http://127.0.0.1:8333", "--dry-run"],
                            capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin",
                                                                             "RLBUS_REGION_DIR": str(tmp_path)})
    assert result.returncode != 0 and "--hub-broker" in result.stderr


def test_a_local_region_runs_link_replica_and_workers_on_the_region_config() -> None:
    services = yaml.safe_load((INFRA / "compose.region.yml").read_text())["services"]
    assert set(services) == {"link", "s3", "bucket", "replica", "worker"}
    assert all(s["network_mode"] == "host" for s in services.values())  # 127.0.0.1 only
    link = services["link"]["command"]
    routes = [link[i + 1] for i, arg in enumerate(link) if arg == "--route"]
    assert routes[0].startswith("kafka:") and "${HUB_BROKER" in routes[0] and "${HUB_S3" in routes[1]
    for role in ("replica", "worker"):
        assert services[role]["command"][:3] == [role, "--config", "/etc/rlbus-region/region.toml"]
        assert services[role]["depends_on"]["link"]["condition"] == "service_healthy"
