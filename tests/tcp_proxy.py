"""A TCP proxy on loopback whose connections a test can cut at a moment it chooses: a worker
lost mid-stream, as a router sees it (its sockets reset), injected from outside the worker."""

from __future__ import annotations

import asyncio


class TcpProxy:
    """Forwards 127.0.0.1:<port> to ``target`` ("host:port") on the running event loop."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.address = ""

    async def start(self) -> TcpProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.address = f"127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = self.target.rsplit(":", 1)
        try:
            up_reader, up_writer = await asyncio.open_connection(host, int(port))
        except OSError:
            writer.transport.abort()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort()
            self._writers.discard(writer)

    async def cut(self) -> None:
        """Reset every connection and stop accepting: the far side looks gone."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def reopen(self) -> None:
        """Accept again on the same port: the far side is back where it was (SIGCONT, a healed
        partition), not a restarted incarnation at a new address."""
        port = int(self.address.rsplit(":", 1)[1])
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", port)
