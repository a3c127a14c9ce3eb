"""Static checks of deploy/: every file loads, names line up across files, and
every metric the alerts and the dashboard query is one the code exports.

No servers: the compose file, the Kubernetes manifests, the Prometheus config
and rules and the Grafana dashboard are parsed and compared with each other,
with the settings of every layer (`ledger.config.LedgerSettings`,
`jobs.orchestration.job_settings.JobSettings`, `service.service_settings.ServiceSettings`)
and with the metric objects of `ledger.intake_metrics`,
`jobs.orchestration.worker_metrics` and `service.service_metrics`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from jobs.orchestration import worker_metrics as job_metrics
from jobs.orchestration.job_settings import JobSettings
from ledger import intake_metrics as ledger_metrics
from ledger.config import LedgerSettings, retention_configs
from service import service_metrics
from service.service_settings import ServiceSettings

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
K8S = DEPLOY / "k8s"

IMAGE = "obliviate:latest"
INFRA_SERVICES = {"broker", "postgres", "prometheus"}
# role -> (the image's arguments on Kubernetes, port its /metrics is served on there)
OBLIVIATE_SERVICES = {
    "service": (["serve", "--host", "0.0.0.0", "--port", "3000"], 3000),
    "worker": (["worker"], 9101),
    "consumer": (["consume"], 9102),
}
# compose service -> (role, its port on the host's network): two replicas of service and
# worker, each a compose service of its own (no two processes share a host port)
COMPOSE_REPLICAS = {"service": ("service", 13000), "service-2": ("service", 13001),
                    "worker": ("worker", 19101), "worker-2": ("worker", 19111),
                    "consumer": ("consumer", 19102)}
# environment names that differ between replicas of one role
REPLICA_ENV = {"OBLIVIATE_WORKER_NAME", "OBLIVIATE_WORKER_METRICS_PORT"}
K8S_DEPLOYMENTS = {f"obliviate-{name}": name for name in OBLIVIATE_SERVICES}
K8S_KINDS = {"Namespace", "ConfigMap", "Secret", "PersistentVolumeClaim", "Deployment",
             "Service", "Kustomization"}

# Environment names other modules read besides the settings' OBLIVIATE_<FIELD> ones.
EXTRA_ENV = {
    "OBLIVIATE_ADMIN_TOKEN",            # service: bearer token of the admin endpoints
    "OBLIVIATE_WORKER_METRICS_PORT",    # worker: metrics port
    "OBLIVIATE_CONSUMER_METRICS_PORT",  # consumer: metrics port
    "OBLIVIATE_SERVICE_WORKERS",        # service.service: BentoML worker processes
    "OBLIVIATE_WORKER_NAME",            # worker: its claims' owner (one per replica)
    "BENTOML_HOME",                     # BentoML's home (a Bento's own, in the image)
    "BENTOML_DO_NOT_TRACK",             # BentoML usage tracking off
}
REQUIRED_ENV = {"OBLIVIATE_DATABASE_URL", "OBLIVIATE_KAFKA_BOOTSTRAP", "OBLIVIATE_HMAC_KEY_HEX",
                "OBLIVIATE_ADMIN_TOKEN", "OBLIVIATE_LEDGER_SIGNING_KEY_HEX",
                "OBLIVIATE_MODEL_STORE"}
# the ledger's one signing key among them: every process signs with it
# (tests/test_signing_identity.py starts processes with this environment)
SECRET_ENV = {"OBLIVIATE_DATABASE_URL", "OBLIVIATE_HMAC_KEY_HEX", "OBLIVIATE_ADMIN_TOKEN",
              "OBLIVIATE_LEDGER_SIGNING_KEY_HEX"}

REQUIRED_ALERTS = {"DeletionSLAMissed", "GuardStuckInNoiseAll", "PrivacyBudgetExhausted",
                   "DeadLettersRising", "ModelVersionLagging", "VerifyFailures"}
SEVERITIES = {"page", "critical", "warning", "info"}
# families the dashboard must show, whatever the alerts use
DASHBOARD_FAMILIES = {
    "obliviate_guard_epsilon_spent", "obliviate_guard_epsilon_budget",
    "obliviate_guard_epsilon_per_query", "obliviate_guard_queries", "obliviate_guard_mode",
    "obliviate_guard_bound", "obliviate_deletion_latency_seconds", "obliviate_requests_pending",
    "obliviate_model_version", "obliviate_served_model_version", "obliviate_model_swaps",
    "obliviate_requests", "obliviate_dead_letters", "obliviate_model_update_seconds",
    "obliviate_guard_bound_seconds", "obliviate_guard_complete",
}
# labels Prometheus itself attaches or histograms carry
BUILTIN_LABELS = {"le", "job", "instance", "__name__"}
# sample names a metric type exports, by suffix (prometheus_client conventions)
SAMPLE_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "gauge": ("",),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
}
# a label named like one of these would put a person or a request in a label
IDENTITY_WORDS = {"user", "users", "record", "records", "request", "requests", "subject",
                  "subjects", "person", "customer", "email", "id", "ids", "uuid"}


# --------------------------------------------------------------------------- loading

def _config_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*")
                  if p.is_file() and p.suffix in {".yml", ".yaml", ".json"})


def _load_all(path: Path) -> list[Any]:
    text = path.read_text()
    if path.suffix == ".json":
        return [json.loads(text)]
    return [doc for doc in yaml.safe_load_all(text) if doc is not None]


@cache
def _load(relpath: str) -> Any:
    (doc,) = _load_all(DEPLOY / relpath)
    return doc


def _compose() -> dict[str, Any]:
    return _load("compose.yaml")


def _services() -> dict[str, Any]:
    return _compose()["services"]


@cache
def _k8s_docs() -> tuple[tuple[str, dict[str, Any]], ...]:
    return tuple((p.name, doc) for p in sorted(K8S.glob("*.yaml")) for doc in _load_all(p))


def _k8s(kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for _, doc in _k8s_docs()
            if doc.get("kind") == kind and "metadata" in doc}


def _alert_rules() -> list[dict[str, Any]]:
    return [rule for group in _load("prometheus/alerts.yml")["groups"]
            for rule in group["rules"] if "alert" in rule]


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows nest theirs


def _dashboard() -> dict[str, Any]:
    return _load("grafana/dashboards/obliviate.json")


def _dashboard_exprs() -> list[tuple[str, str]]:
    return [(f"panel {p.get('title')!r} target {t.get('refId')}", t["expr"])
            for p in _panels(_dashboard()["panels"]) for t in p.get("targets", [])]


def _alert_exprs() -> list[tuple[str, str]]:
    return [(f"alert {r['alert']}", r["expr"]) for r in _alert_rules()]


# --------------------------------------------------------------------------- PromQL

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_SELECTOR = re.compile(r"\{([^{}]*)\}")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")


def metric_names(expr: str) -> set[str]:
    """The `obliviate_*` identifiers of a PromQL expression (string literals skipped)."""
    return {t for t in _IDENT.findall(_STRING.sub('""', expr)) if t.startswith("obliviate_")}


def label_names(expr: str) -> set[str]:
    """Labels named in grouping clauses (by, on, ...) and in selectors' matchers."""
    bare = _STRING.sub('""', expr)
    names = {n.strip() for g in _GROUPING.findall(bare) for n in g.split(",") if n.strip()}
    return names | {m for s in _SELECTOR.findall(bare) for m in _MATCHER.findall(s)}


