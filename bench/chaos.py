"""`tandem bench chaos`: steady load on a live `tandem serve` while faults are injected from
outside, one at a time, as production would meet them: SIGKILL of a worker process (for the decode
worker also once every one of a few streams has its first tokens: they must complete, moved to
the restarted worker), SIGSTOP of the decode worker for a while then SIGCONT, the prefix
index's Redis killed and restarted, clients that go away mid-request, poison requests, and
SIGKILL of the router itself, started again at once: the server runs on a Ray head of its own
(``ray start --head``; `tandem serve --ray-address`, as on a cluster), so its workers are
detached and the restarted router must attach to the same worker processes.

Every request is a greedy float32 completion of one of a few prompts, compared with the answer
the same server gave before any fault under DESIGN.md's token-equality rule: a divergence is
allowed only where the reference's two best logprobs are within 1e-3 (batch shapes change
under load, and with them the rounding of near ties); the rule's firings are counted. Per
fault it counts what was sent, completed with the reference's tokens, failed with an
OpenAI-shaped error, hung (no answer within the deadline), answered wrong, and failed
otherwise; then, once idle, the KV blocks still held on every worker; and
how long until requests succeeded again and until a restarted worker was back in routing (at
its new address, its Stats answering; whether requests then go there is the routing policy's
choice: prefix routing keeps a prompt where it is cached)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import signal
import time
from dataclasses import dataclass, field

import httpx
import psutil

FAULTS = ("kill-prefill", "kill-decode", "kill-decode-mid-stream", "stop-decode", "redis", "disconnect", "poison",
          "kill-router")
MID_STREAMS = 8  # kill-decode-mid-stream: the streams in flight when the decode worker is killed
NEAR_TIE = 1e-3  # DESIGN.md's token-equality rule (float32)
PROMPTS = ["The lighthouse keeper wrote in his log that", "Three things to pack for a long hike:",
           "The recipe for bread begins with", "A short poem about the tide:", "The train left the station and"]


@dataclass(frozen=True)
class ChaosConfig:
    model: str
    faults: tuple[str, ...] = FAULTS
    rate: float = 2.0  # Poisson arrivals per second, during every fault's window
    window_s: float = 30.0  # load per fault; the fault comes ``inject_after_s`` into it
    inject_after_s: float = 5.0
    stop_s: float = 20.0  # stop-decode: how long the decode worker stays stopped
    request_timeout_s: float = 60.0  # past this without an answer a request is hung
    max_tokens: int = 16
    serve_args: tuple[str, ...] = ("--mode", "disagg", "--local-prefill-max-tokens", "0", "--dtype", "float32")
    seed: int = 0


@dataclass
class FaultRow:
    fault: str
    sent: int = 0
    completed: int = 0  # with the reference's tokens
    failed: int = 0  # with an OpenAI-shaped error
    hung: int = 0
    wrong: int = 0
    other: int = 0  # failed in another way (no JSON error, a dropped connection)
    near_ties: int = 0  # completions that diverged from the reference at a near tie (counted completed)
    blocks_held: dict[str, int] = field(default_factory=dict)  # role -> KV blocks in use once idle
    recovered_s: float | None = None  # injection -> the first request after which all succeeded
    worker_back_s: float | None = None  # injection -> the restarted worker back in routing (kill-router: serving)
    notes: list[str] = field(default_factory=list)


@dataclass
class _Outcome:
    sent_at: float
    kind: str  # completed | near_tie | failed | hung | wrong | other


class LiveCluster:
    """What the bench knows of the server under test: its URL, its log, and the Ray head its
    workers run on (bench/launch.py RayHead)."""

    def __init__(self, base_url: str, launched, head) -> None:
        self.base_url, self.launched, self.head = base_url, launched, head

    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=10).text

    def workers(self, role: str) -> list[str]:
        """The role's worker addresses in the router's pool."""
        found = re.findall(rf'^tandem:worker_num_kv_blocks\{{address="([^"]+)",role="{role}"\}}', self.metrics(), re.M)
        return sorted(set(found))

    def gauge(self, name: str, role: str) -> float:
        pattern = rf'^tandem:worker_{name}\{{address="[^"]+",role="{role}"\}} (\S+)$'
        return sum(float(v) for v in re.findall(pattern, self.metrics(), re.M))

    def process(self, address: str) -> psutil.Process:
        """The process listening on a worker's port (a Ray actor on the head)."""
        port = int(address.rsplit(":", 1)[1])
        for process in self.head.processes():
            try:
                if any(c.status == psutil.CONN_LISTEN and c.laddr.port == port
                       for c in process.net_connections("tcp")):
                    return process
            except psutil.NoSuchProcess:
                continue
        raise RuntimeError(f"no process of the Ray head listens on {address}")

    def blocks_held(self) -> dict[str, int]:
        return {role: int(self.gauge("num_kv_blocks", role) - self.gauge("num_free_kv_blocks", role))
                for role in ("prefill", "decode") if self.workers(role)}


