#!/usr/bin/env python3
"""A minimal local A2A 1.0 server for the fleet trial (README step 8).

It serves an agent card at /.well-known/agent-card.json and answers every
JSON-RPC SendMessage with a message echoing the text it received. No
streaming, no tasks: enough for the connector's driver (`[a2a] driver_url`)
to complete a delegation. Standard library only; trial use only.

    python3 echo-a2a.py 9999
"""
import json
import sys
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 9999
BASE = f"http://127.0.0.1:{PORT}"

CARD = {
    "name": "echo",
    "description": "Echoes the text of every message (OAB fleet trial)",
    "version": "1.0.0",
    "supportedInterfaces": [
        {"url": BASE + "/", "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
    ],
    "capabilities": {"streaming": False},
    "defaultInputModes": ["text/plain"],
    "defaultOutputModes": ["text/plain"],
    "skills": [],
}


class Handler(BaseHTTPRequestHandler):
    def reply(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/.well-known/agent-card.json":
            self.reply(200, CARD)
        else:
            self.reply(404, {"error": "not found"})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        rid = req.get("id")
        if req.get("method") != "SendMessage":
            self.reply(200, {"jsonrpc": "2.0", "id": rid,
                             "error": {"code": -32601, "message": "method not found"}})
            return
        parts = req.get("params", {}).get("message", {}).get("parts", [])
        text = " ".join(p.get("text", "") for p in parts if "text" in p)
        message = {"messageId": uuid.uuid4().hex, "role": "ROLE_AGENT",
                   "parts": [{"text": "echo: " + text}]}
        self.reply(200, {"jsonrpc": "2.0", "id": rid, "result": {"message": message}})


ThreadingHTTPServer(("127.0.0.1", PORT), Handler).serve_forever()
