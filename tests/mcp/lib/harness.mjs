// The MCP tests' one harness: starts the real esbd (two tenants with API keys), talks REST to
// it, and gives the official TypeScript SDK client and the inspector CLI, both from the npm
// tools that scripts/install-npm-tools.sh installed (tests/mcp/run.sh passes their directory).
//
// Environment (tests/mcp/run.sh sets them): ESB_BUILD_DIR (esbd lives there), ESBD_MCP_TOOLS
// (the npm tools' directory). esbd reads ESBD_IMAGE_DEFAULT / ESBD_PYTHON_WASM itself.
import { spawn, execFile } from 'node:child_process';
import { createRequire } from 'node:module';
import { mkdtempSync, writeFileSync, readFileSync, rmSync, mkdirSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

function required(name) {
  const v = process.env[name];
  if (!v) throw new Error(`${name} is not set (run the MCP tests through tests/mcp/run.sh)`);
  return v;
}

export const BUILD = required('ESB_BUILD_DIR');
export const TOOLS = required('ESBD_MCP_TOOLS');
const requireTool = createRequire(join(TOOLS, 'package.json'));
export const { Client } = requireTool('@modelcontextprotocol/sdk/client/index.js');
export const { StreamableHTTPClientTransport } =
  requireTool('@modelcontextprotocol/sdk/client/streamableHttp.js');
export const { StdioClientTransport } = requireTool('@modelcontextprotocol/sdk/client/stdio.js');

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// The port in esbd's start-up line "esbd <version> listening on http://127.0.0.1:<port>": esbd
// binds port 0 (choosing a free port first and passing it races with other tests' daemons and
// client connections).
function listeningPort(logText) {
  const m = / listening on http:\/\/127\.0\.0\.1:(\d+)/.exec(logText);
  return m ? Number(m[1]) : 0;
}

// A real esbd on 127.0.0.1 with tenants alice and bob (one API key each) and a temp state dir;
// with devMode, no keys: loopback-only dev mode as tenant `default` (the conformance suite
// cannot send an Authorization header).
export class Esbd {
  static async start({ extraArgs = [], config = {}, poolSize = 0, devMode = false } = {}) {
    const d = new Esbd();
    d.state = mkdtempSync(join(tmpdir(), 'esb-mcp-test-'));
    d.keys = {
      alice: `esb_mcp_alice_${randomBytes(12).toString('hex')}`,
      bob: `esb_mcp_bob_${randomBytes(12).toString('hex')}`,
    };
    const cfg = {
      ...(devMode ? {} : { keys: [
        { key: d.keys.alice, tenant: 'alice' },
        { key: d.keys.bob, tenant: 'bob' },
      ] }),
      ...config,
    };
    if (devMode) d.keys = {};
    writeFileSync(join(d.state, 'config.json'), JSON.stringify(cfg));
    d.port = 0;
    d.url = '';
    d.args = ['--listen', '127.0.0.1:0', '--state-dir', d.state, '--unix-socket', 'none',
      '--pool-size', String(poolSize), '--config', join(d.state, 'config.json'), ...extraArgs];
    d.logPath = join(d.state, 'esbd.log');
    d.proc = spawn(join(BUILD, 'esbd'), d.args, { stdio: ['ignore', 'pipe', 'pipe'] });
    const log = [];
    d.logText = () => log.join('');
    for (const s of [d.proc.stdout, d.proc.stderr]) s.on('data', (b) => log.push(b.toString()));
    d.exited = new Promise((r) => d.proc.on('exit', (code, sig) => r({ code, sig })));
    const deadline = Date.now() + 30_000;
    for (;;) {
      if (d.proc.exitCode !== null || d.proc.signalCode !== null) {
        rmSync(d.state, { recursive: true, force: true });
        throw new Error(`esbd exited during start-up; log:\n${d.logText()}`);
      }
      if (d.port === 0) {
        d.port = listeningPort(d.logText());
        if (d.port !== 0) d.url = `http://127.0.0.1:${d.port}`;
      }
      if (d.port !== 0) {
        try {
          const r = await fetch(`${d.url}/healthz`, { signal: AbortSignal.timeout(2000) });
          if (r.ok) break;
        } catch { /* not up yet */ }
      }
      if (Date.now() > deadline) {
        await d.stop();
        throw new Error(`esbd did not become healthy in 30 s; log:\n${d.logText()}`);
      }
      await sleep(100);
    }
    return d;
  }

  // Is the process still alive?
  alive() { return this.proc.exitCode === null && this.proc.signalCode === null; }

  async stop() {
    if (this.alive()) {
      this.proc.kill('SIGTERM');
      const t = setTimeout(() => this.proc.kill('SIGKILL'), 15_000);
      await this.exited;
      clearTimeout(t);
    }
    // Environments survive esbd by design; tear down what the test left behind.
    await run(join(BUILD, 'esbd'), ['--state-dir', this.state, 'cleanup'], { timeoutMs: 60_000 });
    if (!process.env.ESB_MCP_KEEP_STATE) rmSync(this.state, { recursive: true, force: true });
  }

  headers(tenant) {
    return tenant && this.keys[tenant] ? { Authorization: `Bearer ${this.keys[tenant]}` } : {};
  }

  // REST: returns { status, json, text }.
  async rest(method, path, { tenant = 'alice', body, timeoutMs = 120_000, headers = {} } = {}) {
    const h = { ...this.headers(tenant), ...headers };
    const init = { method, headers: h, signal: AbortSignal.timeout(timeoutMs) };
    if (body !== undefined) {
      h['Content-Type'] = 'application/json';
      init.body = JSON.stringify(body);
    }
    const r = await fetch(`${this.url}${path}`, init);
    const text = await r.text();
    let json;
    try { json = text ? JSON.parse(text) : undefined; } catch { json = undefined; }
    return { status: r.status, json, text, headers: r.headers };
  }

  async createEnvironment(tenant = 'alice', body = { ttl_seconds: 900 }) {
    const r = await this.rest('POST', '/environments', { tenant, body });
    if (r.status !== 201 && r.status !== 200) {
      throw new Error(`POST /environments as ${tenant}: ${r.status} ${r.text}`);
    }
    return r.json.environment_id;
  }

  // The official SDK client over Streamable HTTP at `path` as `tenant`.
  async connect(tenant = 'alice', path = '/mcp', { name = 'esb-mcp-test' } = {}) {
    const client = new Client({ name, version: '1.0.0' }, { capabilities: {} });
    const transport = new StreamableHTTPClientTransport(new URL(`${this.url}${path}`), {
      requestInit: { headers: this.headers(tenant) },
    });
    await client.connect(transport);
    return client;
  }

  // execute in an environment (REST); returns the JSON answer (stdout, stderr, exit_code).
  async execute(envId, command, { tenant = 'alice', timeoutSeconds = 60 } = {}) {
    const r = await this.rest('POST', `/environments/${envId}/execute`, { tenant,
      body: { command, timeout_seconds: timeoutSeconds } });
    if (r.status !== 200) throw new Error(`execute ${command}: ${r.status} ${r.text}`);
    return r.json;
  }

  // Starts a hosted MCP server (POST /environments/{id}/mcp-servers) and waits (bounded) until
  // esbd has initialised it; returns its JSON. Throws with esbd's answer otherwise.
  async addServer(envId, spec, { tenant = 'alice', timeoutMs = 60_000 } = {}) {
    const base = `/environments/${envId}/mcp-servers`;
    const r = await this.rest('POST', base, { tenant, body: spec });
    if (r.status !== 201 && r.status !== 200) {
      throw new Error(`POST ${base} ${JSON.stringify(spec)}: ${r.status} ${r.text}`);
    }
    let s = r.json;
    const deadline = Date.now() + timeoutMs;
    while (s.state === 'starting' && Date.now() < deadline) {
      await sleep(200);
      s = (await this.rest('GET', `${base}/${spec.name}`, { tenant })).json;
    }
    if (s.state !== 'ready') throw new Error(`hosted server ${spec.name}: ${JSON.stringify(s)}`);
    return s;
  }

  // A hosted server's state (GET /environments/{id}/mcp-servers/{name}).
  async server(envId, name, tenant = 'alice') {
    return (await this.rest('GET', `/environments/${envId}/mcp-servers/${name}`, { tenant })).json;
  }

  // Fails clearly when the environment's image lacks the reference MCP servers (an image
  // built before images/rootfs shipped them: rebuild with scripts/build-images.sh).
  async requireReferenceServers(envId) {
    const r = await this.execute(envId,
      'command -v node mcp-server-filesystem mcp-server-memory && node --version');
    if (r.exit_code !== 0 || !/^v22\./m.test(r.stdout)) {
      throw new Error('the rootfs image lacks node 22 or the reference MCP servers ' +
        `(ESBD_IMAGE_DEFAULT=${process.env.ESBD_IMAGE_DEFAULT}; rebuild the images with ` +
        `scripts/build-images.sh): ${JSON.stringify(r)}`);
    }
  }

  // How an MCP client starts `esbd mcp-stdio` against this daemon as `tenant`.
  stdioCommand(tenant) {
    return { command: join(BUILD, 'esbd'), args: ['mcp-stdio', '--url', this.url],
      env: { ESB_API_KEY: this.keys[tenant] ?? '' } };
  }

  // The official SDK client over stdio through `esbd mcp-stdio` as `tenant`.
  async connectStdio(tenant = 'alice') {
    const { command, args, env } = this.stdioCommand(tenant);
    const client = new Client({ name: 'esb-mcp-test-stdio', version: '1.0.0' },
      { capabilities: {} });
    client.transport_ = new StdioClientTransport({ command, args,
      env: { PATH: process.env.PATH, ...env }, stderr: 'pipe' });
    const errs = [];
    client.transport_.stderr?.on('data', (b) => errs.push(b.toString()));
    client.stderrText = () => errs.join('');
    await client.connect(client.transport_);
    return client;
  }

  // The inspector CLI against `path` (HTTP) as `tenant`; `args` are its method options.
  inspector(tenant, path, args, opts = {}) {
    return inspector([`${this.url}${path}`, '--transport', 'http',
      ...(tenant ? ['--header', `Authorization: Bearer ${this.keys[tenant]}`] : []),
      ...args], opts);
  }
}

// Runs a program; resolves { code, signal, stdout, stderr } (never rejects on exit status).
export function run(file, args, { timeoutMs = 60_000, env, input } = {}) {
  return new Promise((resolve) => {
    const child = execFile(file, args, { timeout: timeoutMs, env: env ?? process.env,
      maxBuffer: 64 << 20 }, (err, stdout, stderr) => {
      resolve({ code: err ? (typeof err.code === 'number' ? err.code : -1) : 0,
        signal: err?.signal ?? null, stdout, stderr });
    });
    if (input !== undefined) child.stdin.end(input);
  });
}

let inspectorHome;
// The inspector CLI (@modelcontextprotocol/inspector --cli). Exit codes (notes A6): 0 ok,
// 3 auth, 4 unreachable, 5 tool error. JSON on stdout. It keeps a catalog under $HOME: a
// private one.
export function inspector(args, { timeoutMs = 60_000, env = {} } = {}) {
  if (!inspectorHome) {
    inspectorHome = mkdtempSync(join(tmpdir(), 'esb-mcp-inspector-'));
    mkdirSync(join(inspectorHome, '.mcp-inspector'), { recursive: true });
    process.on('exit', () => rmSync(inspectorHome, { recursive: true, force: true }));
  }
  return run(join(TOOLS, 'node_modules', '.bin', 'mcp-inspector'),
    ['--cli', '--format', 'json', ...args],
    { timeoutMs, env: { ...process.env, HOME: inspectorHome, ...env } });
}

// The result an inspector run printed (--format json: {"result": ...}).
export function inspected(r) {
  if (r.code !== 0) throw new Error(`inspector exit ${r.code}: ${r.stdout}${r.stderr}`);
  const doc = JSON.parse(r.stdout);
  return doc.result ?? doc;
}

// The text of a tool result's content (text items joined).
export function resultText(result) {
  return (result?.content ?? []).filter((c) => c.type === 'text').map((c) => c.text).join('\n');
}

// Parses the JSON a tool result carries: structuredContent, else its text.
export function resultJson(result) {
  if (result?.structuredContent) return result.structuredContent;
  return JSON.parse(resultText(result));
}

export function readJson(path) { return JSON.parse(readFileSync(path, 'utf8')); }

// tools/call through the SDK client (timeout in ms; the SDK's default is 60 s).
export function callTool(client, name, args, { timeoutMs = 120_000, onprogress } = {}) {
  return client.callTool({ name, arguments: args }, undefined,
    { timeout: timeoutMs, ...(onprogress ? { onprogress, resetTimeoutOnProgress: true } : {}) });
}

// The result, or an exception carrying its text when it is a tool error.
export function ok(result, what) {
  if (result?.isError) throw new Error(`${what}: tool error: ${resultText(result)}`);
  return result;
}

// The environment id a create_environment result names.
export function environmentIdOf(result) {
  const text = JSON.stringify(result.structuredContent ?? {}) + resultText(result);
  const m = text.match(/env_[A-Za-z0-9]+/);
  if (!m) throw new Error(`no environment id in ${text.slice(0, 300)}`);
  return m[0];
}

// esbd's own tools, one environment's life through an MCP client (HTTP or stdio): create,
// execute (the shell keeps cd and export), write/read/list files, run code, list, delete.
// Returns what the steps saw, for the caller's own assertions.
export async function environmentRoundTrip(client, assert) {
  const created = ok(await callTool(client, 'create_environment', { ttl_seconds: 600 }),
    'create_environment');
  const id = environmentIdOf(created);
  ok(await callTool(client, 'execute_command', { environment_id: id,
    command: 'cd /tmp && export ESB_X=7' }), 'execute_command cd/export');
  const echo = ok(await callTool(client, 'execute_command', { environment_id: id,
    command: 'echo "$PWD $ESB_X"' }), 'execute_command echo');
  assert.match(resultText(echo), /\/tmp 7/, 'the shell kept cd and export between calls');
  const failing = await callTool(client, 'execute_command', { environment_id: id,
    command: 'echo to-stderr >&2; exit 3' });
  assert.match(JSON.stringify(failing), /exit_code\\?"?:\s*3|exit code 3/i, 'exit code 3 reported');
  ok(await callTool(client, 'write_file', { environment_id: id, path: 'mcp/hello.txt',
    content: 'hello from an MCP client\n' }), 'write_file');
  const read = ok(await callTool(client, 'read_file', { environment_id: id,
    path: 'mcp/hello.txt' }), 'read_file');
  assert.match(resultText(read) + JSON.stringify(read.structuredContent ?? {}),
    /hello from an MCP client/);
  const listed = ok(await callTool(client, 'list_files', { environment_id: id, path: 'mcp' }),
    'list_files');
  assert.match(JSON.stringify(listed), /hello\.txt/);
  const ran = ok(await callTool(client, 'run_code', { code: 'print(6 * 7)' }), 'run_code');
  assert.match(JSON.stringify(ran), /42/);
  assert.match(JSON.stringify(ran), /nano|heavy/, 'run_code says its tier');
  const envs = ok(await callTool(client, 'list_environments', {}), 'list_environments');
  assert.match(JSON.stringify(envs), new RegExp(id));
  ok(await callTool(client, 'delete_environment', { environment_id: id }), 'delete_environment');
  const gone = await callTool(client, 'execute_command', { environment_id: id, command: 'true' });
  assert.equal(gone.isError, true, 'a deleted environment is a tool error');
  return id;
}

// The reference MCP servers the rootfs ships (images/rootfs/npm), as hosted-server specs.
export const FS_SERVER = { name: 'fs', command: 'mcp-server-filesystem', args: ['/workspace'] };
export const MEMORY_SERVER = { name: 'memory', command: 'mcp-server-memory', args: [],
  env: { MEMORY_FILE_PATH: '/workspace/memory.jsonl' } };

// esbd's tool names on /mcp (sdk/tools.json; CONTEXT.md "Interfaces").
export const ESBD_TOOLS = ['create_environment', 'list_environments', 'delete_environment',
  'execute_command', 'write_file', 'read_file', 'list_files', 'run_code',
  'list_environment_tools', 'call_environment_tool'];