@dataclass(frozen=True)
class Reference:
    tokens: list[str]
    top_logprobs: list[dict[str, float]]  # per position, the two best

    def judge(self, tokens: list[str]) -> str:
        """completed, near_tie (diverged where the reference's two best are within NEAR_TIE), or wrong."""
        if tokens == self.tokens:
            return "completed"
        position = next((i for i, (a, b) in enumerate(zip(tokens, self.tokens)) if a != b), None)
        if position is None:  # one is a prefix of the other: a length mismatch is never a tie
            return "wrong"
        best = sorted(self.top_logprobs[position].values(), reverse=True)
        return "near_tie" if len(best) > 1 and best[0] - best[1] <= NEAR_TIE else "wrong"


def _body(cfg: ChaosConfig, prompt: str, **extra) -> dict:
    return {"model": cfg.model, "prompt": prompt, "max_tokens": cfg.max_tokens, "temperature": 0,
            "ignore_eos": True, "logprobs": 2, **extra}


async def _one(client: httpx.AsyncClient, cluster: LiveCluster, cfg: ChaosConfig, prompt: str,
               reference: Reference) -> str:
    try:
        response = await client.post(f"{cluster.base_url}/v1/completions", json=_body(cfg, prompt),
                                     timeout=cfg.request_timeout_s)
    except httpx.TimeoutException:
        return "hung"
    except httpx.HTTPError:
        return "other"
    try:
        payload = response.json()
    except json.JSONDecodeError:
        return "other"
    if response.status_code == 200:
        return reference.judge(payload["choices"][0]["logprobs"]["tokens"])
    return "failed" if isinstance(payload.get("error"), dict) and payload["error"].get("message") else "other"


async def _load(cluster: LiveCluster, cfg: ChaosConfig, references: dict[str, Reference], until: float,
                rng: random.Random) -> list[_Outcome]:
    """Poisson arrivals until ``until``; every request's outcome once all have ended."""
    async with httpx.AsyncClient() as client:
        pending = []
        while time.monotonic() < until:
            prompt = rng.choice(PROMPTS)
            sent = time.monotonic()
            task = asyncio.create_task(_one(client, cluster, cfg, prompt, references[prompt]))
            pending.append((sent, task))
            await asyncio.sleep(rng.expovariate(cfg.rate))
        return [_Outcome(sent, await task) for sent, task in pending]


# An injector starts its fault and returns what undoes it (awaited after the window), or None.
def _kill(role: str):
    def inject(cluster: LiveCluster, cfg: ChaosConfig, row: FaultRow) -> None:
        address = cluster.workers(role)[0]
        cluster.process(address).send_signal(signal.SIGKILL)
        row.notes.append(f"SIGKILL {role} worker {address} (Ray restarts it)")
    return inject


def _kill_mid_stream(references: dict[str, Reference]):
    def inject(cluster: LiveCluster, cfg: ChaosConfig, row: FaultRow) -> asyncio.Task:
        return asyncio.create_task(_streams_cut(cluster, cfg, references, row))
    return inject