def _balanced(expr: str) -> bool:
    pairs, stack = {")": "(", "]": "[", "}": "{"}, []
    for ch in _STRING.sub('""', expr):
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs and (not stack or stack.pop() != pairs[ch]):
            return False
    return not stack


# --------------------------------------------------------------------------- exported metrics

def _metric_objects() -> list[tuple[str, MetricWrapperBase]]:
    return [(f"{module.__name__}.{attr}", obj)
            for module in (ledger_metrics, job_metrics, service_metrics)
            for attr, obj in vars(module).items() if isinstance(obj, MetricWrapperBase)]


@cache
def exported_samples() -> dict[str, str]:
    """Every sample name the code exports -> its metric family."""
    samples: dict[str, str] = {}
    for _, metric in _metric_objects():
        for family in metric.describe():
            for suffix in SAMPLE_SUFFIXES[family.type]:
                samples[family.name + suffix] = family.name
        for family in metric.collect():  # unlabelled metrics: the real sample names
            samples.update({s.name: family.name for s in family.samples})
    for family in service_metrics.LedgerCollector(*[lambda: 0] * 3, lambda: 0.0).collect():
        samples[family.name] = family.name
        samples.update({s.name: family.name for s in family.samples})
    return samples


def _exported_labels() -> set[str]:
    return {label for _, m in _metric_objects() for label in getattr(m, "_labelnames", ())}


