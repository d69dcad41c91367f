// The official JavaScript SDK client (@a2a-js/sdk) against the OAB facade:
// the JavaScript twin of ../client.py.
//
// Run by agent-connector/tests/a2a_interop_js.rs with the facade's URL for
// the callee peer (with its trailing slash: the SDK resolves the card at
// `<url>.well-known/agent-card.json` relative to it). It resolves the card
// through the facade, runs each scenario with the SDK's own client, and
// prints one JSON object with what it saw; the Rust test asserts on it. It
// never sleeps to wait for a state: the sample agent's gated tasks are
// released with an explicit call.
//
// `--transport http_json` makes the SDK prefer the card's HTTP+JSON
// interface (its REST transport) over JSON-RPC; the routes it called on the
// facade are reported, so the test sees which binding was spoken.
//
//   node client.mjs --facade-url http://127.0.0.1:P/peers/callee/ --agent-url http://127.0.0.1:Q [--transport jsonrpc|http_json]

import { ClientFactory, ClientFactoryOptions } from '@a2a-js/sdk/client';

const PROFILE = 'https://oab.dev/a2a/ext/delegation/v1';
const STATE = ['UNSPECIFIED', 'SUBMITTED', 'WORKING', 'COMPLETED', 'FAILED', 'CANCELED', 'INPUT_REQUIRED', 'REJECTED', 'AUTH_REQUIRED'];
const state = (s) => (s === undefined ? undefined : `TASK_STATE_${STATE[s] ?? s}`);

const arg = (name) => {
  const i = process.argv.indexOf(name);
  if (i < 0 || i + 1 >= process.argv.length) throw new Error(`${name} is required`);
  return process.argv[i + 1];
};
const facadeUrl = arg('--facade-url');
const agentUrl = arg('--agent-url');
const transport = process.argv.includes('--transport') ? arg('--transport') : 'jsonrpc';
if (!['jsonrpc', 'http_json'].includes(transport)) throw new Error(`unknown transport ${transport}`);
const preferred = { preferredTransports: [transport === 'http_json' ? 'HTTP+JSON' : 'JSONRPC'] };

// Every request to the facade, as "METHOD route" relative to the peer base
// (task ids as {id}).
const routes = new Set();
const realFetch = globalThis.fetch;
globalThis.fetch = (input, init) => {
  const url = new URL(typeof input === 'string' || input instanceof URL ? input : input.url);
  const base = new URL(facadeUrl);
  if (url.origin === base.origin && url.pathname.startsWith(base.pathname.replace(/\/$/, ''))) {
    const rel = url.pathname.slice(base.pathname.replace(/\/$/, '').length) || '/';
    const method = (init?.method ?? (typeof input === 'object' && 'method' in input ? input.method : 'GET')).toUpperCase();
    routes.add(`${method} ${rel.replace(/^\/tasks\/[^/:]+/, '/tasks/{id}')}`);
  }
  return realFetch(input, init);
};

let n = 0;
const msg = (prefix, t, taskId) => ({
  messageId: `${prefix}${process.pid}-${++n}-${Date.now()}`,
  contextId: '',
  taskId: taskId ?? '',
  role: 1,
  parts: [{ content: { $case: 'text', value: t }, metadata: undefined, filename: '', mediaType: '' }],
  metadata: undefined,
  extensions: [],
  referenceTaskIds: [],
});
const send = (m) => ({ tenant: '', message: m, configuration: undefined, metadata: undefined });
const texts = (parts) => (parts ?? []).filter((p) => p.content?.$case === 'text').map((p) => p.content.value);

function describeTask(t) {
  return {
    id: t.id,
    contextId: t.contextId,
    state: state(t.status?.state),
    artifacts: (t.artifacts ?? []).map((a) => texts(a.parts)),
    history: (t.history ?? []).length,
  };
}

// One StreamResponse as a small object: kind, state, seq, texts.
function describe(ev) {
  const kind = ev.payload?.$case ?? 'empty';
  const body = ev.payload?.value ?? {};
  const out = { kind };
  if (body.status) {
    out.state = state(body.status.state);
    const t = texts(body.status.message?.parts);
    if (t.length) out.text = t.join(' ');
  }
  if (kind === 'artifactUpdate') {
    out.artifact = body.artifact?.artifactId;
    out.parts = texts(body.artifact?.parts);
    out.append = body.append;
    out.lastChunk = body.lastChunk;
  }
  if (kind === 'message') out.text = texts(body.parts).join(' ');
  const seq = body.metadata?.[PROFILE]?.seq;
  if (seq !== undefined) out.seq = Number(seq);
  if (kind === 'task') out.id = body.id;
  return out;
}

async function collect(gen, until) {
  const out = [];
  for await (const ev of gen) {
    out.push(describe(ev));
    if (until && until(out)) {
      await gen.return(undefined);
      break;
    }
  }
  return out;
}

const errorName = async (p) => {
  try {
    await p;
    return 'no error';
  } catch (e) {
    return e?.constructor?.name ?? String(e);
  }
};

async function post(url) {
  const r = await fetch(url, { method: 'POST' });
  if (!r.ok) throw new Error(`POST ${url}: ${r.status}`);
}

