#!/bin/sh
# Inserts the nano interrupt check at every function entry and loop header of wasm2c 1.0.32
# output (for the test guest; the python build has its own pass). $1 = in, $2 = out.
set -e
{
  echo '#include <signal.h>'
  echo 'extern volatile int esb_nano_interrupt; void esb_nano_interrupted(void);'
  echo '#define ESB_NANO_CHECK() do { if (__builtin_expect(esb_nano_interrupt, 0)) esb_nano_interrupted(); } while (0)'
  sed -e 's/^\( *\)FUNC_PROLOGUE;$/\1FUNC_PROLOGUE; ESB_NANO_CHECK();/' \
      -e 's/^\( *\)\(w2c_L[0-9]*\): *$/\1\2: ESB_NANO_CHECK();/' "$1"
} > "$2"