def _families(exprs: list[tuple[str, str]]) -> set[str]:
    samples = exported_samples()
    return {samples[n] for _, e in exprs for n in metric_names(e) if n in samples}


def _unknown_metrics(exprs: list[tuple[str, str]]) -> list[str]:
    samples = exported_samples()
    return [f"{where}: {name}" for where, e in exprs for name in sorted(metric_names(e))
            if name not in samples]


def _allowed_env() -> set[str]:
    return (LedgerSettings.variables() | JobSettings.variables() | ServiceSettings.variables()
            | EXTRA_ENV)


# --------------------------------------------------------------------------- every file loads

def test_deploy_has_the_expected_files() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in _config_files()}
    expected = {"compose.yaml", "prometheus/prometheus.yml", "prometheus/alerts.yml",
                "grafana/dashboards/obliviate.json",
                "grafana/provisioning/datasources/prometheus.yml",
                "grafana/provisioning/dashboards/obliviate.yml", "k8s/kustomization.yaml"}
    assert expected <= names, f"missing under deploy/: {sorted(expected - names)}"


@pytest.mark.parametrize("path", _config_files(), ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_config_file_loads(path: Path) -> None:
    docs = _load_all(path)
    assert docs, f"{path} is empty"
    assert all(isinstance(d, dict) for d in docs), f"{path}: every document must be a mapping"


# --------------------------------------------------------------------------- compose

def _command(name: str) -> list[str]:
    """A compose replica's arguments as its role runs them on Kubernetes."""
    role, port = COMPOSE_REPLICAS[name]
    return [("0.0.0.0" if a == "127.0.0.1" else str(OBLIVIATE_SERVICES[role][1])
             if a == str(port) else a) for a in _services()[name]["command"]]


def test_compose_has_every_service() -> None:
    expected = INFRA_SERVICES | set(COMPOSE_REPLICAS)
    missing = expected - set(_services())
    assert not missing, f"compose.yaml lacks services {sorted(missing)}"


def test_compose_uses_the_images_make_images_builds() -> None:
    built = {f"obliviate-{p.stem.split('.')[0]}:latest"
             for p in (DEPLOY / "images").glob("*.Dockerfile")} - {"obliviate-obliviate:latest"}
    for name, svc in _services().items():
        assert svc["image"] in built | {IMAGE}, f"{name}: {svc['image']} is not built here"
        assert svc["network_mode"] == "host", f"{name}: every container on the host network"


def test_compose_infrastructure() -> None:
    svc = _services()
    broker = " ".join(svc["broker"]["command"])
    assert "--listener-url tcp://127.0.0.1:19092" in broker
    pg = svc["postgres"]
    assert pg["environment"]["POSTGRES_DB"] == "obliviate"
    assert pg["environment"]["POSTGRES_HOST"] == "127.0.0.1"
    assert any(str(v).endswith(":/var/lib/postgresql/data") for v in pg["volumes"])


@pytest.mark.parametrize("name", sorted(COMPOSE_REPLICAS))
def test_compose_obliviate_service(name: str) -> None:
    svc = _services()[name]
    role, port = COMPOSE_REPLICAS[name]
    assert svc["image"] == IMAGE
    assert _command(name) == OBLIVIATE_SERVICES[role][0]
    env = svc["environment"]
    assert isinstance(env, dict), f"{name}: environment must be a mapping"
    unknown = sorted(set(env) - _allowed_env())
    assert not unknown, (f"{name}: environment names that no layer's settings "
                         f"(OBLIVIATE_<FIELD>) nor EXTRA_ENV know: {unknown}")
    assert not REQUIRED_ENV - set(env), f"{name}: missing {sorted(REQUIRED_ENV - set(env))}"
    assert env["OBLIVIATE_KAFKA_BOOTSTRAP"] == "127.0.0.1:19092"
    assert env["OBLIVIATE_MODEL_STORE"] == "/models"
    url = env["OBLIVIATE_DATABASE_URL"]
    assert url.startswith("postgresql+psycopg://obliviate:")
    assert url.endswith("@127.0.0.1:15432/obliviate")
    if role != "service":
        assert env[f"OBLIVIATE_{role.upper()}_METRICS_PORT"] == str(port)
    assert f"127.0.0.1:{port}/" in " ".join(svc["healthcheck"]["test"]), f"{name}: probe"


def test_compose_obliviate_services_share_one_environment() -> None:
    envs = [{k: v for k, v in _services()[n]["environment"].items() if k not in REPLICA_ENV}
            for n in sorted(COMPOSE_REPLICAS)]
    assert all(e == envs[0] for e in envs)
    workers = [_services()[n]["environment"]["OBLIVIATE_WORKER_NAME"]
               for n, (role, _) in COMPOSE_REPLICAS.items() if role == "worker"]
    assert len(set(workers)) == len(workers) == 2, "each worker replica claims under its name"


_REQUIRED_VAR = re.compile(r"\$\{[A-Z0-9_]+:\?[^}]*\}")


def test_compose_commits_no_secrets() -> None:
    env = _services()["service"]["environment"]
    for key in ("OBLIVIATE_HMAC_KEY_HEX", "OBLIVIATE_ADMIN_TOKEN",
                "OBLIVIATE_LEDGER_SIGNING_KEY_HEX"):
        assert _REQUIRED_VAR.fullmatch(env[key]), f"{key} must be ${{VAR:?...}}, not a value"
    password = env["OBLIVIATE_DATABASE_URL"].split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    assert _REQUIRED_VAR.fullmatch(password), "the database password must come from the env"
    pg_password = _services()["postgres"]["environment"]["POSTGRES_PASSWORD"]
    assert _REQUIRED_VAR.fullmatch(pg_password)


def test_compose_model_store_is_shared_by_worker_and_service() -> None:
    def store(name: str) -> set[str]:
        return {v.split(":")[0] for v in _services()[name].get("volumes", [])
                if v.split(":")[1] == "/models"}
    assert store("service") and store("service") == store("worker") == store("service-2")
    assert store("service") <= set(_compose()["volumes"])


def test_compose_named_volumes_are_declared_and_bind_mounts_exist() -> None:
    declared = set(_compose().get("volumes") or {})
    for name, svc in _services().items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name}: bind mount {source} does not exist"
            else:
                assert source in declared, f"{name}: volume {source} is not declared"


