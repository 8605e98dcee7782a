"""An engine in a process of its own: the model, its KV cache and its EngineLoop live in a child process;
the server's process keeps the tokenizer, chat template and grammar checks (RemoteModelInstance) and
talks to the child over a pipe (frontend/process_client.py), as vLLM's V1 engine core does.

Why: the server's event loop parses requests and streams every token, and a CUDA replica's engine runs
~1-4 ms of Python around each graph replay; in one process the two take turns on one GIL, and the served
2B row's waves spent half their time there (benchmarks/RESULTS.md, 2026-11-27 06:00). In two processes
each has its own interpreter.

The seam is the EngineLoop's (engine/loop.py): the inbox commands of engine/messages.py go down the
pipe; what the loop publishes comes back as the messages below. All of them pickle (no tensors, no
asyncio objects). The child is spawned (never forked: a CUDA context does not survive a fork), ignores
SIGINT and SIGTERM (the server stops it with a Shutdown command after its drain; past a timeout, SIGKILL),
and shuts down when the pipe closes, so a server that dies without a word leaves no engine behind.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from bitserve import heap
from bitserve.config import EngineConfig, SchedulerConfig
from bitserve.core.step_outputs import KVCacheStats
from bitserve.engine.devices import CPU
from bitserve.engine.instance import ModelInstance, ServedModelParts, text_side
from bitserve.engine.loop import EngineLoop
from bitserve.engine.messages import Shutdown, StepResult
from bitserve.errors import BitserveError, InvalidRequest, ModelLoadError
from bitserve.loader.catalog import resolve_model
from bitserve.loader.gguf_reader import GGUFFile, read_gguf
from bitserve.log import configure_logging
from bitserve.models.spec import ModelSpec
from bitserve.structured.grammars import GrammarCompiler
from bitserve.tokenizer.chat_template import ChatTemplate
from bitserve.tokenizer.gguf_vocab import GGUFTokenizer

logger = logging.getLogger(__name__)

CLOSE_GRACE_S = 1.0  # close() after the client's own wait: a last moment before SIGKILL
PIPE_BUFFER_BYTES = 4 * 1024 * 1024
READY_POLL_S = 0.5  # how often a load that has not answered yet checks that its process still lives
STOP_TIMEOUT_S = 10.0  # after Shutdown, before SIGKILL (the engine's step in flight has finished by then)


def uses_engine_process(mode: str, device: str) -> bool:
    """ServerConfig.engine_process ("auto": CUDA replicas only) for a replica on `device`."""
    return mode == "on" or (mode == "auto" and device != CPU)


# ---------------------------------------------------------------- messages, child -> server


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the server shows of a replica whose engine it cannot reach into (fixed at load)."""

    spec: ModelSpec
    max_model_len: int
    scheduler_config: SchedulerConfig
    backend_name: str
    backend_description: dict[str, str]
    kv_cache_description: dict[str, int | str]
    kv_cache_bytes: int
    kv_cache_stats: KVCacheStats


@dataclass(frozen=True, slots=True)
class Ready:
    facts: EngineFacts


@dataclass(frozen=True, slots=True)
class LoadFailed:
    error: BaseException


@dataclass(frozen=True, slots=True)
class Stepped:
    result: StepResult
    kv_cache: KVCacheStats  # read after the step: what /health shows until the next one


@dataclass(frozen=True, slots=True)
class Rejected:
    request_id: str
    error: BitserveError


@dataclass(frozen=True, slots=True)
class Embedded:
    request_id: str
    result: list[list[float]] | BitserveError


@dataclass(frozen=True, slots=True)
class Died:
    description: str  # "TypeName: message" of what escaped the step (the traceback is in the child's log)


ChildMessage = Ready | LoadFailed | Stepped | Rejected | Embedded | Died


# ---------------------------------------------------------------- the child


def facts_of(instance: ModelInstance) -> EngineFacts:
    return EngineFacts(
        spec=instance.loaded.spec,
        max_model_len=instance.max_model_len,
        scheduler_config=instance.scheduler_config,
        backend_name=instance.loaded.backend.name,
        backend_description=instance.loaded.backend.describe(),
        kv_cache_description=instance.kv_cache_description,
        kv_cache_bytes=instance.kv_cache_bytes,
        kv_cache_stats=instance.engine.kv_cache_stats(),
    )


