// An A2A 1.0 server built with the official JavaScript SDK (@a2a-js/sdk),
// unmodified: the JavaScript twin of ../sample_agent.py.
//
// Run by agent-connector/tests/a2a_interop_js.rs as the local A2A server
// behind connector B's driver. It binds 127.0.0.1 on a free port and prints
// `READY <port>` on stdout once it serves. `--binding=rest` serves (and
// lists in its card) only the HTTP+JSON binding at `/a2a/rest` (the SDK's
// `restHandler`) instead of JSON-RPC at `/a2a/jsonrpc`.
//
// What it does is chosen by the prefix of the message id:
//
// - `stream-`: working, three progress updates, a text artifact in two
//   chunks (append, lastChunk), completed with a message;
// - `gated-`: working, `step 1`, `step 2`, then waits until
//   `POST /test/gates/<messageId>` is called, then `step 3`, `step 4`, an
//   artifact, completed;
// - `hold-`: working, then waits to be canceled;
// - `ask-`: input-required ("which branch?"). The follow-up's events start
//   with the stored task (this SDK wants a Task or a Message first), still
//   input-required, as the SDK's own samples do; then the follow-up is held
//   until `POST /test/gates/<follow-up messageId>` is called (so the test
//   sees what the caller got before the answer, without a timing guess),
//   then its text completes the task with an artifact `branch <text>`;
//   `GET /test/held/<follow-up messageId>` answers once the follow-up is
//   held;
// - `message-`: answers with a message, no task;
// - `fail-`: failed with a message;
// - anything else: completed, echoing the text.

import express from 'express';
import { AGENT_CARD_PATH } from '@a2a-js/sdk';
import { DefaultRequestHandler, InMemoryTaskStore } from '@a2a-js/sdk/server';
import { agentCardHandler, jsonRpcHandler, restHandler, UserBuilder } from '@a2a-js/sdk/server/express';

// Numeric enums of the SDK (lf.a2a.v1).
const State = {
  SUBMITTED: 1,
  WORKING: 2,
  COMPLETED: 3,
  FAILED: 4,
  CANCELED: 5,
  INPUT_REQUIRED: 6,
};
const ROLE_AGENT = 2;

const gates = new Map();
function gate(name) {
  let g = gates.get(name);
  if (!g) {
    let open;
    const opened = new Promise((resolve) => (open = resolve));
    let hold;
    const held = new Promise((resolve) => (hold = resolve));
    g = { opened, open, held, hold };
    gates.set(name, g);
  }
  return g;
}

// Tasks held until canceled, by task id.
const holds = new Map();

let seq = 0;
const fresh = (p) => `${p}-${process.pid}-${++seq}`;
const text = (t) => ({ content: { $case: 'text', value: t }, metadata: undefined, filename: '', mediaType: '' });
const agentMessage = (ctx, t) => ({
  messageId: fresh('agent'),
  contextId: ctx.contextId,
  taskId: ctx.taskId,
  role: ROLE_AGENT,
  parts: [text(t)],
  metadata: undefined,
  extensions: [],
  referenceTaskIds: [],
});
const userText = (m) =>
  (m?.parts ?? [])
    .map((p) => (p.content?.$case === 'text' ? p.content.value : ''))
    .join('');

function status(bus, ctx, state, t) {
  bus.publish({
    kind: 'statusUpdate',
    data: {
      taskId: ctx.taskId,
      contextId: ctx.contextId,
      status: { state, message: t === undefined ? undefined : agentMessage(ctx, t), timestamp: new Date().toISOString() },
      metadata: undefined,
    },
  });
}

function artifact(bus, ctx, id, name, t, append = false, lastChunk = false) {
  bus.publish({
    kind: 'artifactUpdate',
    data: {
      taskId: ctx.taskId,
      contextId: ctx.contextId,
      artifact: { artifactId: id, name, description: '', parts: [text(t)], metadata: undefined, extensions: [] },
      append,
      lastChunk,
      metadata: undefined,
    },
  });
}

