"""An A2A 1.0 server built with the official a2a-sdk, unmodified.

Run by agent-connector/tests/a2a_interop.rs as the local A2A server behind
connector B's driver. It binds 127.0.0.1 on a free port and prints
``READY <port>`` on stdout once it serves.

``--public-url`` sets the base URL of the card's interfaces (a proxy in
front of it); ``--no-streaming`` makes its card say it does not stream.
``--binding`` chooses what it serves, and its card lists: ``jsonrpc`` (the
default) the JSON-RPC binding at ``/a2a/jsonrpc``, ``rest`` only the
HTTP+JSON binding at ``/a2a/rest`` (the SDK's REST routes), ``both`` the
two, HTTP+JSON first.

What it does is chosen by the prefix of the message id:

- ``stream-``: working, three progress updates, a text artifact in two
  chunks (append, lastChunk), completed with a message;
- ``gated-``: working, ``step 1``, ``step 2``, then waits until
  ``POST /test/gates/<messageId>`` is called, then ``step 3``, ``step 4``,
  an artifact, completed (lets a client drop its stream mid-task without
  any timing guess);
- ``hold-``: working, then waits to be canceled;
- ``ask-``: input-required ("which branch?"); the follow-up message's text
  completes the task with an artifact ``branch <text>``;
- ``message-``: answers with a message, no task;
- ``fail-``: failed with a message;
- ``race-``: working, then progress ``tick 1``, ``tick 2``, ... one per
  millisecond (200 at most, then completed) until canceled; its cancel
  handler emits the progress ``cancel seen`` and then the canceled status.
  Every progress it emitted before its terminal is recorded, in order, and
  served at ``GET /test/emitted/<messageId>`` (``{"emitted": [...],
  "terminal": "<state>"}``), so a test can compare it with what the caller
  received;
- ``paced-<N>-<MS>-``: working, then progress ``tick 1`` ... ``tick N``,
  one every MS milliseconds, then an artifact ``result`` and completed
  (canceled when asked, as ``race-``); recorded and served at
  ``GET /test/emitted/<messageId>`` like ``race-``. Work that goes on while
  whoever follows it restarts;
- ``bench-stream-<N>-``: the benchmark mode (``bench.py``): N events as fast
  as it can, no sleeps, alternating a working status update (message text
  ``bench <i> <t>``) and an artifact chunk (text ``<i> <t>``, appended to the
  artifact ``bench``), then completed. ``<t>`` is ``time.time_ns()`` when the
  event was made, so a client on the same machine can compute the latency;
  the same value is in the event's metadata (``benchSentNs``);
- ``big-<N>-<C>-``: working, then an artifact ``big`` of N bytes of text
  in chunks of C bytes (the first chunk new, the others appended, the last
  one ``lastChunk``), then completed; canceled between two chunks when
  asked (an output larger than the delegation's budget);
- anything else: completed, echoing the text.

Every request's ``traceparent`` header (W3C Trace Context), when it has
one, is recorded with the request's method and path and served at
``GET /test/traceparents`` (``[{"traceparent": ..., "method": ...,
"path": ...}]``), so a test can see what trace reached the agent.
"""

import argparse
import asyncio
import logging
import socket
import sys
import time

import uvicorn

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from a2a.server.agent_execution.agent_executor import AgentExecutor
from a2a.server.agent_execution.context import RequestContext
from a2a.server.events.event_queue import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes, create_rest_routes
from a2a.server.tasks.inmemory_task_store import InMemoryTaskStore
from a2a.server.tasks.task_updater import TaskUpdater
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentSkill,
    Message,
    Part,
    Role,
    Task,
    TaskState,
    TaskStatus,
)

logger = logging.getLogger("sample_agent")

GATES: dict[str, asyncio.Event] = {}
TRACEPARENTS: list[dict[str, str]] = []