async function run() {
  const r = {};
  const streaming = await new ClientFactory(
    ClientFactoryOptions.createFrom(ClientFactoryOptions.default, preferred),
  ).createFromUrl(facadeUrl);
  const blocking = await new ClientFactory(
    ClientFactoryOptions.createFrom(ClientFactoryOptions.default, { ...preferred, clientConfig: { polling: false } }),
  ).createFromUrl(facadeUrl);
  const polling = await new ClientFactory(
    ClientFactoryOptions.createFrom(ClientFactoryOptions.default, { ...preferred, clientConfig: { polling: true } }),
  ).createFromUrl(facadeUrl);
  const profile = { serviceParameters: { 'A2A-Extensions': PROFILE } };

  const card = await (await fetch(new URL('.well-known/agent-card.json', facadeUrl))).json();
  r.card = {
    name: card.name,
    interface: card.supportedInterfaces[0],
    interfaces: card.supportedInterfaces,
    extensions: (card.capabilities.extensions ?? []).map((e) => e.uri),
  };

  // 1. Streamed events of a task, and the same straight from the agent.
  r.streamed = await collect(streaming.sendMessageStream(send(msg('stream-', 'go'))));
  const direct = await new ClientFactory().createFromUrl(`${agentUrl}/`);
  r.direct_streamed = await collect(direct.sendMessageStream(send(msg('stream-', 'go'))));

  // 2. Blocking send, then GetTask.
  const done = await blocking.sendMessage(send(msg('blocking-', 'hello')));
  const got = await blocking.getTask({ tenant: '', id: done.id, historyLength: 1 });
  r.blocking = { sent: describeTask(done), get: describeTask(got) };

  // 3. A direct message answer.
  r.message = await collect(streaming.sendMessageStream(send(msg('message-', 'hi'))));

  // 4. Cancel a running task.
  const held = await polling.sendMessage(send(msg('hold-', 'hold on')));
  const seen = await collect(streaming.resubscribeTask({ tenant: '', id: held.id }), (evs) =>
    evs.some((e) => e.text === 'holding'),
  );
  const canceled = await blocking.cancelTask({ tenant: '', id: held.id, metadata: undefined });
  const again = await errorName(blocking.cancelTask({ tenant: '', id: held.id, metadata: undefined }));
  r.cancel = { before: seen, task: describeTask(canceled), again };

  // 5. Input required, then the answer as a follow-up: streamed, then
  // blocking. The agent holds each follow-up until its gate opens; the
  // stream must stay open (and the blocking call must wait) across the
  // agent's leading task snapshot, still input-required.
  const ask = await blocking.sendMessage(send(msg('ask-', 'deploy?')));
  const answer = msg('answer-', 'main', ask.id);
  const follow = collect(streaming.sendMessageStream(send(answer)));
  await fetch(`${agentUrl}/test/held/${answer.messageId}`);
  await post(`${agentUrl}/test/gates/${answer.messageId}`);
  const followed = await follow;
  const final = await blocking.getTask({ tenant: '', id: ask.id });

  const ask2 = await blocking.sendMessage(send(msg('ask-', 'deploy again?')));
  const answer2 = msg('answer-', 'release', ask2.id);
  const sending = blocking.sendMessage(send(answer2));
  await fetch(`${agentUrl}/test/held/${answer2.messageId}`);
  await post(`${agentUrl}/test/gates/${answer2.messageId}`);
  const blockingFollow = await sending;
  r.input_required = {
    first: describeTask(ask),
    follow: followed,
    final: describeTask(final),
    blocking_first: describeTask(ask2),
    blocking_follow: describeTask(blockingFollow),
  };

  // 6. A failing task.
  r.failed = await collect(streaming.sendMessageStream(send(msg('fail-', 'x'))));

  // 7. SubscribeToTask after dropping the stream mid-task, with the
  // profile: resume after the cursor, nothing missed.
  let gated = msg('gated-', 'with profile');
  let before = await collect(streaming.sendMessageStream(send(gated), profile), (evs) =>
    evs.some((e) => e.text === 'step 2'),
  );
  let taskId = before[0].id;
  const cursor = Math.max(...before.filter((e) => e.seq !== undefined).map((e) => e.seq));
  await post(`${agentUrl}/test/gates/${gated.messageId}`);
  const after = await collect(
    streaming.resubscribeTask(
      { tenant: '', id: taskId },
      { serviceParameters: { 'A2A-Extensions': PROFILE, 'Last-Event-ID': String(cursor) } },
    ),
  );
  r.resubscribe_profile = { before, cursor, after };

  // 8. The same without the profile: snapshot first, then live.
  gated = msg('gated-', 'plain');
  before = await collect(streaming.sendMessageStream(send(gated)), (evs) => evs.some((e) => e.text === 'step 2'));
  taskId = before[0].id;
  const sub = streaming.resubscribeTask({ tenant: '', id: taskId });
  const first = await sub.next();
  const snapshot = describe(first.value);
  await post(`${agentUrl}/test/gates/${gated.messageId}`);
  const live = await collect(sub);
  const terminal = await errorName(collect(streaming.resubscribeTask({ tenant: '', id: taskId })));
  r.resubscribe_plain = { before, snapshot, live, terminal };

  // 9. ListTasks with pagination.
  const page1 = await blocking.listTasks({ tenant: '', contextId: '', status: 0, pageSize: 2, pageToken: '' });
  const page2 = await blocking.listTasks({
    tenant: '',
    contextId: '',
    status: 0,
    pageSize: 100,
    pageToken: page1.nextPageToken,
  });
  r.list = {
    page1: page1.tasks.map((t) => t.id),
    next: page1.nextPageToken,
    total: page1.totalSize,
    page2: page2.tasks.map((t) => t.id),
    next2: page2.nextPageToken,
    artifacts_in_list: page1.tasks.some((t) => (t.artifacts ?? []).length > 0),
  };
  r.routes = [...routes].sort();
  return r;
}

run().then(
  (r) => process.stdout.write(`${JSON.stringify(r)}\n`),
  (e) => {
    process.stderr.write(`client.mjs: ${e?.stack ?? e}\n`);
    process.exit(1);
  },
);