class SampleExecutor {
  async execute(ctx, bus) {
    const message = ctx.userMessage;
    const mid = message.messageId;
    const current = ctx.task;

    if (mid.startsWith('message-')) {
      bus.publish({
        kind: 'message',
        data: {
          messageId: `reply-${mid}`,
          contextId: ctx.contextId,
          taskId: '',
          role: ROLE_AGENT,
          parts: [text(`direct answer to ${userText(message)}`)],
          metadata: undefined,
          extensions: [],
          referenceTaskIds: [],
        },
      });
      bus.finished();
      return;
    }

    if (current && current.status?.state === State.INPUT_REQUIRED) {
      // The answer to "which branch?". This SDK wants every execution's
      // events to start with a Task or a Message, so a follow-up starts
      // with the stored task, still input-required; then it is held until
      // the test releases it.
      bus.publish({ kind: 'task', data: { ...current, history: [...(current.history ?? []), message] } });
      const g = gate(mid);
      g.hold();
      await g.opened;
      status(bus, ctx, State.WORKING, 'resuming');
      artifact(bus, ctx, fresh('answer'), 'answer', `branch ${userText(message)}`, false, true);
      status(bus, ctx, State.COMPLETED, 'done');
      bus.finished();
      return;
    }

    if (!current) {
      bus.publish({
        kind: 'task',
        data: {
          id: ctx.taskId,
          contextId: ctx.contextId,
          status: { state: State.SUBMITTED, message: undefined, timestamp: new Date().toISOString() },
          artifacts: [],
          history: [message],
          metadata: undefined,
        },
      });
    }

    if (mid.startsWith('stream-')) {
      status(bus, ctx, State.WORKING, 'starting');
      for (let i = 1; i <= 3; i++) status(bus, ctx, State.WORKING, `progress ${i}`);
      artifact(bus, ctx, 'out', 'out', 'chunk-1 ');
      artifact(bus, ctx, 'out', 'out', 'chunk-2', true, true);
      status(bus, ctx, State.COMPLETED, 'streamed');
    } else if (mid.startsWith('gated-')) {
      status(bus, ctx, State.WORKING);
      for (const i of [1, 2]) status(bus, ctx, State.WORKING, `step ${i}`);
      await gate(mid).opened;
      for (const i of [3, 4]) status(bus, ctx, State.WORKING, `step ${i}`);
      artifact(bus, ctx, 'result', 'result', 'gated result', false, true);
      status(bus, ctx, State.COMPLETED);
    } else if (mid.startsWith('hold-')) {
      status(bus, ctx, State.WORKING, 'holding');
      // Held until canceled: cancelTask ends it.
      await new Promise((resolve) => holds.set(ctx.taskId, resolve));
      return;
    } else if (mid.startsWith('ask-')) {
      status(bus, ctx, State.INPUT_REQUIRED, 'which branch?');
    } else if (mid.startsWith('fail-')) {
      status(bus, ctx, State.WORKING);
      status(bus, ctx, State.FAILED, 'it broke');
    } else {
      artifact(bus, ctx, fresh('echo'), 'echo', `echo: ${userText(message)}`);
      status(bus, ctx, State.COMPLETED, 'Hello from the sample agent');
    }
    bus.finished();
  }

  async cancelTask(taskId, bus) {
    const ctx = { taskId, contextId: '' };
    const release = holds.get(taskId);
    holds.delete(taskId);
    bus.publish({
      kind: 'statusUpdate',
      data: {
        taskId,
        contextId: ctx.contextId,
        status: { state: State.CANCELED, message: agentMessage(ctx, 'canceled as asked'), timestamp: new Date().toISOString() },
        metadata: undefined,
      },
    });
    bus.finished();
    release?.();
  }
}

const rest = process.argv.includes('--binding=rest');
const app = express();
const server = app.listen(Number(process.argv.find((a) => a.startsWith('--port='))?.slice(7) ?? 0), '127.0.0.1', () => {
  const port = server.address().port;
  const base = `http://127.0.0.1:${port}`;
  const card = {
    name: 'OAB interop sample agent (JS)',
    description: 'An official @a2a-js/sdk server used by the OAB relay interop test.',
    version: '1.0.0',
    supportedInterfaces: rest
      ? [{ url: `${base}/a2a/rest`, protocolBinding: 'HTTP+JSON', tenant: '', protocolVersion: '1.0' }]
      : [{ url: `${base}/a2a/jsonrpc`, protocolBinding: 'JSONRPC', tenant: '', protocolVersion: '1.0' }],
    provider: undefined,
    capabilities: { streaming: true, pushNotifications: false, extensions: [] },
    securitySchemes: {},
    securityRequirements: [],
    defaultInputModes: ['text/plain'],
    defaultOutputModes: ['text/plain'],
    skills: [{ id: 'sample', name: 'Sample', description: 'Streams, asks, holds.', tags: ['test'], examples: [], inputModes: [], outputModes: [], securityRequirements: [] }],
    signatures: [],
  };
  const handler = new DefaultRequestHandler(card, new InMemoryTaskStore(), new SampleExecutor());
  app.use(`/${AGENT_CARD_PATH}`, agentCardHandler({ agentCardProvider: handler }));
  if (rest) {
    app.use('/a2a/rest', restHandler({ requestHandler: handler, userBuilder: UserBuilder.noAuthentication }));
  } else {
    app.use('/a2a/jsonrpc', jsonRpcHandler({ requestHandler: handler, userBuilder: UserBuilder.noAuthentication }));
  }
  app.post('/test/gates/:name', (req, res) => {
    gate(req.params.name).open();
    res.json({ opened: req.params.name });
  });
  app.get('/test/held/:name', async (req, res) => {
    await gate(req.params.name).held;
    res.json({ held: req.params.name });
  });
  process.stdout.write(`READY ${port}\n`);
});
