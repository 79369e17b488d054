"""The cluster collector: per-worker metrics from each worker's last Stats."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, generate_latest

from proto import worker_pb2 as pb
from telemetry.metrics import ClusterCollector


def _worker(role: str, address: str, **stats) -> SimpleNamespace:
    return SimpleNamespace(role=role, address=address, healthy=True, stats=pb.WorkerStats(role=role, **stats))


def test_cluster_metrics_come_from_each_workers_stats():
    pool = SimpleNamespace(
        decode=[_worker("decode", "10.0.0.1:7000", num_kv_blocks=100, num_free_kv_blocks=75, num_waiting=2,
                        num_waiting_for_remote_kv=1, num_kv_recomputed=3, num_kv_failed=2, kv_bytes_received=4096)],
        prefill=[_worker("prefill", "10.0.0.2:7000", num_kv_blocks=50, num_free_kv_blocks=50, kv_bytes_sent=8192,
                         prefix_cache_queried_tokens=40, prefix_cache_hit_tokens=16),
                 SimpleNamespace(role="prefill", address="10.0.0.3:7000", healthy=False, stats=None)])
    registry = CollectorRegistry()
    registry.register(ClusterCollector(pool, "m"))
    text = generate_latest(registry).decode()
    decode = 'model_name="m",role="decode",worker="10.0.0.1:7000"'
    prefill = 'model_name="m",role="prefill",worker="10.0.0.2:7000"'
    assert f"tandem:kv_cache_usage_perc{{{decode}}} 0.25" in text
    assert f"tandem:kv_cache_usage_perc{{{prefill}}} 0.0" in text
    assert f"tandem:num_requests_waiting{{{decode}}} 3.0" in text
    assert f"tandem:kv_transfer_failures_total{{{decode}}} 5.0" in text  # recomputed + failed
    assert "tandem:kv_transfer_failures_total{" + prefill not in text  # decode workers only
    assert f"tandem:kv_transfer_bytes_total{{{decode}}} 4096.0" in text
    assert f"tandem:kv_transfer_bytes_total{{{prefill}}} 8192.0" in text
    assert f"tandem:prefix_cache_hits_total{{{prefill}}} 16.0" in text
    assert 'tandem:worker_healthy{address="10.0.0.3:7000",role="prefill"} 0.0' in text
    assert "10.0.0.3:7000" not in text.split("tandem:worker_healthy")[0]  # no Stats yet: no cluster series


def test_every_numeric_stats_field_of_a_worker_is_exported():
    """A field added to WorkerStats reaches /metrics as ``tandem:worker_<field>`` (the
    collector's list), apart from those exported under DESIGN.md's own names (preemptions, the
    prefix cache, the chunk histogram) and the block size (a setting, not a measure)."""
    elsewhere = {"num_preemptions", "prefix_cache_queried_tokens", "prefix_cache_hit_tokens",
                 "prefill_chunk_tokens_sum", "block_size"}
    numeric = {field.name for field in pb.WorkerStats.DESCRIPTOR.fields
               if field.type not in (field.TYPE_STRING, field.TYPE_BYTES) and not field.is_repeated}
    assert numeric - elsewhere <= set(ClusterCollector._FIELDS), numeric - elsewhere - set(ClusterCollector._FIELDS)
    pool = SimpleNamespace(decode=[_worker("decode", "10.0.0.1:7000", step_ms_per_prompt_token_beside=0.75)],
                           prefill=[])
    registry = CollectorRegistry()
    registry.register(ClusterCollector(pool, "m"))
    text = generate_latest(registry).decode()
    assert 'tandem:worker_step_ms_per_prompt_token_beside{address="10.0.0.1:7000",role="decode"} 0.75' in text
