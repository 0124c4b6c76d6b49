// esbd's own tools on /mcp over Streamable HTTP, with the official TypeScript SDK client and
// the inspector CLI, two tenants with API keys (needs branch m-proto's /mcp and m-tools' tools).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Esbd, ESBD_TOOLS, environmentRoundTrip, callTool, ok, environmentIdOf, resultText,
  inspector, inspected } from '../lib/harness.mjs';

let esbd;
before(async () => { esbd = await Esbd.start(); });
after(async () => { await esbd?.stop(); });

test('SDK client: tools/list on /mcp has every catalogue tool, each with an object schema',
  async () => {
    const client = await esbd.connect('alice');
    try {
      const { tools } = await client.listTools();
      const names = tools.map((t) => t.name);
      for (const n of ESBD_TOOLS) assert.ok(names.includes(n), `${n} missing from ${names}`);
      for (const t of tools) {
        assert.equal(t.inputSchema?.type, 'object', `${t.name}'s inputSchema`);
        assert.ok(t.description, `${t.name} has a description`);
        assert.match(t.name, /^[A-Za-z0-9_.-]{1,128}$/);
      }
      // No conformance fixture without the test-only flag.
      assert.ok(!names.some((n) => n.startsWith('test_')), `fixtures leaked: ${names}`);
    } finally { await client.close(); }
  });

test('SDK client: an environment\'s life through /mcp (create, execute, files, run, delete)',
  async () => {
    const client = await esbd.connect('alice');
    try { await environmentRoundTrip(client, assert); } finally { await client.close(); }
  });

test('SDK client: ping answers and the server names itself', async () => {
  const client = await esbd.connect('alice');
  try {
    assert.deepEqual(await client.ping(), {});
    assert.ok(client.getServerVersion()?.name, 'serverInfo.name');
    assert.ok(client.getServerCapabilities()?.tools, 'tools capability');
  } finally { await client.close(); }
});

test('no API key or a wrong one: /mcp answers 401 and the SDK client cannot connect',
  async () => {
    const init = { jsonrpc: '2.0', id: 1, method: 'initialize', params: {
      protocolVersion: '2025-11-25', capabilities: {}, clientInfo: { name: 't', version: '1' } } };
    for (const headers of [{}, { Authorization: 'Bearer esb_not_a_key' }]) {
      const r = await fetch(`${esbd.url}/mcp`, { method: 'POST', body: JSON.stringify(init),
        headers: { 'Content-Type': 'application/json',
          Accept: 'application/json, text/event-stream', ...headers } });
      assert.equal(r.status, 401, `headers ${JSON.stringify(headers)}: ${await r.text()}`);
    }
    await assert.rejects(esbd.connect(null));
  });

test('a tenant sees only its own environments through /mcp', async () => {
  const alice = await esbd.connect('alice');
  const bob = await esbd.connect('bob');
  try {
    const id = environmentIdOf(ok(await callTool(alice, 'create_environment', {}), 'create'));
    const listed = ok(await callTool(bob, 'list_environments', {}), 'bob lists');
    assert.doesNotMatch(JSON.stringify(listed), new RegExp(id));
    for (const [tool, args] of [['execute_command', { command: 'id' }],
      ['read_file', { path: 'x' }], ['write_file', { path: 'x', content: 'y' }],
      ['list_files', { path: '.' }], ['delete_environment', {}]]) {
      const r = await callTool(bob, tool, { environment_id: id, ...args });
      assert.equal(r.isError, true, `bob's ${tool} on alice's environment: ${resultText(r)}`);
    }
    // Alice's environment is still there and hers.
    ok(await callTool(alice, 'execute_command', { environment_id: id, command: 'true' }),
      'alice still executes');
    ok(await callTool(alice, 'delete_environment', { environment_id: id }), 'alice deletes');
  } finally { await alice.close(); await bob.close(); }
});

test('inspector CLI (legacy era, its default): tools/list and tools/call on /mcp', async () => {
  const list = await esbd.inspector('alice', '/mcp', ['--method', 'tools/list']);
  assert.equal(list.code, 0, `exit ${list.code}: ${list.stderr}`);
  const names = inspected(list).tools.map((t) => t.name);
  for (const n of ESBD_TOOLS) assert.ok(names.includes(n), `${n} missing`);

  const created = await esbd.inspector('alice', '/mcp', ['--method', 'tools/call',
    '--tool-name', 'create_environment']);
  assert.equal(created.code, 0, `create: exit ${created.code}: ${created.stdout}${created.stderr}`);
  const id = environmentIdOf(inspected(created));
  const ran = await esbd.inspector('alice', '/mcp', ['--method', 'tools/call',
    '--tool-name', 'execute_command', '--tool-args-json',
    JSON.stringify({ environment_id: id, command: 'echo inspected-$((6*7))' })]);
  assert.equal(ran.code, 0, `execute: exit ${ran.code}: ${ran.stdout}${ran.stderr}`);
  assert.match(ran.stdout, /inspected-42/);
  const del = await esbd.inspector('alice', '/mcp', ['--method', 'tools/call',
    '--tool-name', 'delete_environment', '--tool-args-json',
    JSON.stringify({ environment_id: id })]);
  assert.equal(del.code, 0, `delete: ${del.stdout}${del.stderr}`);
});

test('inspector CLI: a wrong API key is an auth failure (exit 3)', async () => {
  const r = await inspector([`${esbd.url}/mcp`, '--transport', 'http',
    '--header', 'Authorization: Bearer esb_not_a_key', '--method', 'tools/list']);
  assert.equal(r.code, 3, `exit ${r.code}: ${r.stdout}${r.stderr}`);
});

test('inspector CLI in the modern era (2026-07-28, stateless): tools/list and tools/call',
  async () => {
    const modern = ['--protocol-era', 'modern'];
    const list = await esbd.inspector('alice', '/mcp', [...modern, '--method', 'tools/list']);
    assert.equal(list.code, 0, `exit ${list.code}: ${list.stdout}${list.stderr}`);
    const names = inspected(list).tools.map((t) => t.name);
    for (const n of ESBD_TOOLS) assert.ok(names.includes(n), `${n} missing`);
    const ran = await esbd.inspector('alice', '/mcp', [...modern, '--method', 'tools/call',
      '--tool-name', 'run_code', '--tool-args-json', JSON.stringify({ code: 'print(6*7)' })]);
    assert.equal(ran.code, 0, `exit ${ran.code}: ${ran.stdout}${ran.stderr}`);
    assert.match(ran.stdout, /42/);
  });
