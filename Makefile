# EnterSandBox front door. `make run` and `make test` are what README.md promises.
SHELL := /bin/bash
BUILD_DIR ?= build
JOBS ?= $(shell nproc)

.PHONY: all deps build images run test test-unit test-python bench clean

all: build

deps:
	@bash scripts/install-deps.sh

build: deps
	@cmake -S . -B $(BUILD_DIR) -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	@cmake --build $(BUILD_DIR) -j $(JOBS)

# Slow artefacts (rootfs image, python.wasm), built once and cached by content hash.
images: build
	@bash scripts/build-images.sh
	@# Binaries that link an image artefact (the nano worker links python.wasm's C build)
	@# appear once the artefact exists: configure and build again (incremental).
	@. $(BUILD_DIR)/images.env; cmake -S . -B $(BUILD_DIR) \
	  $${ESBD_PYTHON_WASM:+-DESB_NANO_PYTHON_DIR=$$ESBD_PYTHON_WASM} >/dev/null
	@cmake --build $(BUILD_DIR) -j $(JOBS)

run: images
	@bash scripts/run.sh

test: images
	@bash scripts/test.sh

bench: images
	@bash bench/run.sh

clean:
	rm -rf $(BUILD_DIR)
