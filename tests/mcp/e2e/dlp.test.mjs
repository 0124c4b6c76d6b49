// DLP on tool calls: a planted AWS key in a tool's arguments is blocked before dispatch (the
// tool never runs), on esbd's /mcp, on a hosted server's endpoint and through
// call_environment_tool, and each call leaves one audit row that does not contain the key
// (needs branch m-tools' ToolCallGate; the hosted parts need m-hosted).
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { Esbd, FS_SERVER, callTool, ok, resultText } from '../lib/harness.mjs';

// A syntactically valid, made-up AWS access key id and secret (the egress DLP tests' pair).
const AKID = 'AKIAZ7Q4MXR2VN6LPT3K';
const SECRET = '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';
const PLANTED = `[default]\naws_access_key_id = ${AKID}\naws_secret_access_key = ${SECRET}\n`;

let esbd;
let env;
before(async () => {
  esbd = await Esbd.start();
  env = await esbd.createEnvironment('alice');
});
after(async () => { await esbd?.stop(); });

// The tool result of a blocked call: an error naming the DLP rule, without the key.
function assertBlocked(result, what) {
  assert.equal(result.isError, true, `${what} was not blocked: ${resultText(result)}`);
  assert.match(resultText(result), /dlp|aws/i, `${what}: the error names the rule`);
  assert.ok(!JSON.stringify(result).includes(AKID), `${what}: the answer echoes the key`);
}

async function toolCallRows() {
  const r = await esbd.rest('GET', `/audit?environment_id=${env}&limit=1000`);
  assert.equal(r.status, 200, r.text);
  return r.json.entries.filter((e) => e.action === 'tool.call');
}

test('/mcp execute_command with an AWS key in its command: blocked, nothing ran', async () => {
  const client = await esbd.connect('alice');
  try {
    const r = await callTool(client, 'execute_command', { environment_id: env,
      command: `printf '%s' '${PLANTED}' > /workspace/leak.txt` });
    assertBlocked(r, 'execute_command');
    // The same command without the key runs: the block is the key's, not the command's.
    ok(await callTool(client, 'execute_command', { environment_id: env,
      command: "printf '%s' clean > /workspace/clean.txt" }), 'clean execute_command');
  } finally { await client.close(); }
  const check = await esbd.execute(env, 'ls /workspace');
  assert.doesNotMatch(check.stdout, /leak\.txt/, 'the blocked command must not have run');
  assert.match(check.stdout, /clean\.txt/);
});

test('/mcp write_file with the key in its content: blocked; the audit row is redacted',
  async () => {
    const before = (await toolCallRows()).length;
    const client = await esbd.connect('alice');
    try {
      assertBlocked(await callTool(client, 'write_file', { environment_id: env,
        path: 'creds', content: PLANTED }), 'write_file');
    } finally { await client.close(); }
    const rows = await toolCallRows();
    assert.equal(rows.length, before + 1, 'one audit row per tool call');
    const row = rows.find((e) => /write_file/.test(JSON.stringify(e)));
    assert.ok(row, `no tool.call row for write_file: ${JSON.stringify(rows).slice(0, 800)}`);
    const text = JSON.stringify(row);
    assert.match(text, /block/i, `decision block: ${text}`);
    assert.match(text, /aws/i, `the rule hit: ${text}`);
    assert.ok(!text.includes(AKID) && !text.includes(SECRET), `the row leaks the key: ${text}`);
    const file = await esbd.execute(env, 'test -e /workspace/creds; echo $?');
    assert.equal(file.stdout.trim(), '1', 'the blocked write must not have happened');
  });

test('inspector CLI: the blocked call is a tool error (exit 5)', async () => {
  const r = await esbd.inspector('alice', '/mcp', ['--method', 'tools/call',
    '--tool-name', 'execute_command', '--tool-args-json',
    JSON.stringify({ environment_id: env, command: `echo ${AKID}` })]);
  assert.equal(r.code, 5, `exit ${r.code}: ${r.stdout}${r.stderr}`);
  assert.ok(!r.stdout.includes(AKID), 'the answer echoes the key');
});

test('hosted server: the key in write_file\'s arguments is blocked at its endpoint and ' +
  'through call_environment_tool', async () => {
  await esbd.requireReferenceServers(env);
  await esbd.addServer(env, FS_SERVER);
  const hosted = await esbd.connect('alice', `/environments/${env}/mcp/fs`);
  try {
    assertBlocked(await callTool(hosted, 'write_file', { path: '/workspace/hosted-leak.txt',
      content: PLANTED }), 'hosted write_file');
  } finally { await hosted.close(); }
  const client = await esbd.connect('alice');
  try {
    assertBlocked(await callTool(client, 'call_environment_tool', { environment_id: env,
      name: 'fs.write_file', arguments: { path: '/workspace/hosted-leak2.txt',
        content: PLANTED } }), 'call_environment_tool fs.write_file');
  } finally { await client.close(); }
  const ls = await esbd.execute(env, 'ls /workspace');
  assert.doesNotMatch(ls.stdout, /hosted-leak/, 'a blocked hosted call must not be dispatched');
  const rows = await toolCallRows();
  const hostedRows = rows.filter((e) => /"?fs"?/.test(JSON.stringify(e)) &&
    /write_file/.test(JSON.stringify(e)));
  assert.ok(hostedRows.length >= 2, `hosted tool.call rows: ${JSON.stringify(rows).slice(0, 800)}`);
  for (const row of hostedRows) assert.ok(!JSON.stringify(row).includes(AKID));
});

test('no key in the audit log at all', async () => {
  const r = await esbd.rest('GET', `/audit?limit=1000&q=${encodeURIComponent(AKID)}`);
  assert.equal(r.status, 200, r.text);
  assert.equal(r.json.entries.length, 0, JSON.stringify(r.json.entries).slice(0, 800));
  const all = await esbd.rest('GET', '/audit?limit=1000');
  assert.ok(!all.text.includes(AKID) && !all.text.includes(SECRET));
});
