// A hosted MCP server killed in the middle of a tool call: the caller gets a clear error at
// once (not a hang until the call timeout), esbd restarts or reports the server, and esbd and
// the other servers are unaffected (needs branch m-hosted, plus m-proto and m-tools).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Esbd, FS_SERVER, callTool, ok, resultText, sleep } from '../lib/harness.mjs';

// A small stdio MCP server (Python, standard library only) with one slow tool. It records its
// pid at start and marks when a call is running, so the test kills it mid-call for sure.
const SLOW_SERVER = String.raw`import json, os, sys, time
with open('/workspace/slow.pid', 'w') as f:
    f.write(str(os.getpid()))
def send(m):
    sys.stdout.write(json.dumps(m) + '\n'); sys.stdout.flush()
for line in sys.stdin:
    m = json.loads(line)
    i, method = m.get('id'), m.get('method')
    if method == 'initialize':
        send({'jsonrpc': '2.0', 'id': i, 'result': {'protocolVersion': '2025-11-25',
              'capabilities': {'tools': {}}, 'serverInfo': {'name': 'slow', 'version': '1'}}})
    elif method == 'tools/list':
        send({'jsonrpc': '2.0', 'id': i, 'result': {'tools': [{'name': 'sleep',
              'description': 'sleeps', 'inputSchema': {'type': 'object',
              'properties': {'seconds': {'type': 'number'}}}}]}})
    elif method == 'tools/call':
        open('/workspace/slow.in-call', 'w').close()
        time.sleep(m['params']['arguments'].get('seconds', 0))
        os.unlink('/workspace/slow.in-call')
        send({'jsonrpc': '2.0', 'id': i,
              'result': {'content': [{'type': 'text', 'text': 'slept'}]}})
    elif i is not None:
        send({'jsonrpc': '2.0', 'id': i, 'error': {'code': -32601, 'message': 'no ' + str(method)}})
`;

let esbd;
let env;
let other;
before(async () => {
  esbd = await Esbd.start();
  env = await esbd.createEnvironment('alice');
  other = await esbd.createEnvironment('alice');
  const w = await esbd.rest('POST', `/environments/${env}/files/write`,
    { body: { path: 'slow_server.py', content: SLOW_SERVER } });
  assert.equal(w.status, 200, w.text);
  await esbd.addServer(env, { name: 'slow', command: 'python3',
    args: ['/workspace/slow_server.py'] });
  await esbd.requireReferenceServers(other);
  await esbd.addServer(other, FS_SERVER);
});
after(async () => { await esbd?.stop(); });

// Starts `call()` (a promise of a tool result), waits until the server is inside the call,
// kills it with SIGKILL from inside the sandbox; returns { outcome, secondsAfterKill }.
async function killMidCall(call) {
  await esbd.execute(env, 'rm -f /workspace/slow.in-call');
  const pending = call().then((r) => ({ result: r }), (e) => ({ error: e }));
  const deadline = Date.now() + 30_000;
  for (;;) {
    const r = await esbd.execute(env, 'test -e /workspace/slow.in-call && echo in-call');
    if (r.stdout.includes('in-call')) break;
    if (Date.now() > deadline) throw new Error('the slow call never started');
    await sleep(100);
  }
  const kill = await esbd.execute(env, 'kill -9 "$(cat /workspace/slow.pid)"; echo rc=$?');
  assert.match(kill.stdout, /rc=0/, `kill: ${JSON.stringify(kill)}`);
  const t0 = Date.now();
  const outcome = await pending;
  return { outcome, secondsAfterKill: (Date.now() - t0) / 1000 };
}

function assertFailedClearly({ outcome, secondsAfterKill }, what) {
  assert.ok(secondsAfterKill < 15, `${what}: answered ${secondsAfterKill} s after the kill ` +
    '(the call asked for 60 s): a dead server must not hang its callers');
  const text = outcome.error ? String(outcome.error.message) : resultText(outcome.result);
  console.log(`${what}: answered ${secondsAfterKill} s after the kill: ${text}`);
  if (outcome.result) assert.equal(outcome.result.isError, true, `${what}: ${text}`);
  assert.doesNotMatch(text, /slept/);
  assert.match(text, /exit|died|crash|kill|signal|restart|terminated|closed|gone/i,
    `${what}: the error says the server went away: ${text}`);
}

// Waits (bounded) for esbd to bring the server back; returns its final state JSON.
async function settled(name) {
  const deadline = Date.now() + 30_000;
  let s;
  do {
    s = await esbd.server(env, name);
    if (s.state === 'ready' || s.state === 'failed') return s;
    await sleep(200);
  } while (Date.now() < deadline);
  return s;
}

test('killed mid-call on its own endpoint: a clear error at once; restarted or reported',
  async () => {
    const client = await esbd.connect('alice', `/environments/${env}/mcp/slow`);
    let outcome;
    try {
      outcome = await killMidCall(() => callTool(client, 'sleep', { seconds: 60 },
        { timeoutMs: 90_000 }));
    } finally { await client.close().catch(() => {}); }
    assertFailedClearly(outcome, 'hosted endpoint');
    const r = await fetch(`${esbd.url}/healthz`);
    assert.equal(r.status, 200, 'esbd is healthy');
    const s = await settled('slow');
    console.log(`after the kill: ${JSON.stringify(s)}`);
    assert.ok(s.state === 'ready' ? s.restarts >= 1 : s.state === 'failed' && s.error,
      'the server is restarted (restarts counted) or reported failed with why: ' +
      JSON.stringify(s));
    if (s.state === 'ready') {
      const again = await esbd.connect('alice', `/environments/${env}/mcp/slow`);
      try {
        const r2 = ok(await callTool(again, 'sleep', { seconds: 0 }), 'after restart');
        assert.match(resultText(r2), /slept/);
      } finally { await again.close(); }
    }
  });

test('killed mid-call through /mcp call_environment_tool: a clear tool error', async () => {
  const s = await settled('slow');
  console.log(`before the second kill: ${JSON.stringify(s)}`);
  if (s.state !== 'ready') {
    assert.ok(s.error, `not restarted, and no error reported: ${JSON.stringify(s)}`);
    // Not restarted by policy: a call now must fail clearly and at once.
    const client = await esbd.connect('alice');
    try {
      const r = await callTool(client, 'call_environment_tool', { environment_id: env,
        name: 'slow.sleep', arguments: { seconds: 0 } });
      assert.equal(r.isError, true, resultText(r));
    } finally { await client.close(); }
    return;
  }
  const client = await esbd.connect('alice');
  try {
    const outcome = await killMidCall(() => callTool(client, 'call_environment_tool', {
      environment_id: env, name: 'slow.sleep', arguments: { seconds: 60 } },
    { timeoutMs: 90_000 }));
    assertFailedClearly(outcome, '/mcp call_environment_tool');
    // The /mcp session itself survives its environment's server dying.
    ok(await callTool(client, 'execute_command', { environment_id: env, command: 'true' }),
      '/mcp still serves');
  } finally { await client.close(); }
});

test('the other environment\'s hosted server and esbd are unaffected', async () => {
  const c = await esbd.connect('alice', `/environments/${other}/mcp/fs`);
  try {
    ok(await callTool(c, 'list_allowed_directories', {}), 'other env fs');
  } finally { await c.close(); }
  const s = await esbd.server(other, 'fs');
  assert.equal(s.state, 'ready');
  assert.equal(s.restarts, 0);
  assert.ok(esbd.alive(), 'esbd is still running');
});
