#!/usr/bin/env python3
"""EnterSandBox benchmarks: prints a table with ratios against baselines measured in the same run.

Usage: bench.py --url http://127.0.0.1:PORT --state-dir DIR [--iterations N]
The daemon must run as root with the container driver; bench/run.sh starts one.
"""
import argparse
import concurrent.futures
import http.client
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse


class Client:
    def __init__(self, url):
        u = urllib.parse.urlparse(url)
        self.host, self.port = u.hostname, u.port

    def call(self, method, path, body=None):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data,
                     headers={"Content-Type": "application/json"} if data else {})
        resp = conn.getresponse()
        raw = resp.read()
        conn.close()
        return resp.status, (json.loads(raw) if raw else None)


class KeepAlive(Client):
    """One persistent connection (what an SDK does), for round-trip latency."""

    def __init__(self, url):
        super().__init__(url)
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)

    def call(self, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        self.conn.request(method, path, body=data,
                          headers={"Content-Type": "application/json"} if data else {})
        resp = self.conn.getresponse()
        raw = resp.read()
        return resp.status, (json.loads(raw) if raw else None)


def pct(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, int(round(p / 100.0 * (len(s) - 1)))))
    return s[k]


def ms(t0):
    return (time.perf_counter() - t0) * 1000.0


def wait_pool(client, want, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        _, h = client.call("GET", "/healthz")
        if h and h.get("pool_ready", 0) >= want:
            return True
        time.sleep(0.05)
    return False


def bench_create(client, n, pooled):
    lat, errors = [], 0
    for _ in range(n):
        if pooled and not wait_pool(client, 1):
            errors += 1
            continue
        body = {} if pooled else {"memory_mb": 513}  # a shape the pool does not hold → cold
        t0 = time.perf_counter()
        st, r = client.call("POST", "/environments", body)
        dt = ms(t0)
        if st != 201 or r.get("pooled") != pooled:
            errors += 1
        else:
            lat.append(dt)
        if st == 201:
            client.call("DELETE", "/environments/" + r["environment_id"])
    return lat, errors


def raw_runtime_baseline(state_dir, env_id, n):
    """`crun run` / `runc run` of the same bundle esbd wrote, with `/bin/true` as the process."""
    bundle_src = os.path.join(state_dir, "container", "envs", env_id)
    with open(os.path.join(bundle_src, "config.json")) as f:
        cfg = json.load(f)
    runtime = None
    for name in ("crun", "runc"):
        if os.path.isdir(os.path.join(state_dir, "container", "runtime", name)):
            runtime = name
    runtime = runtime or "crun"
    binary = shutil.which(runtime)
    cfg["process"]["args"] = ["/bin/true"]
    cfg["process"]["terminal"] = False
    lat = []
    hybrid = os.path.ismount("/sys/fs/cgroup/unified") and runtime == "crun"
    with tempfile.TemporaryDirectory(prefix="esb-bench-") as tmp:
        root = os.path.join(tmp, "state")
        for i in range(n):
            bundle = os.path.join(tmp, "b%d" % i)
            os.makedirs(bundle)
            c = json.loads(json.dumps(cfg))
            lin = c.get("linux", {})
            if "cgroupsPath" in lin:
                lin["cgroupsPath"] = lin["cgroupsPath"].rstrip("/") + "-bench%d" % i
            with open(os.path.join(bundle, "config.json"), "w") as f:
                json.dump(c, f)
            cmd = [binary, "--root", root, "run", "--bundle", bundle, "bench%d-%d" % (os.getpid(), i)]
            if hybrid:
                # Same trick the driver uses on hybrid cgroup hosts (see notes/host-facts.md).
                cmd = ["unshare", "-m", "sh", "-c",
                       "umount /sys/fs/cgroup/unified 2>/dev/null; exec \"$@\"", "sh"] + cmd
            t0 = time.perf_counter()
            p = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
            dt = ms(t0)
            if p.returncode == 0:
                lat.append(dt)
            else:
                print("  raw %s run failed: %s" % (runtime, p.stderr.decode()[-300:]), file=sys.stderr)
    return runtime, lat


def bench_exec(url, env_id, n):
    c = KeepAlive(url)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        st, r = c.call("POST", "/environments/%s/execute" % env_id, {"command": "echo hi"})
        dt = ms(t0)
        if st == 200 and r["stdout"] == "hi\n":
            lat.append(dt)
    base = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(["/bin/echo", "hi"], stdout=subprocess.DEVNULL)
        base.append(ms(t0))
    bash = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(["/bin/bash", "--noprofile", "--norc", "-c", "echo hi"], stdout=subprocess.DEVNULL)
        bash.append(ms(t0))
    return lat, base, bash


def bench_concurrent(client, n):
    """n clients at once: create + execute (timed as one phase), then delete (timed apart)."""
    errors = []
    ids = [None] * n

    def use(i):
        t0 = time.perf_counter()
        st, r = client.call("POST", "/environments", {})
        if st != 201:
            errors.append("create %d: %s" % (st, r))
            return None
        ids[i] = r["environment_id"]
        st2, r2 = client.call("POST", "/environments/%s/execute" % ids[i], {"command": "echo %d" % i})
        if st2 != 200 or r2.get("stdout") != "%d\n" % i:
            errors.append("execute %d: %s" % (st2, r2))
        return ms(t0)

    def delete(eid):
        t0 = time.perf_counter()
        st, _ = client.call("DELETE", "/environments/" + eid)
        if st != 200:
            errors.append("delete %d" % st)
        return ms(t0)

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as ex:
        lat = [x for x in ex.map(use, range(n)) if x is not None]
    use_wall = ms(t0)
    t1 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=n) as ex:
        del_lat = list(ex.map(delete, [i for i in ids if i]))
    return lat, use_wall, del_lat, ms(t1), errors