def sendable(error: BaseException) -> BaseException:
    """`error` if it pickles, else a ModelLoadError that names it (a library's exception may not)."""
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001 - any failure to pickle means: describe it instead
        return ModelLoadError(f"{type(error).__name__}: {error}")
    return error


def run_engine_process(config: EngineConfig, conn: Connection, log_level: str, log_format: str) -> None:
    """The child's entry point: load the model, say Ready (or LoadFailed), run the engine loop until
    Shutdown or the pipe closes. Exit status 1 when the engine died."""
    # Ctrl-C, or a supervisor's SIGTERM to the whole process group, must not cut the requests the server
    # is draining: the server sends Shutdown when its drain is done (and a dead server closes the pipe)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    configure_logging(log_level, log_format)
    try:
        instance = ModelInstance.load(config)
    except BaseException as exc:  # noqa: BLE001 - every load failure is reported to the server
        conn.send(LoadFailed(sendable(exc)))
        return
    heap.freeze(f"engine process {os.getpid()}")  # this process serves this one model for its life
    try:
        died = serve_engine(instance, conn)
    finally:
        instance.close()
    if died:
        sys.exit(1)


def serve_engine(instance: ModelInstance, conn: Connection) -> bool:
    """Run `instance`'s engine loop with its results sent down `conn`; True if the engine died."""
    engine = instance.engine
    died = threading.Event()

    def die(error: BaseException) -> None:
        died.set()
        try:
            conn.send(Died(f"{type(error).__name__}: {error}"))
        except OSError:  # the server is gone too
            pass

    loop = EngineLoop(
        engine,
        publish=lambda result: conn.send(Stepped(result, engine.kv_cache_stats())),
        reject=lambda request_id, error: conn.send(Rejected(request_id, error)),
        die=die,
        embedded=lambda request_id, result: conn.send(Embedded(request_id, result)),
    )
    conn.send(Ready(facts_of(instance)))
    threading.Thread(
        target=forward_commands, args=(conn, loop), name="bitserve-engine-inbox", daemon=True
    ).start()
    loop.run()
    return died.is_set()


def forward_commands(conn: Connection, loop: EngineLoop) -> None:
    """The server's commands (a list a message: ProcessEngineClient._flush) -> the loop's inbox, until
    the pipe closes (then Shutdown)."""
    while True:
        try:
            commands = conn.recv()
        except (EOFError, OSError):
            loop.inbox.put(Shutdown())
            return
        for command in commands:
            loop.inbox.put(command)


# ---------------------------------------------------------------- the server's side