def test_compose_healthchecks_and_dependencies() -> None:
    svc = _services()
    assert "13000/healthz" in " ".join(svc["service"]["healthcheck"]["test"])
    conditions = {"service_healthy", "service_completed_successfully", "service_started"}
    for name, s in svc.items():
        deps = s.get("depends_on", {})
        assert isinstance(deps, dict), f"{name}: depends_on needs conditions"
        for dep, spec in deps.items():
            assert dep in svc, f"{name} depends on unknown service {dep}"
            assert spec["condition"] in conditions
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in svc[dep], f"{name} waits for {dep}: no healthcheck"
    for name in COMPOSE_REPLICAS:
        assert svc[name]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "broker" in svc["consumer"]["depends_on"]


# --------------------------------------------------------------------------- prometheus

def _scrape_targets(job: dict[str, Any]) -> set[tuple[str, int]]:
    targets = set()
    for sc in job.get("static_configs", []):
        for t in sc["targets"]:
            host, port = t.rsplit(":", 1)
            targets.add((host, int(port)))
    for sd in job.get("dns_sd_configs", []):
        targets |= {(n, int(sd["port"])) for n in sd["names"]}
    return targets


def test_prometheus_scrapes_every_obliviate_process() -> None:
    config = _load("prometheus/prometheus.yml")
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    for role in OBLIVIATE_SERVICES:
        assert role in jobs, f"no scrape job {role!r}"
        assert jobs[role].get("metrics_path", "/metrics") == "/metrics"
        want = {("127.0.0.1", port) for r, port in COMPOSE_REPLICAS.values() if r == role}
        assert _scrape_targets(jobs[role]) == want, f"job {role} scrapes the wrong targets"


