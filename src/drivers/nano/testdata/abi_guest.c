// A WASI *reactor* that implements nanobuild's guest ABI 1 (images/python-wasm/README.md) with
// a toy command language instead of Python, so the persistent-session path (esb_run called
// repeatedly on one instance, esb_reseed, /.esb/result.json) is tested without the real build.
//   set N | get | raise TYPE MSG | unsupported WHAT | exit N | procexit N | loop | cwd | echo T
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <wasi/api.h>

static long g_value = 0;
static int g_reseeds = 0;
static int g_runs = 0;

static void WriteResult(const char* status, int code, const char* type, const char* msg,
                        const char* unsupported) {
  FILE* f = fopen("/.esb/result.json", "w");
  if (!f) return;
  if (type) {
    fprintf(f,
            "{\"abi\":1,\"status\":\"%s\",\"exit_code\":%d,\"error\":{\"type\":\"%s\","
            "\"message\":\"%s\",\"traceback\":\"Traceback (most recent call last):\\n  toy\\n"
            "%s: %s\",\"unsupported\":%s%s%s}}",
            status, code, type, msg, type, msg, unsupported ? "\"" : "",
            unsupported ? unsupported : "null", unsupported ? "\"" : "");
  } else {
    fprintf(f, "{\"abi\":1,\"status\":\"%s\",\"exit_code\":%d,\"error\":null}", status, code);
  }
  fclose(f);
}

__attribute__((export_name("esb_reseed"))) void esb_reseed(void) { g_reseeds++; }

__attribute__((export_name("esb_run"))) int esb_run(void) {
  static char code[65536];
  size_t n = 0;
  ssize_t r;
  while (n < sizeof(code) - 1 && (r = read(0, code + n, sizeof(code) - 1 - n)) > 0) n += r;
  code[n] = 0;
  g_runs++;
  int rc = 0;
  char a[256] = {0}, b[256] = {0};
  if (sscanf(code, "set %ld", &g_value) == 1) {
    WriteResult("ok", 0, NULL, NULL, NULL);
  } else if (strncmp(code, "get", 3) == 0) {
    printf("value %ld reseeds %d runs %d\n", g_value, g_reseeds, g_runs);
    WriteResult("ok", 0, NULL, NULL, NULL);
  } else if (sscanf(code, "raise %255s %255s", a, b) == 2) {
    fprintf(stderr, "Traceback (most recent call last):\n  toy\n%s: %s\n", a, b);
    WriteResult("exception", 1, a, b, NULL);
    rc = 1;
  } else if (sscanf(code, "unsupported %255s", a) == 1) {
    char what[300];
    snprintf(what, sizeof(what), "module:%s", a);
    WriteResult("unsupported", 1, "ModuleNotFoundError", a, what);
    rc = 1;
  } else if (sscanf(code, "exit %d", &rc) == 1) {
    WriteResult("exit", rc, NULL, NULL, NULL);
  } else if (sscanf(code, "procexit %d", &rc) == 1) {
    fflush(stdout);
    __wasi_proc_exit(rc);
  } else if (strncmp(code, "loop", 4) == 0) {
    volatile unsigned long i = 0;
    for (;;) i++;
  } else if (strncmp(code, "cwd", 3) == 0) {
    char buf[256];
    printf("cwd %s\n", getcwd(buf, sizeof(buf)) ? buf : "?");
    WriteResult("ok", 0, NULL, NULL, NULL);
  } else if (strncmp(code, "echo ", 5) == 0) {
    fputs(code + 5, stdout);
    WriteResult("ok", 0, NULL, NULL, NULL);
  } else {
    fprintf(stderr, "unknown toy command\n");
    rc = 2;
  }
  fflush(stdout);
  fflush(stderr);
  return rc;
}
