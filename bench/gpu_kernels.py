"""The GPU check of tandem's Triton kernels, in one command that needs only torch and triton:

    python bench/gpu_kernels.py            # on a machine with a CUDA GPU
    python bench/gpu_kernels.py --smoke    # anywhere: tiny shapes, interpreted on the CPU

1. Correctness on the device against the dense reference (engine/triton_ops/reference.py):
   paged decode (single pass and split-K), chunked prefill, KV write, KV pack/unpack.
2. Speed, as the median of triton.testing.do_bench:
   - paged decode attention at batch 1/8/64 and context 512/4k/32k, as achieved bandwidth (the
     K/V bytes it must read, per second), against the device-to-device copy bandwidth measured
     in the same run (bytes read + bytes written, per second). Target: >= 70% at 4k x 64.
   - KV pack and unpack of one request (4k tokens, all layers) against a copy of the same bytes.
     Target: >= 80%.
It prints one table. NCCL point-to-point between two ranks cannot be checked on one GPU (NCCL
refuses two ranks on one device); the script says so rather than fake it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "engine" not in sys.modules:  # the kernels without the rest of tandem (its package __init__ loads the engine)
    package = types.ModuleType("engine")
    package.__path__ = [str(ROOT / "engine")]
    sys.modules["engine"] = package

import torch  # noqa: E402

# model shape for the timings: Llama-3-8B's attention (32 query heads, 8 KV heads, head_dim 128)
HEADS, KV_HEADS, HEAD_DIM, LAYERS, BLOCK = 32, 8, 128, 32, 16


def check_correctness(device: str, smoke: bool) -> list[tuple[str, float, float]]:
    from engine.triton_ops.kv_pack import pack_kv_blocks, unpack_kv_blocks
    from engine.triton_ops.kv_write import write_kv
    from engine.triton_ops.paged_decode import paged_decode_attention
    from engine.triton_ops.paged_prefill import paged_prefill_attention
    from engine.triton_ops.reference import (
        ERROR_BOUND,
        PagedCache,
        decode_reference,
        prefill_reference,
        rel_error,
    )

    rows = []
    dtypes = [torch.float16, torch.bfloat16] + ([] if smoke else [torch.float32])
    for dtype in dtypes:
        for group, head_dim, splits in ((1, 64, 1), (4, 128, 1), (8, 128, 4)):
            lens = [1, 16, 47, 300] if smoke else [1, 16, 47, 300, 1000, 4099]
            paged = PagedCache(lens, BLOCK, 2, head_dim, dtype, seed=group, device=device)
            query = torch.randn(len(lens), 2 * group, head_dim, device=device).to(dtype)
            out = torch.full_like(query, float("nan"))
            paged_decode_attention(query, paged.cache, paged.table_tensor(pad=1), torch.tensor(
                lens, dtype=torch.int32, device=device), out=out, num_splits=splits)
            rows.append((f"decode {str(dtype)[6:]} g{group} d{head_dim} splits {splits}",
                         rel_error(out, decode_reference(query, paged)), ERROR_BOUND[dtype]))
        chunks = [(5, 0), (33, 17), (64, 300)]
        lens = [q + p for q, p in chunks]
        paged = PagedCache(lens, BLOCK, 2, 128, dtype, seed=7, device=device)
        cu = [0]
        for q, _ in chunks:
            cu.append(cu[-1] + q)
        query = torch.randn(cu[-1], 8, 128, device=device).to(dtype)
        out = torch.full_like(query, float("nan"))
        paged_prefill_attention(query, paged.cache, paged.table_tensor(), torch.tensor(lens, dtype=torch.int32,
                                device=device), torch.tensor(cu, dtype=torch.int32, device=device), 64, out=out)
        rows.append((f"prefill {str(dtype)[6:]} g4 d128", rel_error(out, prefill_reference(query, cu, paged)),
                     ERROR_BOUND[dtype]))
        cache = torch.randn(8, BLOCK, 4, 64, device=device).to(dtype)
        expected = cache.clone()
        kv = torch.randn(5, 4, 64, device=device).to(dtype)
        slots = torch.tensor([0, 17, 100, -1, 127], device=device)
        write_kv(kv, cache, slots)
        expected.flatten(0, 1)[slots[slots >= 0]] = kv[slots >= 0]
        rows.append((f"kv_write {str(dtype)[6:]}", float(not torch.equal(cache, expected)), 0.0))
        storage = torch.randn(4, 10, BLOCK, 4, 64, device=device).to(dtype)
        ids = torch.tensor([3, 9, 0], device=device)
        packed = pack_kv_blocks(storage, ids, 1, 4)
        back = torch.zeros_like(storage)
        unpack_kv_blocks(packed, back, ids, 1)
        exact = torch.equal(packed, storage[1:4][:, ids]) and torch.equal(back[1:4][:, ids], storage[1:4][:, ids])
        rows.append((f"kv_pack/unpack {str(dtype)[6:]}", float(not exact), 0.0))
    return rows


def copy_bandwidth(device: str, nbytes: int, bench) -> float:
    """Device-to-device copy: (read + write) bytes per second."""
    src = torch.empty(nbytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * nbytes / (ms / 1e3)


def decode_inputs(device: str, batch: int, context: int) -> tuple[torch.Tensor, ...]:
    """Random bf16 query, KV cache in shuffled blocks, block tables, lengths and an output."""
    blocks_per_seq = -(-context // BLOCK)
    cache = torch.empty(batch * blocks_per_seq, BLOCK, 2 * KV_HEADS, HEAD_DIM, dtype=torch.bfloat16,
                        device=device).normal_()
    tables = torch.randperm(batch * blocks_per_seq, device=device, dtype=torch.int32).view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)
    return query, cache, tables, lens, torch.empty_like(query)


def time_decode(device: str, bench, batches, contexts) -> list[dict]:
    from engine.triton_ops.paged_decode import paged_decode_attention

    rows = []
    for context in contexts:
        for batch in batches:
            query, cache, tables, lens, out = decode_inputs(device, batch, context)
            nbytes = batch * context * 2 * KV_HEADS * HEAD_DIM * 2  # the K and V (bf16) each step must read
            timed = {}
            for label, splits in (("auto", None), ("1", 1)):
                ms = bench(lambda s=splits: paged_decode_attention(query, cache, tables, lens, out=out,
                                                                   num_splits=s, max_seq_len=context))
                timed[label] = (ms, nbytes / (ms / 1e3))
            rows.append({"batch": batch, "context": context, "bytes": nbytes,
                         "ms": timed["auto"][0], "bandwidth": timed["auto"][1],
                         "ms_single_pass": timed["1"][0], "bandwidth_single_pass": timed["1"][1]})
    return rows


def time_split_sweep(device: str, bench, batches, contexts, splits=(1, 2, 4, 8, 16, 32)) -> list[dict]:
    """Paged decode at each split count, to place ``choose_num_splits``'s threshold: for each
    (batch, context), every split count's time and the count the heuristic picks."""
    from engine.triton_ops.paged_decode import choose_num_splits, paged_decode_attention

    rows = []
    for context in contexts:
        for batch in batches:
            query, cache, tables, lens, out = decode_inputs(device, batch, context)
            ms = {n: bench(lambda n=n: paged_decode_attention(query, cache, tables, lens, out=out, num_splits=n))
                  for n in splits}
            best = min(ms, key=ms.get)
            rows.append({"batch": batch, "context": context, "ms": {str(n): t for n, t in ms.items()},
                         "best": best, "chosen": choose_num_splits(batch, KV_HEADS, context, torch.device(device))})
    return rows


