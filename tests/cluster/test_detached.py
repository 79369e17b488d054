"""The pieces of workers that outlive their router (cluster/detached.py) that need no cluster:
namespaces, the record a later router reads, the configuration fingerprint, and the worker
server's idle clock that --orphan-timeout reads. The live behaviour is
tests/chaos/test_router_restart.py's."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import grpc

from cluster.detached import ClusterRecord, cluster_namespace, config_fingerprint
from engine.llm import EngineArgs
from proto.rpc import SECRET_METADATA_KEY
from worker_runtime.server import _SecretCheck


def test_namespaces_are_per_served_name_and_never_shared():
    assert cluster_namespace("smollm2-135m-instruct") == "tandem-smollm2-135m-instruct"
    names = ["org/model", "org-model", "Org-Model", "org model"]
    spaces = {cluster_namespace(name) for name in names}
    assert len(spaces) == len(names)
    assert all(space.startswith("tandem-") and " " not in space and "/" not in space for space in spaces)


def test_the_record_round_trips_and_a_bad_one_reads_as_none():
    record = ClusterRecord("s3cret", "redis://:pw@127.0.0.1:1/0", "abc")
    assert ClusterRecord.loads(record.dumps()) == record
    for bad in (None, b"", b"not json", b"[1, 2]", b'{"secret": "x"}'):
        assert ClusterRecord.loads(bad) is None


def test_the_fingerprint_changes_with_what_the_workers_were_started_with():
    engine = EngineArgs(model="/m", dtype="float32", max_model_len=1024)
    same = config_fingerprint(engine, "disagg", {"decode": 0.0}, None)
    assert same == config_fingerprint(replace(engine), "disagg", {"decode": 0.0}, None)
    others = [config_fingerprint(replace(engine, max_model_len=2048), "disagg", {"decode": 0.0}, None),
              config_fingerprint(engine, "colocated", {"decode": 0.0}, None),
              config_fingerprint(engine, "disagg", {"decode": 1.0}, None),
              config_fingerprint(engine, "disagg", {"decode": 0.0}, "redis://elsewhere")]
    assert same not in others and len(set(others)) == len(others)


def test_only_calls_with_the_secret_count_as_a_router_calling():
    check = _SecretCheck("right")
    handler = grpc.unary_unary_rpc_method_handler(lambda request, context: None)

    async def call(method: str, secret: str | None) -> None:
        metadata = ((SECRET_METADATA_KEY, secret),) if secret is not None else ()

        async def continuation(details):
            return handler

        await check.intercept_service(continuation, SimpleNamespace(method=method, invocation_metadata=metadata))

    check.last_call = 0.0
    for method, secret in (("/grpc.health.v1.Health/Check", None), ("/tandem.Decode/Stats", "wrong"),
                           ("/tandem.Decode/Stats", None)):
        asyncio.run(call(method, secret))
        assert check.last_call == 0.0, (method, secret)
    asyncio.run(call("/tandem.Decode/Stats", "right"))
    assert check.last_call > 0.0
