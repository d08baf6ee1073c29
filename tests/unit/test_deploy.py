"""Deployment files are checked like code: Prometheus config and alert rules with promtool (its rule
unit tests included), the Grafana dashboard's shape. (`make install` installs promtool, as it installs
redis-server.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: `make install` installs it (Debian package prometheus)"
    return subprocess.run(
        [promtool, *args], cwd=DEPLOY / "prometheus", capture_output=True, text=True, timeout=120, check=False
    )


def test_prometheus_config_and_rules_are_valid() -> None:
    done = _promtool("check", "config", "prometheus.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "18 rules found" in done.stdout


def test_alert_rules_pass_their_unit_tests() -> None:
    done = _promtool("test", "rules", "mrc-alerts.test.yml")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_every_alert_has_a_test() -> None:
    rules = (DEPLOY / "prometheus" / "mrc-alerts.yml").read_text()
    tests = (DEPLOY / "prometheus" / "mrc-alerts.test.yml").read_text()
    alerts = re.findall(r"- alert: (\w+)", rules)
    assert len(alerts) == 18
    for alert in alerts:
        assert f"alertname: {alert}" in tests, alert


def test_every_alert_says_what_to_do_in_the_runbook() -> None:
    """Review, helper-99: no alert had a runbook entry; the on-call person paged at 3 a.m. had a
    summary line and nothing to do."""
    rules = (DEPLOY / "prometheus" / "mrc-alerts.yml").read_text()
    runbook = (DEPLOY.parent / "docs" / "operations.md").read_text()
    section = runbook.split("\n## Alerts\n", 1)[1].split("\n## ", 1)[0]
    entries = dict(re.findall(r"^### (\w+) \((page|warning)\)$", section, re.MULTILINE))
    severities = dict(re.findall(r"- alert: (\w+)\n(?:.*\n)*?\s+labels: \{severity: (\w+)\}", rules))
    assert entries == severities


def dashboard_metrics() -> set[str]:
    """The mrc_ metric families the dashboard queries (histogram suffixes removed)."""
    dashboard = json.loads((DEPLOY / "grafana" / "mrc-dashboard.json").read_text())
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\bmrc_[a-z0-9_]+", target["expr"]):
                names.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return names


def test_the_dashboard_has_the_shape_grafana_imports() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "mrc-dashboard.json").read_text())
    assert {"title", "uid", "panels", "schemaVersion", "templating"} <= set(dashboard)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["type"] in {"timeseries", "heatmap", "stat", "table"}
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"])
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"].count("(") == target["expr"].count(")"), target["expr"]
    titles = " ".join(panel["title"] for panel in dashboard["panels"])
    for topic in ("latency", "stage", "batch", "Queue", "busy", "GPU memory", "NVML", "Outcomes"):
        assert topic.lower() in titles.lower(), topic
    assert len(dashboard_metrics()) >= 20


@pytest.mark.parametrize(
    "name", ["mrc_job_latency_seconds", "mrc_queue_depth", "mrc_model_busy_seconds_total"]
)
def test_the_dashboard_queries_the_key_series(name: str) -> None:
    assert name in dashboard_metrics()


BIN = Path(sys.executable).parent
SCHEMAS = Path(__file__).resolve().parents[1] / "support" / "schemas"


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("name", ["worker.Dockerfile", "api.Dockerfile"])
def test_dockerfiles_pass_hadolint(name: str) -> None:
    done = _run(str(BIN / "hadolint"), str(DEPLOY / "docker" / name))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_images_run_as_a_non_root_user_and_the_api_image_has_no_torch() -> None:
    for name in ("worker.Dockerfile", "api.Dockerfile"):
        text = (DEPLOY / "docker" / name).read_text()
        assert "\nUSER 10001:10001\n" in text, name
    assert '".[api]"' in (DEPLOY / "docker" / "api.Dockerfile").read_text()
    worker = (DEPLOY / "docker" / "worker.Dockerfile").read_text()
    assert '".[worker]"' in worker
    assert "COPY models" not in worker  # weights are mounted, never baked in
    # Triton builds its C helper at the first grammar-masked step, which the warm-up runs: without a C
    # compiler a CUDA worker never became ready (review, helper-116)
    assert re.search(r"apt-get install -y --no-install-recommends gcc libc6-dev", worker)


def test_every_mrc_process_in_a_container_runs_under_tini() -> None:
    """PID 1 ignores a signal it has no handler for, and Python has none while it starts: a SIGTERM in
    those tens of milliseconds (a rollout right after a start) was lost, and the pod ran on until the
    grace period's SIGKILL. tini is PID 1 in both images, and every command that replaces an image's
    entrypoint (the lane exporter's, in Kubernetes and in compose) names it first."""
    for name, program in (("worker.Dockerfile", "mrc-worker"), ("api.Dockerfile", "mrc-api")):
        text = (DEPLOY / "docker" / name).read_text()
        assert re.search(r"apt-get install -y --no-install-recommends [a-z0-9. -]*\btini\b", text), name
        assert f'ENTRYPOINT ["tini", "--", "{program}"]' in text, name
    replaced = [
        service["entrypoint"] for service in _compose()["services"].values() if "entrypoint" in service
    ]
    import yaml

    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
            replaced += [c["command"] for c in spec.get("containers", []) if "command" in c]
    assert replaced, "the lane exporter's command, at least"
    for command in replaced:
        if command[0].startswith("mrc") or "mrc" in command:
            assert command[:2] == ["tini", "--"], command


def _compose() -> dict:
    import yaml

    return dict(yaml.safe_load((DEPLOY / "compose.yaml").read_text()))


def test_compose_file_matches_the_compose_specification() -> None:
    """Validated against the Compose Specification's JSON schema (tests/support/schemas, from the
    compose-spec project via the docker-compose 1.29.2 wheel), the check `docker compose config` makes."""
    import jsonschema

    schema = json.loads((SCHEMAS / "compose-spec.json").read_text())
    jsonschema.Draft201909Validator.check_schema(schema)
    jsonschema.Draft201909Validator(schema).validate(_compose())
    broken = {**_compose(), "services": {"worker": {"image": "x", "deploy": {"replicas": "many"}}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft201909Validator(schema).validate(broken)


def test_compose_wires_the_parts_together() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"redis", "minio", "worker", "api", "lanes", "prometheus", "grafana"} <= set(services)
    assert "./redis.conf:/usr/local/etc/redis/redis.conf:ro" in services["redis"]["volumes"]
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert services["worker"]["stop_grace_period"] == "10m"
    for path in ("prometheus/prometheus.yml", "prometheus/mrc-alerts.yml", "grafana/mrc-dashboard.json"):
        assert (DEPLOY / path).is_file(), path
    for name in ("worker", "api", "lanes"):
        env = services[name]["environment"]
        assert env["MRC_REDIS_URL"] == "redis://redis:6379/0", name
        assert env["MRC_S3_ENDPOINT_URL"] == "http://minio:9000", name
        assert "AWS_SECRET_ACCESS_KEY" in env, name
    prometheus = (DEPLOY / "prometheus" / "prometheus.yml").read_text()
    assert '"worker:9400"' in prometheus
    assert '"lanes:9401"' in prometheus
    assert '"api:8000"' in prometheus
    api = services["api"]
    assert api["environment"]["MRC_API_KEYS"].startswith("${MRC_API_KEYS:?"), "no keys must not mean open"
    # Every port on the host's loopback: Prometheus has no authentication and holds every key's usage
    for name, service in services.items():
        assert all(str(port).startswith("127.0.0.1:") for port in service.get("ports", [])), name
    grafana = services["grafana"]["environment"]
    assert grafana["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?"), "not admin/admin"
    # The lane exporter runs in the API image, whose own health check probes mrc-api's port
    assert "9401" in " ".join(services["lanes"]["healthcheck"]["test"])


def test_redis_refuses_writes_at_its_limit_before_the_kernel_kills_it() -> None:
    """noeviction acts only under a maxmemory; the container's limit sits above it."""
    conf = dict(
        line.split(None, 1) for line in (DEPLOY / "redis.conf").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )  # fmt: skip
    assert conf["maxmemory-policy"] == "noeviction"
    units = {"gb": 1 << 30, "mb": 1 << 20}
    maxmemory = int(conf["maxmemory"][:-2]) * units[conf["maxmemory"][-2:]]
    assert maxmemory > 0
    limit = _compose()["services"]["redis"]["mem_limit"]
    assert int(limit[:-1]) * (1 << 30) > maxmemory


def test_kubernetes_manifests_match_the_kubernetes_schemas() -> None:
    names = ("worker.yaml", "api.yaml", "config.yaml", "examples/secret.yaml")
    manifests = [str(DEPLOY / "k8s" / name) for name in names]
    done = _run(str(BIN / "kubernetes-validate"), "--strict", *manifests)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("passed") + done.stderr.count("passed") == 7


def test_applying_the_manifests_never_overwrites_the_secret_or_puts_one_in_the_config_map() -> None:
    import yaml

    applied = [
        doc for path in sorted((DEPLOY / "k8s").glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text()) if doc
    ]  # fmt: skip
    assert not [doc for doc in applied if doc["kind"] == "Secret"], "kubectl apply -f would overwrite it"
    (config,) = [doc for doc in applied if doc["kind"] == "ConfigMap"]
    for key in config["data"]:
        assert key not in {"MRC_REDIS_URL", "MRC_API_KEYS"}, key
        assert "SECRET" not in key, key
    (secret,) = yaml.safe_load_all((DEPLOY / "k8s" / "examples" / "secret.yaml").read_text())
    keys = set(secret["stringData"])
    assert {"MRC_REDIS_URL", "REDIS_PASSWORD", "AWS_SECRET_ACCESS_KEY", "MRC_API_KEYS"} <= keys
    budgets = {doc["metadata"]["name"] for doc in applied if doc["kind"] == "PodDisruptionBudget"}
    assert budgets == {"mrc-api", "mrc-worker"}


def test_the_api_deployment_drains_its_requests_and_stays_in_the_service_while_redis_is_away() -> None:
    import yaml

    from shared.settings import Settings

    deployment = next(yaml.safe_load_all((DEPLOY / "k8s" / "api.yaml").read_text()))
    pod = deployment["spec"]["template"]["spec"]
    api = next(container for container in pod["containers"] if container["name"] == "api")
    # Redis is shared by every replica: readiness on it would refuse connections instead of the 503
    assert api["readinessProbe"]["httpGet"]["path"] == "/healthz"
    assert "preStop" in api["lifecycle"]
    # a chat completion holds its request up to MRC_OPENAI_WAIT_S
    assert pod["terminationGracePeriodSeconds"] >= Settings.model_fields["openai_wait_s"].default + 30


def test_the_worker_deployment_probes_and_drains_as_the_worker_does() -> None:
    import yaml

    deployment = next(yaml.safe_load_all((DEPLOY / "k8s" / "worker.yaml").read_text()))
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # Liveness from the start: a worker alive but not ready on purpose is kept (MrcWorkerNotReady says so)
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["terminationGracePeriodSeconds"] >= 300
    # No Service selects workers: a preStop pause only delayed the drain (review, helper-99)
    assert "lifecycle" not in container
    budget = list(yaml.safe_load_all((DEPLOY / "k8s" / "worker.yaml").read_text()))[-1]
    assert budget["kind"] == "PodDisruptionBudget"
    # A worker kept not ready on purpose must not hold every other node's drain (review, helper-99)
    assert budget["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    # KEDA's HPA owns the count: a `replicas` here is set again by every apply (review, helper-116)
    assert "replicas" not in deployment["spec"]
    # a surge pod needs a spare GPU; without one the rollout never ended (review, helper-116)
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


@pytest.mark.parametrize("name", ["worker.yaml", "api.yaml"])
def test_every_pod_meets_the_restricted_pod_security_level(name: str) -> None:
    """A namespace enforcing Pod Security "restricted" refused the pods (review, helper-116)."""
    import yaml

    deployment = next(yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()))
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in pod["containers"]:
        assert container["securityContext"]["allowPrivilegeEscalation"] is False, container["name"]
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], container["name"]


def test_keda_scales_on_the_lists_the_jobs_are_really_on() -> None:
    """ScaledObject is a CRD (no Kubernetes schema): its shape is checked here, and its list names
    against the keys the code queues jobs on."""
    import yaml

    from shared import names

    scaled, auth = yaml.safe_load_all((DEPLOY / "k8s" / "keda-scaledobject.yaml").read_text())
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert (auth["apiVersion"], auth["kind"]) == ("keda.sh/v1alpha1", "TriggerAuthentication")
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    (ref,) = auth["spec"]["secretTargetRef"]
    assert (ref["parameter"], ref["name"], ref["key"]) == ("password", "mrc-secrets", "REDIS_PASSWORD")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "mrc-worker"
    lists = {t["metadata"]["listName"] for t in scaled["spec"]["triggers"] if t["type"] == "redis"}
    assert lists == {names.queue_keys("interactive")[0], names.queue_keys("backlog")[0]}
    for trigger in scaled["spec"]["triggers"]:
        assert int(trigger["metadata"]["listLength"]) > 0
        # KEDA connects from its own namespace: a short name does not resolve there (review, helper-116)
        address = trigger["metadata"]["address"]
        assert re.fullmatch(r"mrc-redis\.[a-z0-9-]+\.svc\.cluster\.local:6379", address)
    # cooldownPeriod only acts when scaling to zero; with a floor of one the HPA's behaviour is what damps
    if scaled["spec"].get("minReplicaCount", 0) > 0:
        assert "cooldownPeriod" not in scaled["spec"]
        behavior = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert behavior["scaleDown"]["stabilizationWindowSeconds"] >= 300


def test_the_dashboards_lane_queries_count_redis_wide_series_once(tmp_path: Path) -> None:
    """Every worker and the lane exporter export the same Redis-wide lane series. Each dashboard query
    of them, evaluated by promtool over the exporter and two workers, gives what one source says."""
    import yaml

    dashboard = json.loads((DEPLOY / "grafana" / "mrc-dashboard.json").read_text())
    exprs = [
        target["expr"] for panel in dashboard["panels"] for target in panel["targets"]
        if re.search(r"mrc_(queue_|dead_letter)", target["expr"])
    ]  # fmt: skip
    assert len(exprs) >= 4
    sources = ['job="mrc-lanes"', 'job="mrc-worker",instance="w1"', 'job="mrc-worker",instance="w2"']
    series = []
    for source in sources:
        for name in ("mrc_queue_depth", "mrc_queue_in_flight", "mrc_queue_oldest_age_seconds"):
            series.append({"series": f'{name}{{lane="backlog",{source}}}', "values": "7x10"})
        series.append({"series": f"mrc_dead_letter_depth{{{source}}}", "values": "7x10"})
    tests = [
        {
            "interval": "1m",
            "input_series": series,
            "promql_expr_test": [
                {
                    "expr": expr,
                    "eval_time": "5m",
                    "exp_samples": [
                        {"labels": '{lane="backlog"}' if "by (lane)" in expr else "{}", "value": 7}
                    ],
                }
                for expr in exprs
            ],
        }
    ]
    path = tmp_path / "dashboard-lanes.test.yml"
    path.write_text(yaml.safe_dump({"tests": tests}))
    done = _promtool("test", "rules", str(path))
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_s3_lifecycle_policy_is_the_s3_apis_and_expires_only_what_mrc_may_lose() -> None:
    """Review, helper-115: nothing deleted photos, results or run files, and nothing said how long
    they must stay. The policy is checked against the S3 API's own model (botocore, offline), and its
    folders and days against the code's."""
    import botocore.session
    from botocore.validate import ParamValidator

    from shared import names
    from shared.records import RECORD_TTL_S
    from shared.runs import RUN_TTL_S

    policy = json.loads((DEPLOY / "s3-lifecycle.json").read_text())
    model = botocore.session.get_session().get_service_model("s3")
    shape = model.operation_model("PutBucketLifecycleConfiguration").input_shape
    report = ParamValidator().validate({"Bucket": "b", "LifecycleConfiguration": policy}, shape)
    assert not report.has_errors(), report.generate_report()
    rules = [rule for rule in policy["Rules"] if "Expiration" in rule]
    expiring = {rule["Filter"]["Prefix"]: rule["Expiration"]["Days"] for rule in rules}
    folders = {
        names.uploads_folder(""),
        names.result_key("", "x").rsplit("x", 1)[0],
        names.run_key("", "x", "y").split("x", 1)[0],
    }
    assert set(expiring) == folders == {"inputs/", "results/", "runs/"}  # never files/: clients list them
    assert min(expiring.values()) * 86_400 >= max(RUN_TTL_S, RECORD_TTL_S)
