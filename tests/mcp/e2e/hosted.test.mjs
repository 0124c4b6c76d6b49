// MCP servers hosted inside a sandbox: the rootfs's reference servers (filesystem, memory),
// reached with the official SDK client and the inspector CLI at /environments/{id}/mcp/{name},
// through esbd's own /mcp (list_environment_tools / call_environment_tool) and through REST
// (needs branch m-hosted, plus m-proto's endpoint and m-tools' environment tools).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Esbd, FS_SERVER, MEMORY_SERVER, callTool, ok, resultText, inspected }
  from '../lib/harness.mjs';

let esbd;
let env;
before(async () => {
  esbd = await Esbd.start();
  env = await esbd.createEnvironment('alice');
  await esbd.requireReferenceServers(env);
  for (const spec of [FS_SERVER, MEMORY_SERVER]) {
    const s = await esbd.addServer(env, spec);
    assert.equal(s.url, `/environments/${env}/mcp/${spec.name}`);
    assert.ok(s.tools > 0, `${spec.name} reports its tools: ${JSON.stringify(s)}`);
  }
});
after(async () => { await esbd?.stop(); });

test('REST lists both hosted servers, ready, with their tools', async () => {
  const r = await esbd.rest('GET', `/environments/${env}/mcp-servers`);
  assert.equal(r.status, 200, r.text);
  const byName = Object.fromEntries(r.json.servers.map((s) => [s.name, s]));
  for (const n of ['fs', 'memory']) {
    assert.equal(byName[n]?.state, 'ready', `${n}: ${JSON.stringify(byName[n])}`);
    assert.equal(byName[n].restarts, 0);
  }
});

test('SDK client on /environments/{id}/mcp/fs: the filesystem server\'s own tools, unchanged',
  async () => {
    const client = await esbd.connect('alice', `/environments/${env}/mcp/fs`);
    try {
      const names = (await client.listTools()).tools.map((t) => t.name);
      for (const n of ['read_text_file', 'write_file', 'list_directory', 'directory_tree']) {
        assert.ok(names.includes(n), `${n} missing from ${names}`);
      }
      assert.ok(!names.some((n) => n.includes('.')), 'not namespaced on its own endpoint');
      ok(await callTool(client, 'create_directory', { path: '/workspace/hosted' }),
        'create_directory');
      ok(await callTool(client, 'write_file', { path: '/workspace/hosted/hello.txt',
        content: 'written by the hosted filesystem server\n' }), 'write_file');
      const read = ok(await callTool(client, 'read_text_file',
        { path: '/workspace/hosted/hello.txt' }), 'read_text_file');
      assert.match(resultText(read), /written by the hosted filesystem server/);
      // Outside its allowed directory: the server's own refusal, as a tool error.
      const outside = await callTool(client, 'read_text_file', { path: '/etc/passwd' });
      assert.equal(outside.isError, true, resultText(outside));
    } finally { await client.close(); }
    // The file is really in the sandbox.
    const cat = await esbd.execute(env, 'cat /workspace/hosted/hello.txt');
    assert.equal(cat.stdout, 'written by the hosted filesystem server\n');
  });

test('SDK client on /environments/{id}/mcp/memory: the knowledge graph round-trips',
  async () => {
    const client = await esbd.connect('alice', `/environments/${env}/mcp/memory`);
    try {
      ok(await callTool(client, 'create_entities', { entities: [{ name: 'esbd',
        entityType: 'daemon', observations: ['hosts MCP servers inside sandboxes'] }] }),
      'create_entities');
      const found = ok(await callTool(client, 'search_nodes', { query: 'esbd' }),
        'search_nodes');
      assert.match(JSON.stringify(found), /hosts MCP servers inside sandboxes/);
    } finally { await client.close(); }
    const file = await esbd.execute(env, 'cat /workspace/memory.jsonl');
    assert.match(file.stdout, /"name":"esbd"/);
  });

test('one connection to /mcp reaches the sandbox\'s tools (namespaced <server>.<tool>)',
  async () => {
    const client = await esbd.connect('alice');
    try {
      // Not merged into /mcp's own tools/list (notes A4).
      const own = (await client.listTools()).tools.map((t) => t.name);
      assert.ok(!own.some((n) => n.startsWith('fs.')), `hosted tools leaked: ${own}`);
      const listed = ok(await callTool(client, 'list_environment_tools',
        { environment_id: env }), 'list_environment_tools');
      const text = JSON.stringify(listed);
      for (const n of ['fs.read_text_file', 'fs.write_file', 'memory.create_entities']) {
        assert.ok(text.includes(n), `${n} missing from ${text.slice(0, 500)}`);
      }
      const read = ok(await callTool(client, 'call_environment_tool', { environment_id: env,
        name: 'fs.read_text_file', arguments: { path: '/workspace/hosted/hello.txt' } }),
      'call_environment_tool');
      assert.match(JSON.stringify(read), /written by the hosted filesystem server/);
      const unknown = await callTool(client, 'call_environment_tool', { environment_id: env,
        name: 'fs.no_such_tool', arguments: {} });
      assert.equal(unknown.isError, true, resultText(unknown));
    } finally { await client.close(); }
  });

test('REST: the environment\'s tool registry and a call through it', async () => {
  const tools = await esbd.rest('GET', `/environments/${env}/tools`);
  assert.equal(tools.status, 200, tools.text);
  const t = tools.json.tools.find((x) => x.name === 'fs.list_directory');
  assert.ok(t, `fs.list_directory missing: ${tools.text.slice(0, 500)}`);
  assert.equal(t.server, 'fs');
  assert.equal(t.tool, 'list_directory');
  assert.equal(t.inputSchema?.type, 'object');
  const r = await esbd.rest('POST', `/environments/${env}/tools/fs.list_directory/call`,
    { body: { arguments: { path: '/workspace/hosted' } } });
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.isError, false);
  assert.match(JSON.stringify(r.json.content), /hello\.txt/);
});

test('inspector CLI on a hosted server: tools/list and tools/call', async () => {
  const path = `/environments/${env}/mcp/fs`;
  const list = inspected(await esbd.inspector('alice', path, ['--method', 'tools/list']));
  assert.ok(list.tools.some((x) => x.name === 'list_allowed_directories'));
  const call = inspected(await esbd.inspector('alice', path, ['--method', 'tools/call',
    '--tool-name', 'list_allowed_directories']));
  assert.match(JSON.stringify(call), /\/workspace/);
});

test('DELETE stops a hosted server; its endpoint is gone', async () => {
  const spec = { ...FS_SERVER, name: 'fs2' };
  await esbd.addServer(env, spec);
  const del = await esbd.rest('DELETE', `/environments/${env}/mcp-servers/fs2`);
  assert.equal(del.status, 200, del.text);
  const after = await esbd.rest('GET', `/environments/${env}/mcp-servers/fs2`);
  assert.equal(after.status, 404, after.text);
  await assert.rejects(esbd.connect('alice', `/environments/${env}/mcp/fs2`));
  // The process is gone from the sandbox too (only fs's own process remains).
  const ps = await esbd.execute(env, 'ps -eo args | grep -c "[m]cp-server-filesystem"');
  assert.equal(ps.stdout.trim(), '1', `processes left: ${JSON.stringify(ps)}`);
});
