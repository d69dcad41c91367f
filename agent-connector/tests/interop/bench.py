"""SSE streaming benchmark with the official a2a-sdk client.

Run by agent-connector/tests/a2a_bench.rs twice in one run: against the
sample server directly (``sample_agent.py``) and against the OAB facade's
per-peer URL (facade -> relay -> driver -> the same sample server).

Each task is one ``SendStreamingMessage`` whose message id is
``bench-stream-<N>-<uuid>``: the sample agent then streams N events
(alternating a working status update and an artifact chunk) as fast as it
can, then completes. ``--tasks`` such tasks run with at most
``--concurrency`` streams open at a time, after ``--warmup`` unmeasured ones.

What is measured (all on this machine's clocks):

- ``events_per_s``: bench events received (the N per task, not the task
  snapshot or the final status) over the wall time of the measured run;
- ``latency_ms``: per bench event, receipt - send, where send is the
  server's ``time.time_ns()`` when the executor made the event (before the
  SDK queued it; carried in the event's text) and receipt is
  ``time.time_ns()`` when the SDK client yielded the parsed event. It holds
  every hop: the server SDK's queue and task store, its SSE encoding, (the
  driver, connector B, the relay, connector A and the facade,) the client
  SDK's parsing, and any queueing under load;
- ``ttfe_ms``: from the call of ``send_message`` to the first event of any
  kind (the task); ``ttfbe_ms``: to the first bench event;
- ``task_ms``: from the call to the end of the stream.

With ``--blocking`` each task is instead one blocking ``SendMessage``
(no streaming) whose message id is ``bench-blocking-<uuid>``: the sample
agent completes it at once with an echo artifact. ``tasks_per_s`` and
``task_ms`` (the call to its answer) are then what counts; there are no
bench events.

Percentiles are nearest-rank. Prints one JSON object on stdout.
"""

import argparse
import asyncio
import json
import math
import resource
import socket
import sys
import time
import uuid

import httpx

from a2a.client import ClientConfig, create_client
from a2a.types import Message, Part, Role, SendMessageRequest, TaskState

STEP = 60.0


def pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(p / 100.0 * len(s)) - 1))
    return round(s[k], 3)


def summary(values: list[float]) -> dict:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "p99": pct(values, 99),
        "max": round(max(values), 3) if values else None,
        "mean": round(sum(values) / len(values), 3) if values else None,
    }


def stamp(ev) -> int | None:
    """The server's send time of a bench event, from its text."""
    kind = ev.WhichOneof("payload")
    if kind == "status_update":
        parts = ev.status_update.status.message.parts
        if parts:
            fields = parts[0].text.split()
            if len(fields) == 3 and fields[0] == "bench":
                return int(fields[2])
    elif kind == "artifact_update":
        parts = ev.artifact_update.artifact.parts
        if parts:
            fields = parts[0].text.split()
            if len(fields) == 2:
                return int(fields[1])
    return None


class Stats:
    def __init__(self) -> None:
        self.latency: list[float] = []
        self.ttfe: list[float] = []
        self.ttfbe: list[float] = []
        self.task: list[float] = []
        self.bench_events = 0
        self.all_events = 0
        self.ok = 0
        self.failed: list[str] = []


async def one(client, n: int, stats: Stats | None) -> None:
    mid = f"bench-stream-{n}-{uuid.uuid4().hex}"
    req = SendMessageRequest(message=Message(role=Role.ROLE_USER, message_id=mid, parts=[Part(text="go")]))
    t0 = time.perf_counter()
    first = None
    first_bench = None
    got = 0
    events = 0
    lat: list[float] = []
    last_state = None
    gen = client.send_message(req)
    try:
        while True:
            try:
                ev = await asyncio.wait_for(gen.__anext__(), STEP)
            except StopAsyncIteration:
                break
            now_ns = time.time_ns()
            now = time.perf_counter()
            events += 1
            if first is None:
                first = now
            sent = stamp(ev)
            if sent is not None:
                got += 1
                if first_bench is None:
                    first_bench = now
                lat.append((now_ns - sent) / 1e6)
            kind = ev.WhichOneof("payload")
            if kind == "status_update":
                last_state = ev.status_update.status.state
            elif kind == "task":
                last_state = ev.task.status.state
    finally:
        await gen.aclose()
    end = time.perf_counter()
    if stats is None:
        return
    stats.all_events += events
    stats.bench_events += got
    stats.latency.extend(lat)
    if first is not None:
        stats.ttfe.append((first - t0) * 1e3)
    if first_bench is not None:
        stats.ttfbe.append((first_bench - t0) * 1e3)
    stats.task.append((end - t0) * 1e3)
    if got == n and last_state == TaskState.TASK_STATE_COMPLETED:
        stats.ok += 1
    else:
        stats.failed.append(f"{mid}: {got}/{n} events, last state {TaskState.Name(last_state or 0)}")


