// Glue for the test guest (module name `testguest`): see drivers/nano/guest.h.
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "drivers/nano/guest.h"
#include "test_guest.wasm.h"

static void* NewInstance(struct Z_wasi_snapshot_preview1_instance_t* wasi) {
  Z_testguest_instance_t* inst = calloc(1, sizeof(Z_testguest_instance_t));
  if (inst) Z_testguest_instantiate(inst, wasi);
  return inst;
}
static void FreeInstance(void* inst) {
  Z_testguest_free((Z_testguest_instance_t*)inst);
  free(inst);
}
static wasm_rt_memory_t* Memory(void* inst) { return Z_testguestZ_memory(inst); }
static void Start(void* inst) { Z_testguestZ__start(inst); }

const struct EsbNanoGuest esb_nano_guest = {
    "testguest", Z_testguest_init_module, NewInstance, FreeInstance, Memory, Start, NULL, NULL, NULL,
};

// Host-side misbehaviour on request (see worker.cc): what a compromised worker might try.
void esb_nano_test_hook(const char* what) {
  if (strcmp(what, "socket") == 0) socket(AF_INET, SOCK_STREAM, 0);
  if (strcmp(what, "open") == 0) open("/etc/passwd", O_RDONLY);
  if (strcmp(what, "execve") == 0) execl("/bin/sh", "sh", "-c", "true", (char*)NULL);
  if (strcmp(what, "fork") == 0) fork();
}
