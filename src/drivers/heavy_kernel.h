// The stateful Python kernel of the heavy (container) tier: src/agent/python/kernel.py, a
// guest-side program compiled into esbd (CMake embeds the file), shipped READ-ONLY into every
// sandbox by its driver (the container driver binds it from its share tmpfs, like esb-agent,
// at kHeavyKernelPath) and run through the driver's ordinary Exec call (RunHeavyKernel below
// is RunCode for any agent-based driver: container today, microVM later):
//
//   python3 /usr/lib/esb/kernel.py run|once CELLFILE RESULTFILE TIMEOUT_MS FORMATS
//
// Its working state (cells, results, the lock, the restart counter) lives in the
// sandbox-writable kHeavyKernelDir; the code itself cannot be replaced from inside.
//
// `run` = a cell of the environment's persistent kernel; `once` = a one-shot run in this
// process (POST /run on heavy). Every cell (both modes) reports `value` (repr of the final
// expression, capped at 64 KiB), `table` (a final DataFrame/Series as columns + rows, at most
// 512 KiB of JSON), structured errors (type, message, traceback; clipped), and `artifacts`:
// figures saved as FORMATS (png,svg) into RESULTFILE's "-art" directory — on plt.show()
// through an in-memory matplotlib backend module, and for figures left open at the end (32
// per cell; the rest are closed and reported as dropped) — plus files created or changed under
// /workspace/artifacts during the cell. RunHeavyKernel reports them; the core's run pipeline
// (core/run) copies them out and RunHeavyKernel removes the staging directory.
//
// Server (`serve`, started on demand by the client, double-forked + setsid so it outlives the
// exec's process group): listens on an abstract unix socket named after its directory (no
// file to delete; the name frees itself when the kernel dies) and runs cells one after another
// in one persistent `__main__` namespace. sys.stdout/sys.stderr are file-like objects for the
// kernel's whole life, sending each write of the current cell to the client as a JSON line
// (2 MiB per cell -> `truncated`; one lock orders all threads' frames, and an interrupt never
// tears a frame); file descriptors 1 and 2 are pipes read by a thread, so subprocess and C
// output reach the cell too. A fork() inside a cell never returns to the serve loop.
// Wire format: the client sends {"code", "formats", "outdir"}\n, and later at most
// {"t":"interrupt"}\n; the server answers {"t":"out","s":"stdout"|"stderr","d":...}\n lines,
// then {"t":"done","status","value","error","truncated","table","artifacts","restarted"}\n.
//
// Interrupts belong to a cell: the client's interrupt line (or its going away) is read by a
// per-cell watcher thread, which raises KeyboardInterrupt in that cell — at once if it runs,
// or as it starts if the timeout came first. A cell whose client went away and that does not
// stop within 2 s is killed with its whole process group (nobody waits for it).
//
// Client (`run`): serialises cells with flock, starts the server if nothing listens, relays
// output to its own stdout/stderr, and at the deadline sends the interrupt line. If no answer
// comes within 2 s more, it SIGKILLs the server's process group (children included) and
// reports kernel_restarted; a kernel lost any other way (killed, OOM) is reported as
// kernel_restarted by the first cell of the next kernel. The client always writes
// {status ok|error|interrupted, value, error, kernel_restarted, timed_out, truncated, table,
// artifacts} to RESULTFILE and exits 0 (its own failure shows as a missing result file).
//
// Once (`once`): the same cell in the client's own process; SIGALRM at the deadline raises
// KeyboardInterrupt, and a cell that ignores it is ended 2 s later with its process group
// (still with a result file).
//
// Output framing: `run` and `once` write the cell's stdout and stderr as frames on the
// exec's stdout (kernel_frames.h), so esbd sees them in the order the cell wrote them; a
// Python-level write first forwards whatever subprocesses wrote before it. (Two subprocess
// streams written at the same moment race each other, as in any terminal.)
#pragma once

#include <string_view>

#include "absl/status/statusor.h"
#include "drivers/driver.h"

namespace esb {

// Where the kernel's code is (read-only) and where it keeps its state (writable) inside a
// sandbox. kernel.py reads the state directory from ESB_KERNEL_DIR (default: this one).
inline constexpr std::string_view kHeavyKernelPath = "/usr/lib/esb/kernel.py";
inline constexpr std::string_view kHeavyKernelDir = "/tmp/.esb-kernel";

// The source of kernel.py (Python 3.11+, stdlib only).
std::string_view HeavyKernelSource();
// The source of esb_vars.py (src/agent/python/): time travel's bounded variables summary.
std::string_view EsbVarsSource();
// What drivers ship at kHeavyKernelPath: kernel.py with esb_vars.py's source prepended as the
// string `_ESB_VARS_SOURCE` (one read-only file: kernel.py loads the summary from it; on the
// host, from esb_vars.py next to it).
const std::string& ShippedHeavyKernel();

// The bounded variables summary a kernel cell reported (StepState::variables_json): a JSON
// array of at most 64 KiB and a bounded shape; anything else is dropped (empty).
std::string ValidVariablesJson(std::string_view text);

// Runs `request` through kernel.py in instance `ref` of `driver`, using only the driver's
// WriteFile / Exec / ReadFile: `request.once` = a one-shot run in a fresh process, else a cell
// of the instance's persistent kernel. Output goes to `sink` as it is produced.
// A persistent-kernel cell also reports the variables summary (time travel) into `*variables`
// when given (validated with ValidVariablesJson; empty: none).
absl::StatusOr<RunResult> RunHeavyKernel(Driver& driver, const InstanceRef& ref,
                                         const RunRequest& request, const OutputSink& sink,
                                         std::string* variables = nullptr);

// A whole file from inside a sandbox, at most `cap` bytes (else ResourceExhausted): every
// size and length the sandbox reports is checked against what was really received.
using ChunkReader = std::function<absl::StatusOr<FileChunk>(int64_t offset, int64_t length)>;
absl::StatusOr<std::string> ReadWholeSandboxFile(const ChunkReader& read, int64_t cap);

}  // namespace esb