def bench_nano(url, n):
    """`print(1)` through POST /run on nano vs bare /usr/bin/python3 vs a container-tier run."""
    c = KeepAlive(url)
    st, h = c.call("GET", "/healthz")
    if "nano" not in (h or {}).get("drivers", {}):
        return None
    nano, heavy, bare = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        st, r = c.call("POST", "/run", {"code": "print(1)", "runtime": "nano"})
        dt = ms(t0)
        if st == 200 and r["stdout"] == "1\n":
            nano.append(dt)
        time.sleep(0.02)  # an interactive agent's pace; back-to-back is measured below
    for _ in range(max(5, n // 10)):
        t0 = time.perf_counter()
        st, r = c.call("POST", "/run", {"code": "print(1)", "runtime": "heavy"})
        if st == 200 and r["stdout"] == "1\n":
            heavy.append(ms(t0))
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-c", "print(1)"], stdout=subprocess.DEVNULL)
        bare.append(ms(t0))
    # Throughput: back-to-back runs from 2 clients for ~5 s.
    deadline = time.time() + 5
    count = [0]

    def worker():
        k = KeepAlive(url)
        while time.time() < deadline:
            st, r = k.call("POST", "/run", {"code": "print(1)", "runtime": "nano"})
            if st == 200:
                count[0] += 1
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as ex:
        list(ex.map(lambda _: worker(), range(2)))
    rps = count[0] / ((time.perf_counter() - t0))
    return nano, heavy, bare, rps


def nano_session_memory(url, sessions):
    """Idle memory of stateful nano sessions: PSS of their worker processes."""
    c = Client(url)
    ids = []
    for _ in range(sessions):
        st, r = c.call("POST", "/environments", {"runtime": "nano"})
        if st != 201:
            break
        ids.append(r["environment_id"])
        c.call("POST", "/environments/%s/run" % r["environment_id"], {"code": "x = 1"})
    pss = 0
    workers = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open("/proc/%s/cmdline" % pid, "rb") as f:
                if b"esb-nano-worker" not in f.read():
                    continue
            with open("/proc/%s/smaps_rollup" % pid) as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1])
                        workers += 1
        except OSError:
            continue
    for i in ids:
        c.call("DELETE", "/environments/" + i)
    return len(ids), workers, pss / 1024.0


# The "mixed" workload: what an agent's code calls look like when most are plain logic and a
# few need pandas. Each snippet prints a deterministic line that the bench checks.
MIXED_LOGIC = [
    'import json\nd = {"a": [1, 2, 3], "b": {"c": "x"}}\ns = json.dumps(d, sort_keys=True)\n'
    'print(len(s), json.loads(s)["a"][2])',
    'import re\ntext = "alice@example.com, bob@test.org; carol@x.io"\n'
    'print(sorted(re.findall(r"[\\w.]+@([\\w.]+)", text)))',
    'import math\nprint(round(sum(math.sqrt(i) for i in range(1, 2001)), 3))',
    'from collections import Counter\n'
    'words = "the quick brown fox jumps over the lazy dog the end".split()\n'
    'print(Counter(words).most_common(2))',
    'import json, collections\nrows = [{"k": i % 3, "v": i} for i in range(100)]\n'
    'acc = collections.defaultdict(int)\nfor r in rows:\n    acc[r["k"]] += r["v"]\n'
    'print(json.dumps(acc, sort_keys=True))',
]
MIXED_PANDAS = [
    ('import pandas as pd\n'
     'df = pd.DataFrame({"team": ["a", "b", "a", "c", "b", "a"], "pts": [3, 5, 2, 7, 1, 4]})\n'
     'print(df.groupby("team")["pts"].sum().to_dict())', "{'a': 9, 'b': 6, 'c': 7}\n"),
    ('import pandas as pd\n'
     'df = pd.DataFrame({"team": ["a", "b", "a", "c", "b", "a"], "pts": [3, 5, 2, 7, 1, 4]})\n'
     'print(df.groupby("team")["pts"].mean().round(2).to_dict())',
     "{'a': 3.0, 'b': 3.0, 'c': 7.0}\n"),
]


