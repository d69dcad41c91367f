"""The official a2a-sdk client against the OAB facade.

Run by agent-connector/tests/a2a_interop.rs with the facade's URL for the
callee peer and a transport (`--transport jsonrpc` or `http_json`: the SDK
client is restricted to that binding of the card). It resolves the agent
card through the facade, runs each scenario with the SDK's own client, and
prints one JSON object with what it saw; the Rust test asserts on it. It never sleeps to wait for a state: the
sample agent's gated tasks are released with an explicit call.
"""

import argparse
import asyncio
import json
import re
import sys
import uuid

import httpx

from google.protobuf.json_format import MessageToDict

from a2a.client import ClientCallContext, ClientConfig, create_client
from a2a.utils.constants import TransportProtocol
from a2a.types import (
    CancelTaskRequest,
    GetTaskRequest,
    ListTasksRequest,
    Message,
    Part,
    Role,
    SendMessageRequest,
    SubscribeToTaskRequest,
)

PROFILE = "https://oab.dev/a2a/ext/delegation/v1"
STEP = 30.0


def msg(prefix: str, text: str, task_id: str | None = None) -> Message:
    m = Message(role=Role.ROLE_USER, message_id=f"{prefix}{uuid.uuid4().hex}", parts=[Part(text=text)])
    if task_id:
        m.task_id = task_id
    return m


def describe(ev) -> dict:
    """One StreamResponse as a small dict: kind, state, seq, texts."""
    d = MessageToDict(ev)
    kind = next(iter(d)) if d else "empty"
    body = d.get(kind, {})
    out = {"kind": kind}
    status = body.get("status") or {}
    if status:
        out["state"] = status.get("state")
        texts = [p.get("text") for p in (status.get("message") or {}).get("parts", []) if "text" in p]
        if texts:
            out["text"] = " ".join(texts)
    if kind == "artifactUpdate":
        art = body.get("artifact", {})
        out["artifact"] = art.get("artifactId")
        out["parts"] = [p.get("text") for p in art.get("parts", [])]
        out["append"] = body.get("append", False)
        out["lastChunk"] = body.get("lastChunk", False)
    if kind == "message":
        out["text"] = " ".join(p.get("text", "") for p in body.get("parts", []))
    seq = ((body.get("metadata") or {}).get(PROFILE) or {}).get("seq")
    if seq is not None:
        out["seq"] = int(seq)
    if kind == "task":
        out["id"] = body.get("id")
    return out


def task_dict(task) -> dict:
    d = MessageToDict(task)
    return {
        "id": d.get("id"),
        "contextId": d.get("contextId"),
        "state": (d.get("status") or {}).get("state"),
        "artifacts": [[p.get("text") for p in a.get("parts", [])] for a in d.get("artifacts", [])],
        "history": len(d.get("history", [])),
        "metadata": d.get("metadata"),
    }


async def collect(gen, until=None) -> list[dict]:
    out = []
    while True:
        try:
            ev = await asyncio.wait_for(gen.__anext__(), STEP)
        except StopAsyncIteration:
            return out
        out.append(describe(ev))
        if until and until(out):
            await gen.aclose()
            return out


BINDINGS = {"jsonrpc": TransportProtocol.JSONRPC, "http_json": TransportProtocol.HTTP_JSON}


