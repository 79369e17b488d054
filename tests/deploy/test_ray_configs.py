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
from cluster.cli import build_parser

ROOT = Path(__file__).parents[2]


def serve_commands(text: str) -> list[list[str]]:
    """Every `tandem serve ...` in a shell string, as argv after `tandem`."""
    found = []
    for segment in re.split(r";|&&|\n", text):
        words = shlex.split(segment.replace(">", " > ").replace("&", " & "))
        if words[:1] == ["nohup"]:
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


def test_kuberay_raycluster():
    cluster = yaml.safe_load((ROOT / "deploy/kuberay/raycluster.yaml").read_text())
    assert (cluster["apiVersion"], cluster["kind"]) == ("ray.io/v1", "RayCluster")
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    command = head["lifecycle"]["postStart"]["exec"]["command"][-1]
    (serve,) = serve_commands(command)
    args = _parse(serve)
    assert args.ray_address == "auto"
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
        env = {e["name"]: e for e in container["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token" and env["RAY_worker_niceness"]["value"] == "0"
        assert env["TANDEM_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "tandem-secrets"
