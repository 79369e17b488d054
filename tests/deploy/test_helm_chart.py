"""helm/tandem: Helm's own linter and renderer, values.schema.json, kubernetes-validate on every
core object (the RayCluster's pod templates included), the CRDs against their projects'
documented fields, and the wiring between objects: selectors match labels, probes and Services
hit real container ports, secret references exist, and the router's `tandem serve` command
parses with the real CLI and agrees with the values it came from.

The tools live in their own environment (`make tools`, .venv-tools; TANDEM_DEPLOY_TOOLS
overrides the path): helm-sdkpy for lint, the helm binary for `helm template`, kubernetes-validate."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from cluster.autoscale import PoolSize
from cluster.cli import build_parser

ROOT = Path(__file__).parents[2]
CHART = ROOT / "helm" / "tandem"
SCENARIOS = sorted((CHART / "ci").glob("*.yaml"))
BAD = sorted((Path(__file__).parent / "bad-values").glob("*.yaml"))
TOOLS = Path(os.environ.get("TANDEM_DEPLOY_TOOLS", ROOT / ".venv-tools"))
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")  # the chart's kubeVersion floor, and the newest schemas
CRD_KINDS = {"RayCluster", "ServiceMonitor", "HTTPRoute"}


def _tool(name: str) -> Path:
    path = TOOLS / "bin" / name
    assert path.exists(), f"{path} is missing: run `make tools` (the chart checks' own environment)"
    return path


def _ids(paths) -> list[str]:
    return [p.stem for p in paths]


def merged_values(*files: Path) -> dict:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    for path in files:
        values = _merge(values, yaml.safe_load(path.read_text()) or {})
    return values


def _merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def helm_template(*values_files: Path, release: str = "rel") -> subprocess.CompletedProcess:
    args = [str(_tool("helm")), "template", release, str(CHART), "--namespace", "llm"]
    for path in values_files:
        args += ["-f", str(path)]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


@cache
def rendered(scenario: str | None) -> tuple[dict, ...]:
    files = [CHART / "ci" / f"{scenario}.yaml"] if scenario else []
    result = helm_template(*files)
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def chart_tool(*args: str, stdin: str | None = None):
    result = subprocess.run([str(_tool("python")), str(Path(__file__).parent / "chart_tool.py"), *args],
                            capture_output=True, text=True, input=stdin, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def one(docs, kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_templates(docs) -> dict[str, dict]:
    """component -> pod template (the RayCluster's head and worker groups, Redis's Deployment)."""
    cluster = one(docs, "RayCluster")
    templates = {"router": cluster["spec"]["headGroupSpec"]["template"]}
    for group in cluster["spec"]["workerGroupSpecs"]:
        templates[group["groupName"]] = group["template"]
    for deployment in (d for d in docs if d["kind"] == "Deployment"):
        templates[deployment["metadata"]["labels"]["app.kubernetes.io/component"]] = deployment["spec"]["template"]
    return templates


def head_containers(docs) -> dict[str, dict]:
    """The head pod's containers by name (the Ray head's, then the router's)."""
    containers = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    return {container["name"]: container for container in containers}


def serve_argv(docs) -> list[str]:
    """The router container's `tandem serve ...`, as argv after `tandem`."""
    script = head_containers(docs)["router"]["args"][-1]
    commands = [shlex.split(part.strip())[2:] for part in script.split(";") if part.strip().startswith("exec tandem ")]
    assert len(commands) == 1, script
    return commands[0]


