// The checks.json judge (check_conformance.mjs) on hand-made results: each vacuous-pass rule
// of notes/mcp.md A7 must turn a suite "pass" into a failure, and the expected-failures and
// era-gate rules must hold. No esbd, no root.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, mkdirSync, writeFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { judge, readResults, vacuousReason } from './check_conformance.mjs';

const ok = (id, details = {}) => ({ id, status: 'SUCCESS', details });
const fail = (id, msg = 'bad') => ({ id, status: 'FAILURE', errorMessage: msg });
const wire = ok('wire-schema-valid', { messagesValidated: 3, violations: [] });
const none = { scenarios: new Set(), checks: new Map() };
const initOk = ['server-initialize', [ok('server-initialize', { serverName: 'esbd' }), wire]];
const verdict = (v, s) => v.rows.find((r) => r.scenario === s)?.verdict;

test('a pass on a missing fixture tool is a failure (tools-call-simple-text, A7)', () => {
  const c = ok('tools-call-simple-text', { result: { isError: true, content: [{ type: 'text',
    text: 'MCP error -32602: Tool test_simple_text not found' }] } });
  assert.match(vacuousReason('tools-call-simple-text', c), /test_simple_text/);
  const v = judge('2025-11-25', new Map([initOk, ['tools-call-simple-text', [c, wire]]]), none);
  assert.equal(verdict(v, 'tools-call-simple-text'), 'FAIL');
  assert.equal(v.ok, false);
});

test('a pass on a missing test:// resource or an unknown tool is a failure', () => {
  assert.ok(vacuousReason('x',
    ok('x', { error: { message: 'unknown tool: test_error_handling' } })));
  assert.ok(vacuousReason('x', ok('x', { text: 'resource test://static-text does not exist' })));
  // A fixture named in a real answer is not a missing one, even when its name says "missing".
  assert.equal(vacuousReason('tools-list', ok('tools-list', { tools: ['test_simple_text',
    'test_missing_capability'] })), null);
  assert.equal(vacuousReason('x', ok('x', { content: 'called test_simple_text: hello' })), null);
});

test('a pass on a session error is a failure, except in the session lifecycle scenario', () => {
  const c = ok('sep-2322-validate-input-responses',
    { error: { code: -32000, message: 'Bad Request: Server not initialized' } });
  assert.match(vacuousReason('input-required-result-validate-input', c), /session/);
  const bad = ok('x', { body: { error: { message: 'Bad session' } } });
  assert.ok(vacuousReason('ping', bad));
  assert.equal(vacuousReason('server-session-lifecycle', bad), null);
});

test('only synthetic or INFO checks: no real pass, a failure', () => {
  const v = judge('2025-11-25', new Map([initOk,
    ['dns-rebinding-protection', [wire, { id: 'server-info', status: 'INFO' }]]]), none);
  assert.equal(verdict(v, 'dns-rebinding-protection'), 'FAIL');
  assert.match(v.problems.join('\n'), /no real passing check/);
});

test('FAILURE and WARNING fail a scenario; a clean one passes', () => {
  const v = judge('2025-11-25', new Map([initOk,
    ['ping', [ok('ping', { result: {} }), wire]],
    ['tools-list', [ok('tools-list', { tools: 10 }), fail('tools-list-names')]],
    ['server-sse-multiple-streams', [ok('a'), { id: 'b', status: 'WARNING' }]]]), none);
  assert.equal(verdict(v, 'ping'), 'pass');
  assert.equal(verdict(v, 'tools-list'), 'FAIL');
  assert.equal(verdict(v, 'server-sse-multiple-streams'), 'FAIL');
});

test('expected failures: failing or vacuous is fine, a real pass is stale', () => {
  const expected = { scenarios: new Set(['prompts-list', 'resources-list', 'completion-complete']),
    checks: new Map() };
  const v = judge('2025-11-25', new Map([initOk,
    ['prompts-list', [fail('prompts-list', 'Method not found'), wire]],
    ['resources-list', [ok('resources-list', { error: 'Tool test_x not found' }), wire]],
    ['completion-complete', [ok('completion-complete', { values: ['a'] }), wire]]]), expected);
  assert.equal(verdict(v, 'prompts-list'), 'expected-failure');
  assert.equal(verdict(v, 'resources-list'), 'expected-failure');
  assert.equal(verdict(v, 'completion-complete'), 'STALE');
  assert.equal(v.ok, false);
});

test('era gates: nothing counts without server-initialize (2025) or server/discover (2026)',
  () => {
    const v1 = judge('2025-11-25', new Map([['ping', [ok('ping'), wire]]]), none);
    assert.match(v1.problems[0], /^GATE: server-initialize/);
    const v2 = judge('2026-07-28', new Map([['server-stateless',
      [fail('sep-2575-server-implements-discover'), ok('sep-2575-http-server-meta-invalid-400')]],
    ['tools-list', [ok('tools-list'), wire]]]), none);
    assert.match(v2.problems[0], /^GATE: sep-2575-server-implements-discover/);
    const v3 = judge('2026-07-28', new Map([['server-stateless',
      [ok('sep-2575-server-implements-discover', { supportedVersions: ['2026-07-28'] })]]]),
    none);
    assert.equal(v3.ok, true, v3.problems.join('\n'));
  });

test('a required scenario that did not run is a failure', () => {
  const v = judge('2025-11-25', new Map([initOk]), none, ['server-initialize', 'ping']);
  assert.match(v.problems.join('\n'), /ping: required by 2025-11-25 but it did not run/);
});

test('readResults maps server-<scenario>-<timestamp>/checks.json to scenarios', () => {
  const dir = mkdtempSync(join(tmpdir(), 'esb-checks-'));
  try {
    for (const [name, checks] of [['server-tools-call-error-2026-11-24T21-11-36-946Z', [ok('a')]],
      ['server-ping-2026-11-24T21-11-36-628Z', [ok('ping')]], ['not-a-result', [ok('x')]]]) {
      mkdirSync(join(dir, name));
      writeFileSync(join(dir, name, 'checks.json'), JSON.stringify(checks));
    }
    const r = readResults(dir);
    assert.deepEqual([...r.keys()].sort(), ['ping', 'tools-call-error']);
  } finally { rmSync(dir, { recursive: true, force: true }); }
});