async def one_blocking(client, stats: Stats | None) -> None:
    mid = f"bench-blocking-{uuid.uuid4().hex}"
    req = SendMessageRequest(message=Message(role=Role.ROLE_USER, message_id=mid, parts=[Part(text="go")]))
    t0 = time.perf_counter()
    last_state = None
    async for ev in client.send_message(req):
        kind = ev.WhichOneof("payload")
        if kind == "task":
            last_state = ev.task.status.state
        elif kind == "status_update":
            last_state = ev.status_update.status.state
    end = time.perf_counter()
    if stats is None:
        return
    stats.task.append((end - t0) * 1e3)
    if last_state == TaskState.TASK_STATE_COMPLETED:
        stats.ok += 1
    else:
        stats.failed.append(f"{mid}: last state {TaskState.Name(last_state or 0)}")


async def run(args) -> dict:
    transport = None
    if args.nodelay:
        transport = httpx.AsyncHTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    http = httpx.AsyncClient(
        transport=transport,
        timeout=httpx.Timeout(STEP),
        limits=httpx.Limits(max_connections=args.concurrency + 4, max_keepalive_connections=args.concurrency + 4),
    )
    client = await create_client(args.url, ClientConfig(streaming=not args.blocking, httpx_client=http))

    async def worker(queue: asyncio.Queue, stats: Stats | None) -> None:
        while True:
            try:
                queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            try:
                if args.blocking:
                    await one_blocking(client, stats)
                else:
                    await one(client, args.events, stats)
            except Exception as e:  # a failed task is counted, the run goes on
                if stats is not None:
                    stats.failed.append(f"{type(e).__name__}: {e}")

    async def batch(count: int, stats: Stats | None) -> float:
        queue: asyncio.Queue = asyncio.Queue()
        for i in range(count):
            queue.put_nowait(i)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(queue, stats) for _ in range(min(args.concurrency, count))))
        return time.perf_counter() - t0

    if args.warmup:
        await batch(args.warmup, None)
    stats = Stats()
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    wall = await batch(args.tasks, stats)
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    await http.aclose()
    return {
        "label": args.label,
        "url": args.url,
        "mode": "blocking" if args.blocking else "stream",
        "events_per_task": 0 if args.blocking else args.events,
        "tasks": args.tasks,
        "concurrency": args.concurrency,
        "warmup": args.warmup,
        "wall_s": round(wall, 4),
        "tasks_ok": stats.ok,
        "tasks_failed": len(stats.failed),
        "failures": stats.failed[:5],
        "bench_events": stats.bench_events,
        "all_events": stats.all_events,
        "events_per_s": round(stats.bench_events / wall, 1) if wall > 0 else None,
        "tasks_per_s": round(stats.ok / wall, 2) if wall > 0 else None,
        "latency_ms": summary(stats.latency),
        "ttfe_ms": summary(stats.ttfe),
        "ttfbe_ms": summary(stats.ttfbe),
        "task_ms": summary(stats.task),
        "client_cpu_s": round(
            (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime), 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True, help="the agent's base URL (sample server or facade peer URL)")
    parser.add_argument("--events", type=int, default=50, help="events per task")
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=8, help="unmeasured tasks first")
    parser.add_argument("--label", default="")
    parser.add_argument("--blocking", action="store_true", help="blocking SendMessage tasks, no streaming")
    parser.add_argument("--nodelay", action="store_true", help="TCP_NODELAY on the client's sockets")
    args = parser.parse_args()
    json.dump(asyncio.run(run(args)), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