class EngineProcess:
    """The server's handle on one engine process: the process, its end of the pipe, its facts."""

    def __init__(self, process: BaseProcess, conn: Connection, facts: EngineFacts) -> None:
        self.process = process
        self.conn = conn
        self.facts = facts

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Wait for the process to end (after a Shutdown was sent), else kill it."""
        stop_process(self.process, self.conn, timeout_s)


def stop_process(process: BaseProcess, conn: Connection, timeout_s: float) -> None:
    process.join(timeout_s)
    if process.is_alive():  # it ignores SIGTERM (run_engine_process)
        logger.warning("engine process %s did not stop in %.0f s: killing it", process.pid, timeout_s)
        process.kill()
        process.join()
    conn.close()


@dataclass(frozen=True, slots=True)
class BackendFacts:
    """The replica's kernel backend as /health and /v1/models show it (KernelBackend's name, describe)."""

    name: str
    description: dict[str, str]

    def describe(self) -> dict[str, str]:
        return dict(self.description)


@dataclass(frozen=True, slots=True)
class RemoteLoad:
    """The parts of a LoadResult the frontend reads: the file's metadata and tensor table (this process's
    own read-only map of it), the model's spec and the backend's description."""

    gguf: GGUFFile
    spec: ModelSpec
    backend: BackendFacts


@dataclass(eq=False)
class RemoteModelInstance(ServedModelParts):
    """A ModelInstance whose engine runs in a process of its own (its weights and KV cache are there)."""

    name: str
    path: Path
    loaded: RemoteLoad
    tokenizer: GGUFTokenizer
    chat_template: ChatTemplate | InvalidRequest
    config: EngineConfig
    max_model_len: int
    scheduler_config: SchedulerConfig
    grammars: GrammarCompiler  # validates guides at the edge; the child compiles them for the steps
    engine_process: EngineProcess

    @property
    def kv_cache_bytes(self) -> int:
        return self.engine_process.facts.kv_cache_bytes

    @property
    def kv_cache_description(self) -> dict[str, int | str]:
        return dict(self.engine_process.facts.kv_cache_description)

    def close(self) -> None:
        """Stop the engine process and unmap the file. Its client sent Shutdown and waited for the
        process (AsyncEngine.shutdown, in a worker thread); what still runs a moment later is killed,
        since this runs on the event loop."""
        self.engine_process.stop(timeout_s=CLOSE_GRACE_S)
        self.loaded.gguf.close()


# What the frontend serves a replica through: its engine a thread here, or a process of its own
ServedModel = ModelInstance | RemoteModelInstance


def start_engine_process(
    config: EngineConfig, *, log_level: str = "INFO", log_format: str = "json"
) -> RemoteModelInstance:
    """Spawn a process that loads `config`'s model and runs its engine; build the text side here while it
    loads. Blocks until the model is ready (a worker thread's call). Raises what the load raised."""
    path = resolve_model(config.model.model)
    context = multiprocessing.get_context("spawn")
    conn, child_conn = context.Pipe(duplex=True)
    widen_pipe(conn)
    widen_pipe(child_conn)
    process = context.Process(
        target=run_engine_process,
        args=(config, child_conn, log_level, log_format),
        name=f"bitserve-engine-{config.model.device}",
        daemon=True,
    )
    process.start()
    child_conn.close()
    logger.info("engine process %s loading %s on %s", process.pid, path.name, config.model.device)
    gguf: GGUFFile | None = None
    try:
        gguf = read_gguf(path)
        facts = wait_ready(process, conn)
        tokenizer, chat_template = text_side(config, path, gguf.metadata, facts.spec)
    except BaseException:
        if gguf is not None:
            gguf.close()
        stop_process(process, conn, timeout_s=0.0)
        raise
    return RemoteModelInstance(
        name=config.model.model,
        path=path,
        loaded=RemoteLoad(gguf, facts.spec, BackendFacts(facts.backend_name, facts.backend_description)),
        tokenizer=tokenizer,
        chat_template=chat_template,
        config=config,
        max_model_len=facts.max_model_len,
        scheduler_config=facts.scheduler_config,
        grammars=GrammarCompiler(tokenizer, facts.spec.vocab_size),
        engine_process=EngineProcess(process, conn, facts),
    )


def widen_pipe(conn: Connection) -> None:
    """Ask for PIPE_BUFFER_BYTES of socket buffer each way (the kernel caps it at net.core.wmem_max /
    rmem_max; the default is ~200 KB, about 100 messages, each charged ~2 KB): a burst of step results or
    commands then waits in the kernel, not in a blocked write on either side."""
    sock = socket.socket(fileno=os.dup(conn.fileno()))  # the same socket: its options are the pipe's
    try:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, PIPE_BUFFER_BYTES)
    finally:
        sock.close()


def exited_while_loading(process: BaseProcess) -> ModelLoadError:
    return ModelLoadError(
        f"the engine process exited with code {process.exitcode} while loading the model",
        hint="see the server log for the engine process's last lines",
    )


def wait_ready(process: BaseProcess, conn: Connection) -> EngineFacts:
    """The child's first message: its facts, or the load's error raised here."""
    while not conn.poll(READY_POLL_S):
        if not process.is_alive():
            raise exited_while_loading(process)
    try:
        message: Any = conn.recv()
    except EOFError:
        process.join(STOP_TIMEOUT_S)
        raise exited_while_loading(process) from None
    if isinstance(message, LoadFailed):
        raise message.error
    if not isinstance(message, Ready):
        raise ModelLoadError(f"the engine process answered {type(message).__name__} before Ready")
    return message.facts
