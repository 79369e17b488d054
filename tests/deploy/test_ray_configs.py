"""The Ray cluster configs in deploy/ (cluster launcher for VMs, KubeRay RayCluster): they
parse, their node types / worker groups offer exactly the custom resources tandem's worker
actors ask for, Ray runs with token auth and niceness 0, ports line up, and every
`tandem serve` command in them parses with the real command-line parser."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import yaml

from cluster.actors import ROLES
from cluster.autoscale import PoolSize
from cluster.cli import build_parser

ROOT = Path(__file__).parents[2]


def serve_commands(text: str) -> list[list[str]]:
    """Every `tandem serve ...` in a shell string, as argv after `tandem`."""
    found = []
    for segment in re.split(r";|&&|\n", text):
        if "tandem serve" not in segment:
            continue
        words = shlex.split(segment.replace(">", " > ").replace("&", " & "))
        if words[:1] in (["nohup"], ["exec"]):
            words = words[1:]
        if words[:2] == ["tandem", "serve"]:
            found.append(words[1:words.index(">")] if ">" in words else words[1:])
    return found


def _parse(argv: list[str]):
    return build_parser().parse_args(argv)


def test_cluster_launcher_config():
    config = yaml.safe_load((ROOT / "deploy/ray/cluster-launcher.yaml").read_text())
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    for role in ROLES:
        node = types[role]
        assert node["resources"] == {role: 1}
        assert 1 <= node["min_workers"] <= node["max_workers"] <= config["max_workers"]
    assert set(types[config["head_node_type"]]["resources"].values()) == {0}
    starts = config["head_start_ray_commands"] + config["worker_start_ray_commands"]
    for command in (c for c in starts if "ray start" in c):
        assert "RAY_AUTH_MODE=token" in command and "RAY_worker_niceness=0" in command
    (serve,) = [argv for command in config["head_start_ray_commands"] for argv in serve_commands(command)]
    args = _parse(serve)
    assert args.ray_address == "auto" and args.mode == "disagg"
    for role in ROLES:  # the router's pool bounds are the node types' (one worker per node)
        assert getattr(args, f"{role}_workers") == PoolSize(types[role]["min_workers"], types[role]["max_workers"])
    # a prefix index every node reaches (not the private loopback Redis), on the port that Redis listens on
    commands = " ".join(config["head_start_ray_commands"])
    url_port = re.search(r'TANDEM_REDIS_URL="redis://:[^@]+@[^:]+:(\d+)/', commands).group(1)
    assert f"redis-server --port {url_port} --bind 0.0.0.0" in commands and "--requirepass" in commands


def test_kuberay_raycluster():
    cluster = yaml.safe_load((ROOT / "deploy/kuberay/raycluster.yaml").read_text())
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    autoscaler_env = {e["name"]: e for e in spec["autoscalerOptions"]["env"]}
    assert autoscaler_env["RAY_AUTH_MODE"]["value"] == "token"
    assert autoscaler_env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "tandem-secrets"
    ray_head, head = spec["headGroupSpec"]["template"]["spec"]["containers"]
    assert cluster["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    # Ray's head in its own (first) container; the router in its own, so that its crash restarts only it
    assert ray_head["name"] == "ray-head" and ray_head["args"][-1].endswith('eval "exec $KUBERAY_GEN_RAY_START_CMD"')
    script = head["args"][-1]
    (serve,) = serve_commands(script)
    args = _parse(serve)
    gcs = {p["name"]: p["containerPort"] for p in ray_head["ports"]}["gcs"]
    assert args.ray_address == f"127.0.0.1:{gcs}" and f"/dev/tcp/127.0.0.1/{gcs}" in script
    assert {"name": "tmp", "mountPath": "/tmp"} in ray_head["volumeMounts"] and \
        {"name": "tmp", "mountPath": "/tmp"} in head["volumeMounts"]  # the raylet's sockets, shared
    pod = spec["headGroupSpec"]["template"]["spec"]
    pause = head["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= pause + args.drain_timeout
    assert ray_head["lifecycle"]["preStop"]["sleep"]["seconds"] >= pause + args.drain_timeout  # the head outlives
    assert pod["terminationGracePeriodSeconds"] >= ray_head["lifecycle"]["preStop"]["sleep"]["seconds"]
    head_ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert (head_ports["http"], head_ports["grpc"]) == (args.port, args.grpc_port)
    assert head["readinessProbe"]["httpGet"] == {"path": "/ready", "port": args.port}
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == set(ROLES)
    for role, group in groups.items():
        assert json.loads(json.loads(group["rayStartParams"]["resources"])) == {role: 1}
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        pod = group["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (container,) = pod["containers"]
        resources = container["resources"]
        assert resources["requests"] == resources["limits"], "GPU requests equal limits"
        assert {p["containerPort"] for p in container["ports"]} == {args.worker_port}
        assert container["readinessProbe"]["grpc"]["port"] == args.worker_port
        assert "$KUBERAY_GEN_RAY_START_CMD" in container["args"][-1]
        assert getattr(args, f"{role}_workers") == PoolSize(group["minReplicas"], group["maxReplicas"])
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token" and env["RAY_worker_niceness"]["value"] == "0"
        assert env["TANDEM_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "tandem-secrets"


def test_kuberay_pod_templates_validate_with_kubernetes_validate():
    import jsonschema

    from tests.deploy.test_helm_chart import (
        KUBERNETES_VERSIONS,
        RAYCLUSTER_SPEC,
        chart_tool,
    )

    cluster = yaml.safe_load((ROOT / "deploy/kuberay/raycluster.yaml").read_text())
    jsonschema.validate(cluster["spec"], RAYCLUSTER_SPEC)
    templates = [cluster["spec"]["headGroupSpec"]["template"]]
    templates += [group["template"] for group in cluster["spec"]["workerGroupSpecs"]]
    objects = [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"t{i}"}, "template": template}
               for i, template in enumerate(templates)]
    for version in KUBERNETES_VERSIONS:
        results = chart_tool("validate", version, stdin=json.dumps(objects))
        assert all(r["ok"] for r in results) and len(results) == 3, results