def time_pack(device: str, bench, tokens: int, layers: int = LAYERS) -> list[dict]:
    from engine.triton_ops.kv_pack import pack_kv_blocks, unpack_kv_blocks

    blocks = -(-tokens // BLOCK)
    storage = torch.empty(layers, 4 * blocks, BLOCK, 2 * KV_HEADS, HEAD_DIM, dtype=torch.bfloat16,
                          device=device).normal_()
    ids = torch.randperm(4 * blocks, device=device)[:blocks]
    buffer = pack_kv_blocks(storage, ids, 0, layers)
    nbytes = buffer.numel() * buffer.element_size()
    rows = []
    for name, fn in (("pack", lambda: pack_kv_blocks(storage, ids, 0, layers, out=buffer)),
                     ("unpack", lambda: unpack_kv_blocks(buffer, storage, ids, 0))):
        ms = bench(fn)
        rows.append({"kernel": name, "tokens": tokens, "layers": layers, "bytes": nbytes, "ms": ms,
                     "bandwidth": 2 * nbytes / (ms / 1e3)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, interpreted on the CPU (no GPU needed)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--split-sweep", action="store_true",
                        help="also time every split count at contexts 512 to 32k and batches 1 to 64 (on a GPU: "
                             "GPU time, each call inside a CUDA graph)")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel is defined
    import triton

    if args.smoke:
        device = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA device: run with --smoke for the interpreted check", file=sys.stderr)
        return 2
    else:
        device = "cuda"
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    print(f"# tandem Triton kernels on {name}: torch {torch.__version__}, triton {triton.__version__}\n")
    results: dict = {"device": name, "torch": torch.__version__, "triton": triton.__version__}
    checks = check_correctness(device, args.smoke)
    results["correctness"] = [{"check": c, "error": e, "bound": b} for c, e, b in checks]
    failed = [c for c, e, b in checks if not e <= b]
    if args.smoke:
        bench = _wall_clock_bench
        batches, contexts, tokens, layers, copy_bytes = (1, 2), (64,), 32, 2, 1 << 20
    else:
        from triton.testing import do_bench

        def bench(fn):
            return do_bench(fn, warmup=25, rep=100, return_mode="median")

        batches, contexts, tokens, layers, copy_bytes = (1, 8, 64), (512, 4096, 32768), 4096, LAYERS, 2 << 30
    copy_bw = copy_bandwidth(device, copy_bytes, bench)
    decode = time_decode(device, bench, batches, contexts)
    pack = time_pack(device, bench, tokens, layers)
    results.update(copy_bandwidth=copy_bw, decode=decode, pack=pack)
    print("\n".join(render_table(checks, copy_bw, copy_bytes, decode, pack, judge_speed=not args.smoke)))
    if args.split_sweep:
        sweep_batches, sweep_contexts = ((1, 2), (64, 128)) if args.smoke else (
            (1, 4, 8, 16, 32, 64), (512, 1024, 2048, 4096, 8192, 32768))
        # on a GPU each call is timed inside a CUDA graph, as the engine runs it: the host's
        # launch cost (larger for two launches than for one) is not in the figure
        results["split_sweep"] = time_split_sweep(device, bench if args.smoke else _graph_bench, sweep_batches,
                                                  sweep_contexts)
        print("\n| batch | context | ms at 1/2/4/8/16/32 splits | best | chosen |\n|---|---|---|---|---|")
        for row in results["split_sweep"]:
            times = " / ".join(f"{t:.4f}" for t in row["ms"].values())
            print(f"| {row['batch']} | {row['context']} | {times} | {row['best']} | {row['chosen']} |")
    if args.smoke:
        print("(interpreted on the CPU: the timings say nothing about a GPU)")
    print("NCCL point-to-point: not checked (one GPU; NCCL refuses two ranks on one device)")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if failed:
        print(f"\nFAILED: {failed}", file=sys.stderr)
        return 1
    return 0


def render_table(checks, copy_bw: float, copy_bytes: int, decode: list[dict], pack: list[dict],
                 judge_speed: bool = True) -> list[str]:
    """One markdown table: each correctness check (error against its bound), the copy that
    sets the bar, then each timing as bandwidth against that copy, with the issue's targets
    (judged only on a GPU: ``judge_speed``)."""
    def verdict(ok: bool) -> str:
        return "ok" if ok else "FAIL"

    def speed(ok: bool) -> str:
        return ("met" if ok else "MISSED") if judge_speed else "not judged"

    lines = ["| row | shape | rel. error (bound) | ms | GB/s | vs copy | target |", "|---|---|---|---|---|---|---|"]
    for check, error, bound in checks:
        lines.append(f"| check {check} | | {error:.1e} ({bound:.1e}) | | | | {verdict(error <= bound)} |")
    lines.append(f"| device-to-device copy | {copy_bytes >> 20} MiB | | | {copy_bw / 1e9:.0f} | 100% | |")
    for row in decode:
        shape = f"batch {row['batch']}, context {row['context']}"
        at_target = row["batch"] == 64 and row["context"] == 4096
        for label, ms, bw in (("split auto", row["ms"], row["bandwidth"]),
                              ("single pass", row["ms_single_pass"], row["bandwidth_single_pass"])):
            target = f">= 70%: {speed(bw >= 0.7 * copy_bw)}" if at_target and label == "split auto" else ""
            lines.append(f"| paged decode bf16, {label} | {shape} | | {ms:.3f} | {bw / 1e9:.0f} | "
                         f"{bw / copy_bw:.0%} | {target} |")
    for row in pack:
        lines.append(f"| KV {row['kernel']} | {row['tokens']} tokens, {row['layers']} layers | | {row['ms']:.3f} | "
                     f"{row['bandwidth'] / 1e9:.0f} | {row['bandwidth'] / copy_bw:.0%} | "
                     f">= 80%: {speed(row['bandwidth'] >= 0.8 * copy_bw)} |")
    return lines


def _graph_bench(fn, calls: int = 20, replays: int = 20) -> float:
    """Milliseconds per call of ``fn`` on the GPU alone: ``calls`` calls captured in one CUDA
    graph, replayed ``replays`` times between two events (after a warm-up)."""
    fn()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / (calls * replays)


def _wall_clock_bench(fn, repeats: int = 3) -> float:
    """Median milliseconds by the wall clock (the smoke run; no CUDA events on the CPU)."""
    import time

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    sys.exit(main())