# -- values and schema -------------------------------------------------------------------------
def test_values_yaml_documents_every_field():
    """Every top-level field and every field one level down has a comment: on its line, or above
    it or above the run of siblings it belongs to (no blank line between)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for number, line in enumerate(lines):
        match = re.match(r"^( {0,2})([A-Za-z][\w-]*):", line)
        if not match or "#" in line:
            continue
        indent, documented = len(match.group(1)), False
        for previous in reversed(lines[:number]):
            previous_indent = len(previous) - len(previous.lstrip())
            if not previous.strip() or previous_indent < indent:
                break  # a blank line or the parent: no comment for this run
            if previous.lstrip().startswith("#"):
                documented = previous_indent == indent
                break
        if not documented:
            undocumented.append(f"{line.strip()} (line {number + 1})")
    assert not undocumented, f"fields without a comment in values.yaml: {undocumented}"


@pytest.mark.parametrize("scenario", [None, *SCENARIOS], ids=["defaults", *_ids(SCENARIOS)])
def test_values_validate_against_the_schema(scenario):
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(merged_values(*([scenario] if scenario else [])), schema)


@pytest.mark.parametrize("bad", BAD, ids=_ids(BAD))
def test_a_wrong_value_is_rejected_by_the_schema_and_at_install(bad):
    schema = json.loads((CHART / "values.schema.json").read_text())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(merged_values(bad), schema)
    result = helm_template(bad)  # what `helm install` runs first
    assert result.returncode != 0 and "schema" in result.stderr, result.stderr


def test_pool_bounds_out_of_order_fail_at_install(tmp_path):
    values = tmp_path / "bounds.yaml"
    values.write_text("decode: {minReplicas: 5, maxReplicas: 2}\n")
    result = helm_template(values)
    assert result.returncode != 0 and "decode.minReplicas (5) is above decode.maxReplicas (2)" in result.stderr


def test_the_device_agrees_with_the_gpus_of_every_pool_in_use(tmp_path):
    values = tmp_path / "device.yaml"
    values.write_text("serve: {device: cuda}\nprefill: {gpus: 0}\n")  # the prefill pool has none
    result = helm_template(values)
    assert result.returncode != 0 and "serve.device is cuda but prefill.gpus is 0" in result.stderr
    values.write_text("serve: {device: cuda, mode: colocated}\nprefill: {gpus: 0}\n")  # no prefill pool then
    assert helm_template(values).returncode == 0
    values.write_text("serve: {device: cpu}\nprefill: {gpus: 0}\n")  # the decode pool still asks for 1
    result = helm_template(values)
    assert result.returncode != 0 and "serve.device is cpu but decode.gpus is 1" in result.stderr


def test_external_redis_with_auth_needs_a_password(tmp_path):
    values = tmp_path / "redis.yaml"
    values.write_text("redis: {mode: external, external: {host: redis.data}}\n")
    result = helm_template(values)
    assert result.returncode != 0 and "set redis.password or redis.existingSecret" in result.stderr


# -- Helm's linter -----------------------------------------------------------------------------
@pytest.mark.parametrize("scenario", [None, *SCENARIOS], ids=["defaults", *_ids(SCENARIOS)])
def test_helm_lint(scenario):
    result = chart_tool("lint", str(CHART), *([str(scenario)] if scenario else []))
    assert result["charts"] == 1
    problems = [m for m in result["messages"] if m["severity"] >= 2]  # warnings and errors
    assert not problems and not result["errors"], result


def test_helm_lint_fails_on_every_wrong_value():
    for bad in BAD:
        result = chart_tool("lint", str(CHART), str(bad))
        assert {"severity": 3, "path": "values.yaml", "error": ""} in result["messages"] and result["errors"], result


# -- objects -----------------------------------------------------------------------------------
def _core_objects(docs) -> list[dict]:
    """The core objects, plus each RayCluster pod template as a core PodTemplate."""
    objects = [d for d in docs if d["kind"] not in CRD_KINDS]
    for component, template in pod_templates(docs).items():
        objects.append({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"raycluster-{component}"},
                        "template": template})
    return objects


@pytest.mark.parametrize("scenario", [None, *_ids(SCENARIOS)], ids=["defaults", *_ids(SCENARIOS)])
def test_core_objects_validate_with_kubernetes_validate(scenario):
    docs = rendered(scenario)
    objects = _core_objects(docs)
    assert {d["kind"] for d in objects} >= {"Service", "NetworkPolicy", "PodTemplate"}
    for version in KUBERNETES_VERSIONS:
        results = chart_tool("validate", version, stdin=json.dumps(objects))
        failed = [r for r in results if not r["ok"]]
        assert not failed, f"Kubernetes {version}: {failed}"
        assert len(results) == len(objects)


def test_kubernetes_validate_catches_a_broken_pod_template():
    """The check can fail: a probe on a port name given as a number-like typo, a misspelt field."""
    template = json.loads(json.dumps(pod_templates(rendered(None))["router"]))
    template["spec"]["containers"][1]["readinessProbe"]["httpGet"]["prot"] = 8000  # the router's
    results = chart_tool("validate", "1.37.0", stdin=json.dumps(
        [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": template}]))
    assert not results[0]["ok"] and "prot" in results[0]["error"]


# The CRDs' fields as their projects document them (KubeRay ray.io/v1 RayCluster, Prometheus
# Operator monitoring.coreos.com/v1 ServiceMonitor, Gateway API v1 HTTPRoute): unknown keys fail.
def _closed(properties: dict, required: tuple = ()) -> dict:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_POD_TEMPLATE = {"type": "object", "required": ["spec"]}
RAYCLUSTER_SPEC = _closed({
    "rayVersion": {"type": "string"}, "enableInTreeAutoscaling": {"type": "boolean"}, "suspend": {"type": "boolean"},
    "managedBy": {"type": "string"}, "headServiceAnnotations": _STRING_MAP,
    "gcsFaultToleranceOptions": {"type": "object"},
    "autoscalerOptions": _closed({
        "idleTimeoutSeconds": {"type": "integer", "minimum": 0},
        "upscalingMode": {"enum": ["Default", "Aggressive", "Conservative"]},
        "resources": {"type": "object"}, "image": {"type": "string"}, "imagePullPolicy": {"type": "string"},
        "securityContext": {"type": "object"}, "env": {"type": "array"}, "envFrom": {"type": "array"},
        "volumeMounts": {"type": "array"}, "version": {"enum": ["v1", "v2"]}}),
    "headGroupSpec": _closed({
        "rayStartParams": _STRING_MAP, "template": _POD_TEMPLATE, "serviceType": {"type": "string"},
        "headService": {"type": "object"}, "enableIngress": {"type": "boolean"}, "resources": _STRING_MAP,
        "labels": _STRING_MAP}, ("template",)),
    "workerGroupSpecs": {"type": "array", "items": _closed({
        "groupName": {"type": "string", "minLength": 1}, "replicas": {"type": "integer", "minimum": 0},
        "minReplicas": {"type": "integer", "minimum": 0}, "maxReplicas": {"type": "integer", "minimum": 0},
        "idleTimeoutSeconds": {"type": "integer"}, "suspend": {"type": "boolean"}, "numOfHosts": {"type": "integer"},
        "rayStartParams": _STRING_MAP, "template": _POD_TEMPLATE, "scaleStrategy": {"type": "object"},
        "resources": _STRING_MAP, "labels": _STRING_MAP}, ("groupName", "template", "maxReplicas"))},
}, ("headGroupSpec",))
SERVICEMONITOR_SPEC = _closed({
    "selector": {"type": "object"}, "namespaceSelector": _closed({"any": {"type": "boolean"},
                                                                  "matchNames": {"type": "array"}}),
    "jobLabel": {"type": "string"}, "targetLabels": {"type": "array"}, "podTargetLabels": {"type": "array"},
    "sampleLimit": {"type": "integer"}, "endpoints": {"type": "array", "items": _closed({
        "port": {"type": "string"}, "targetPort": {}, "path": {"type": "string"}, "scheme": {"type": "string"},
        "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"}, "scrapeTimeout": {"type": "string"},
        "honorLabels": {"type": "boolean"}, "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"},
        "params": {"type": "object"}, "tlsConfig": {"type": "object"}, "bearerTokenSecret": {"type": "object"},
        "authorization": {"type": "object"}})},
}, ("selector", "endpoints"))
HTTPROUTE_SPEC = _closed({
    "parentRefs": {"type": "array", "minItems": 1, "items": _closed({
        "group": {"type": "string"}, "kind": {"type": "string"}, "namespace": {"type": "string"},
        "name": {"type": "string", "minLength": 1}, "sectionName": {"type": "string"}, "port": {"type": "integer"}},
        ("name",))},
    "hostnames": {"type": "array", "items": {"type": "string"}},
    "rules": {"type": "array", "items": _closed({
        "name": {"type": "string"}, "matches": {"type": "array"}, "filters": {"type": "array"},
        "backendRefs": {"type": "array", "items": _closed({
            "group": {"type": "string"}, "kind": {"type": "string"}, "name": {"type": "string"},
            "namespace": {"type": "string"}, "port": {"type": "integer"}, "weight": {"type": "integer"},
            "filters": {"type": "array"}}, ("name",))},
        "timeouts": _closed({"request": {"type": "string"}, "backendRequest": {"type": "string"}}),
        "sessionPersistence": {"type": "object"}})},
})
CRD_SPECS = {("ray.io/v1", "RayCluster"): RAYCLUSTER_SPEC,
             ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICEMONITOR_SPEC,
             ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTPROUTE_SPEC}


@pytest.mark.parametrize("scenario", [None, *_ids(SCENARIOS)], ids=["defaults", *_ids(SCENARIOS)])
def test_custom_resources_use_only_documented_fields(scenario):
    for doc in (d for d in rendered(scenario) if d["kind"] in CRD_KINDS):
        jsonschema.validate(doc["spec"], CRD_SPECS[(doc["apiVersion"], doc["kind"])])
        assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}


def test_every_optional_object_appears_in_some_scenario():
    kinds = {d["kind"] for s in [None, *_ids(SCENARIOS)] for d in rendered(s)}
    assert kinds >= {"RayCluster", "Service", "Secret", "Deployment", "PodDisruptionBudget", "NetworkPolicy",
                     "Ingress", "HTTPRoute", "ServiceMonitor", "ConfigMap"}
    assert "HorizontalPodAutoscaler" not in kinds  # pools scale through Ray, not an HPA


# -- wiring ------------------------------------------------------------------------------------
def _container_ports(template: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}


def _matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _probe_port(probe: dict):
    for kind in ("httpGet", "tcpSocket", "grpc"):
        if kind in probe:
            return probe[kind]["port"]
    return None  # exec


@pytest.mark.parametrize("scenario", [None, *_ids(SCENARIOS)], ids=["defaults", *_ids(SCENARIOS)])
def test_objects_are_wired_together(scenario):
    docs = rendered(scenario)
    values = merged_values(*([CHART / "ci" / f"{scenario}.yaml"] if scenario else []))
    templates = pod_templates(docs)
    labels = {component: t["metadata"]["labels"] for component, t in templates.items()}
    # Services select pods and target ports those pods expose
    for service in (d for d in docs if d["kind"] == "Service"):
        selected = [c for c, lab in labels.items() if _matches(service["spec"]["selector"], lab)]
        assert len(selected) == 1, (service["metadata"]["name"], selected)
        ports = _container_ports(templates[selected[0]])
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports, (service["metadata"]["name"], port)
    router = one(docs, "Service", next(d["metadata"]["name"] for d in docs if d["kind"] == "Service"
                                       and d["spec"]["selector"].get("app.kubernetes.io/component") == "router"))
    assert {p["port"] for p in router["spec"]["ports"]} == {values["ports"]["http"], values["ports"]["grpc"]}
    # probes hit ports their container has
    for component, template in templates.items():
        for container in template["spec"]["containers"]:
            names = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                if kind in container:
                    port = _probe_port(container[kind])
                    assert port is None or port in names or port in names.values(), (component, kind, port)
    # worker groups: the fixed worker port, a gRPC readiness probe on it, one unit of the role's resource
    cluster = one(docs, "RayCluster")
    roles = ["prefill", "decode"] if values["serve"]["mode"] == "disagg" else ["decode"]
    assert [g["groupName"] for g in cluster["spec"]["workerGroupSpecs"]] == roles
    args = build_parser().parse_args(serve_argv(docs))
    for group in cluster["spec"]["workerGroupSpecs"]:
        role, container = group["groupName"], group["template"]["spec"]["containers"][0]
        assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {role: 1}
        assert container["readinessProbe"]["grpc"]["port"] == values["ports"]["worker"] == args.worker_port
        assert _container_ports(group["template"])["worker"] == args.worker_port
        assert getattr(args, f"{role}_workers") == PoolSize(group["minReplicas"], group["maxReplicas"])
        bounds = (values[role]["minReplicas"], values[role]["maxReplicas"])
        assert (group["minReplicas"], group["maxReplicas"]) == bounds
        resources = container["resources"]
        gpus = values[role]["gpus"]
        assert resources["requests"].get("nvidia.com/gpu") == resources["limits"].get("nvidia.com/gpu") == \
            (str(gpus) if gpus else None)
        assert getattr(args, f"{role}_gpus") == gpus
        assert _matches(group["template"]["metadata"]["labels"], labels[role])
    # draining: the pod's grace period outlasts the preStop pause plus --drain-timeout
    head_pod = templates["router"]["spec"]
    head = head_containers(docs)["router"]
    pause = head["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert head_pod["terminationGracePeriodSeconds"] >= pause + args.drain_timeout + 10
    assert args.drain_timeout == values["serve"]["drainTimeoutSeconds"]
    assert head["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert head["livenessProbe"]["httpGet"]["path"] == "/health"
    # the Ray head outlives the router's pause and drain (the workers finish what is in flight),
    # and Kubernetes waits for it
    ray_head = head_containers(docs)["ray-head"]
    head_stays = ray_head["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert head_stays >= pause + args.drain_timeout + 5
    assert head_pod["terminationGracePeriodSeconds"] >= head_stays + 5
    assert args.port == values["ports"]["http"] and args.grpc_port == values["ports"]["grpc"]
    # PDBs select the pods of their component, and only those
    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        selected = [c for c, lab in labels.items() if _matches(pdb["spec"]["selector"]["matchLabels"], lab)]
        assert selected == [pdb["metadata"]["labels"]["app.kubernetes.io/component"]]
    _check_secret_references(docs, values, templates)
    _check_exposure(docs, values, router, templates)


def _check_secret_references(docs, values, templates) -> None:
    chart_secrets = {d["metadata"]["name"]: set(d.get("data", {})) for d in docs if d["kind"] == "Secret"}
    existing = {(ref["name"], ref["key"]) for ref in [values["redis"]["existingSecret"],
                *(values["secrets"][k] for k in values["secrets"] if k.endswith("ExistingSecret"))] if ref["name"]}
    for component, template in templates.items():
        for container in template["spec"]["containers"]:
            defined = set()
            for env in container.get("env", []):
                for name in re.findall(r"\$\((\w+)\)", env.get("value", "")):
                    assert name in defined, f"{component}: {env['name']} uses $({name}) before it is defined"
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in chart_secrets.get(ref["name"], ()) or (ref["name"], ref["key"]) in existing, \
                        f"{component}: {env['name']} refers to a missing secret {ref}"
                defined.add(env["name"])
            for arg in container.get("args", []):
                for name in re.findall(r"\$\((\w+)\)", arg):
                    assert name in defined, f"{component}: args use $({name}) that no env defines"
    head_env = {e["name"]: e for e in head_containers(docs)["router"]["env"]}
    url = head_env["TANDEM_REDIS_URL"]["value"]
    if values["redis"]["mode"] == "bundled":
        redis = one(docs, "Service", url.split("@")[1].split(":")[0])
        assert redis["spec"]["ports"][0]["port"] == int(url.rsplit(":", 1)[1].split("/")[0])
    else:
        external = values["redis"]["external"]
        assert url == (f"{'rediss' if external['tls'] else 'redis'}://:$(REDIS_PASSWORD)@{external['host']}:"
                       f"{external['port']}/{external['database']}")
    assert ("TANDEM_API_KEY" in head_env) == bool(values["secrets"]["apiKey"] or
                                                 values["secrets"]["apiKeyExistingSecret"]["name"])
    for name in ("TANDEM_CLUSTER_SECRET", "RAY_AUTH_TOKEN"):
        assert "secretKeyRef" in head_env[name]["valueFrom"]
    # every Ray process authenticates with the same token: head, workers and the autoscaler
    cluster = one(docs, "RayCluster")
    token_refs = [{e["name"]: e for e in env}["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]
                  for env in [cluster["spec"]["autoscalerOptions"]["env"],
                              *(c["env"] for name, t in templates.items() if name != "redis"
                                for c in t["spec"]["containers"])]]
    assert len({(r["name"], r["key"]) for r in token_refs}) == 1, token_refs
    for ref in token_refs:
        assert ref["key"] in chart_secrets.get(ref["name"], ()) or (ref["name"], ref["key"]) in existing


def _check_exposure(docs, values, router, templates) -> None:
    router_ports = {p["name"] for p in router["spec"]["ports"]}
    for ingress in (d for d in docs if d["kind"] == "Ingress"):
        for rule in ingress["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                assert path["backend"]["service"]["name"] == router["metadata"]["name"]
                assert path["backend"]["service"]["port"]["name"] in router_ports
    for route in (d for d in docs if d["kind"] == "HTTPRoute"):
        for backend in (b for rule in route["spec"]["rules"] for b in rule["backendRefs"]):
            assert backend["name"] == router["metadata"]["name"]
            assert backend["port"] in {p["port"] for p in router["spec"]["ports"]}
    for monitor in (d for d in docs if d["kind"] == "ServiceMonitor"):
        assert _matches(monitor["spec"]["selector"]["matchLabels"], router["metadata"]["labels"])
        assert all(e["port"] in router_ports and e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
    for dashboard in (d for d in docs if d["kind"] == "ConfigMap" and "tandem-dashboard.json" in d["data"]):
        shipped = json.loads((ROOT / "deploy/grafana/tandem-dashboard.json").read_text())
        assert json.loads(dashboard["data"]["tandem-dashboard.json"]) == shipped
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert bool(policies) == values["networkPolicy"]["enabled"]
    if policies:
        # every pod of the release is covered; only the router's HTTP and gRPC ports are open beyond it
        for component, template in templates.items():
            covering = [p for p in policies if _matches(p["spec"]["podSelector"]["matchLabels"],
                                                        template["metadata"]["labels"])]
            assert covering, f"no NetworkPolicy covers {component}"
            for policy in covering:
                for rule in policy["spec"]["ingress"]:
                    internal = rule.get("from") and all(
                        "podSelector" in peer and "namespaceSelector" not in peer for peer in rule["from"])
                    if internal:
                        assert all(_matches(peer["podSelector"]["matchLabels"], template["metadata"]["labels"])
                                   or peer["podSelector"]["matchLabels"].items() <=
                                   template["metadata"]["labels"].items() for peer in rule["from"])
                    else:
                        assert component == "router", f"{component} takes traffic from outside the release"
                        ports = {p["port"] for p in rule["ports"]}
                        assert ports <= {"http", "grpc"} and ports <= set(_container_ports(template))


# -- the tandem commands in the chart ------------------------------------------------------------
@pytest.mark.parametrize("scenario", [None, *_ids(SCENARIOS)], ids=["defaults", *_ids(SCENARIOS)])
def test_the_router_command_parses_with_the_real_cli_and_follows_the_values(scenario):
    docs = rendered(scenario)
    values = merged_values(*([CHART / "ci" / f"{scenario}.yaml"] if scenario else []))
    args = build_parser().parse_args(serve_argv(docs))
    assert args.func.__name__ == "run_serve" and args.ray_address == "127.0.0.1:6379"
    assert (args.model, args.dtype, args.mode) == (values["model"]["name"], values["model"]["dtype"],
                                                   values["serve"]["mode"])
    assert args.served_model_name == (values["model"]["servedModelName"] or None)
    assert args.otlp_endpoint == (values["telemetry"]["otlpEndpoint"] or None)
    scaling = values["autoscaling"]
    assert (args.prefill_queue_target, args.decode_queue_target, args.scale_up_window, args.scale_down_window,
            args.autoscale_interval) == (scaling["prefillQueueTarget"], scaling["decodeQueueTarget"],
                                         scaling["scaleUpWindowSeconds"], scaling["scaleDownWindowSeconds"],
                                         scaling["intervalSeconds"])
    assert args.kv_transport == values["serve"]["kvTransport"] and args.max_num_seqs == values["serve"]["maxNumSeqs"]
    assert (args.device, args.attention_backend, args.gpu_memory_utilization, args.enforce_eager) == (
        values["serve"]["device"], values["serve"]["attentionBackend"], values["serve"]["gpuMemoryUtilization"],
        values["serve"]["enforceEager"])
    for group in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]:
        assert "$KUBERAY_GEN_RAY_START_CMD" in group["template"]["spec"]["containers"][0]["args"][-1]


@pytest.mark.parametrize("scenario", [None, *_ids(SCENARIOS)], ids=["defaults", *_ids(SCENARIOS)])
def test_the_router_runs_in_its_own_container_beside_the_ray_head(scenario):
    """A router crash restarts only the router's container: Ray's head (KubeRay's `ray start`,
    blocking, as the first container, where KubeRay puts its command) keeps running, and so do
    the detached workers the restarted router attaches to."""
    docs = rendered(scenario)
    containers = head_containers(docs)
    assert list(containers) == ["ray-head", "router"]
    ray_head, router = containers["ray-head"], containers["router"]
    assert ray_head["args"][-1].endswith('eval "exec $KUBERAY_GEN_RAY_START_CMD"')  # --block kept: its main process
    assert "tandem" not in ray_head["args"][-1] and not any(k in ray_head for k in ("livenessProbe", "startupProbe"))
    script = router["args"][-1]
    assert "KUBERAY_GEN_RAY_START_CMD" not in script
    assert script.startswith("until (exec 3<>/dev/tcp/127.0.0.1/6379)")  # waits for the head's GCS
    gcs = {p["name"]: p["containerPort"] for p in ray_head["ports"]}["gcs"]
    assert build_parser().parse_args(serve_argv(docs)).ray_address == f"127.0.0.1:{gcs}"
    assert {p["name"] for p in router["ports"]} == {"http", "grpc"}
    # the driver reaches the raylet through its sockets under /tmp/ray: one volume, both containers
    mounts = [{m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (ray_head, router)]
    assert mounts[0]["tmp"] == mounts[1]["tmp"] == "/tmp"
    ray_env = {e["name"] for e in ray_head["env"]}
    assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} <= ray_env and "TANDEM_CLUSTER_SECRET" not in ray_env
    values = merged_values(*([CHART / "ci" / f"{scenario}.yaml"] if scenario else []))
    assert router["resources"] == values["router"]["resources"]
    assert ray_head["resources"] == values["router"]["rayHeadResources"]


def test_extra_args_must_be_real_flags(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("serve: {extraArgs: ['--num-kv-blocks', '4096']}\n")
    assert build_parser().parse_args(serve_argv(tuple(
        d for d in yaml.safe_load_all(helm_template(good).stdout) if d))).num_kv_blocks == 4096
    for wrong in ("--num-kv-blockz", "--num-kv-block"):  # a typo, and an abbreviation (refused too)
        bad = tmp_path / "bad.yaml"
        bad.write_text(f"serve: {{extraArgs: ['{wrong}', '4096']}}\n")
        with pytest.raises(SystemExit):
            build_parser().parse_args(serve_argv(tuple(d for d in yaml.safe_load_all(helm_template(bad).stdout) if d)))


def test_secrets_given_as_values_land_in_the_chart_secret_and_generated_ones_are_random():
    docs = rendered("ingress")
    import base64

    data = {k: base64.b64decode(v).decode() for k, v in one(docs, "Secret")["data"].items()}
    assert data["api-key"] == "change-me-to-a-long-random-key"
    assert len(data["cluster-secret"]) == 48 and len(data["ray-auth-token"]) == 48
    assert re.fullmatch(r"[A-Za-z0-9]{48}", data["redis-password"])
    assert len({data["cluster-secret"], data["ray-auth-token"], data["redis-password"]}) == 3
    external = rendered("external-redis")
    assert not [d for d in external if d["kind"] == "Secret"]  # every secret is one of yours


def test_traffic_classes_reach_the_router_as_a_mounted_file_it_can_load(tmp_path):
    """serve.trafficClasses becomes a ConfigMap mounted where the router's --traffic-classes
    points, and what it holds is what router/traffic.py loads; without it, no ConfigMap."""
    from router.traffic import load_traffic_classes

    docs = rendered("colocated-cpu")
    values = merged_values(CHART / "ci" / "colocated-cpu.yaml")
    args = build_parser().parse_args(serve_argv(docs))
    assert args.scheduling_policy == "priority"
    config_map = one(docs, "ConfigMap", "rel-tandem-traffic-classes")
    router = head_containers(docs)["router"]
    mount = next(m for m in router["volumeMounts"] if m["name"] == "traffic-classes")
    assert args.traffic_classes == mount["mountPath"] + "/classes.yaml"
    cluster = one(docs, "RayCluster")
    volume = next(v for v in cluster["spec"]["headGroupSpec"]["template"]["spec"]["volumes"]
                  if v["name"] == "traffic-classes")
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    path = tmp_path / "classes.yaml"
    path.write_text(config_map["data"]["classes.yaml"])
    classes = load_traffic_classes(path, args.scheduling_policy)
    assert {name: (c.priority, c.ttft_ms, c.sheddable) for name, c in classes.classes.items() if name != "default"} \
        == {name: (c["priority"], c["ttft_ms"], c.get("sheddable", False))
            for name, c in values["serve"]["trafficClasses"].items()}
    plain = build_parser().parse_args(serve_argv(rendered(None)))
    assert plain.traffic_classes is None and plain.scheduling_policy == "fcfs"
    assert not [d for d in rendered(None) if d["kind"] == "ConfigMap" and "traffic" in d["metadata"]["name"]]