async def _streams_cut(cluster: LiveCluster, cfg: ChaosConfig, references: dict[str, Reference],
                       row: FaultRow) -> list[_Outcome]:
    """MID_STREAMS streamed requests; once each has a token, SIGKILL the decode worker. Their
    outcomes (each should complete: migrated to the restarted worker, issue 23)."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(MID_STREAMS)]
    firsts = [asyncio.Event() for _ in prompts]
    async with httpx.AsyncClient() as client:
        sent = time.monotonic()
        tasks = [asyncio.create_task(_stream_one(client, cluster, cfg, p, references[p], first))
                 for p, first in zip(prompts, firsts)]
        try:
            await asyncio.wait_for(asyncio.gather(*(first.wait() for first in firsts)), cfg.request_timeout_s)
            address = (await asyncio.to_thread(cluster.workers, "decode"))[0]
            (await asyncio.to_thread(cluster.process, address)).send_signal(signal.SIGKILL)
            row.notes.append(f"SIGKILL decode worker {address} with {MID_STREAMS} streams past their first token")
        except TimeoutError:
            row.notes.append("the streams had no first token in time: nothing killed")
        kinds = [await task for task in tasks]
    done = sum(kind in ("completed", "near_tie") for kind in kinds)
    row.notes.append(f"{done} of the {MID_STREAMS} streams completed with the reference's tokens")
    return [_Outcome(sent, kind) for kind in kinds]


async def _stream_one(client: httpx.AsyncClient, cluster: LiveCluster, cfg: ChaosConfig, prompt: str,
                      reference: Reference, first: asyncio.Event) -> str:
    tokens: list[str] = []
    try:
        async with client.stream("POST", f"{cluster.base_url}/v1/completions", json=_body(cfg, prompt, stream=True),
                                 timeout=cfg.request_timeout_s) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "failed"
                for choice in event.get("choices") or []:
                    tokens += (choice.get("logprobs") or {}).get("tokens") or []
                if tokens:
                    first.set()
    except httpx.TimeoutException:
        return "hung"
    except (httpx.HTTPError, json.JSONDecodeError):
        return "other"
    finally:
        first.set()  # failed before a token: the kill need not wait for it
    return reference.judge(tokens)


def _kill_router(cluster: LiveCluster, cfg: ChaosConfig, row: FaultRow) -> asyncio.Task:
    return asyncio.create_task(_router_restart(cluster, row))


async def _router_restart(cluster: LiveCluster, row: FaultRow) -> list[_Outcome]:
    """SIGKILL `tandem serve`, start it again at once (same flags and ports); when it served
    again, and whether from the same worker processes."""
    workers = cluster.head.actor_pids()
    killed = time.monotonic()
    cluster.launched.process.kill()
    await asyncio.to_thread(cluster.launched.process.wait, 30)
    cluster.launched = cluster.launched.again()
    await asyncio.to_thread(cluster.launched.start)
    row.worker_back_s = time.monotonic() - killed
    same = cluster.head.actor_pids() == workers and any("attached to" in line for line in cluster.launched.log)
    row.notes.append(f"router SIGKILLed and started again: serving {row.worker_back_s:.1f} s after the kill, from "
                     f"{'the same' if same else 'NOT the same'} {len(workers)} worker processes; requests in flight "
                     "or sent while no router listened end without an answer (other)")
    return []


async def _after(delay_s: float, undo) -> None:
    try:
        await asyncio.sleep(delay_s)
    finally:  # even if the window is cut short: nothing stays stopped or down
        await asyncio.to_thread(undo)


def _stop_decode(cluster: LiveCluster, cfg: ChaosConfig, row: FaultRow) -> asyncio.Task:
    address = cluster.workers("decode")[0]
    process = cluster.process(address)
    process.send_signal(signal.SIGSTOP)
    row.notes.append(f"SIGSTOP decode worker {address}, SIGCONT {cfg.stop_s:g} s later")
    return asyncio.create_task(_after(cfg.stop_s, lambda: process.send_signal(signal.SIGCONT)))


def _redis(redis):
    def inject(cluster: LiveCluster, cfg: ChaosConfig, row: FaultRow) -> asyncio.Task:
        redis.process.kill()
        redis.process.wait(10)
        row.notes.append("Redis SIGKILLed, started again 10 s later (same port and password, empty)")
        return asyncio.create_task(_after(10.0, redis.start))
    return inject


def _disconnect(cluster: LiveCluster, cfg: ChaosConfig, row: FaultRow) -> None:
    """Clients that give up mid-request: streamed and not, 20 of each."""
    rng = random.Random(cfg.seed)

    async def give_up(stream: bool) -> None:
        body = _body(cfg, rng.choice(PROMPTS), max_tokens=400, stream=stream)
        try:
            async with httpx.AsyncClient() as client:
                await client.post(f"{cluster.base_url}/v1/completions", json=body, timeout=0.3)
        except httpx.HTTPError:
            pass
    for stream in (True, False):
        for _ in range(20):
            asyncio.get_running_loop().create_task(give_up(stream))
    row.notes.append("40 clients gone 0.3 s into a 400-token request (20 streamed)")


def _poison(cluster: LiveCluster, cfg: ChaosConfig, row: FaultRow) -> None:
    """Requests that are wrong in every way a client can be wrong: each must get its own 4xx."""
    wrongs = [{"prompt": [10 ** 9]}, {"prompt": "x", "max_tokens": -1}, {"prompt": "x", "temperature": float("nan")},
              {"prompt": ""}, {"prompt": "x", "stop": ["a" * 100000]}, {"prompt": "x", "n": 10 ** 6},
              {"messages": "not a list"}]
    bodies = [{"model": cfg.model, **wrong} for wrong in wrongs]
    statuses = []
    for body in bodies:
        try:
            text = json.dumps(body, allow_nan=True)
            statuses.append(httpx.post(f"{cluster.base_url}/v1/completions", content=text, timeout=30,
                                       headers={"content-type": "application/json"}).status_code)
        except httpx.HTTPError as exc:
            statuses.append(type(exc).__name__)
    row.notes.append(f"{len(bodies)} poison requests answered {statuses}")


async def _watch_restart(cluster: LiveCluster, role: str, before: list[str], injected: float, row: FaultRow,
                         until: float) -> None:
    """When a restarted worker of ``role`` was back in routing: in the pool at a new address,
    with Stats (the router routes only to workers whose last Stats answered)."""
    while time.monotonic() < until:
        await asyncio.sleep(0.25)
        try:
            now = await asyncio.to_thread(cluster.workers, role)
            if now and now != before and await asyncio.to_thread(cluster.gauge, "num_kv_blocks", role) > 0:
                row.worker_back_s = time.monotonic() - injected
                return
        except httpx.HTTPError:
            continue


def _recovered(outcomes: list[_Outcome], injected: float) -> float | None:
    """Injection -> the first request after which every request succeeded (None: never)."""
    after = [o for o in outcomes if o.sent_at >= injected]
    last_bad = max((i for i, o in enumerate(after) if o.kind not in ("completed", "near_tie")), default=None)
    if last_bad is None:
        return 0.0
    return after[last_bad + 1].sent_at - injected if last_bad + 1 < len(after) else None


async def run_fault(cluster: LiveCluster, cfg: ChaosConfig, fault: str, references: dict[str, Reference], inject,
                    rng: random.Random) -> FaultRow:
    row = FaultRow(fault)
    start = time.monotonic()
    load = asyncio.create_task(_load(cluster, cfg, references, start + cfg.window_s, rng))
    await asyncio.sleep(cfg.inject_after_s)
    role = {"kill-prefill": "prefill", "kill-decode": "decode", "kill-decode-mid-stream": "decode"}.get(fault)
    before = await asyncio.to_thread(cluster.workers, role) if role else []
    injected = time.monotonic()
    undo = inject(cluster, cfg, row)
    watch = asyncio.create_task(_watch_restart(cluster, role, before, injected, row, injected + 240)) if role else None
    outcomes = await load
    for pending in (undo, watch):
        if pending is not None:
            outcomes += await pending or []  # an injector's own requests (kill-decode-mid-stream)
    outcomes.sort(key=lambda outcome: outcome.sent_at)
    for outcome in outcomes:
        row.completed += outcome.kind == "near_tie"
        kind = "near_ties" if outcome.kind == "near_tie" else outcome.kind
        setattr(row, kind, getattr(row, kind) + 1)
    row.sent = len(outcomes)
    row.recovered_s = _recovered(outcomes, injected)
    row.blocks_held = await _idle_blocks(cluster)
    return row


async def _idle_blocks(cluster: LiveCluster, timeout_s: float = 60.0) -> dict[str, int]:
    """KV blocks in use on each role once nothing runs (waits up to ``timeout_s`` for zero)."""
    deadline = time.monotonic() + timeout_s
    held: dict[str, int] = {}
    while time.monotonic() < deadline:
        try:
            held = await asyncio.to_thread(cluster.blocks_held)
            if held and not any(held.values()):
                return held
        except httpx.HTTPError:
            pass
        await asyncio.sleep(1.0)
    return held


def _references(cluster: LiveCluster, cfg: ChaosConfig) -> dict[str, Reference]:
    """Each prompt's answer before any fault, one request at a time."""
    answers = {}
    for prompt in PROMPTS:
        response = httpx.post(f"{cluster.base_url}/v1/completions", json=_body(cfg, prompt), timeout=120)
        response.raise_for_status()
        logprobs = response.json()["choices"][0]["logprobs"]
        answers[prompt] = Reference(logprobs["tokens"], logprobs["top_logprobs"])
    return answers


