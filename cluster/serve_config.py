"""`tandem serve`'s configuration: one frozen ``ServeConfig``, built once from the command line,
each flag defaulting to its ``TANDEM_*`` variable (``--max-num-seqs`` <- ``TANDEM_MAX_NUM_SEQS``).

Every flag is declared once, as a field of ``ServeConfig`` with its parser type and help; the
argparse parser is generated from those fields, so the parser, the environment and the config
cannot disagree. The ``TANDEM_*`` variables of the serving command are read here and nowhere
else (the engine's own are in ``engine/envs.py``)."""

from __future__ import annotations

import argparse
import os
import secrets
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from cluster.autoscale import PoolSize, pool_size
from cluster.placement import MODES
from engine.config import LANE_POLICIES
from engine.models.registry import DEFAULT_MODEL
from engine.prefill_lane import (
    DEFAULT_PREFILL_LANE_HELP_MS,
    DEFAULT_PREFILL_LANE_MAX_WAIT_MS,
    DEFAULT_PREFILL_LANE_MIN_TOKENS,
    DEFAULT_PREFILL_LANE_PACE_MS,
    DEFAULT_PREFILL_LANE_POLICY,
    DEFAULT_PREFILL_LANE_TTFT_RATIO,
    SPLIT_MIN_TOKENS,
)
from engine.step_budget import DEFAULT_MAX_STEP_MS
from proto import worker_pb2

ENV_PREFIX = "TANDEM_"
KV_TRANSPORTS = {"grpc": worker_pb2.KV_TRANSPORT_GRPC, "torch": worker_pb2.KV_TRANSPORT_TORCH}  # --kv-transport


def _gpus(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 64:
        raise argparse.ArgumentTypeError(f"{text}: GPUs per worker must be in [0, 64]")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text}: must be in (0, 1]")
    return value


def _lane_tokens(value: str) -> int | None:
    if value.strip().lower() in ("off", "none", "0"):
        return None
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"--prefill-lane-min-tokens must be a positive number of tokens or 'off', "
                                         f"got {value!r}")
    return number


def _lane_wait_ms(value: str) -> float | None:
    if value.strip().lower() in ("off", "none"):
        return None
    number = float(value)
    if not 0 <= number < float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError(f"--prefill-lane-max-wait-ms must be a number of ms >= 0 or 'off', "
                                         f"got {value!r}")
    return number


def _pace_ms(value: str) -> float:
    number = float(value)
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"--prefill-lane-pace-ms must be a number of ms > 0, got {value!r}")
    return number


def _positive_or_off(flag: str, what: str) -> Callable[[str], float | None]:
    """A parser for ``flag``: a number > 0 (finite), or 'off' / 'none' for None."""

    def parse(value: str) -> float | None:
        if value.strip().lower() in ("off", "none"):
            return None
        number = float(value)
        if not 0 < number < float("inf"):  # NaN fails too
            raise argparse.ArgumentTypeError(f"{flag} must be {what} > 0 or 'off', got {value!r}")
        return number

    parse.__name__ = "number"  # argparse: "invalid number value: ..."
    return parse


_help_ms = _positive_or_off("--prefill-lane-help-ms", "a number of ms")
_ttft_ratio = _positive_or_off("--prefill-lane-ttft-ratio", "a number")


def _step_ms(value: str) -> float | None:
    if value.strip().lower() in ("off", "none", "0"):
        return None
    number = float(value)
    if not 0 < number < float("inf"):  # NaN fails too
        raise argparse.ArgumentTypeError(f"--max-step-ms must be a positive number of ms or 'off', got {value!r}")
    return number