async def run(facade_url: str, agent_url: str, transport: str) -> dict:
    results: dict = {}
    # Every request the SDK sends, as "METHOD route" relative to the peer
    # base (task ids as {id}), so the test sees which binding was spoken.
    base_path = httpx.URL(facade_url).path.rstrip("/")
    routes: set[str] = set()

    async def record(request: httpx.Request) -> None:
        path = request.url.path
        rel = path[len(base_path):] if path.startswith(base_path) else path
        routes.add(f"{request.method} {re.sub(r'^/tasks/[^/:]+', '/tasks/{id}', rel) or '/'}")

    sdk_http = httpx.AsyncClient(timeout=STEP, event_hooks={"request": [record]})
    only = [BINDINGS[transport]]

    def config(**kw) -> ClientConfig:
        return ClientConfig(supported_protocol_bindings=only, httpx_client=sdk_http, **kw)

    streaming = await create_client(facade_url, config())
    blocking = await create_client(facade_url, config(streaming=False))
    polling = await create_client(facade_url, config(streaming=False, polling=True))
    profile = ClientCallContext(service_parameters={"A2A-Extensions": PROFILE})
    http = httpx.AsyncClient(timeout=STEP)

    card = (await http.get(facade_url.rstrip("/") + "/.well-known/agent-card.json")).json()
    results["card"] = {
        "name": card.get("name"),
        "interface": card["supportedInterfaces"][0],
        "interfaces": card["supportedInterfaces"],
        "extensions": [e["uri"] for e in card["capabilities"].get("extensions", [])],
        "streaming": card["capabilities"].get("streaming"),
    }

    # 1. Streamed events of a task.
    results["streamed"] = await collect(streaming.send_message(SendMessageRequest(message=msg("stream-", "go"))))

    # 2. Blocking send, then GetTask.
    events = await collect(blocking.send_message(SendMessageRequest(message=msg("blocking-", "hello"))))
    task = MessageToDict(await blocking.get_task(GetTaskRequest(id=events[0]["id"], history_length=1)))
    results["blocking"] = {"events": events, "get": {
        "state": task["status"]["state"],
        "artifacts": [[p.get("text") for p in a.get("parts", [])] for a in task.get("artifacts", [])],
        "history": len(task.get("history", [])),
        "id": task["id"],
    }}

    # 3. A direct message answer.
    results["message"] = await collect(streaming.send_message(SendMessageRequest(message=msg("message-", "hi"))))

    # 4. Cancel a running task.
    events = await collect(polling.send_message(SendMessageRequest(message=msg("hold-", "hold on"))))
    hold_id = events[0]["id"]
    seen = await collect(
        streaming.subscribe(SubscribeToTaskRequest(id=hold_id)),
        until=lambda evs: any(e.get("text") == "holding" for e in evs),
    )
    canceled = await blocking.cancel_task(CancelTaskRequest(id=hold_id))
    try:
        await blocking.cancel_task(CancelTaskRequest(id=hold_id))
        again = "no error"
    except Exception as e:  # the SDK maps -32002 to its own error type
        again = type(e).__name__
    results["cancel"] = {"before": seen, "task": task_dict(canceled), "again": again}

    # 5. Input required, then the answer as a follow-up.
    first = await collect(blocking.send_message(SendMessageRequest(message=msg("ask-", "deploy?"))))
    ask_id = first[0]["id"]
    follow = await collect(streaming.send_message(SendMessageRequest(message=msg("answer-", "main", task_id=ask_id))))
    final = task_dict(await blocking.get_task(GetTaskRequest(id=ask_id)))
    results["input_required"] = {"first": first, "follow": follow, "final": final}

    # 6. A failing task.
    results["failed"] = await collect(streaming.send_message(SendMessageRequest(message=msg("fail-", "x"))))

    # 7. SubscribeToTask after dropping the stream mid-task, with the profile:
    # resume after the cursor, nothing missed.
    gen = streaming.send_message(SendMessageRequest(message=msg("gated-", "with profile")), context=profile)
    before = await collect(gen, until=lambda evs: any(e.get("text") == "step 2" for e in evs))
    task_id = before[0]["id"]
    cursor = max(e["seq"] for e in before if "seq" in e)
    # The first message's id is the gate's name.
    task_now = MessageToDict(await blocking.get_task(GetTaskRequest(id=task_id)))
    gated_mid = task_now["history"][0]["messageId"]
    await http.post(f"{agent_url}/test/gates/{gated_mid}")
    ctx = ClientCallContext(service_parameters={"A2A-Extensions": PROFILE, "Last-Event-ID": str(cursor)})
    after = await collect(streaming.subscribe(SubscribeToTaskRequest(id=task_id), context=ctx))
    results["resubscribe_profile"] = {"before": before, "cursor": cursor, "after": after}

    # 8. The same without the profile: snapshot first, then live.
    gen = streaming.send_message(SendMessageRequest(message=msg("gated-", "plain")))
    before = await collect(gen, until=lambda evs: any(e.get("text") == "step 2" for e in evs))
    task_id = before[0]["id"]
    gated_mid = MessageToDict(await blocking.get_task(GetTaskRequest(id=task_id)))["history"][0]["messageId"]
    sub = streaming.subscribe(SubscribeToTaskRequest(id=task_id))
    snapshot = describe(await asyncio.wait_for(sub.__anext__(), STEP))
    await http.post(f"{agent_url}/test/gates/{gated_mid}")
    live = await collect(sub)
    results["resubscribe_plain"] = {"before": before, "snapshot": snapshot, "live": live}
    try:
        await collect(streaming.subscribe(SubscribeToTaskRequest(id=task_id)))
        results["resubscribe_plain"]["terminal"] = "no error"
    except Exception as e:
        results["resubscribe_plain"]["terminal"] = type(e).__name__

    # 9. ListTasks with pagination.
    page1 = await blocking.list_tasks(ListTasksRequest(page_size=2))
    page2 = await blocking.list_tasks(ListTasksRequest(page_size=100, page_token=page1.next_page_token))
    results["list"] = {
        "page1": [t.id for t in page1.tasks],
        "next": page1.next_page_token,
        "total": page1.total_size,
        "page2": [t.id for t in page2.tasks],
        "next2": page2.next_page_token,
        "artifacts_in_list": any(len(t.artifacts) for t in page1.tasks),
    }

    # 10. Error classes as the SDK maps them.
    errors = {}
    for name, call in [
        ("get_unknown", lambda: blocking.get_task(GetTaskRequest(id="no-such-task"))),
        ("cancel_unknown", lambda: blocking.cancel_task(CancelTaskRequest(id="no-such-task"))),
        ("follow_up_finished", lambda: collect(
            blocking.send_message(SendMessageRequest(message=msg("late-", "more", task_id=ask_id))))),
    ]:
        try:
            await call()
            errors[name] = "no error"
        except Exception as e:
            errors[name] = type(e).__name__
    results["errors"] = errors
    results["routes"] = sorted(routes)
    await sdk_http.aclose()
    await http.aclose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--facade-url", required=True)
    parser.add_argument("--agent-url", required=True)
    parser.add_argument("--transport", choices=sorted(BINDINGS), default="jsonrpc")
    args = parser.parse_args()
    results = asyncio.run(run(args.facade_url, args.agent_url, args.transport))
    json.dump(results, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
