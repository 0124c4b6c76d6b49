// Entry points of the nano guest (CPython 3.11 on wasm32-wasi, linked as a WASI reactor). The ABI
// is specified in images/python-wasm/README.md.
//
//   wizer.initialize  run once by Wizer at build time: libc constructors, interpreter start,
//                     `import _esb_nano` (which pre-imports the common stdlib). Removed from the
//                     output module by Wizer.
//   esb_run           read code from fd 0 to EOF, run it in the persistent __main__, return the
//                     exit code (the work is done by _esb_nano.run()).
//   esb_reseed        _esb_nano.reseed(): random.seed() from WASI random_get.
#include <Python.h>

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

// wasm-ld synthesises this; it runs wasi-libc's and our constructors. crt1-reactor's exported
// _initialize calls it too; whichever runs first at Wizer time wins (g_ctors_ran).
extern void __wasm_call_ctors(void);

static int g_ctors_ran;
__attribute__((constructor)) static void MarkCtorsRan(void) { g_ctors_ran = 1; }

static PyObject* g_run;     // _esb_nano.run
static PyObject* g_reseed;  // _esb_nano.reseed

static void InitFailed(const char* what) {
  fprintf(stderr, "nano guest init failed: %s\n", what);
  fflush(stderr);
  __builtin_trap();  // makes Wizer fail loudly instead of snapshotting a broken interpreter
}

static void CheckStatus(PyStatus status, const char* what) {
  if (PyStatus_Exception(status)) {
    fprintf(stderr, "nano guest: %s: %s\n", what, status.err_msg ? status.err_msg : "?");
    InitFailed(what);
  }
}

__attribute__((export_name("wizer.initialize"))) void NanoWizerInitialize(void) {
  if (!g_ctors_ran) __wasm_call_ctors();

  // Frozen into the snapshot (README: "Environment at snapshot").
  setenv("HOME", "/workspace", 1);
  setenv("TMPDIR", "/tmp", 1);
  setenv("LANG", "C.UTF-8", 1);
  if (chdir("/workspace") != 0) InitFailed("chdir(/workspace)");

  PyPreConfig preconfig;
  PyPreConfig_InitIsolatedConfig(&preconfig);
  preconfig.utf8_mode = 1;
  CheckStatus(Py_PreInitialize(&preconfig), "Py_PreInitialize");

  PyConfig config;
  PyConfig_InitIsolatedConfig(&config);
  config.site_import = 0;
  config.write_bytecode = 0;
  config.install_signal_handlers = 0;
  config.buffered_stdio = 1;
  config.parse_argv = 0;
  config.pathconfig_warnings = 0;
#ifdef NANO_HASH_SEED
  config.use_hash_seed = 1;
  config.hash_seed = (unsigned long)(NANO_HASH_SEED);
#endif
  CheckStatus(PyConfig_SetString(&config, &config.home, L"/usr"), "config.home");
  CheckStatus(PyConfig_SetString(&config, &config.program_name, L"python3.11"),
              "config.program_name");
  CheckStatus(PyConfig_SetString(&config, &config.stdio_encoding, L"utf-8"),
              "config.stdio_encoding");
  CheckStatus(PyConfig_SetString(&config, &config.stdio_errors, L"backslashreplace"),
              "config.stdio_errors");
  config.module_search_paths_set = 1;
  CheckStatus(PyWideStringList_Append(&config.module_search_paths, L"/workspace"),
              "module_search_paths");
  CheckStatus(PyWideStringList_Append(&config.module_search_paths, L"/usr/lib/python3.11"),
              "module_search_paths");
  wchar_t* argv[] = {L""};
  CheckStatus(PyConfig_SetArgv(&config, 1, argv), "argv");
  CheckStatus(Py_InitializeFromConfig(&config), "Py_InitializeFromConfig");
  PyConfig_Clear(&config);

  PyObject* mod = PyImport_ImportModule("_esb_nano");
  if (mod == NULL) {
    PyErr_Print();
    InitFailed("import _esb_nano");
  }
  PyObject* r = PyObject_CallMethod(mod, "init", NULL);
  if (r == NULL) {
    PyErr_Print();
    InitFailed("_esb_nano.init()");
  }
  Py_DECREF(r);
  g_run = PyObject_GetAttrString(mod, "run");
  g_reseed = PyObject_GetAttrString(mod, "reseed");
  Py_DECREF(mod);
  if (g_run == NULL || g_reseed == NULL) {
    PyErr_Print();
    InitFailed("_esb_nano.run/reseed");
  }
}

__attribute__((export_name("esb_run"))) int EsbRun(void) {
  if (g_run == NULL) return 70;  // not initialised (EX_SOFTWARE): host ran the un-wizened module
  PyObject* r = PyObject_CallNoArgs(g_run);
  if (r == NULL) {  // the runner itself failed (e.g. MemoryError while reporting)
    PyErr_Print();
    fflush(stderr);
    return 1;
  }
  long code = PyLong_AsLong(r);
  Py_DECREF(r);
  if (code == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return 1;
  }
  return (int)code;
}

__attribute__((export_name("esb_reseed"))) void EsbReseed(void) {
  if (g_reseed == NULL) return;
  PyObject* r = PyObject_CallNoArgs(g_reseed);
  if (r == NULL) {
    PyErr_Print();
    fflush(stderr);
    return;
  }
  Py_DECREF(r);
}
