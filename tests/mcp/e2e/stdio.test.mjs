// esbd's own tools through `esbd mcp-stdio` (stdio bridge to a running daemon), with the
// official TypeScript SDK client and the inspector CLI (needs branch m-proto's mcp-stdio).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Esbd, ESBD_TOOLS, environmentRoundTrip, callTool, ok, environmentIdOf, resultText,
  inspector, inspected } from '../lib/harness.mjs';

let esbd;
before(async () => { esbd = await Esbd.start(); });
after(async () => { await esbd?.stop(); });

test('SDK client over esbd mcp-stdio: tools/list and an environment\'s life', async () => {
  const client = await esbd.connectStdio('alice');
  try {
    const names = (await client.listTools()).tools.map((t) => t.name);
    for (const n of ESBD_TOOLS) assert.ok(names.includes(n), `${n} missing from ${names}`);
    await environmentRoundTrip(client, assert);
  } finally { await client.close(); }
});

test('mcp-stdio acts as the key\'s tenant: bob cannot use alice\'s environment', async () => {
  const alice = await esbd.connectStdio('alice');
  const bob = await esbd.connectStdio('bob');
  try {
    const id = environmentIdOf(ok(await callTool(alice, 'create_environment', {}), 'create'));
    const r = await callTool(bob, 'execute_command', { environment_id: id, command: 'id' });
    assert.equal(r.isError, true, `bob on alice's environment: ${resultText(r)}`);
    ok(await callTool(alice, 'delete_environment', { environment_id: id }), 'delete');
  } finally { await alice.close(); await bob.close(); }
});

test('mcp-stdio with a wrong key fails clearly instead of serving', async () => {
  const { command, args } = esbd.stdioCommand('alice');
  const r = await inspector(['-e', 'ESB_API_KEY=esb_not_a_key', '--method', 'tools/list', '--',
    command, ...args], { timeoutMs: 30_000 });
  assert.notEqual(r.code, 0, `a wrong key must not list tools: ${r.stdout}`);
  assert.match(r.stdout + r.stderr, /401|unauthori[sz]ed|api key|auth/i);
});

test('inspector CLI over stdio: tools/list and tools/call', async () => {
  const { command, args, env } = esbd.stdioCommand('alice');
  const e = Object.entries(env).flatMap(([k, v]) => ['-e', `${k}=${v}`]);
  const list = await inspector([...e, '--method', 'tools/list', '--', command, ...args]);
  assert.equal(list.code, 0, `exit ${list.code}: ${list.stdout}${list.stderr}`);
  const names = inspected(list).tools.map((t) => t.name);
  for (const n of ESBD_TOOLS) assert.ok(names.includes(n), `${n} missing`);
  const ran = await inspector([...e, '--method', 'tools/call', '--tool-name', 'run_code',
    '--tool-args-json', JSON.stringify({ code: 'print(6*7)' }), '--', command, ...args]);
  assert.equal(ran.code, 0, `exit ${ran.code}: ${ran.stdout}${ran.stderr}`);
  assert.match(ran.stdout, /42/);
});
