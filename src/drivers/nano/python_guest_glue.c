// Glue for nanobuild's CPython guest (module name `python`, images/python-wasm/README.md,
// guest ABI 1): exports esb_run and esb_reseed, no _start.
#include <stdlib.h>

#include "drivers/nano/guest.h"
#include "python_wasm.h"

static void* NewInstance(struct Z_wasi_snapshot_preview1_instance_t* wasi) {
  Z_python_instance_t* inst = calloc(1, sizeof(Z_python_instance_t));
  if (inst) Z_python_instantiate(inst, wasi);
  return inst;
}
static void FreeInstance(void* inst) {
  Z_python_free((Z_python_instance_t*)inst);
  free(inst);
}
static wasm_rt_memory_t* Memory(void* inst) { return Z_pythonZ_memory(inst); }
static uint32_t Run(void* inst) { return Z_pythonZ_esb_run(inst); }
static void Reseed(void* inst) { Z_pythonZ_esb_reseed(inst); }

const struct EsbNanoGuest esb_nano_guest = {
    "python", Z_python_init_module, NewInstance, FreeInstance, Memory, NULL, Run, Reseed, NULL,
};
