"""The A2A conformance kit's agent behind connector B, for `scripts/tck`.

The kit (a2aproject/a2a-tck) ships its system-under-test agent as
`sut/a2a-python/sut_agent.py`: an executor whose behaviour each test picks
with the message id's prefix. That file is generated against an unreleased
a2a-python layout (`a2a.server.apps`); this script loads its executor class
from the kit's checkout unchanged and serves it with the released SDK
(a2a-sdk 1.x, from `.venv`) on the bindings asked for, so the driver can be
run against an agent that offers JSON-RPC, HTTP+JSON or both.

    .venv/bin/python scripts/tck_agent.py --tck ../a2a-tck --port 9999 --bindings jsonrpc,rest

Nothing of the kit is copied into this repository: the executor is read from
the checkout given with `--tck` at run time.
"""

import argparse
import ast
import sys
from pathlib import Path

import uvicorn
from starlette.applications import Starlette

from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import (
    create_agent_card_routes,
    create_jsonrpc_routes,
    create_rest_routes,
)
from a2a.server.tasks.inmemory_task_store import InMemoryTaskStore
from a2a.types import (
    AgentCapabilities,
    AgentCard,
    AgentInterface,
    AgentProvider,
    AgentSkill,
)

JSONRPC_PATH = "/a2a/jsonrpc"
REST_PATH = "/a2a/rest"


def load_executor(tck: Path):
    """The kit's `TckAgentExecutor` class, read from its checkout.

    The generated file imports application classes by names the released SDK
    does not have, so it cannot be imported whole: its executor class and
    its module-level constants are compiled on their own, against the names
    the executor uses, imported here from the released SDK."""
    source = tck / "sut" / "a2a-python" / "sut_agent.py"
    if not source.is_file():
        sys.exit(f"tck_agent: {source} not found (is --tck an a2a-tck checkout, branch 1.0-dev?)")
    tree = ast.parse(source.read_text(), filename=str(source))
    kept = [
        node
        for node in tree.body
        if (isinstance(node, ast.ClassDef) and node.name == "TckAgentExecutor")
        or (isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets))
    ]
    if not any(isinstance(node, ast.ClassDef) for node in kept):
        sys.exit(f"tck_agent: no TckAgentExecutor class in {source}")
    import asyncio
    import logging

    from google.protobuf import json_format
    from google.protobuf.struct_pb2 import Value

    from a2a.server.agent_execution.agent_executor import AgentExecutor
    from a2a.server.agent_execution.context import RequestContext
    from a2a.server.events.event_queue import EventQueue
    from a2a.server.tasks.task_updater import TaskUpdater
    from a2a.types import Part, Task, TaskState, TaskStatus
    from a2a.utils.errors import A2AError, TaskNotCancelableError, UnsupportedOperationError

    namespace = {
        "__name__": "tck_sut_agent",
        "asyncio": asyncio,
        "logging": logging,
        "logger": logging.getLogger("TckSutAgent"),
        "json_format": json_format,
        "Value": Value,
        "AgentExecutor": AgentExecutor,
        "RequestContext": RequestContext,
        "EventQueue": EventQueue,
        "TaskUpdater": TaskUpdater,
        "Part": Part,
        "A2AError": A2AError,
        "TaskNotCancelableError": TaskNotCancelableError,
        "UnsupportedOperationError": UnsupportedOperationError,
    }
    module = ast.Module(body=kept, type_ignores=[])
    exec(compile(module, str(source), "exec"), namespace)
    kit_executor = namespace["TckAgentExecutor"]

    class Executor(kit_executor):
        """The kit's executor, with the task enqueued before its first
        update where the released SDK requires it (a message-only answer
        stays a message)."""

        async def execute(self, context, event_queue):
            message = context.message
            if (
                context.current_task is None
                and message is not None
                and context.task_id
                and context.context_id
                and not message.message_id.startswith("tck-message-response")
            ):
                await event_queue.enqueue_event(
                    Task(
                        id=context.task_id,
                        context_id=context.context_id,
                        status=TaskStatus(state=TaskState.TASK_STATE_SUBMITTED),
                        history=[message],
                    )
                )
            await super().execute(context, event_queue)

    return Executor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tck", required=True, type=Path, help="a2a-tck checkout (branch 1.0-dev)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9999)
    parser.add_argument(
        "--bindings",
        default="jsonrpc,rest",
        help="comma-separated, in the card's order of preference: jsonrpc, rest",
    )
    args = parser.parse_args()
    bindings = [b.strip() for b in args.bindings.split(",") if b.strip()]
    unknown = [b for b in bindings if b not in ("jsonrpc", "rest")]
    if unknown or not bindings:
        sys.exit(f"tck_agent: --bindings takes jsonrpc and/or rest, not {args.bindings!r}")

    base = f"http://{args.host}:{args.port}"
    interfaces = []
    for binding in bindings:
        if binding == "jsonrpc":
            interfaces.append(
                AgentInterface(url=base + JSONRPC_PATH, protocol_binding="JSONRPC", protocol_version="1.0")
            )
        else:
            interfaces.append(
                AgentInterface(url=base + REST_PATH, protocol_binding="HTTP+JSON", protocol_version="1.0")
            )
    card = AgentCard(
        name="A2A TCK agent",
        description="The A2A conformance kit's system-under-test executor",
        version="1.0.0",
        provider=AgentProvider(organization="A2A Project", url="https://github.com/a2aproject"),
        supported_interfaces=interfaces,
        capabilities=AgentCapabilities(streaming=True, push_notifications=False),
        default_input_modes=["text"],
        default_output_modes=["text"],
        skills=[AgentSkill(id="tck", name="TCK Conformance", description="TCK test messages", tags=["tck"])],
    )
    handler = DefaultRequestHandler(
        agent_executor=load_executor(args.tck)(),
        task_store=InMemoryTaskStore(),
        agent_card=card,
    )
    routes = [*create_agent_card_routes(agent_card=card)]
    if "jsonrpc" in bindings:
        routes += create_jsonrpc_routes(request_handler=handler, rpc_url=JSONRPC_PATH)
    if "rest" in bindings:
        routes += create_rest_routes(request_handler=handler, path_prefix=REST_PATH)
    uvicorn.run(Starlette(routes=routes), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
