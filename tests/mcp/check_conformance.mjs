// Reads every scenario's checks.json that `conformance server -o DIR` wrote and decides, more
// strictly than the suite's own summary (notes/mcp.md A7: some checks pass vacuously):
//   - a SUCCESS whose details say a fixture (a test_* tool/prompt or a test:// resource) is
//     missing, unknown or not found is a failure (the suite reports e.g. tools-call-simple-text
//     as passed when the server answers "unknown tool test_simple_text");
//   - a SUCCESS whose details are only a session/initialisation error is a failure (several
//     checks pass on any error reply, even "Bad session");
//   - wire-schema checks are synthetic (they also validate the suite's own messages and pass
//     against a closed port) and INFO/SKIPPED checks prove nothing: a scenario that is not an
//     expected failure needs at least one real passing check and no FAILURE or WARNING;
//   - nothing of an era counts unless its handshake really passed: server-initialize for
//     2025-11-25, server/discover (check sep-2575-server-implements-discover) for 2026-07-28;
//   - a scenario listed in the expected-failures file must still fail, or pass only vacuously
//     (it is deliberately unimplemented; a real pass means the entry is stale);
//   - every required scenario of the era must have run.
// Usage: node check_conformance.mjs ERA RESULTS_DIR EXPECTED_FAILURES_YML (conformance.mjs
// runs it after the suite; standalone, it re-judges a kept results directory)
// Exit 0 when the era conforms (minus the expected failures), 1 otherwise; prints a table.
import { readFileSync, readdirSync, existsSync } from 'node:fs';
import { join, dirname } from 'node:path';
import { createRequire } from 'node:module';

