// Glue for nanobuild's CPython guest (module name `python`, images/python-wasm/README.md,
// guest ABI 1): exports esb_run and esb_reseed, no _start.
#include <stdlib.h>
#include <string.h>

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

// Z_python_instance_t holds one mutable global (the shadow stack pointer) besides the memory
// and the function table; the table has no table.set/grow in this module, so its size is
// only checked. Layout: u32 stack pointer, u32 table size.
static size_t SaveGlobals(void* p, uint8_t* out, size_t cap) {
  Z_python_instance_t* inst = (Z_python_instance_t*)p;
  uint32_t v[2] = {inst->w2c___stack_pointer, inst->w2c_T0.size};
  if (cap < sizeof v) return 0;
  memcpy(out, v, sizeof v);
  return sizeof v;
}
static int LoadGlobals(void* p, const uint8_t* in, size_t len) {
  Z_python_instance_t* inst = (Z_python_instance_t*)p;
  uint32_t v[2];
  if (len != sizeof v) return -1;
  memcpy(v, in, sizeof v);
  if (v[1] != inst->w2c_T0.size) return -1;
  inst->w2c___stack_pointer = v[0];
  return 0;
}

const struct EsbNanoGuest esb_nano_guest = {
    "python", Z_python_init_module, NewInstance, FreeInstance, Memory, NULL, Run, Reseed,
    NULL,     SaveGlobals,          LoadGlobals,
};
