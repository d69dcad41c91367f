"""The official a2a-sdk client's push notification calls through the OAB facade.

Run by agent-connector/tests/a2a_interop.rs with the facade's URL for the
callee peer and the URL of a webhook the test serves. A send registers a
config for its new task (`SendMessageConfiguration.task_push_notification_config`),
then the four config methods run on that task; it prints one JSON object
with what the SDK saw, and the Rust test checks it and the webhook.
"""

import argparse
import asyncio
import json
import sys
import uuid

from google.protobuf.json_format import MessageToDict

from a2a.client import ClientConfig, create_client
from a2a.types import (
    AuthenticationInfo,
    DeleteTaskPushNotificationConfigRequest,
    GetTaskPushNotificationConfigRequest,
    ListTaskPushNotificationConfigsRequest,
    Message,
    Part,
    Role,
    SendMessageConfiguration,
    SendMessageRequest,
    TaskPushNotificationConfig,
)


async def error_name(call) -> str:
    try:
        await call
        return "no error"
    except Exception as e:  # the SDK maps A2A error codes to its own types
        return type(e).__name__


async def run(facade_url: str, webhook_url: str) -> dict:
    client = await create_client(facade_url, ClientConfig(streaming=False))
    message = Message(role=Role.ROLE_USER, message_id=f"stream-{uuid.uuid4().hex}", parts=[Part(text="go")])
    config = SendMessageConfiguration(
        task_push_notification_config=TaskPushNotificationConfig(
            url=webhook_url,
            token="py-token",
            authentication=AuthenticationInfo(scheme="Bearer", credentials="py-cred"),
        )
    )
    task_id = None
    async for ev in client.send_message(SendMessageRequest(message=message, configuration=config)):
        if ev.HasField("task"):
            task_id = ev.task.id
    out: dict = {"task_id": task_id}

    created = await client.create_task_push_notification_config(
        TaskPushNotificationConfig(task_id=task_id, id="py-1", url=webhook_url, token="second")
    )
    out["created"] = MessageToDict(created)
    got = await client.get_task_push_notification_config(
        GetTaskPushNotificationConfigRequest(task_id=task_id, id="py-1")
    )
    out["got"] = MessageToDict(got)
    listed = await client.list_task_push_notification_configs(ListTaskPushNotificationConfigsRequest(task_id=task_id))
    out["listed"] = [c.id for c in listed.configs]
    await client.delete_task_push_notification_config(
        DeleteTaskPushNotificationConfigRequest(task_id=task_id, id="py-1")
    )
    out["delete_again"] = await error_name(
        client.delete_task_push_notification_config(DeleteTaskPushNotificationConfigRequest(task_id=task_id, id="py-1"))
    )
    out["get_deleted"] = await error_name(
        client.get_task_push_notification_config(GetTaskPushNotificationConfigRequest(task_id=task_id, id="py-1"))
    )
    out["unknown_task"] = await error_name(
        client.create_task_push_notification_config(TaskPushNotificationConfig(task_id="nope", url=webhook_url))
    )
    out["bad_url"] = await error_name(
        client.create_task_push_notification_config(TaskPushNotificationConfig(task_id=task_id, url="ftp://x/"))
    )
    listed = await client.list_task_push_notification_configs(ListTaskPushNotificationConfigsRequest(task_id=task_id))
    out["listed_after"] = len(listed.configs)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--facade-url", required=True)
    parser.add_argument("--webhook-url", required=True)
    args = parser.parse_args()
    json.dump(asyncio.run(run(args.facade_url, args.webhook_url)), sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
