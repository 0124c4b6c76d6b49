// setjmp-based trap boundary, kept in C: no C++ frames between the setjmp and the guest.
#include "drivers/nano/guest.h"
#include "wasm-rt-impl.h"

int esb_nano_call_start(void* instance) {
  int trap = wasm_rt_impl_try();
  if (trap != 0) return trap;
  esb_nano_guest.start(instance);
  return 0;
}

int esb_nano_call_run(void* instance, uint32_t* result) {
  int trap = wasm_rt_impl_try();
  if (trap != 0) return trap;
  *result = esb_nano_guest.run(instance);
  return 0;
}

int esb_nano_call_reseed(void* instance) {
  if (esb_nano_guest.reseed == NULL) return 0;
  int trap = wasm_rt_impl_try();
  if (trap != 0) return trap;
  esb_nano_guest.reseed(instance);
  return 0;
}

int esb_nano_call_init(void* instance) {
  if (esb_nano_guest.init_instance == NULL) return 0;
  int trap = wasm_rt_impl_try();
  if (trap != 0) return trap;
  esb_nano_guest.init_instance(instance);
  return 0;
}