def mixed_workload(n, seed=20261122):
    """n (code, expected stdout, kind) in a fixed shuffled order: 80% logic, 20% pandas.
    Logic snippets' expected output comes from running them here (pure stdlib)."""
    import contextlib
    import io
    import random
    expected = {}
    for code in MIXED_LOGIC:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(compile(code, "<mixed>", "exec"), {})
        expected[code] = buf.getvalue()
    n_pandas = n // 5
    work = [(MIXED_LOGIC[i % len(MIXED_LOGIC)], None, "logic") for i in range(n - n_pandas)]
    work += [(MIXED_PANDAS[i % len(MIXED_PANDAS)][0], MIXED_PANDAS[i % len(MIXED_PANDAS)][1],
              "pandas") for i in range(n_pandas)]
    random.Random(seed).shuffle(work)
    return [(code, exp if exp is not None else expected[code], kind) for code, exp, kind in work]


def bench_mixed(url, work, runtime):
    """Runs the workload back to back through POST /run with one runtime; returns per-call
    latencies, total wall time, a count of the answers' tiers and the failures."""
    import collections
    c = KeepAlive(url)
    lat, tiers, failures = [], collections.Counter(), []
    t_all = time.perf_counter()
    for code, expected, kind in work:
        t0 = time.perf_counter()
        st, r = c.call("POST", "/run", {"code": code, "runtime": runtime, "timeout_ms": 60000})
        lat.append(ms(t0))
        r = r or {}
        tiers[str(r.get("tier"))] += 1
        if st != 200 or r.get("exit_code") != 0 or r.get("stdout") != expected:
            failures.append("%s/%s: HTTP %s exit %s stdout %r stderr %r" % (
                runtime, kind, st, r.get("exit_code"), (r.get("stdout") or "")[:80],
                (r.get("stderr") or r.get("message") or "")[-200:]))
    return lat, ms(t_all), tiers, failures


def run_mixed(url, n):
    work = mixed_workload(n)
    kinds = {"logic": sum(1 for w in work if w[2] == "logic"),
             "pandas": sum(1 for w in work if w[2] == "pandas")}
    print("Measuring mixed workload: %d POST /run calls (%d logic, %d pandas), runtime auto "
          "then heavy ..." % (len(work), kinds["logic"], kinds["pandas"]), file=sys.stderr)
    # Warm-up (not counted): one call of each kind on each runtime, so neither mode pays
    # first-use costs (page cache, worker start) inside its measurement.
    warm = [next(w for w in work if w[2] == "logic"), next(w for w in work if w[2] == "pandas")]
    for runtime in ("auto", "heavy"):
        bench_mixed(url, warm, runtime)
    results = {}
    for runtime in ("auto", "heavy"):
        results[runtime] = bench_mixed(url, work, runtime)
    print()
    print("| %-30s | %5s | %10s | %9s | %9s | %11s | %12s | %-18s | %8s |" % (
        "mixed workload, runtime", "n", "total (ms)", "p50", "p95", "logic p50",
        "pandas p50", "tiers used", "failures"))
    print("|" + "-" * 32 + "|" + "-" * 7 + "|" + "-" * 12 + "|" + "-" * 11 + "|" + "-" * 11
          + "|" + "-" * 13 + "|" + "-" * 14 + "|" + "-" * 20 + "|" + "-" * 10 + "|")
    for runtime in ("auto", "heavy"):
        lat, wall, tiers, failures = results[runtime]
        by_kind = {k: [t for t, w in zip(lat, work) if w[2] == k] for k in ("logic", "pandas")}
        print("| %-30s | %5d | %10.0f | %9.2f | %9.2f | %11.2f | %12.2f | %-18s | %8d |" % (
            runtime + (" (always-heavy baseline)" if runtime == "heavy" else ""), len(lat),
            wall, pct(lat, 50), pct(lat, 95), pct(by_kind["logic"], 50),
            pct(by_kind["pandas"], 50),
            ", ".join("%s=%d" % kv for kv in sorted(tiers.items())), len(failures)))
    a_lat, a_wall = results["auto"][0], results["auto"][1]
    h_lat, h_wall = results["heavy"][0], results["heavy"][1]
    print()
    print("mixed: heavy/auto total wall %.2fx, p50 %.2fx, p95 %.2fx" % (
        h_wall / a_wall, pct(h_lat, 50) / pct(a_lat, 50), pct(h_lat, 95) / pct(a_lat, 95)))
    for runtime in ("auto", "heavy"):
        for f in results[runtime][3][:3]:
            print("  failure: " + f)


