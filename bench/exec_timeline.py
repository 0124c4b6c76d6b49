#!/usr/bin/env python3
"""Where one `echo hi` exec spends its time: reads a `perf trace -a` log taken while
`transport_bench exec` ran and prints the median of every hop, client send to client read.

`bash bench/run.sh exec-trace` records the log and runs this. The hops are recognised by
syscall, size and flags, so they are tied to today's wire: agent protocol v2 (one multiplexed
connection per environment, already past HELLO: esbd's request frame is a `sendmsg` with
MSG_NOSIGNAL only, the agent's frames are its next two `sendmsg`s, the output then the
RESPONSE), the Beast server (answers with MSG_DONTWAIT|MSG_NOSIGNAL) and the 164-byte HTTP
request transport_bench sends. The trace is system-wide: other esbd daemons running on the
machine at the same time can break a timeline (it is then skipped). After a protocol or server
change the markers must be updated (the script says so when it finds no complete timeline).

Usage: exec_timeline.py PERF_TRACE_LOG
"""
import re
import statistics
import sys

LINE = re.compile(
    r"^\s*([\d.]+) \(\s*[\d.]*\s*(?:ms)?\): (\S+)/(\d+) (\w+)\((.*?)\)\s*(?:= (\S+))?")

HTTP_ANSWER = ("195", "196")

STEPS = [
    ("client sends the HTTP request",
     lambda c, s, a, r: c == "transport_benc" and s == "sendto" and "len: 164" in a),
    ("esbd's I/O thread reads it",
     lambda c, s, a, r: c == "esbd" and s == "recvfrom" and r == "164"),
    ("esbd's worker sends the exec frame",
     lambda c, s, a, r: c == "esbd" and s == "sendmsg" and "DONTWAIT" not in a),
    ("agent sends the stdout frame", lambda c, s, a, r: c == "esb-agent" and s == "sendmsg"),
    ("agent sends the response", lambda c, s, a, r: c == "esb-agent" and s == "sendmsg"),
    ("esbd sends the HTTP response",
     lambda c, s, a, r: c == "esbd" and s == "sendmsg" and "DONTWAIT" in a and r in HTTP_ANSWER),
    ("client reads it",
     lambda c, s, a, r: c == "transport_benc" and s == "recvfrom" and r in HTTP_ANSWER),
]


def main():
    events = []
    with open(sys.argv[1], errors="replace") as f:
        for line in f:
            if "[continued]" in line:
                continue
            m = LINE.match(line)
            if not m or m.group(2) not in ("esbd", "esb-agent", "transport_benc"):
                continue
            ts, comm, _, sc, args, ret = m.groups()
            events.append((float(ts), comm, sc, args, ret))
    events.sort(key=lambda e: e[0])
    runs = []
    i = 0
    while i < len(events):
        if not STEPS[0][1](*events[i][1:]):
            i += 1
            continue
        t, j, k = [events[i][0]], i + 1, 1
        while j < len(events) and k < len(STEPS) and not STEPS[0][1](*events[j][1:]):
            if STEPS[k][1](*events[j][1:]):
                t.append(events[j][0])
                k += 1
            j += 1
        if k == len(STEPS):
            runs.append(t)
            i = j
        else:
            i += 1
    if not runs:
        print("no complete exec timeline found: the wire sizes this script keys on (see its "
              "docstring) no longer match; update STEPS")
        return 1
    print("%d complete exec timelines; median (min, max) of each hop in ms:" % len(runs))
    total_of_medians = 0.0
    for k in range(1, len(STEPS)):
        d = [r[k] - r[k - 1] for r in runs]
        total_of_medians += statistics.median(d)
        print("  %-44s -> %-44s %6.3f (%6.3f, %6.3f)" % (
            STEPS[k - 1][0], STEPS[k][0], statistics.median(d), min(d), max(d)))
    tot = [r[-1] - r[0] for r in runs]
    print("  client send -> client read: median %.3f ms (min %.3f, max %.3f); sum of the hop "
          "medians %.3f ms" % (statistics.median(tot), min(tot), max(tot), total_of_medians))
    return 0


if __name__ == "__main__":
    sys.exit(main())
