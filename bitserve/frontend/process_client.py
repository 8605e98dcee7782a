"""ProcessEngineClient: the seam between the asyncio frontend and an engine in its own process
(engine/process.py), with ThreadEngineClient's face.

Commands are pickled down the pipe from the event loop (the child's inbox thread drains them at once, so a
send never waits on a step). The child's messages are read on the event loop itself, when the pipe is
readable (`loop.add_reader`): no thread of ours competes for this process's GIL, and each message
becomes the same callback ThreadEngineClient would have scheduled. A pipe that closes without a
Shutdown sent (the child crashed, was killed, ran out of memory) is the engine's death.
"""

from __future__ import annotations

import asyncio
import logging
import time

from bitserve.engine.loop import Command
from bitserve.engine.messages import AbortRequests, AddRequest, Embed, EngineRequest, KVCacheStats, Shutdown
from bitserve.engine.process import ChildMessage, Died, Embedded, EngineProcess, Rejected, Stepped
from bitserve.errors import EngineDead
from bitserve.frontend.engine_client import EngineCallbacks

logger = logging.getLogger(__name__)

MESSAGES_PER_READ = 4  # step results handled before the event loop runs its other ready tasks


class ProcessEngineClient:
    """Calls `callbacks` on the event loop, as ThreadEngineClient does."""

    def __init__(
        self, engine_process: EngineProcess, loop: asyncio.AbstractEventLoop, callbacks: EngineCallbacks
    ) -> None:
        self._process = engine_process
        self._conn = engine_process.conn
        self._loop = loop
        self._callbacks = callbacks
        self._kv_cache = engine_process.facts.kv_cache_stats
        self.last_progress = time.monotonic()  # when the last step's result arrived (liveness)
        self.num_steps = 0
        self._stopping = False  # Shutdown sent: the pipe closing is the expected end
        self._ended = False  # the pipe closed or the engine reported its death
        self._outbox: list[Command] = []  # commands of this event-loop iteration, sent together (_flush)
        self._fd = self._conn.fileno()
        loop.add_reader(self._fd, self._read)

    @property
    def is_alive(self) -> bool:
        """False once the pipe closed or the engine reported its death. Not a waitpid: routing asks for
        every admission (2.6% of the API process's time under a 256-request burst), and a child that
        exits closes its end of the pipe, which the loop reads (`_lost`) as soon as it runs; an admission
        in between fails over like any request whose engine died before its first token."""
        return not self._ended

    def kv_cache_stats(self) -> KVCacheStats:
        """The KV cache after the child's last step (its facts' until the first)."""
        return self._kv_cache

    def add_request(self, request: EngineRequest) -> None:
        self._send(AddRequest(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(tuple(request_ids)))

    def embed(self, command: Embed) -> None:
        self._send(command)

    def shutdown(self) -> None:
        """Ask the engine to stop after its current step; join() then waits for the process."""
        self._stopping = True
        self._send(Shutdown())
        self._flush()
        self._stop_reading()

    def join(self, timeout: float | None = None) -> None:
        self._process.process.join(timeout)

    def _send(self, command: Command) -> None:
        """Queue `command`; the commands of one event-loop iteration go down the pipe as one message.
        One write per command filled the pipe during a burst: the kernel charges a Unix socket's buffer
        ~2 KB a message whatever its size (386 bytes pickled for an AddRequest), so ~100 requests parsed
        before the child's inbox thread ran blocked the event loop in write() (py-spy, 2026-11-29: 1.5 ms
        a request at 100 concurrent on 2 vCPUs)."""
        if self._ended:
            return  # the death was reported; AsyncEngine refuses new work
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(command)

    def _flush(self) -> None:
        commands, self._outbox = self._outbox, []
        if not commands or self._ended:
            return
        try:
            self._conn.send(commands)
        except OSError:  # the child is gone: its pipe's closing is read (and reported) next
            logger.warning("engine process %s: pipe closed under a send", self._process.process.pid)

    def _read(self) -> None:
        """Up to MESSAGES_PER_READ messages in the pipe, in order (the reader fires again while more
        wait: an engine stepping faster than its results are handled must not starve the streams' writers,
        which the thread client's one callback a step never did); a closed pipe ends the engine."""
        try:
            for _ in range(MESSAGES_PER_READ):
                if not self._conn.poll():
                    return
                self._dispatch(self._conn.recv())
        except (EOFError, OSError):
            self._lost()

    def _dispatch(self, message: ChildMessage) -> None:
        if isinstance(message, Stepped):
            self.num_steps += 1
            self.last_progress = time.monotonic()
            self._kv_cache = message.kv_cache
            self._callbacks.on_step(message.result)
        elif isinstance(message, Rejected):
            self._callbacks.on_rejected(message.request_id, message.error)
        elif isinstance(message, Embedded):
            self._callbacks.on_embedded(message.request_id, message.result)
        elif isinstance(message, Died):
            self._end(EngineDead(f"the engine process's step failed: {message.description}"))
        else:
            logger.error("engine process %s sent an unexpected %s", self._process.process.pid, type(message))

    def _lost(self) -> None:
        if self._stopping or self._ended:
            self._stop_reading()
            return
        process = self._process.process
        process.join(1.0)  # the pipe closes as the process exits: its status is there a moment later
        self._end(EngineDead(f"the engine process {process.pid} exited (code {process.exitcode})"))

    def _end(self, error: BaseException) -> None:
        if self._ended:
            return
        self._ended = True
        self._stop_reading()
        logger.critical("%s", error)
        self._callbacks.on_dead(error)

    def _stop_reading(self) -> None:
        try:
            self._loop.remove_reader(self._fd)
        except (ValueError, OSError):  # the loop or the descriptor is already closed
            pass