class RecordTraceparent:
    """ASGI middleware: records each request's ``traceparent`` header."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            for name, value in scope.get("headers", []):
                if name == b"traceparent":
                    TRACEPARENTS.append(
                        {"traceparent": value.decode("latin-1"), "method": scope["method"], "path": scope["path"]}
                    )
        await self.app(scope, receive, send)


class Race:
    """What a ``race-`` task emitted before its terminal.

    The lock orders each progress against the terminal: nothing is emitted
    (or recorded) once the terminal is in the queue.
    """

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.emitted: list[str] = []
        self.terminal: str | None = None

    async def progress(self, updater: TaskUpdater, text: str) -> bool:
        async with self.lock:
            if self.terminal is not None:
                return False
            await updater.update_status(TaskState.TASK_STATE_WORKING, updater.new_agent_message([Part(text=text)]))
            self.emitted.append(text)
            return True

    async def end(self, updater: TaskUpdater, state: str, artifact: str | None = None) -> None:
        async with self.lock:
            if self.terminal is not None:
                return
            self.terminal = state
            if artifact is not None and state != "canceled":
                await updater.add_artifact([Part(text=artifact)], artifact_id="result", name="result", last_chunk=True)
            if state == "canceled":
                await updater.cancel(updater.new_agent_message([Part(text="canceled as asked")]))
            else:
                await updater.complete(updater.new_agent_message([Part(text="ticked to the end")]))


# Races by message id (for the test) and by task id (for the cancel handler).
RACES: dict[str, Race] = {}
RACES_BY_TASK: dict[str, Race] = {}


def gate(name: str) -> asyncio.Event:
    return GATES.setdefault(name, asyncio.Event())


class SampleExecutor(AgentExecutor):
    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        message = context.message
        task_id = context.task_id
        context_id = context.context_id
        if message is None or not task_id or not context_id:
            return
        mid = message.message_id
        updater = TaskUpdater(event_queue=event_queue, task_id=task_id, context_id=context_id)
        current = context.current_task

        if mid.startswith("message-"):
            await event_queue.enqueue_event(
                Message(
                    role=Role.ROLE_AGENT,
                    message_id=f"reply-{mid}",
                    context_id=context_id,
                    parts=[Part(text=f"direct answer to {context.get_user_input()}")],
                )
            )
            return

        if current is not None and current.status.state == TaskState.TASK_STATE_INPUT_REQUIRED:
            # The answer to "which branch?". "again" asks once more, with no
            # message: the state the task re-enters is the only news.
            branch = context.get_user_input()
            if branch == "again":
                await updater.requires_input()
                return
            await updater.start_work(updater.new_agent_message([Part(text="resuming")]))
            await updater.add_artifact([Part(text=f"branch {branch}")], name="answer", last_chunk=True)
            await updater.complete(updater.new_agent_message([Part(text="done")]))
            return

        if current is None:
            await event_queue.enqueue_event(
                Task(
                    id=task_id,
                    context_id=context_id,
                    status=TaskStatus(state=TaskState.TASK_STATE_SUBMITTED),
                    history=[message],
                )
            )

        if mid.startswith("stream-"):
            await updater.start_work(updater.new_agent_message([Part(text="starting")]))
            for i in range(1, 4):
                await updater.update_status(
                    TaskState.TASK_STATE_WORKING,
                    updater.new_agent_message([Part(text=f"progress {i}")]),
                )
            await updater.add_artifact([Part(text="chunk-1 ")], artifact_id="out", name="out")
            await updater.add_artifact(
                [Part(text="chunk-2")], artifact_id="out", name="out", append=True, last_chunk=True
            )
            await updater.complete(updater.new_agent_message([Part(text="streamed")]))
        elif mid.startswith("big-"):
            total, chunk = (int(x) for x in mid.split("-")[1:3])
            await updater.start_work()
            sent = 0
            while sent < total:
                n = min(chunk, total - sent)
                await updater.add_artifact(
                    [Part(text="x" * n)],
                    artifact_id="big",
                    name="big",
                    append=sent > 0,
                    last_chunk=sent + n >= total,
                )
                sent += n
            await updater.complete()
        elif mid.startswith("bench-stream-"):
            await bench_stream(updater, int(mid.split("-")[2]))
        elif mid.startswith("gated-"):
            await updater.start_work()
            for i in (1, 2):
                await updater.update_status(
                    TaskState.TASK_STATE_WORKING, updater.new_agent_message([Part(text=f"step {i}")])
                )
            await gate(mid).wait()
            for i in (3, 4):
                await updater.update_status(
                    TaskState.TASK_STATE_WORKING, updater.new_agent_message([Part(text=f"step {i}")])
                )
            await updater.add_artifact([Part(text="gated result")], artifact_id="result", name="result", last_chunk=True)
            await updater.complete()
        elif mid.startswith("paced-"):
            n, ms = (int(x) for x in mid.split("-")[1:3])
            race = RACES.setdefault(mid, Race())
            RACES_BY_TASK[task_id] = race
            await updater.start_work()
            for i in range(1, n + 1):
                await asyncio.sleep(ms / 1000)
                if not await race.progress(updater, f"tick {i}"):
                    return
            await race.end(updater, "completed", artifact=f"{n} ticks")
        elif mid.startswith("race-"):
            race = RACES.setdefault(mid, Race())
            RACES_BY_TASK[task_id] = race
            await updater.start_work()
            for i in range(1, 201):
                if not await race.progress(updater, f"tick {i}"):
                    return
                # Paced like real work, so the cancel lands mid-stream.
                await asyncio.sleep(0.001)
            await race.end(updater, "completed")
        elif mid.startswith("hold-"):
            await updater.start_work(updater.new_agent_message([Part(text="holding")]))
            # Held until canceled: the framework cancels this coroutine.
            await asyncio.Event().wait()
        elif mid.startswith("ask-"):
            await updater.requires_input(updater.new_agent_message([Part(text="which branch?")]))
        elif mid.startswith("fail-"):
            await updater.start_work()
            await updater.failed(updater.new_agent_message([Part(text="it broke")]))
        else:
            await updater.add_artifact([Part(text=f"echo: {context.get_user_input()}")], name="echo")
            await updater.complete(updater.new_agent_message([Part(text="Hello from the sample agent")]))

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        updater = TaskUpdater(
            event_queue=event_queue, task_id=context.task_id or "", context_id=context.context_id or ""
        )
        race = RACES_BY_TASK.get(context.task_id or "")
        if race is not None:
            # Progress after the cancel arrived, then the terminal.
            await race.progress(updater, "cancel seen")
            await race.end(updater, "canceled")
            return
        await updater.cancel(updater.new_agent_message([Part(text="canceled as asked")]))


async def bench_stream(updater: TaskUpdater, n: int) -> None:
    """N events as fast as the SDK takes them, each stamped when made."""
    for i in range(n):
        t = time.time_ns()
        meta = {"benchSentNs": str(t), "benchIndex": i}
        if i % 2 == 0:
            await updater.update_status(
                TaskState.TASK_STATE_WORKING,
                updater.new_agent_message([Part(text=f"bench {i} {t}")]),
                metadata=meta,
            )
        else:
            await updater.add_artifact(
                [Part(text=f"{i} {t} ")],
                artifact_id="bench",
                name="bench",
                append=i > 1,
                metadata=meta,
            )
    await updater.complete(updater.new_agent_message([Part(text="bench done")]))


async def open_gate(request: Request) -> JSONResponse:
    gate(request.path_params["name"]).set()
    return JSONResponse({"opened": request.path_params["name"]})


async def emitted(request: Request) -> JSONResponse:
    race = RACES.get(request.path_params["name"])
    if race is None:
        return JSONResponse({"error": "no such race"}, status_code=404)
    async with race.lock:
        return JSONResponse({"emitted": race.emitted, "terminal": race.terminal})


async def traceparents(request: Request) -> JSONResponse:
    return JSONResponse(TRACEPARENTS)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--binding", choices=["jsonrpc", "rest", "both"], default="jsonrpc")
    parser.add_argument("--no-streaming", action="store_true", help="a card without capabilities.streaming")
    parser.add_argument("--public-url", default="", help="the base URL in the card (default: its own)")
    args = parser.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    port = sock.getsockname()[1]
    base = args.public_url.rstrip("/") or f"http://{args.host}:{port}"
    rest = AgentInterface(protocol_binding="HTTP+JSON", protocol_version="1.0", url=f"{base}/a2a/rest")
    jsonrpc = AgentInterface(protocol_binding="JSONRPC", protocol_version="1.0", url=f"{base}/a2a/jsonrpc")
    interfaces = {"jsonrpc": [jsonrpc], "rest": [rest], "both": [rest, jsonrpc]}[args.binding]
    card = AgentCard(
        name="OAB interop sample agent",
        description="An official a2a-sdk server used by the OAB relay's interop test.",
        version="1.0.0",
        supported_interfaces=interfaces,
        capabilities=AgentCapabilities(streaming=not args.no_streaming, push_notifications=False),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="sample", name="Sample", description="Streams, asks, holds.", tags=["test"])],
    )
    handler = DefaultRequestHandler(agent_executor=SampleExecutor(), task_store=InMemoryTaskStore(), agent_card=card)
    # The test routes come before the REST routes: those end with a
    # catch-all `/{tenant}` mount.
    routes = [
        *create_agent_card_routes(agent_card=card),
        Route("/test/gates/{name}", open_gate, methods=["POST"]),
        Route("/test/emitted/{name}", emitted, methods=["GET"]),
        Route("/test/traceparents", traceparents, methods=["GET"]),
    ]
    if args.binding in ("jsonrpc", "both"):
        routes += create_jsonrpc_routes(request_handler=handler, rpc_url="/a2a/jsonrpc")
    if args.binding in ("rest", "both"):
        routes += create_rest_routes(request_handler=handler, path_prefix="/a2a/rest")
    app = RecordTraceparent(Starlette(routes=routes))
    config = uvicorn.Config(app, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if serving.done():
            serving.result()
            return
        await asyncio.sleep(0.01)
    print(f"READY {port}", flush=True)
    await serving


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    asyncio.run(main())