def _switch(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


def flag(default: Any, parse: Callable[[str], Any] = str, help: str | None = None,
         choices: tuple[str, ...] | None = None) -> Any:
    """A ``ServeConfig`` field that is also a flag: ``parse`` turns the flag's (or the
    variable's) text into the value (``bool``: a switch with no argument)."""
    return field(default=default, metadata={"parse": parse, "help": help, "choices": choices})


@dataclass(frozen=True)
class ServeConfig:
    """What `tandem serve` was asked for. Values derived once the cluster is up (the mode auto
    picks, GPUs and threads per worker, the Redis URL of a private Redis) are ``ServePlan``'s."""

    model: str = flag(DEFAULT_MODEL)
    served_model_name: str | None = flag(None)
    dtype: str = flag("auto")
    host: str = flag("0.0.0.0")
    port: int = flag(8000, int)
    grpc_port: int = flag(50051, int, "the public gRPC API")
    grpc_tls_cert: str | None = flag(None, help="PEM certificate chain (TLS on)")
    grpc_tls_key: str | None = flag(None, help="PEM private key")
    mode: str = flag("auto", choices=MODES,
                     help="disagg: prefill and decode pools; colocated: decode workers prefill too; auto (default): "
                          "colocated where every worker would share one node's CPU cores (or one GPU), else disagg")
    prefill_workers: PoolSize = flag(PoolSize(1, 1), pool_size,
                                     "N, or MIN:MAX to autoscale the pool between them (disagg mode)")
    decode_workers: PoolSize = flag(PoolSize(1, 1), pool_size, "N, or MIN:MAX to autoscale the pool between them")
    prefill_queue_target: float = flag(2048.0, float, "autoscaling: queued prompt tokens per prefill worker above "
                                                      "which the pool grows")
    decode_queue_target: float = flag(4.0, float, "autoscaling: waiting sequences per decode worker above which "
                                                  "the pool grows")
    scale_up_window: float = flag(10.0, float, "autoscaling: seconds a queue must stay above its target before a "
                                               "worker is added")
    scale_down_window: float = flag(60.0, float, "autoscaling: seconds a pool must stay quiet before one worker "
                                                 "drains and stops")
    autoscale_interval: float = flag(2.0, float, "autoscaling: seconds between looks at the queues")
    worker_threads: int | None = flag(None, int, "torch threads each worker pins (default: colocated on one node, "
                                                 "its CPUs shared by the decode workers; else 1)")
    prefill_gpus: float | None = flag(None, _gpus, "GPUs each prefill worker asks Ray for (Ray hides the GPUs from "
                                                   "an actor that asks for none); default: 1 where the Ray cluster "
                                                   "has GPUs and --device is not cpu, else 0")
    decode_gpus: float | None = flag(None, _gpus, "GPUs each decode worker asks Ray for (default: as --prefill-gpus)")
    worker_port: int = flag(0, int, "0: any free port")
    ray_address: str | None = flag(None, help="join this Ray cluster (default: start one)")
    api_key: str | None = flag(None)
    chat_template: str | None = flag(None, help="a Jinja file overriding the model's")
    max_model_len: int | None = flag(None, int)
    block_size: int = flag(16, int)
    num_kv_blocks: int | None = flag(None, int)
    gpu_memory_utilization: float = flag(0.9, _fraction, "on a GPU without --num-kv-blocks: the share of its "
                                                         "memory a worker may bring it to; the KV cache gets what "
                                                         "the weights and the activation headroom leave")
    max_num_seqs: int = flag(64, int)
    attention_backend: str = flag("auto", choices=("auto", "torch", "triton"),
                                  help="auto: Triton kernels on CUDA, torch on the CPU; triton where it cannot run "
                                       "is an error")
    device: str = flag("auto", choices=("cpu", "cuda", "auto"),
                       help="where each worker's model and KV cache live (auto: CUDA when the worker sees a GPU)")
    enforce_eager: bool = flag(False, bool, "on a GPU, run decode steps eagerly instead of replaying CUDA graphs "
                                            "(as vLLM's flag; no effect on the CPU)")
    max_num_batched_tokens: int = flag(8192, int, "tokens per forward pass: the hard cap on a prefill chunk")
    max_step_ms: float | None = flag(DEFAULT_MAX_STEP_MS, _step_ms,
                                     "where prefill shares a step with decoding streams (colocated workers, a "
                                     "decode worker's local prefill), the prompt chunk is sized from the measured "
                                     "prefill rate so that the step stays under this many ms ('off': "
                                     f"--max-num-batched-tokens only; default {DEFAULT_MAX_STEP_MS:g}, measured: "
                                     "see README)")
    prefill_lane_min_tokens: int | None = flag(
        DEFAULT_PREFILL_LANE_MIN_TOKENS, _lane_tokens,
        "colocated workers with 2 or more threads: a prompt with at least this many tokens to compute, arriving "
        "while streams decode, is read on one thread of its own while the others keep decoding ('off': every "
        f"prompt shares the steps; default {DEFAULT_PREFILL_LANE_MIN_TOKENS}, measured: see README)")
    prefill_lane_max_wait_ms: float | None = flag(
        DEFAULT_PREFILL_LANE_MAX_WAIT_MS, _lane_wait_ms,
        "while the prefill lane is full, the next prompt for it waits for it at most this many ms after its arrival, "
        "then is read in the steps beside the streams, and at once where the lane, at its measured pace, would not "
        f"get through it and the rest of the queue within this bound ('off': it waits for the lane; default "
        f"{DEFAULT_PREFILL_LANE_MAX_WAIT_MS:g}, measured: see README)")
    prefill_lane_policy: str = flag(
        DEFAULT_PREFILL_LANE_POLICY, choices=LANE_POLICIES,
        help="which prompts the prefill lane takes. first: every prompt long enough that arrives while streams "
             "decode (the streams keep their pace; a prompt's first token waits for the lane's one thread). "
             "overflow: a lone prompt is read in the steps on every thread, beside the streams, and the lane takes "
             "a prompt only while other prefill work is under way (the lane busy, another request waiting, a "
             "prompt being read in chunks). pace: the steps read a prompt on every thread while the decoding streams "
             "get their tokens at most --prefill-lane-pace-ms apart, and the lane takes it when they are slower. "
             "cost: as pace, but when the streams are slower the lane takes a prompt only if, by what the engine "
             "measures as it serves, a prompt token read there costs the streams less than one read in the steps "
             f"(tandem:worker_lane_* and step_ms_per_prompt_token); default {DEFAULT_PREFILL_LANE_POLICY}, measured: "
             "see README")
    prefill_lane_pace_ms: float = flag(
        DEFAULT_PREFILL_LANE_PACE_MS, _pace_ms,
        "the pace policy's bound: the mean ms between the decoding streams' tokens over the last 2 s above which a "
        f"prompt goes to the prefill lane (set it a little under your TPOT target; default "
        f"{DEFAULT_PREFILL_LANE_PACE_MS:g})")
    prefill_lane_help_ms: float | None = flag(
        DEFAULT_PREFILL_LANE_HELP_MS, _help_ms,
        f"while the prefill lane reads a prompt of {SPLIT_MIN_TOKENS}+ tokens, the worker's engine thread reads a "
        "layer of the prompt's second half beside the lane between two of its steps when the last step and that "
        "layer take at most this many ms together, so the streams' tokens stay about this far apart at most "
        f"('off': only while it has nothing to step; default {DEFAULT_PREFILL_LANE_HELP_MS:g})")
    prefill_lane_ttft_ratio: float | None = flag(
        DEFAULT_PREFILL_LANE_TTFT_RATIO, _ttft_ratio,
        "policies pace and cost: the prefill lane takes a prompt only if, by the rates the worker measures as it "
        "serves, it would give the prompt its first token within this many times what the steps would, the prompt "
        "tokens queued in the steps included ('off': whenever the policy sends it; default "
        f"{'off' if DEFAULT_PREFILL_LANE_TTFT_RATIO is None else format(DEFAULT_PREFILL_LANE_TTFT_RATIO, 'g')})")
    max_queue: int = flag(256, int, "sequences (prompts x n) in flight before new requests get 429; tokenize "
                                    "calls count one")
    scheduling_policy: str = flag("fcfs", help="fcfs: arrival order everywhere; priority: requests run by their "
                                               "priority (lower first: the request's own, else its traffic "
                                               "class's), then arrival, at the router's admission queue, on the "
                                               "prefill and decode workers, and in preemption (vLLM's flag)",
                                  choices=("fcfs", "priority"))
    traffic_classes: str | None = flag(None, help="a YAML or JSON file mapping a traffic class name to its "
                                                  "priority, ttft_ms, tpot_ms and sheddable (router/traffic.py); "
                                                  "requests name one with traffic_class (default: 'default')")
    max_n: int = flag(16, int, "choices (n) per prompt")
    max_prompts_per_request: int = flag(64, int, "prompts in one /v1/completions request")
    max_stop_strings: int = flag(16, int, "entries in a request's stop")
    max_stop_string_len: int = flag(256, int, "characters per stop string")
    max_input_chars: int = flag(1 << 20, int, "characters of prompt or message text per request, checked before "
                                              "tokenizing")
    tokenizer_threads: int = flag(2, int, "the router's pool that tokenizes and renders chat templates (off its "
                                          "event loop)")
    kv_transport: str = flag("grpc", choices=tuple(KV_TRANSPORTS))
    kv_failure_policy: str = flag("recompute", choices=("recompute", "fail"))
    routing_policy: str = flag("prefix", choices=("prefix", "load", "round-robin"))
    redis_url: str | None = flag(None, help="the prefix index (redis:// or rediss://, password in the URL); "
                                            "default: a private Redis")
    local_prefill_max_tokens: int = flag(128, int, "in disagg mode, a request whose uncached suffix on the decode "
                                                   "worker is at most this long is prefilled there (measured "
                                                   "crossover on this machine; see README)")
    drain_timeout: float = flag(30.0, float)
    request_timeout: float = flag(600.0, float, "seconds a request may take from admission to its last token; past "
                                                "them it ends with a 504 (streamed: an error event) and its work on "
                                                "the workers is cancelled")
    migration_limit: int = flag(3, int, "how often one stream may move to another decode worker (or the restarted "
                                        "one) when its decode worker is lost after the first token; it resumes "
                                        "there from the tokens already sent (0: such streams end with an error)")
    step_outputs: bool = flag(True, bool, "decode workers send the router their streams' tokens in one message per "
                                          "engine step (off: one message per token per stream)")
    ready_timeout: float = flag(600.0, float, "seconds each worker may take to start")
    orphan_timeout: float = flag(120.0, float, "with --ray-address, where workers outlive their router: a worker "
                                               "no router has called for this many seconds drains and exits, and "
                                               "the private Redis once it has had no client for as long (0: never)")
    worker_max_restarts: int = flag(-1, int, "how often Ray restarts a worker process that died, over the "
                                             "cluster's life (-1: always)")
    prefill_nice: int = flag(10, int, "Unix niceness of prefill workers: where they share CPUs with decode workers "
                                      "and the router, decode steps win (0: same priority)")
    otlp_endpoint: str | None = flag(None, help="export traces over OTLP here (also: the OTEL_EXPORTER_OTLP_* "
                                                "variables); default: off")
    trace_content: bool = flag(False, bool, "put prompt and output text on the request spans (off: token counts "
                                            "only)")

    def __post_init__(self) -> None:
        for spec in fields(self):  # a TANDEM_* default is not checked by argparse's choices
            choices = spec.metadata.get("choices")
            if choices and getattr(self, spec.name) not in choices:
                raise ValueError(f"--{_dashed(spec.name)} (or {env_name(spec.name)}) must be one of "
                                 f"{', '.join(choices)}, got {getattr(self, spec.name)!r}")
        if self.orphan_timeout < 0:
            raise ValueError(f"--orphan-timeout must be >= 0 seconds, got {self.orphan_timeout}")
        if self.migration_limit < 0 or self.worker_max_restarts < -1:
            raise ValueError(f"--migration-limit must be >= 0 (got {self.migration_limit}) and "
                             f"--worker-max-restarts >= -1 (got {self.worker_max_restarts})")

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ServeConfig:
        return cls(**{spec.name: getattr(args, spec.name) for spec in fields(cls)})

    @property
    def name(self) -> str:
        """The model name the API serves and reports."""
        return self.served_model_name or self.model

    @property
    def kv_transport_code(self) -> int:
        return KV_TRANSPORTS[self.kv_transport]

    def tls_credentials(self) -> tuple[bytes, bytes] | None:
        """(certificate chain, private key) for the public gRPC API, or None (plaintext)."""
        if not (self.grpc_tls_cert or self.grpc_tls_key):
            return None
        if not (self.grpc_tls_cert and self.grpc_tls_key):
            raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
        with open(self.grpc_tls_cert, "rb") as cert, open(self.grpc_tls_key, "rb") as key:
            return cert.read(), key.read()


def _dashed(name: str) -> str:
    return name.replace("_", "-")


def env_name(name: str) -> str:
    """The variable a flag defaults from: ``max_num_seqs`` -> ``TANDEM_MAX_NUM_SEQS``."""
    return ENV_PREFIX + name.upper()


def add_serve_arguments(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> None:
    """One flag per ``ServeConfig`` field, its default read from the environment."""
    env = os.environ if env is None else env
    for spec in fields(ServeConfig):
        parse, text = spec.metadata["parse"], env.get(env_name(spec.name))
        default = spec.default if spec.default is not MISSING else None
        if parse is bool:
            # a switch that is on by default also gets its --no- form
            action = argparse.BooleanOptionalAction if default else "store_true"
            parser.add_argument(f"--{_dashed(spec.name)}", action=action,
                                default=default if text is None else _switch(text), help=spec.metadata["help"])
            continue
        parser.add_argument(f"--{_dashed(spec.name)}", type=parse, choices=spec.metadata["choices"],
                            default=default if text is None else parse(text), help=spec.metadata["help"])


def cluster_secret(env: Mapping[str, str] | None = None) -> str:
    """The secret every worker RPC carries: ``TANDEM_CLUSTER_SECRET`` (the Helm chart's), else
    a fresh random one for this command's cluster."""
    env = os.environ if env is None else env
    return env.get(env_name("CLUSTER_SECRET")) or secrets.token_urlsafe(32)
