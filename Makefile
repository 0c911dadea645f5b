# vocabpipe: the two commands users need are `make demo` and `make test`.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)

# Fuzzing (docs/fuzzing.md): a clang-14 libFuzzer + AddressSanitizer build of fuzz/ in its own
# folder. `make fuzz` runs every target FUZZ_SECONDS (default 600) on its seed corpus;
# `make test` runs them FUZZ_SMOKE_SECONDS (default 5) each.
FUZZ_DIR ?= build-fuzz
FUZZ_SECONDS ?= 600
FUZZ_SMOKE_SECONDS ?= 5
# Every compile goes through scripts/compile.sh, which uses ccache when ccache is on PATH at
# compile time. The launcher is decided by no test here: a test when this Makefile is parsed
# would run before `deps` installs ccache, so the first configure of a fresh machine would differ
# from every later one and `make demo` then `make test` would rebuild the whole tree.
COMPILE_LAUNCHER := $(CURDIR)/scripts/compile.sh
FUZZ_LAUNCHER := -DCMAKE_CXX_COMPILER_LAUNCHER=$(COMPILE_LAUNCHER)

.PHONY: deps configure build test test-deploy demo demo-text gpu-bundle format clean fuzz fuzz-smoke fuzz-build

deps:
	bash scripts/setup.sh

# ccache, when installed, caches compiles across build folders and clones (nvcc's too); the
# launcher also keeps each object's compiler messages (OBJ.warnings) for check_warnings.sh.
LAUNCHER := -DCMAKE_CXX_COMPILER_LAUNCHER=$(COMPILE_LAUNCHER) \
  -DCMAKE_CUDA_COMPILER_LAUNCHER=$(COMPILE_LAUNCHER)

configure: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE) $(LAUNCHER)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

# A clean tree compiles without a warning (-Wall -Wextra): the check fails on any object whose
# last compile printed one, whether this build or an earlier one compiled it.
test: build
	bash scripts/check_warnings.sh $(BUILD_DIR)
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) --timeout 600
	$(MAKE) fuzz-smoke

fuzz-build: deps
	cmake -S fuzz -B $(FUZZ_DIR) -G Ninja -DCMAKE_C_COMPILER=clang-14 \
	  -DCMAKE_CXX_COMPILER=clang++-14 $(FUZZ_LAUNCHER) -DFUZZ_SECONDS=$(FUZZ_SECONDS)
	cmake --build $(FUZZ_DIR) -j $(JOBS)

# Bounded runs of every fuzz target (part of `make test`).
fuzz-smoke:
	$(MAKE) fuzz-build FUZZ_SECONDS=$(FUZZ_SMOKE_SECONDS)
	ctest --test-dir $(FUZZ_DIR) --output-on-failure -j $(JOBS)

# Long runs: FUZZ_SECONDS per target (make fuzz FUZZ_SECONDS=60 for a shorter one).
fuzz: fuzz-build
	ctest --test-dir $(FUZZ_DIR) --output-on-failure -j $(JOBS)

demo: build
	bash scripts/demo.sh $(BUILD_DIR)

# A small GPT-2 on real text (the King James Bible from Debian's bible-kjv): tokenizer, train/val
# split, 2-rank training with validation loss and samples; under 15 minutes on 2 cores.
demo-text: build
	bash scripts/demo_text.sh $(BUILD_DIR)

# The CUDA checks for a GPU host in gpu-bundle/ (< 64 MiB); there: bash gpu-bundle/run.sh LOGDIR
# (docs/cuda.md, "Running the checks on a GPU").
gpu-bundle: deps
	BUILD_DIR=$(BUILD_DIR) JOBS=$(JOBS) bash scripts/gpu-bundle.sh

format:
	find proto coordinator worker client tests bench -name '*.h' -o -name '*.cc' | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR) $(FUZZ_DIR)

# The deployment tests (tests/deploy: network namespaces, a local Slurm, the k8s validator);
# `make test` runs them too. They need root and skip without it.
test-deploy: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -L deploy --timeout 900