def test_prometheus_loads_the_alert_rules() -> None:
    config = _load("prometheus/prometheus.yml")
    assert "alerts.yml" in config["rule_files"]
    for rule_file in config["rule_files"]:
        assert (DEPLOY / "prometheus" / rule_file).is_file()
    prom = _services()["prometheus"]
    config_flag = next(a for a in prom["command"] if a.startswith("--config.file="))
    config_dir = config_flag.split("=", 1)[1].rsplit("/", 1)[0]
    assert any(v.split(":")[:2] == ["./prometheus", config_dir] for v in prom["volumes"])


def test_alert_rules() -> None:
    rules = _alert_rules()
    names = {r["alert"] for r in rules}
    assert not REQUIRED_ALERTS - names, f"missing alerts {sorted(REQUIRED_ALERTS - names)}"
    for rule in rules:
        where = rule["alert"]
        assert re.fullmatch(r"\d+[smhdwy]", str(rule.get("for", ""))), f"{where}: bad for:"
        assert rule["labels"]["severity"] in SEVERITIES, f"{where}: severity"
        assert rule["annotations"].get("summary") and rule["annotations"].get("description")
    sla = [metric_names(r["expr"]) for r in rules if r["alert"] == "DeletionSLAMissed"]
    assert any("obliviate_deletion_latency_seconds_bucket" in s for s in sla)
    assert any({"obliviate_requests_pending", "obliviate_requests_applied_total"} <= s for s in sla)


# --------------------------------------------------------------------------- the metric names

def test_exported_sample_names_follow_the_type_conventions() -> None:
    """The suffix table agrees with what prometheus_client really exports."""
    samples = exported_samples()
    assert {"obliviate_dead_letters_total", "obliviate_dead_letters_created",
            "obliviate_deletion_latency_seconds_bucket", "obliviate_deletion_latency_seconds_sum",
            "obliviate_deletion_latency_seconds_count", "obliviate_guard_queries_total",
            "obliviate_guard_mode", "obliviate_requests_pending",
            "obliviate_model_version"} <= set(samples)
    assert "obliviate_requests" not in samples  # a counter's bare name is not a sample


def test_every_queried_metric_is_exported() -> None:
    exprs = _alert_exprs() + _dashboard_exprs()
    assert len(exprs) > 10
    unknown = _unknown_metrics(exprs)
    assert not unknown, (
        "metric names referenced in deploy/ that no code exports:\n  " + "\n  ".join(unknown)
        + "\nexported: " + ", ".join(sorted(exported_samples())))


