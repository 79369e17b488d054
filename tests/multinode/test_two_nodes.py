"""A two-node cluster (issue 25): the router and one role's worker on the host, the other role's
worker on a second node (a network namespace behind a veth link), then the other way round.

What must hold across the link: `--mode auto` sees two nodes and disaggregates; each worker
advertises the address the other node reaches it by (its node's link address, not
127.0.0.1); KV crosses the link over gRPC and over torch.distributed (gloo), checksummed,
with the cluster secret, and the answers equal the single-node engine's; both workers
publish to the prefix index, whose private Redis listens on the host's link address only;
the spans of the router and of both workers join one trace. The second router of each
direction (``--kv-transport torch``) attaches to the workers the first left behind (they are
detached under ``--ray-address``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.parse

import httpx
import openai
import psutil
import pytest
import redis

from engine import SamplingParams
from tests.multinode.conftest import two_nodes, worker_addresses
from tests.reference import EqualityStats, assert_same_tokens_as_text
from tests.workers import wait_until

MODEL = "smollm2-135m-instruct"
PROMPTS = {  # fresh prompts per transport (a prompt the decode worker has cached needs no KV), each longer
    # than a KV block or two, so that both workers hold full blocks to publish to the prefix index
    "grpc": ["The history of the printing press begins in the workshops of fifteenth-century Mainz, where a "
             "goldsmith named Johannes Gutenberg combined movable metal type with an oil-based ink and",
             "def quicksort(items):\n    \"\"\"Sort a list of numbers in ascending order by choosing a pivot, "
             "splitting the rest into smaller and larger parts, and sorting each part.\"\"\"\n    "],
    "torch": ["Rivers carry sediment from the mountains down to the sea, where it settles in deltas that grow "
              "a little every year; over centuries these deltas become farmland, and",
              "A recipe for a simple loaf of bread needs flour, water, salt and yeast; mix them, knead the dough "
              "for ten minutes, let it rise for an hour, and then"],
}


def assert_answers_equal_engine(server, llm, prompts: list[str], stats: EqualityStats) -> None:
    api = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    completion = api.completions.create(model=MODEL, prompt=prompts, max_tokens=16, temperature=0, logprobs=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    for choice, reference in zip(sorted(completion.choices, key=lambda c: c.index), llm.generate(prompts, greedy)):
        assert_same_tokens_as_text(choice.logprobs.tokens, reference.outputs[0], stats, label=choice.text)
        assert choice.text == reference.outputs[0].text
    # streamed: every token crossed the link on the decode worker's stream
    reference = llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=24))[0].outputs[0]
    events = list(api.completions.create(model=MODEL, prompt=prompts[0], max_tokens=24, temperature=0, stream=True))
    assert "".join(event.choices[0].text for event in events if event.choices) == reference.text


RECORD = """
import sys, ray
from cluster.detached import cluster_namespace, read_record
ray.init(address=sys.argv[1], namespace=cluster_namespace(sys.argv[2]), logging_level="error")
print(read_record(cluster_namespace(sys.argv[2])).redis_url)
"""


def index_url(cluster) -> str:
    """The prefix index's Redis URL from the cluster's record in Ray (what a router reads),
    through a driver of its own."""
    done = subprocess.run([sys.executable, "-c", RECORD, cluster.head.address, MODEL], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **cluster.head.join_env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def listening(cluster, port: int) -> list[str]:
    """The addresses a process under the head listens on at ``port``."""
    found = []
    for process in cluster.head.processes():
        try:
            found += [c.laddr.ip for c in process.net_connections("tcp")
                      if c.status == psutil.CONN_LISTEN and c.laddr.port == port]
        except psutil.NoSuchProcess:
            continue
    return found


def assert_both_nodes_publish(cluster, addresses: dict[str, list[str]]) -> None:
    url = urllib.parse.urlsplit(index_url(cluster))
    assert url.hostname == cluster.link.host_ip  # the address the other node reaches it by
    assert listening(cluster, url.port) == [cluster.link.host_ip]  # and only there, not on loopback
    host, port, password = url.hostname, url.port, url.password
    client = redis.Redis(host=host, port=port, password=password, socket_timeout=5)
    try:
        owners = {key.decode().split(":blocks:", 1)[1] for key in client.scan_iter("tandem:prefix:*:blocks:*")
                  if client.scard(key)}
    finally:
        client.close()
    for role in ("prefill", "decode"):  # each worker's id is its address; its blocks arrived over the link or not
        assert any(owner.startswith(addresses[role][0] + ":") for owner in owners), (role, owners)


def assert_one_trace_over_both_nodes(cluster, server, request_id: str) -> None:
    reply = httpx.post(f"{server.base_url}/v1/completions", timeout=120, headers={"X-Request-Id": request_id}, json={
        "model": MODEL, "prompt": "A trace across two nodes starts", "max_tokens": 4, "temperature": 0})
    assert reply.status_code == 200, reply.text

    def joined(receiver):
        roots = [s for s in receiver.spans if s.attributes.get("tandem.request_id") == request_id
                 and not s.parent_span_id]
        if not roots:
            return None
        trace = receiver.trace(roots[0].trace_id)
        return trace if {"tandem-router", "tandem-prefill", "tandem-decode"} <= {s.service for s in trace} else None

    trace = cluster.receiver.wait_for(joined, timeout_s=60, what="router, prefill and decode spans in one trace")
    workers = {s.service: s.attributes["tandem.worker"] for s in trace if "tandem.worker" in s.attributes}
    ips = {cluster.remote_role: cluster.link.ns_ip, cluster.local_role: cluster.link.host_ip}
    for role, ip in ips.items():  # each from the node its worker runs on
        assert workers[f"tandem-{role}"].startswith(ip + ":"), workers


@pytest.mark.parametrize("remote_role", ["decode", "prefill"])
def test_two_node_cluster_answers_as_one_engine(remote_role, namespaces, smollm_dir, llm):
    stats = EqualityStats()
    with two_nodes(remote_role) as cluster:
        first = cluster.serve(smollm_dir, "--kv-transport", "grpc")
        second = None
        try:
            assert first.mode == "disagg", "".join(first.log[-20:])  # auto: two nodes can hold workers
            addresses = worker_addresses(first)
            ips = {cluster.remote_role: cluster.link.ns_ip, cluster.local_role: cluster.link.host_ip}
            for role, ip in ips.items():  # advertised where the other node reaches it
                assert len(addresses[role]) == 1 and addresses[role][0].startswith(ip + ":"), addresses

            assert_answers_equal_engine(first, llm, PROMPTS["grpc"], stats)
            # the router polls each worker's Stats apart (every 0.5 s): once both snapshots are of
            # after the last transfer, every byte sent has arrived
            def all_sent_arrived() -> bool:
                received = first.metric("kv_bytes_received", "decode")
                return received > 0 and first.metric("kv_bytes_sent", "prefill") == received

            wait_until(all_sent_arrived, timeout_s=10, what="the decode worker to have received every KV byte sent")
            assert first.metric("num_prompt_tokens_computed", "decode") == 0  # every prompt came as KV
            assert_both_nodes_publish(cluster, addresses)
            assert_one_trace_over_both_nodes(cluster, first, f"two-nodes-{remote_role}")

            # a second router, KV over torch.distributed (gloo) between the nodes: it attaches
            # to the workers the first one left (detached), by their link addresses
            first.process.kill()
            first.process.wait(30)
            began = time.monotonic()
            second = cluster.serve(smollm_dir, "--kv-transport", "torch")
            assert any("attached to 2 live workers" in line for line in second.log), "".join(second.log[-20:])
            print(f"{remote_role} across the link: a second router attached in {time.monotonic() - began:.1f} s")
            assert worker_addresses(second) == addresses
            before = second.metric("kv_bytes_received", "decode")
            assert_answers_equal_engine(second, llm, PROMPTS["torch"], stats)
            assert second.metric("kv_bytes_received", "decode") > before
            assert second.metric("num_kv_failed", "decode") == second.metric("num_kv_recomputed", "decode") == 0
            assert second.metric("num_prompt_tokens_computed", "decode") == 0
            for role in ("prefill", "decode"):  # nothing held once the answers are in
                assert second.metric("num_held_transfers", role) == 0
            print(f"token-equality: {stats.compared} sequences, near-tie rule fired {stats.near_ties} times")
            assert stats.near_ties <= 1
        finally:
            for server in (first, second):
                if server is not None and server.process.poll() is None:
                    server.stop()