def row(name, values, baseline_name=None, baseline=None, goal=""):
    p50, p99 = pct(values, 50), pct(values, 99)
    ratio = ""
    if baseline:
        ratio = "%.2fx %s" % (p50 / pct(baseline, 50), baseline_name)
    print("| %-44s | %5d | %9.2f | %9.2f | %-22s | %-18s |" % (name, len(values), p50, p99, ratio, goal))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--iterations", type=int, default=30)
    ap.add_argument("--concurrency", type=int, default=100)
    ap.add_argument("--pool-wait", type=int, default=0,
                    help="before the concurrency test, wait until this many pooled instances are ready")
    ap.add_argument("--bench", choices=("all", "mixed"), default="all",
                    help="'mixed': only the auto-vs-heavy mixed POST /run workload")
    ap.add_argument("--mixed-n", type=int, default=50, help="calls in the mixed workload")
    a = ap.parse_args()
    if a.bench == "mixed":
        run_mixed(a.url, a.mixed_n)
        return
    c = Client(a.url)
    n = a.iterations

    print("Measuring (iterations=%d, concurrency=%d) ..." % (n, a.concurrency), file=sys.stderr)
    warm, warm_err = bench_create(c, n, pooled=True)
    cold, cold_err = bench_create(c, max(5, n // 2), pooled=False)
    st, env = c.call("POST", "/environments", {})
    env_id = env["environment_id"]
    runtime, raw = raw_runtime_baseline(a.state_dir, env_id, max(5, n // 2))
    exec_lat, fork_lat, bash_lat = bench_exec(a.url, env_id, n * 5)
    c.call("DELETE", "/environments/" + env_id)
    if a.pool_wait:
        wait_pool(c, a.pool_wait, timeout=300)
    conc_lat, conc_use, conc_del, conc_del_wall, conc_err = bench_concurrent(c, a.concurrency)
    nano = bench_nano(a.url, n * 3)
    mem = nano_session_memory(a.url, 50) if nano else None

    print()
    print("| %-44s | %5s | %9s | %9s | %-22s | %-18s |" % ("benchmark (ms)", "n", "p50", "p99", "ratio (p50)", "goal"))
    print("|" + "-" * 46 + "|" + "-" * 7 + "|" + "-" * 11 + "|" + "-" * 11 + "|" + "-" * 24 + "|" + "-" * 20 + "|")
    row("create, warm pool (API round trip)", warm, "raw " + runtime, raw, "p50 <= 15 ms")
    row("create, cold (API round trip)", cold, "raw " + runtime, raw, "<= 1.2x raw runtime")
    row("baseline: raw `%s run` /bin/true" % runtime, raw)
    row("execute `echo hi` (API, keep-alive)", exec_lat, "fork+exec", fork_lat, "p50 <= 3 ms")
    row("baseline: local fork+exec /bin/echo", fork_lat)
    row("baseline: local bash -c 'echo hi'", bash_lat)
    row("%d concurrent create+execute (each)" % a.concurrency, conc_lat, goal="all in <= 3 s")
    row("%d concurrent delete (each)" % a.concurrency, conc_del)
    if nano:
        nano_lat, heavy_lat, bare_lat, rps = nano
        row("POST /run print(1), nano", nano_lat, "python3", bare_lat, "p50 <= 5 ms")
        row("POST /run print(1), heavy (container)", heavy_lat, "python3", bare_lat)
        row("baseline: bare /usr/bin/python3 -c", bare_lat)
    print()
    if nano:
        print("nano throughput: %.1f runs/s back to back from 2 clients" % rps)
        if mem and mem[1]:
            per = mem[2] / max(1, mem[0])
            print("nano idle sessions: %d sessions, %d worker processes, %.1f MiB PSS in all, "
                  "%.2f MiB each -> ~%d sessions in 24 GiB (goal >= 1000)" % (
                      mem[0], mem[1], mem[2], per, int(24 * 1024 / per) if per else 0))
    else:
        print("nano tier not available on this daemon: nano rows skipped")
    print("concurrent: %d/%d created and used in %.0f ms wall, deleted in %.0f ms wall, "
          "errors: %d%s" % (len(conc_lat), a.concurrency, conc_use, conc_del_wall, len(conc_err),
                            (" (first: %s)" % conc_err[0]) if conc_err else ""))
    print("create errors: warm %d, cold %d" % (warm_err, cold_err))


if __name__ == "__main__":
    main()
