// The official MCP conformance suite (@modelcontextprotocol/conformance) against the real esbd,
// for one spec era: starts esbd with the test-only --mcp-conformance-fixtures flag (the suite's
// test_* tools), runs `conformance server --requirements ERA --expected-failures
// tests/mcp/expected-failures.yml`, then check_conformance.mjs reads every scenario's
// checks.json (the suite's own summary passes some checks vacuously: notes/mcp.md A7).
// Usage (through tests/mcp/run.sh): node conformance.mjs 2025-11-25|2026-07-28
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';
import { createRequire } from 'node:module';
import { Esbd, TOOLS, run } from './lib/harness.mjs';
import { checkEra } from './check_conformance.mjs';

const HERE = dirname(fileURLToPath(import.meta.url));
const ERAS = ['2025-11-25', '2026-07-28'];
const era = process.argv[2];
if (!ERAS.includes(era)) {
  console.error(`usage: conformance.mjs ${ERAS.join('|')}`);
  process.exit(2);
}
const requireTool = createRequire(join(TOOLS, 'package.json'));
const expectedPath = join(HERE, 'expected-failures.yml');

// Dev mode (no API keys): the suite sends no Authorization header. Loopback only, which the
// dns-rebinding scenario relies on.
const esbd = await Esbd.start({ devMode: true, extraArgs: ['--mcp-conformance-fixtures'] });
const out = mkdtempSync(join(tmpdir(), `esb-mcp-conformance-${era}-`));
let status = 1;
try {
  const t0 = Date.now();
  const r = await run(join(TOOLS, 'node_modules', '.bin', 'conformance'), ['server',
    '--url', `${esbd.url}/mcp`, '--requirements', era, '--expected-failures', expectedPath,
    '-o', out], { timeoutMs: 300_000 });
  console.log(r.stdout);
  if (r.stderr.trim()) console.log(r.stderr);
  console.log(`conformance server --requirements ${era}: exit ${r.code} in ` +
    `${((Date.now() - t0) / 1000).toFixed(1)} s`);
  if (!esbd.alive()) throw new Error(`esbd died during the suite; log:\n${esbd.logText()}`);

  const verdict = checkEra({ era, dir: out, expectedPath, requireTool });
  const { notScored } = verdict;

  // The suite's own baseline verdict must agree, except where this checker knows better: a
  // scenario it calls stale because it passes only vacuously, or an unscored one.
  const own = parseBaseline(r.stdout);
  const disagree = [
    ...own.unexpected.filter((s) => !notScored.has(s.split(':')[0])),
    ...own.stale.filter((s) => {
      const row = verdict.rows.find((x) => x.scenario === s.split(':')[0]);
      return !notScored.has(s.split(':')[0]) && !(row && row.verdict === 'expected-failure');
    }),
  ];
  if (r.code !== 0 && own.unexpected.length + own.stale.length === 0) {
    disagree.push(`the suite exited ${r.code} without a baseline verdict (see its output)`);
  }
  const problems = [...verdict.problems, ...disagree.map((d) => `suite: ${d}`)];
  if (problems.length > 0) {
    console.log(`\n${era}: FAILED (${problems.length}):`);
    for (const p of problems) console.log(`  - ${p}`);
  } else {
    const passed = verdict.rows.filter((x) => x.verdict === 'pass').length;
    console.log(`\n${era}: conformant: ${passed} scenarios really pass, ` +
      `${verdict.rows.length - passed} deliberately unimplemented ` +
      '(tests/mcp/expected-failures.yml)');
    status = 0;
  }
} catch (e) {
  console.log(`FAILED: ${e.stack ?? e}`);
} finally {
  await esbd.stop();
  if (status === 0 && !process.env.ESB_MCP_KEEP_STATE) {
    rmSync(out, { recursive: true, force: true });
  }
  else console.log(`results kept in ${out}`);
}
process.exit(status);

// The suite's "Unexpected failures" and "Stale baseline entries" lists from its output.
function parseBaseline(stdout) {
  const plain = stdout.replace(/\x1b\[[0-9;]*m/g, '');
  const unexpected = [];
  const stale = [];
  let list = null;
  for (const line of plain.split('\n')) {
    if (/^Unexpected failures/.test(line)) list = unexpected;
    else if (/^Stale baseline entries/.test(line)) list = stale;
    else if (/^Expected failures/.test(line) || /^\S/.test(line)) list = null;
    else if (list && /^\s+[✗✓]\s+(\S+)/.test(line)) list.push(line.trim().slice(2).trim());
  }
  return { unexpected, stale };
}
