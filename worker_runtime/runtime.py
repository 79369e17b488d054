"""WorkerRuntime: one worker process's machinery around its role's servicer.

It owns the engine loop (which builds the engine on its own thread), the grpc.aio server
the role's services are registered on, the prefix-event publisher and tracing, and starts
and stops them in one order for both roles. The role supplies the services and the engine
loop's hooks; nothing here knows Prefill or Generate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine.engine_core import EngineCore
from engine.engine_loop import BeforeStep, EngineLoop, build_engine
from engine.llm import EngineArgs
from prefix_index.publisher import PrefixEventPublisher, PrefixIndexConfig, attach_publisher
from proto import worker_pb2 as pb
from proto.convert import worker_stats
from proto.rpc import Role
from telemetry.tracing import DECODE_SERVICE, PREFILL_SERVICE, Tracing, TracingConfig, setup_tracing
from worker_runtime.errors import EngineDead
from worker_runtime.server import ServerConfig, WorkerServer

_SERVICE_NAMES = {Role.PREFILL: PREFILL_SERVICE, Role.DECODE: DECODE_SERVICE}
logger = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class RuntimeConfig:
    """What every worker is configured with, whatever its role."""

    engine: EngineArgs
    server: ServerConfig
    prefix_index: PrefixIndexConfig | None = None  # publish cached blocks to Redis; None: no index
    tracing: TracingConfig | None = None  # None: tracing off


class WorkerRuntime:
    """``register(server)`` adds the role's services (on the server's loop, before it starts);
    ``before_step`` and ``after_outputs`` are the engine loop's hooks (engine/engine_loop.py).
    The constructor returns once the engine is built; ``start`` serves."""

    def __init__(self, role: Role, config: RuntimeConfig, register: Callable[[grpc.aio.Server], None],
                 before_step: BeforeStep | None = None, after_outputs: Callable[[], None] | None = None) -> None:
        self.role = role
        self.config = config
        self.server = WorkerServer(config.server, register)
        self.engine_loop = EngineLoop(lambda: build_engine(config.engine), before_step=before_step,
                                      after_step=self._publish_events, after_outputs=after_outputs,
                                      on_death=self._engine_died)
        # where the process may end itself once its engine loop died, so that its supervisor
        # (Ray) restarts it: cluster/actors.py sets this; None: it only stops serving
        self.exit_on_engine_death: Callable[[], None] | None = None
        self.core: EngineCore = self.engine_loop.core
        self.publisher: PrefixEventPublisher | None = None
        self.tracing: Tracing | None = None

    @property
    def address(self) -> str:
        """host:port other processes reach this worker on (once started)."""
        return self.server.address

    @property
    def incarnation(self) -> str:
        """The prefix-index incarnation this process publishes as ("": no index)."""
        return self.publisher.incarnation if self.publisher is not None else ""

    def start(self) -> str:
        """Serve, then publish and step; returns host:port."""
        address = self.server.start()
        self.tracing = setup_tracing(_SERVICE_NAMES[self.role], self.config.tracing, address)
        self.publisher = attach_publisher(self.core, self.config.prefix_index, address)
        if self.publisher is not None:
            self.publisher.start()
        self.engine_loop.start()
        return address

    def stop(self) -> None:
        """Stop serving, then stepping, then publishing (the publisher's goodbye deletes the
        heartbeat key, so the index stops counting this worker at once)."""
        self.server.stop()
        self.engine_loop.stop()
        if self.publisher is not None:
            self.publisher.stop()
        if self.tracing is not None:
            self.tracing.shutdown()

    def stats(self, kv_bytes_sent: int = 0, num_held_transfers: int = 0) -> pb.WorkerStats:
        """Read without waiting for the engine thread (a long step must not make the worker look
        dead): each figure is current, together they may be a step apart. Raises EngineDead
        once the engine loop has died: a worker that cannot step must not look healthy."""
        if self.engine_loop.error is not None:
            raise EngineDead(f"the engine loop died: {self.engine_loop.error!r}")
        return worker_stats(self.core, self.role.value, self.address, kv_bytes_sent, num_held_transfers,
                            self.incarnation)

    def _engine_died(self, exc: BaseException) -> None:  # engine thread, as it ends
        """NOT_SERVING at once (probes and the router's health checks see it), then, where the
        process is supervised, its end."""
        logger.error("%s worker %s: the engine loop died (%r); not serving", self.role, self.address, exc)
        self.server.set_serving(False)
        if self.exit_on_engine_death is not None:
            self.exit_on_engine_death()

    def _publish_events(self, core: EngineCore) -> None:  # engine thread, after each step
        if self.publisher is not None:
            self.publisher.publish(core.block_pool.take_events())