def test_every_queried_label_exists() -> None:
    allowed = _exported_labels() | BUILTIN_LABELS
    unknown = [f"{where}: {label}" for where, e in _alert_exprs() + _dashboard_exprs()
               for label in sorted(label_names(e)) if label not in allowed]
    assert not unknown, ("labels no metric carries:\n  " + "\n  ".join(unknown)
                         + f"\nknown labels: {sorted(allowed)}")


def test_expressions_are_balanced() -> None:
    bad = [where for where, e in _alert_exprs() + _dashboard_exprs() if not _balanced(e)]
    assert not bad, f"unbalanced brackets in {bad}"


def test_dashboard_shows_every_alerted_family() -> None:
    shown = _families(_dashboard_exprs())
    alerted = _families(_alert_exprs())
    assert alerted <= shown, f"alerted on but not on the dashboard: {sorted(alerted - shown)}"
    missing = sorted(DASHBOARD_FAMILIES - shown)
    assert not missing, f"not on the dashboard: {missing}"


def test_no_high_cardinality_labels() -> None:
    def identity_like(label: str) -> bool:
        low = label.lower()
        return bool(set(low.split("_")) & IDENTITY_WORDS
                    or re.search(r"(user|record|request|subject)s?id", low))

    offenders = [f"{where}: {label}" for where, m in _metric_objects()
                 for label in getattr(m, "_labelnames", ()) if identity_like(label)]
    assert not offenders, f"labels naming a person, record or request: {offenders}"
    for family in service_metrics.LedgerCollector(*[lambda: 0] * 3, lambda: 0.0).collect():
        assert all(not s.labels for s in family.samples)
    assert not [label for label in _exported_labels() | BUILTIN_LABELS if identity_like(label)]


# --------------------------------------------------------------------------- grafana

