"""The one conversion between the worker protos and the engine's types, done at the edge:
sampling parameters both ways, engine outputs to stream chunks, an engine's counters to its
Stats reply."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from engine.outputs import PositionLogprobs
from engine.sampling_params import SamplingParams
from engine.step_budget import CHUNK_TOKEN_BUCKETS
from proto import worker_pb2 as pb
from proto.sampling import sampling_from_proto, sampling_to_proto

if TYPE_CHECKING:
    from engine.engine_core import EngineCore, EngineCoreOutput

def params_from_proto(message: pb.SamplingParams) -> SamplingParams:
    """Unset optional fields keep vLLM's defaults (an unset max_tokens: up to the context
    length); raises ValueError on invalid values."""
    return SamplingParams(**{"max_tokens": None, **sampling_from_proto(message)})


def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    return sampling_to_proto(params)


def position_to_proto(position: PositionLogprobs | None) -> pb.PositionLogprobs:
    message = pb.PositionLogprobs()
    for token_id, entry in (position or {}).items():
        message.entries.add(token_id=token_id, logprob=entry.logprob, rank=entry.rank,
                            decoded_token=entry.decoded_token or "")
    return message


def output_to_chunk(output: EngineCoreOutput, num_prompt_tokens: int) -> pb.GenerateChunk:
    chunk = pb.GenerateChunk(
        token_ids=output.new_token_ids, text_delta=output.text_delta,
        logprobs=[position_to_proto(p) for p in output.new_logprobs],
        prompt_logprobs=[position_to_proto(p) for p in output.new_prompt_logprobs],
        finish_reason=output.finish_reason or "", num_prompt_tokens=num_prompt_tokens,
        num_cached_tokens=output.num_cached_tokens, kv_recomputed=output.kv_recomputed,
        num_preemptions=output.num_preemptions,
    )
    if isinstance(output.stop_reason, str):
        chunk.stop_string = output.stop_reason
    elif output.stop_reason is not None:
        chunk.stop_token_id = output.stop_reason
    return chunk


def worker_stats(core: EngineCore, role: str, address: str, kv_bytes_sent: int = 0,
                 num_held_transfers: int = 0, prefix_incarnation: str = "") -> pb.WorkerStats:
    scheduler, pool, counters = core.scheduler, core.block_pool, core.counters
    tradeoff = scheduler.step_budget.tradeoff
    return pb.WorkerStats(
        role=role, address=address, num_kv_blocks=pool.num_blocks, num_free_kv_blocks=pool.num_free_blocks,
        num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_waiting_for_remote_kv=core.num_waiting_for_remote_kv(), num_in_lane=core.num_in_lane(),
        num_prompt_tokens_computed=counters.num_prompt_tokens_computed,
        num_generation_tokens=counters.num_generation_tokens,
        kv_bytes_received=core.kv_importer.num_bytes_received, kv_bytes_sent=kv_bytes_sent,
        num_kv_recomputed=counters.num_kv_recomputed, num_kv_failed=counters.num_kv_failed,
        num_held_transfers=num_held_transfers, max_num_running=counters.max_num_running,
        prefix_namespace=core.kv_manager.namespace, prefix_incarnation=prefix_incarnation,
        block_size=core.kv_manager.block_size, num_preemptions=scheduler.num_preemptions,
        prefix_cache_queried_tokens=core.kv_manager.stats.num_queried_tokens,
        prefix_cache_hit_tokens=core.kv_manager.stats.num_hit_tokens,
        prefill_chunk_bounds=CHUNK_TOKEN_BUCKETS, prefill_chunk_counts=list(scheduler.step_budget.chunk_counts),
        prefill_chunk_tokens_sum=scheduler.step_budget.chunk_sum, max_num_seqs=scheduler.config.max_num_seqs,
        num_lane_prompts=counters.num_lane_prompts, num_lane_prompt_tokens=counters.num_lane_prompt_tokens,
        lane_busy_ms=round(counters.lane_busy_s * 1000), stream_pace_ms=core.stream_pace_ms(),
        num_lane_layers_helped=counters.lane_layers_helped,
        lane_ms_per_token=(core.lane.ms_per_token if core.lane is not None else None) or 0.0,
        lane_slowdown=tradeoff.slowdown or 0.0, step_ms_per_prompt_token=tradeoff.step_ms_per_token or 0.0,
        step_ms_per_prompt_token_beside=tradeoff.step_ms_per_token_beside or 0.0,
        **dataclasses.asdict(scheduler.step_budget.totals),
    )
