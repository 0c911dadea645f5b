# vocabpipe: the two commands users need are `make demo` and `make test`.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)

.PHONY: deps configure build test demo gpu-bundle format clean

deps:
	bash scripts/setup.sh

# ccache, when installed, caches compiles across build folders and clones (nvcc's too).
LAUNCHER := $(if $(shell command -v ccache),-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache,)

configure: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(LAUNCHER)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) --timeout 600

demo: build
	bash scripts/demo.sh $(BUILD_DIR)

# The CUDA checks for a GPU host in gpu-bundle/ (< 64 MiB); there: bash gpu-bundle/run.sh LOGDIR
# (docs/cuda.md, "Running the checks on a GPU").
gpu-bundle: deps
	BUILD_DIR=$(BUILD_DIR) JOBS=$(JOBS) bash scripts/gpu-bundle.sh

format:
	find proto coordinator worker client tests bench -name '*.h' -o -name '*.cc' | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR)
