// A tenant cannot reach another tenant's hosted MCP servers: not through their endpoint, not
// through REST, not through esbd's /mcp (needs branch m-hosted, plus m-proto and m-tools).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Esbd, FS_SERVER, callTool, ok, resultText, inspector } from '../lib/harness.mjs';

let esbd;
let aliceEnv;
before(async () => {
  esbd = await Esbd.start();
  aliceEnv = await esbd.createEnvironment('alice');
  await esbd.requireReferenceServers(aliceEnv);
  await esbd.addServer(aliceEnv, FS_SERVER);
  ok(await (async () => {
    const c = await esbd.connect('alice', `/environments/${aliceEnv}/mcp/fs`);
    try {
      return await callTool(c, 'write_file', { path: '/workspace/secret.txt',
        content: 'alice-only\n' });
    } finally { await c.close(); }
  })(), 'alice writes through her server');
});
after(async () => { await esbd?.stop(); });

const initialize = JSON.stringify({ jsonrpc: '2.0', id: 1, method: 'initialize', params: {
  protocolVersion: '2025-11-25', capabilities: {}, clientInfo: { name: 't', version: '1' } } });
const callSecret = JSON.stringify({ jsonrpc: '2.0', id: 2, method: 'tools/call', params: {
  name: 'read_text_file', arguments: { path: '/workspace/secret.txt' },
  _meta: { 'io.modelcontextprotocol/protocolVersion': '2026-07-28',
    'io.modelcontextprotocol/clientCapabilities': {} } } });

test('bob: alice\'s hosted endpoint is 404 (legacy initialize and modern tools/call alike)',
  async () => {
    const path = `/environments/${aliceEnv}/mcp/fs`;
    const legacy = await esbd.rest('POST', path, { tenant: 'bob', body: JSON.parse(initialize),
      headers: { Accept: 'application/json, text/event-stream' } });
    assert.equal(legacy.status, 404, legacy.text);
    const modern = await esbd.rest('POST', path, { tenant: 'bob', body: JSON.parse(callSecret),
      headers: { Accept: 'application/json, text/event-stream', 'MCP-Protocol-Version':
        '2026-07-28', 'Mcp-Method': 'tools/call', 'Mcp-Name': 'read_text_file' } });
    assert.equal(modern.status, 404, modern.text);
    assert.doesNotMatch(modern.text, /alice-only/);
    await assert.rejects(esbd.connect('bob', path));
    const r = await esbd.inspector('bob', path, ['--method', 'tools/list']);
    assert.notEqual(r.code, 0, `inspector as bob listed alice's tools: ${r.stdout}`);
    // Same answer as for an environment that does not exist (no existence oracle).
    const none = await esbd.rest('POST', '/environments/env_doesnotexist/mcp/fs',
      { tenant: 'bob', body: JSON.parse(initialize),
        headers: { Accept: 'application/json, text/event-stream' } });
    assert.equal(none.status, legacy.status);
  });

test('no key: the hosted endpoint is 401', async () => {
  const r = await esbd.rest('POST', `/environments/${aliceEnv}/mcp/fs`, { tenant: null,
    body: JSON.parse(initialize), headers: { Accept: 'application/json, text/event-stream' } });
  assert.equal(r.status, 401, r.text);
  const i = await inspector([`${esbd.url}/environments/${aliceEnv}/mcp/fs`, '--transport',
    'http', '--method', 'tools/list']);
  assert.equal(i.code, 3, `inspector without a key: exit ${i.code} ${i.stdout}${i.stderr}`);
});

test('bob: REST on alice\'s servers and tools is 404, and changes nothing', async () => {
  const base = `/environments/${aliceEnv}`;
  for (const [method, path, body] of [
    ['GET', `${base}/mcp-servers`], ['GET', `${base}/mcp-servers/fs`],
    ['POST', `${base}/mcp-servers`, { name: 'evil', command: 'sh', args: ['-c', 'id'] }],
    ['DELETE', `${base}/mcp-servers/fs`], ['GET', `${base}/tools`],
    ['POST', `${base}/tools/fs.read_text_file/call`,
      { arguments: { path: '/workspace/secret.txt' } }]]) {
    const r = await esbd.rest(method, path, { tenant: 'bob', body });
    assert.equal(r.status, 404, `${method} ${path}: ${r.status} ${r.text}`);
    assert.doesNotMatch(r.text, /alice-only/);
  }
  const mine = await esbd.rest('GET', `${base}/mcp-servers`);
  assert.deepEqual(mine.json.servers.map((s) => [s.name, s.state]), [['fs', 'ready']]);
});

test('bob: esbd\'s /mcp environment tools refuse alice\'s environment', async () => {
  const client = await esbd.connect('bob');
  try {
    const listed = await callTool(client, 'list_environment_tools',
      { environment_id: aliceEnv });
    assert.equal(listed.isError, true, resultText(listed));
    assert.doesNotMatch(JSON.stringify(listed), /read_text_file/);
    const called = await callTool(client, 'call_environment_tool', { environment_id: aliceEnv,
      name: 'fs.read_text_file', arguments: { path: '/workspace/secret.txt' } });
    assert.equal(called.isError, true, resultText(called));
    assert.doesNotMatch(JSON.stringify(called), /alice-only/);
  } finally { await client.close(); }
});

test('alice still reaches her server after bob\'s attempts', async () => {
  const c = await esbd.connect('alice', `/environments/${aliceEnv}/mcp/fs`);
  try {
    const r = ok(await callTool(c, 'read_text_file', { path: '/workspace/secret.txt' }),
      'read_text_file');
    assert.match(resultText(r), /alice-only/);
  } finally { await c.close(); }
});