@dataclass
class ChaosResult:
    rows: list[FaultRow]
    startup_s: float | None  # how long the workers took to start at first (`tandem serve`'s log)


def _startup_s(log_lines: list[str]) -> float | None:
    found = [re.search(r"workers ready in ([0-9.]+) s", line) for line in log_lines]
    return next((float(m.group(1)) for m in found if m), None)


def run_chaos(cfg: ChaosConfig, log=print) -> ChaosResult:
    from bench.launch import LaunchedServe, RayHead
    from cluster.redis_server import PrivateRedis

    unknown = set(cfg.faults) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; choose from {', '.join(FAULTS)}")
    redis = PrivateRedis()
    redis.start()
    head = RayHead({"prefill": 2, "decode": 2})
    launched = LaunchedServe(["--model", cfg.model, "--redis-url", redis.url, "--ray-address", head.address,
                              *cfg.serve_args])
    launched.env.update(head.join_env)
    cluster = LiveCluster("", launched, head)
    try:
        head.start()
        cluster.base_url = launched.start().removesuffix("/v1")
        references = _references(cluster, cfg)
        injectors = {"kill-prefill": _kill("prefill"), "kill-decode": _kill("decode"),
                     "kill-decode-mid-stream": _kill_mid_stream(references), "stop-decode": _stop_decode,
                     "redis": _redis(redis), "disconnect": _disconnect, "poison": _poison,
                     "kill-router": _kill_router}
        rows, rng = [], random.Random(cfg.seed)
        for fault in cfg.faults:
            if fault == "kill-prefill" and not cluster.workers("prefill"):
                rows.append(FaultRow(fault, notes=["no prefill worker (colocated): skipped"]))
                continue
            log(f"chaos: {fault}")
            rows.append(asyncio.run(run_fault(cluster, cfg, fault, references, injectors[fault], rng)))
            log(f"chaos: {fault}: {dataclasses.asdict(rows[-1])}")
        return ChaosResult(rows, _startup_s(launched.log))
    finally:
        cluster.launched.stop()  # a drain: it stops the workers too
        head.stop()
        redis.close()


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def render_chaos(cfg: ChaosConfig, result: ChaosResult) -> str:
    rows = result.rows
    lines = [f"`tandem bench chaos`: {cfg.rate:g} req/s of greedy {cfg.max_tokens}-token completions for "
             f"{cfg.window_s:g} s per fault, the fault {cfg.inject_after_s:g} s in; hung = no answer within "
             f"{cfg.request_timeout_s:g} s; serve {' '.join(cfg.serve_args)} --ray-address (a Ray head of its own); "
             "workers started in "
             f"{_seconds(result.startup_s)} s at first",
             "",
             "| fault | sent | completed (near ties) | failed (OpenAI error) | hung | wrong | other | "
             "blocks held once idle | succeeding again after (s) | restarted worker back in routing (router: serving) "
             "after (s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        held = ", ".join(f"{role} {n}" for role, n in r.blocks_held.items()) or "-"
        lines.append(f"| {r.fault} | {r.sent} | {r.completed} ({r.near_ties}) | {r.failed} | {r.hung} | {r.wrong} | "
                     f"{r.other} | "
                     f"{held} | {_seconds(r.recovered_s)} | {_seconds(r.worker_back_s)} |")
    lines += [""] + [f"- {r.fault}: {note}" for r in rows for note in r.notes]
    return "\n".join(lines)


def register(commands, default_model: str) -> None:
    chaos = commands.add_parser("chaos", help="faults injected into a live tandem serve under steady load")
    chaos.add_argument("--model", default=default_model)
    chaos.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {','.join(FAULTS)}")
    chaos.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals per second")
    chaos.add_argument("--window", type=float, default=30.0, help="seconds of load per fault")
    chaos.add_argument("--inject-after", type=float, default=5.0, help="seconds into the window the fault comes")
    chaos.add_argument("--stop-seconds", type=float, default=20.0, help="stop-decode: how long the worker is stopped")
    chaos.add_argument("--request-timeout", type=float, default=60.0, help="past this a request counts as hung")
    chaos.add_argument("--serve-args", default="--mode disagg --local-prefill-max-tokens 0 --dtype float32",
                       help="the tandem serve flags (after --model, --redis-url and --ray-address)")
    chaos.add_argument("--out", help="write the rows as JSON here")
    chaos.set_defaults(func=run_cli)


def run_cli(args) -> int:
    import shlex

    from bench.report import log, print_and_save

    cfg = ChaosConfig(model=args.model, faults=tuple(f.strip() for f in args.faults.split(",") if f.strip()),
                      rate=args.rate, window_s=args.window, inject_after_s=args.inject_after,
                      stop_s=args.stop_seconds, request_timeout_s=args.request_timeout,
                      serve_args=tuple(shlex.split(args.serve_args)))
    result = run_chaos(cfg, log=log)
    return print_and_save(render_chaos(cfg, result), args.out, lambda: json.dumps(dataclasses.asdict(result), indent=2))
