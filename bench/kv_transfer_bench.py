"""`tandem bench kv-transfer`: the KV transports on loopback against, in the same run, a
bare gRPC byte stream (the ceiling for gRPC) and a memory copy of the same bytes; and how much
of a prompt's transfer hides behind its prefill (layer-wise sends vs send-after-prefill). With
``--link``, the transports between two processes again, on loopback and across a link to a
second node (bench/kv_link_bench.py)."""

from __future__ import annotations

import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import torch

from engine.remote_kv import PrefillTiming
from kv_transfer.grpc_transport import GrpcKVReceiver, GrpcKVSink
from kv_transfer.inbox import EngineInbox
from kv_transfer.torch_dist import TorchDistKVReceiver, TorchDistKVSink
from kv_transfer.wire import MAX_CHUNK_BYTES
from proto.rpc import CHANNEL_OPTIONS, SERVER_OPTIONS
from worker_runtime.server import ServerConfig, WorkerServer

SECRET = "bench-secret"
TOKEN_SHAPE = (6, 64)  # SmolLM2: 2 x 3 KV heads, head_dim 64
_BARE_METHOD = "/tandem.bench.Bare/Push"


@dataclass(slots=True)
class ThroughputRow:
    size_mib: int
    memcpy_mb_s: float
    bare_grpc_mb_s: float
    grpc_mb_s: float
    gloo_mb_s: float


@dataclass(slots=True)
class OverlapResult:
    prompt_tokens: int
    prefill_s: float  # the prefill step alone
    exposed_layerwise_s: float  # transfer time left after prefill, sending layer by layer
    exposed_after_s: float  # the same when everything is sent after prefill


@dataclass(slots=True)
class KVTransferBenchResult:
    rows: list[ThroughputRow] = field(default_factory=list)
    overlap: OverlapResult | None = None


def kv_of_size(size_mib: int) -> torch.Tensor:
    tokens = size_mib * (1 << 20) // (TOKEN_SHAPE[0] * TOKEN_SHAPE[1] * 4)
    return torch.randn(tokens, *TOKEN_SHAPE)


def _memcpy(kv: torch.Tensor) -> float:
    start = time.perf_counter()
    kv.clone()
    return time.perf_counter() - start


