// The link between the generic worker and one wasm2c-generated guest module. Exactly one guest
// is linked into a worker binary (wabt's runtime is process-global); its glue file defines
// `esb_nano_guest`. Plain C so the glue can be C too.
#pragma once

#include <stdint.h>

#include "wasm-rt.h"

#ifdef __cplusplus
extern "C" {
#endif

struct Z_wasi_snapshot_preview1_instance_t;

struct EsbNanoGuest {
  const char* name;
  // wasm2c's <mod>_init_module (once per process).
  void (*init_module)(void);
  // Allocates and instantiates a fresh instance (data segments copied: for a Wizer snapshot this
  // is the pre-initialised interpreter).
  void* (*new_instance)(struct Z_wasi_snapshot_preview1_instance_t* wasi);
  void (*free_instance)(void* instance);
  wasm_rt_memory_t* (*memory)(void* instance);
  // One-shot entry (WASI `_start`): runs main once, exit code via proc_exit.
  void (*start)(void* instance);
  // Optional persistent entry (sessions): runs the code the host put on stdin in the same
  // interpreter; returns the exit status. NULL for plain WASI programs.
  uint32_t (*run)(void* instance);
  // Optional: called once per fresh instance before the first `run` (reseeds `random`).
  void (*reseed)(void* instance);
  // Optional: called once right after instantiation, with the host wired to the instance's
  // memory (a WASI reactor's _initialize). NULL for a Wizer snapshot.
  void (*init_instance)(void* instance);
  // Optional (time travel, compact images): the instance's state outside linear memory (wasm2c
  // globals; checks of the table size), as bytes. save returns the length written (0: the
  // guest cannot be saved, or `cap` is too small); load returns 0 on success, -1 when `bytes`
  // do not fit this module. NULL: images of this guest are unsupported.
  size_t (*save_globals)(void* instance, uint8_t* out, size_t cap);
  int (*load_globals)(void* instance, const uint8_t* bytes, size_t len);
};

extern const struct EsbNanoGuest esb_nano_guest;

// Calls `fn(instance)` inside wasm_rt_impl_try. Returns 0 when it returned normally, else the
// wasm_rt_trap_t (proc_exit and interrupts also unwind as traps; the host records why).
int esb_nano_call_start(void* instance);
// Same for `run`; *result receives its return value when it returns normally.
int esb_nano_call_run(void* instance, uint32_t* result);
// Calls `reseed` / `init_instance` (if any) inside wasm_rt_impl_try.
int esb_nano_call_reseed(void* instance);
int esb_nano_call_init(void* instance);

#ifdef __cplusplus
}
#endif