def test_dashboard_structure() -> None:
    dash = _dashboard()
    assert dash["uid"] and dash["title"]
    assert 36 <= dash["schemaVersion"] <= 41
    panels = list(_panels(dash["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in panels:
        grid = p["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, f"{p['title']}: gridPos"
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "prometheus", p["title"]
        targets = p["targets"]
        assert targets and all(t.get("expr") for t in targets), f"{p['title']}: no queries"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), f"{p['title']}: duplicate refIds"
        assert all(t.get("datasource", {"uid": "prometheus"})["uid"] == "prometheus"
                   for t in targets)


def test_grafana_provisioning() -> None:
    """For a Grafana of the operator's own (Debian packages none): the data source is the
    compose file's Prometheus, the provider reads the dashboards' folder."""
    (ds,) = _load("grafana/provisioning/datasources/prometheus.yml")["datasources"]
    assert ds["uid"] == "prometheus" and ds["type"] == "prometheus"
    assert ds["url"] == "http://127.0.0.1:19090"
    (provider,) = _load("grafana/provisioning/dashboards/obliviate.yml")["providers"]
    assert provider["options"]["path"]


# --------------------------------------------------------------------------- kubernetes

def test_k8s_kinds_and_kustomization() -> None:
    kinds = {doc.get("kind") for _, doc in _k8s_docs()}
    assert not K8S_KINDS - kinds, f"missing kinds {sorted(K8S_KINDS - kinds)}"
    kustomization = _load("k8s/kustomization.yaml")
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == files
    header = (K8S / "kustomization.yaml").read_text().split("apiVersion:")[0]
    assert all(f in header for f in files), "the header comment must list every manifest"
    for _, doc in _k8s_docs():
        if doc["kind"] not in {"Namespace", "Kustomization"}:
            assert doc["metadata"]["namespace"] == "obliviate", doc["metadata"]["name"]


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container["ports"] if p["name"] == port)


def test_k8s_deployments() -> None:
    deployments = _k8s("Deployment")
    config = _k8s("ConfigMap")["obliviate-config"]["data"]
    assert set(K8S_DEPLOYMENTS) <= set(deployments)
    for dname, name in K8S_DEPLOYMENTS.items():
        d = deployments[dname]
        command, port = OBLIVIATE_SERVICES[name]
        template = d["spec"]["template"]
        assert d["spec"]["replicas"] == 2, dname
        selector = d["spec"]["selector"]["matchLabels"]
        assert selector.items() <= template["metadata"]["labels"].items(), dname
        c = _container(d)
        assert c["image"] == IMAGE, dname
        assert c.get("args", c.get("command")) == command, f"{dname}: runs {command}"
        ports = [p["containerPort"] for p in c["ports"]]
        assert ports == [port], f"{dname}: container ports {ports}, expected [{port}]"
        annotations = template["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/port"] == str(port), f"{dname}: scrape port"
        refs = {(k, v["name"]) for e in c["envFrom"] for k, v in e.items()}
        assert refs == {("configMapRef", "obliviate-config"), ("secretRef", "obliviate-secrets")}
    assert config["OBLIVIATE_WORKER_METRICS_PORT"] == str(OBLIVIATE_SERVICES["worker"][1])
    assert config["OBLIVIATE_CONSUMER_METRICS_PORT"] == str(OBLIVIATE_SERVICES["consumer"][1])
    service = _container(deployments["obliviate-service"])
    assert service["readinessProbe"]["httpGet"]["path"] == "/readyz", "readiness: GET /readyz"
    assert service["livenessProbe"]["httpGet"]["path"] == "/healthz", "liveness: GET /healthz"
    for probe in ("readinessProbe", "livenessProbe"):
        assert _port(service, service[probe]["httpGet"]["port"]) == 3000


def test_k8s_service_targets_the_service_pods() -> None:
    svc = _k8s("Service")["obliviate-service"]
    deployment = _k8s("Deployment")["obliviate-service"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (port,) = svc["spec"]["ports"]
    assert port["port"] == 3000
    assert _port(_container(deployment), port["targetPort"]) == 3000


@pytest.mark.parametrize(("setting", "claim", "users"), [
    ("OBLIVIATE_MODEL_STORE", "obliviate-models", ("obliviate-service", "obliviate-worker")),
    ("OBLIVIATE_KEY_STORE_DIR", "obliviate-keys",
     ("obliviate-service", "obliviate-worker", "obliviate-consumer"))])
def test_k8s_model_store_and_key_store_are_shared_rwx_volumes(setting: str, claim: str,
                                                              users: tuple[str, ...]) -> None:
    pvc = _k8s("PersistentVolumeClaim")[claim]
    assert "ReadWriteMany" in pvc["spec"]["accessModes"], "every pod shares the store"
    path = _k8s("ConfigMap")["obliviate-config"]["data"][setting]
    for dname in users:
        d = _k8s("Deployment")[dname]
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        mounts = [m for m in _container(d)["volumeMounts"] if m["mountPath"] == path]
        assert len(mounts) == 1, f"{dname} must mount {claim} at {path}"
        assert volumes[mounts[0]["name"]]["persistentVolumeClaim"]["claimName"] == claim


def test_k8s_configuration_names() -> None:
    config = _k8s("ConfigMap")["obliviate-config"]["data"]
    secret = _k8s("Secret")["obliviate-secrets"]["stringData"]
    allowed = _allowed_env()
    unknown = sorted((set(config) | set(secret)) - allowed)
    assert not unknown, f"names neither the settings nor EXTRA_ENV know: {unknown}"
    assert not SECRET_ENV & set(config), "secrets belong in the Secret, not the ConfigMap"
    assert not REQUIRED_ENV - set(config) - set(secret)
    assert set(secret) == SECRET_ENV
    assert all("REPLACE_ME" in v for v in secret.values()), "the Secret is a template"
    assert config["OBLIVIATE_CONSUMER_GROUP"], "all consumer replicas share one group"


def test_topics_are_created_with_the_documented_retention() -> None:
    """Raw requests (additions carry features) live in Kafka for the retention
    docs/operations.md states, and segments roll often enough for it to be kept (Kafka
    deletes whole ones)."""
    s = LedgerSettings()
    want = {s.requests_topic: retention_configs(s.requests_retention_s),
            s.dead_letter_topic: retention_configs(s.dead_letter_retention_s)}
    # compose's broker gets its topics from the consumer (`ensure_topics`, these configs)
    assert want == s.topic_configs()
    job = " ".join(_k8s("Job")["obliviate-kafka-topics"]["spec"]["template"]["spec"]
                   ["containers"][0]["args"])
    for script, names in ((job, {s.requests_topic: "$OBLIVIATE_REQUESTS_TOPIC",
                                 s.dead_letter_topic: "$OBLIVIATE_DEAD_LETTER_TOPIC"}),):
        for topic, cfg in want.items():
            create = next(c for c in script.split(";") if f"--topic {names[topic]} " in
                          c.replace('"', "") + " ")
            for key, value in cfg.items():
                assert f"--config {key}={value}" in create, (topic, key)
    assert int(want[s.requests_topic]["segment.ms"]) * 10 == int(
        want[s.requests_topic]["retention.ms"])


def test_compose_listens_on_loopback_only() -> None:
    """On the host's network every listener binds 127.0.0.1: the broker (PLAINTEXT, no
    auth: producing to the requests topic deletes data), PostgreSQL, Prometheus, the
    metrics and the service (a proxy of the operator's publishes it)."""
    svc = _services()
    assert svc["postgres"]["environment"]["POSTGRES_HOST"] == "127.0.0.1"
    assert "--web.listen-address=127.0.0.1:19090" in svc["prometheus"]["command"]
    assert svc["service"]["environment"]["OBLIVIATE_METRICS_HOST"] == "127.0.0.1"
    for name, s in svc.items():
        assert not s.get("ports"), f"{name}: no port mapping on the host network"
        command = s.get("command", [])
        if "--host" in command:
            assert command[command.index("--host") + 1] == "127.0.0.1", name
        assert not any("0.0.0.0" in str(a) for a in command), name


def _probe_path(test: list[str]) -> str:
    """The path a compose healthcheck's URL asks for."""
    url = next(a for a in test if a.startswith("http://"))
    return "/" + url.split("/", 3)[3]


@pytest.mark.parametrize("role", sorted(OBLIVIATE_SERVICES))
def test_k8s_matches_compose(role: str) -> None:
    """Kubernetes and compose run each role alike: the same arguments, environment names
    (less what names a replica or a host), secrets handed in from outside, one key store
    at the same path, and the liveness probe on the same path."""
    name = next(n for n, (r, _) in COMPOSE_REPLICAS.items() if r == role)
    compose = _services()[name]
    container = _container(_k8s("Deployment")[f"obliviate-{role}"])
    config = _k8s("ConfigMap")["obliviate-config"]["data"]
    secret = _k8s("Secret")["obliviate-secrets"]["stringData"]
    assert container.get("args") == _command(name)
    host_only = {"OBLIVIATE_SERVICE_WORKERS"} | REPLICA_ENV
    assert set(compose["environment"]) - host_only == (set(config) | set(secret)) - host_only
    for key in SECRET_ENV:
        assert _REQUIRED_VAR.search(compose["environment"][key]) and key in secret, key
    assert config["OBLIVIATE_KEY_STORE_DIR"] == compose["environment"]["OBLIVIATE_KEY_STORE_DIR"]
    k8s_mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert k8s_mounts == {v.split(":")[1] for v in compose["volumes"]}
    assert container["livenessProbe"]["httpGet"]["path"] == _probe_path(
        compose["healthcheck"]["test"])