def _bare_grpc(kv: torch.Tensor) -> float:
    """The same bytes as raw 1 MiB messages through a client-streaming call, no framing."""
    received = [0]

    def push(request_iterator, _context):
        for message in request_iterator:
            received[0] += len(message)
        return b"ok"

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=SERVER_OPTIONS)
    handler = grpc.method_handlers_generic_handler(
        "tandem.bench.Bare", {"Push": grpc.stream_unary_rpc_method_handler(push)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    data = kv.view(torch.uint8).flatten()
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS) as channel:
        call = channel.stream_unary(_BARE_METHOD)
        start = time.perf_counter()
        call(data[i : i + MAX_CHUNK_BYTES].numpy().tobytes() for i in range(0, data.numel(), MAX_CHUNK_BYTES))
        elapsed = time.perf_counter() - start
    server.stop(None)
    assert received[0] == data.numel()
    return elapsed


class CountingInbox(EngineInbox):
    """Receives like the decode engine's inbox but keeps only a byte count."""

    def __init__(self) -> None:
        super().__init__()
        self.num_bytes = 0

    def put(self, item) -> None:
        kv = getattr(item, "kv", None)
        if kv is not None:
            self.num_bytes += kv.numel() * kv.element_size()


def serve_kv(inbox: EngineInbox, dtype: torch.dtype, token_shape: tuple[int, int], host: str = "127.0.0.1",
             secret: str = SECRET) -> WorkerServer:
    """What a decode worker serves KV on (its grpc.aio server) with only the KV receiver."""
    receiver = GrpcKVReceiver(inbox, dtype, token_shape, lambda: server.address)
    server = WorkerServer(ServerConfig(host, 0, secret),
                          lambda grpc_server: grpc_server.add_generic_rpc_handlers((receiver.handler(),)))
    server.start()
    return server


def _grpc_transport(kv: torch.Tensor) -> float:
    inbox = CountingInbox()
    server = serve_kv(inbox, torch.float32, TOKEN_SHAPE)
    sink = GrpcKVSink(server.address, SECRET, timeout_s=600)
    start = time.perf_counter()
    sink.send_layer("bench", 0, 0, kv)
    reply = sink.finish()
    elapsed = time.perf_counter() - start
    server.stop()
    assert reply is not None and inbox.num_bytes == kv.numel() * 4, sink.error
    return elapsed


def _gloo_transport(kv: torch.Tensor) -> float:
    inbox = CountingInbox()
    receiver = TorchDistKVReceiver(inbox, SECRET, torch.float32, TOKEN_SHAPE, timeout_s=600)
    sink = TorchDistKVSink(receiver.address, SECRET, timeout_s=600)
    time.sleep(0.2)  # let the pair connect: we time the transfer, not the rendezvous
    start = time.perf_counter()
    sink.send_layer("bench", 0, 0, kv)
    sink.finish()
    receiver.join()
    elapsed = time.perf_counter() - start
    assert inbox.num_bytes == kv.numel() * 4, receiver.stats.error
    return elapsed


def throughput(sizes_mib: list[int], repeats: int = 2) -> list[ThroughputRow]:
    rows = []
    for size in sizes_mib:
        kv = kv_of_size(size)
        mb = kv.numel() * 4 / 1e6
        ways = (("memcpy", _memcpy), ("bare", _bare_grpc), ("grpc", _grpc_transport), ("gloo", _gloo_transport))
        best = {name: min(fn(kv) for _ in range(repeats)) for name, fn in ways}
        rows.append(ThroughputRow(size, mb / best["memcpy"], mb / best["bare"], mb / best["grpc"], mb / best["gloo"]))
    return rows


class _HoldingSink(GrpcKVSink):
    """Send-after-prefill: layers are held back until the first token is known."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._held: list[tuple] = []

    def send_layer(self, *item) -> None:
        self._held.append(item)

    def send_first_token(self, request_id, token, num_cached_tokens, timing=PrefillTiming()) -> None:
        for item in self._held:
            super().send_layer(*item)
        super().send_first_token(request_id, token, num_cached_tokens, timing)


def overlap(model: str, prompt_tokens: int, threads: int) -> OverlapResult:
    """Exposed transfer time after a prefill of ``prompt_tokens``: layer-wise vs after."""
    from engine import LLM, SamplingParams
    from engine.remote_kv import KVExport, prefill_side_params

    torch.set_num_threads(threads)
    kwargs = dict(model=model, dtype="float32", max_model_len=prompt_tokens + 64, enable_prefix_caching=False)
    prefill, decode = LLM(**kwargs).engine_core, LLM(**kwargs).engine_core
    inbox = EngineInbox()
    cache = decode.kv_cache.layers[0]
    server = serve_kv(inbox, cache.dtype, tuple(cache.shape[2:]))
    ids = torch.randint(100, 40000, (prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    timings = {}
    for label, sink_type in (("layerwise", GrpcKVSink), ("after", _HoldingSink)):
        sink = sink_type(server.address, SECRET, timeout_s=600)
        remote = decode.make_request(label, ids, params)
        from_pos = decode.add_remote_request(remote, deadline_s=600)
        prefill.add_request(prefill.make_request(label, ids, prefill_side_params(params, remote.seed)),
                            KVExport(sink, from_pos))
        start = time.perf_counter()
        while prefill.has_unfinished_requests():
            prefill.step()
        prefill_done = time.perf_counter()
        sink.finish()  # returns once the receiver has read the whole stream
        transfer_done = time.perf_counter()
        inbox.drain_into(decode)
        while decode.has_unfinished_requests():
            decode.step()
        timings[label] = (prefill_done - start, transfer_done - prefill_done)
    server.stop()
    return OverlapResult(prompt_tokens, timings["layerwise"][0], timings["layerwise"][1], timings["after"][1])


def render(result: KVTransferBenchResult) -> str:
    lines = [
        "| KV size | memcpy MB/s | bare gRPC MB/s | tandem gRPC MB/s | gRPC / bare | gloo MB/s |",
        "|---|---|---|---|---|---|",
    ]
    for row in result.rows:
        lines.append(f"| {row.size_mib} MiB | {row.memcpy_mb_s:.0f} | {row.bare_grpc_mb_s:.0f} | {row.grpc_mb_s:.0f} | "
                     f"{row.grpc_mb_s / row.bare_grpc_mb_s:.2f}x | {row.gloo_mb_s:.0f} |")
    if result.overlap is not None:
        o = result.overlap
        lines += ["", f"prefill of a {o.prompt_tokens}-token prompt: {o.prefill_s * 1000:.0f} ms; transfer time left "
                  f"after it: layer-wise {o.exposed_layerwise_s * 1000:.0f} ms, send-after-prefill "
                  f"{o.exposed_after_s * 1000:.0f} ms"]
    return "\n".join(lines)


def register(commands, default_model: str) -> None:
    transfer = commands.add_parser("kv-transfer", help="KV transports vs bare gRPC and memcpy on loopback")
    transfer.add_argument("--sizes-mib", default="1,4,16,64,256")
    transfer.add_argument("--model", default=default_model)
    transfer.add_argument("--prompt-tokens", type=int, default=2048, help="0 skips the overlap measurement")
    transfer.add_argument("--ttft-rounds", type=int, default=3,
                          help="rounds of disaggregated vs colocated time to first token (0 skips)")
    transfer.add_argument("--threads", type=int, default=2)
    transfer.add_argument("--link", action="store_true",
                          help="also between this host and a network namespace behind a veth link (root; "
                               "bench/kv_link_bench.py), next to two processes on loopback")
    transfer.add_argument("--link-rate", default=None, metavar="RATE",
                          help="with --link: the link again, shaped to RATE with tc tbf (e.g. 1gbit)")
    transfer.set_defaults(func=run_cli)


def run_cli(args) -> int:
    from bench.report import comma_ints

    result = KVTransferBenchResult(rows=throughput(list(comma_ints(args.sizes_mib))))
    if args.prompt_tokens:
        result.overlap = overlap(args.model, args.prompt_tokens, args.threads)
    print(render(result))
    if args.link:
        from bench.kv_link_bench import link_throughput, render_link

        print("\nBetween two processes: on loopback, and across the link to a second node (network namespace)")
        print(render_link(link_throughput(list(comma_ints(args.sizes_mib)), rate=args.link_rate)))
    if args.prompt_tokens and args.ttft_rounds:
        from bench.ttft_bench import render_ttft, ttft

        print(render_ttft(ttft(args.model, args.prompt_tokens, args.threads, args.ttft_rounds)))
    return 0