const FIXTURE = /\btest_[A-Za-z0-9_]+|test:\/\/[^\s"']+/;
const FIXTURES = new RegExp(FIXTURE.source, 'g');
const MISSING = new RegExp('not found|unknown|no such|missing|does not exist|not registered|' +
  'not listed|not available|unavailable', 'i');
const SESSION_ERROR = new RegExp('\\bbad session\\b|session not found|not initiali[sz]ed|' +
  'missing session|invalid session|no valid session', 'i');
const SYNTHETIC = new Set(['wire-schema-valid', 'wire-schema-harness-error']);
const GATES = {
  '2025-11-25': { scenario: 'server-initialize' },
  '2026-07-28': { scenario: 'server-stateless', check: 'sep-2575-server-implements-discover' },
};

function strings(value, out = []) {
  if (typeof value === 'string') out.push(value);
  else if (Array.isArray(value)) for (const v of value) strings(v, out);
  else if (value && typeof value === 'object') {
    for (const v of Object.values(value)) strings(v, out);
  }
  return out;
}

// Why a SUCCESS check proves nothing, or null when it is a real pass.
export function vacuousReason(scenario, check) {
  if (SYNTHETIC.has(check.id)) return 'synthetic wire-schema check';
  const texts = strings([check.details, check.errorMessage]);
  for (const t of texts) {
    const m = t.match(FIXTURE);
    // The words around the name say it is missing (not the name: test_missing_capability).
    if (m && MISSING.test(t.replace(FIXTURES, ' '))) {
      return `fixture ${m[0]} is missing: "${t.slice(0, 160)}"`;
    }
  }
  // The session lifecycle scenario is about session errors; elsewhere one is never the point.
  if (scenario !== 'server-session-lifecycle') {
    for (const t of texts) {
      if (SESSION_ERROR.test(t)) return `passed on a session error: "${t.slice(0, 160)}"`;
    }
  }
  if (check.details?.untestable === true) return 'the suite marked it untestable';
  return null;
}

// { scenario: [checks...] } from DIR/server-<scenario>-<timestamp>/checks.json (newest wins).
export function readResults(dir) {
  const byScenario = new Map();
  for (const entry of readdirSync(dir).sort()) {
    const m = entry.match(/^server-(.+)-\d{4}-\d{2}-\d{2}T[\d-]+Z$/);
    const file = join(dir, entry, 'checks.json');
    if (!m || !existsSync(file)) continue;
    byScenario.set(m[1], JSON.parse(readFileSync(file, 'utf8')));
  }
  return byScenario;
}

// Entries of the expected-failures file's `server:` list ("scenario" or "scenario:check-id").
export function readExpected(path, requireTool) {
  const yaml = requireTool('yaml');
  const doc = yaml.parse(readFileSync(path, 'utf8')) ?? {};
  const scenarios = new Set();
  const checks = new Map();
  for (const e of doc.server ?? []) {
    const s = String(e);
    const i = s.indexOf(':');
    if (i < 0) { scenarios.add(s); continue; }
    const [sc, id] = [s.slice(0, i), s.slice(i + 1)];
    if (!checks.has(sc)) checks.set(sc, new Set());
    checks.get(sc).add(id);
  }
  return { scenarios, checks };
}

export function judge(era, results, expected, required = []) {
  const rows = [];
  const problems = [];
  const isFail = (c) => c.status === 'FAILURE' || c.status === 'WARNING';
  for (const [scenario, checks] of results) {
    const wholeExpected = expected.scenarios.has(scenario);
    const expectedChecks = expected.checks.get(scenario) ?? new Set();
    const real = [];
    const vacuous = [];
    const failing = [];
    for (const c of checks) {
      if (isFail(c)) {
        if (!expectedChecks.has(c.id)) {
          failing.push(`${c.id}: ${c.status} ${(c.errorMessage ?? '').slice(0, 200)}`.trim());
        }
      } else if (c.status === 'SUCCESS' && !SYNTHETIC.has(c.id)) {
        const why = vacuousReason(scenario, c);
        if (why) vacuous.push(`${c.id}: ${why}`); else real.push(c.id);
      }
    }
    let verdict;
    const why = [];
    if (wholeExpected) {
      if (failing.length === 0 && real.length > 0 && vacuous.length === 0) {
        verdict = 'STALE';
        why.push('listed as an expected failure but really passes: remove it from the file');
      } else {
        verdict = 'expected-failure';
      }
    } else if (failing.length > 0) {
      verdict = 'FAIL';
      why.push(...failing);
    } else if (vacuous.length > 0) {
      verdict = 'FAIL';
      why.push(...vacuous.map((v) => `vacuous pass ${v}`));
    } else if (real.length === 0) {
      verdict = 'FAIL';
      why.push('no real passing check (only synthetic wire-schema, INFO or SKIPPED ones)');
    } else {
      verdict = 'pass';
    }
    for (const id of expectedChecks) {
      const c = checks.find((x) => x.id === id);
      if (c && c.status === 'SUCCESS' && !vacuousReason(scenario, c)) {
        verdict = 'STALE';
        why.push(`${scenario}:${id} is listed as an expected failure but passes`);
      }
    }
    rows.push({ scenario, verdict, real: real.length, vacuous: vacuous.length,
      failing: failing.length, why });
    if (verdict === 'FAIL' || verdict === 'STALE') problems.push(`${scenario}: ${why.join('; ')}`);
  }
  for (const s of required) {
    if (!results.has(s)) problems.push(`${s}: required by ${era} but it did not run`);
  }
  // The era's gate.
  const gate = GATES[era];
  let gateOk = false;
  if (gate) {
    const checks = results.get(gate.scenario) ?? [];
    if (gate.check) {
      const c = checks.find((x) => x.id === gate.check);
      gateOk = !!c && c.status === 'SUCCESS' && !vacuousReason(gate.scenario, c);
    } else {
      gateOk = rows.some((r) => r.scenario === gate.scenario && r.verdict === 'pass');
    }
    if (!gateOk) {
      problems.unshift(`GATE: ${gate.check ?? gate.scenario} did not really pass, so nothing of ` +
        `${era} counts`);
    }
  }
  return { rows, problems, ok: problems.length === 0 };
}

// Judges the era's results in DIR against the suite's requirement set for it (requirements/
// ERA.yaml: `server` must all run; `not_scored` ones, extensions and pending scenarios, are
// reported and never counted) and the expected-failures file; prints the verdict table.
export function checkEra({ era, dir, expectedPath, requireTool }) {
  const suiteDir = dirname(requireTool.resolve('@modelcontextprotocol/conformance/package.json'));
  const req = requireTool('yaml').parse(
    readFileSync(join(suiteDir, 'requirements', `${era}.yaml`), 'utf8')) ?? {};
  const notScored = new Set((req.not_scored ?? [])
    .filter((e) => e.leg === undefined || e.leg === 'server').map((e) => e.scenario));
  const results = readResults(dir);
  for (const s of notScored) results.delete(s);
  const verdict = judge(era, results, readExpected(expectedPath, requireTool),
    (req.server ?? []).map(String));
  console.log(`\nchecks.json verdicts for ${era} (real/vacuous/failing checks):`);
  for (const r of verdict.rows) {
    console.log(`  ${r.verdict.padEnd(16)} ${r.scenario.padEnd(48)} ` +
      `${r.real}/${r.vacuous}/${r.failing}`);
  }
  console.log(`  (run but not scored by ${era}, not counted: ` +
    `${[...notScored].join(', ') || 'none'})`);
  return { ...verdict, notScored };
}

function main() {
  const [era, dir, expectedPath] = process.argv.slice(2);
  if (!era || !dir || !expectedPath) {
    console.error('usage: check_conformance.mjs ERA RESULTS_DIR EXPECTED_FAILURES_YML');
    process.exit(2);
  }
  const tools = process.env.ESBD_MCP_TOOLS;
  if (!tools) { console.error('ESBD_MCP_TOOLS is not set'); process.exit(2); }
  const requireTool = createRequire(join(tools, 'package.json'));
  const { rows, problems, ok } = checkEra({ era, dir, expectedPath, requireTool });
  if (!ok) {
    console.log(`\n${era}: NOT CONFORMANT (${problems.length} problems):`);
    for (const p of problems) console.log(`  - ${p}`);
    process.exit(1);
  }
  const passed = rows.filter((r) => r.verdict === 'pass').length;
  console.log(`\n${era}: ${passed} scenarios really pass; ` +
    `${rows.length - passed} are listed expected failures`);
}

if (import.meta.url === `file://${process.argv[1]}`) main();
