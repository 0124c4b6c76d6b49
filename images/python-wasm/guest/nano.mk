# Included after CPython's own Makefile (make -f Makefile -f nano.mk nano.wasm): links the
# interpreter with guest/nano_main.c as a WASI reactor (crt1-reactor.o: exports _initialize,
# no _start). It must be a reactor: for a module without _initialize, wasm-ld wraps every export
# in __wasm_call_ctors/__wasm_call_dtors, which would re-run libc's constructors on each call.
NANO_MAIN_SRC ?= nano_main.c

Programs/nano_main.o: $(NANO_MAIN_SRC) pyconfig.h
	$(CC) -c $(PY_CFLAGS) $(PY_CPPFLAGS) $(NANO_CFLAGS) -o $@ $(NANO_MAIN_SRC)

nano.wasm: Programs/nano_main.o $(LINK_PYTHON_DEPS)
	$(LINKCC) $(PY_CORE_LDFLAGS) $(LINKFORSHARED) -mexec-model=reactor -o $@ Programs/nano_main.o $(LINK_PYTHON_OBJS) $(LIBS) $(MODLIBS) $(SYSLIBS)
