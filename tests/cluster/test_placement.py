"""`--mode auto`'s choice from what `ray.nodes()` reports (entries shaped as Ray returns them)."""

from __future__ import annotations

import pytest

from cluster.placement import choose_mode, default_worker_threads, worker_nodes


def node(cpus=2.0, gpus=0.0, alive=True, roles=("prefill", "decode")) -> dict:
    resources = {"CPU": cpus, "memory": 8e9, "node:10.0.0.1": 1.0} | {role: 1.0 for role in roles}
    if gpus:
        resources["GPU"] = gpus
    return {"NodeID": "x", "Alive": alive, "NodeManagerAddress": "10.0.0.1", "Resources": resources}


def choose(nodes, cluster_gpus=0.0, prefill_gpus=0.0, decode_gpus=0.0, prefill_workers=1, decode_workers=1,
           requested="auto"):
    return choose_mode(requested, nodes, cluster_gpus, prefill_gpus, decode_gpus, prefill_workers, decode_workers)


def test_one_cpu_node_is_colocated():
    choice = choose([node()])
    assert choice.mode == "colocated" and "one node's CPU cores" in choice.reason


def test_nodes_of_their_own_are_disaggregated():
    head = node(roles=())  # the Ray head holds no worker (the Helm chart's head pod)
    choice = choose([head, node(roles=("prefill",)), node(roles=("decode",))])
    assert choice.mode == "disagg" and "2 Ray nodes" in choice.reason
    # a dead node does not count; a head without worker resources does not either
    assert choose([head, node(roles=("decode",)), node(roles=("prefill",), alive=False)]).mode == "colocated"


def test_a_gpu_per_worker_is_disaggregated_one_shared_gpu_is_not():
    assert choose([node(gpus=2)], cluster_gpus=2, prefill_gpus=1, decode_gpus=1).mode == "disagg"
    shared = choose([node(gpus=1)], cluster_gpus=1, prefill_gpus=1, decode_gpus=1)
    assert shared.mode == "colocated" and "one GPU" in shared.reason
    # fractions of one GPU share it
    assert choose([node(gpus=1)], cluster_gpus=1, prefill_gpus=0.5, decode_gpus=0.5).mode == "colocated"
    # two decode workers and a prefill worker need three
    assert choose([node(gpus=2)], cluster_gpus=2, prefill_gpus=1, decode_gpus=1, decode_workers=2).mode == "colocated"


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_an_explicit_mode_is_kept(mode):
    many = [node(roles=("prefill",)), node(roles=("decode",))]
    assert choose(many, requested=mode).mode == mode == choose([node()], requested=mode).mode


def test_default_threads_share_the_node_between_colocated_workers():
    assert default_worker_threads("colocated", [node(cpus=8)], decode_workers=1) == 8
    assert default_worker_threads("colocated", [node(cpus=8)], decode_workers=3) == 2
    assert default_worker_threads("colocated", [node(cpus=2)], decode_workers=4) == 1
    assert default_worker_threads("disagg", [node(cpus=8)], decode_workers=1) == 1
    assert default_worker_threads("colocated", [node(roles=("decode",)), node(roles=("decode",))], 1) == 1
    assert worker_nodes([node(), node(alive=False)]) == [node()]


def test_serve_defaults_to_auto():
    from cluster.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.mode == "auto" and args.worker_threads is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--mode", "split"])
