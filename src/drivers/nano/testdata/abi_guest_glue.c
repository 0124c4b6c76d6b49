// Glue for the ABI test guest (module `abiguest`, a WASI reactor): see drivers/nano/guest.h.
#include <stdlib.h>

#include "abi_guest.wasm.h"
#include "drivers/nano/guest.h"

static void* NewInstance(struct Z_wasi_snapshot_preview1_instance_t* wasi) {
  Z_abiguest_instance_t* inst = calloc(1, sizeof(Z_abiguest_instance_t));
  if (!inst) return NULL;
  Z_abiguest_instantiate(inst, wasi);
  return inst;
}
static void FreeInstance(void* inst) {
  Z_abiguest_free((Z_abiguest_instance_t*)inst);
  free(inst);
}
static wasm_rt_memory_t* Memory(void* inst) { return Z_abiguestZ_memory(inst); }
static uint32_t Run(void* inst) { return Z_abiguestZ_esb_run(inst); }
static void Reseed(void* inst) { Z_abiguestZ_esb_reseed(inst); }
// A reactor runs its constructors in _initialize (the Wizer'd python has done this already).
static void Init(void* inst) { Z_abiguestZ__initialize(inst); }

const struct EsbNanoGuest esb_nano_guest = {
    "abiguest", Z_abiguest_init_module, NewInstance, FreeInstance, Memory, NULL, Run, Reseed, Init,
};
