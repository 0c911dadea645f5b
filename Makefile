# vocabpipe: the two commands users need are `make demo` and `make test`.
BUILD_DIR ?= build
BUILD_TYPE ?= Release
JOBS ?= $(shell nproc)

.PHONY: deps configure build test test-deploy demo format clean

deps:
	bash scripts/setup.sh

configure: deps
	cmake -S . -B $(BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=$(BUILD_TYPE)

build: configure
	cmake --build $(BUILD_DIR) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -j $(JOBS) --timeout 600

demo: build
	bash scripts/demo.sh $(BUILD_DIR)

format:
	find proto coordinator worker client tests bench -name '*.h' -o -name '*.cc' | xargs clang-format -i

clean:
	rm -rf $(BUILD_DIR)

# The deployment tests (tests/deploy: network namespaces, a local Slurm, the k8s validator);
# `make test` runs them too. They need root and skip without it.
test-deploy: build
	ctest --test-dir $(BUILD_DIR) --output-on-failure -L deploy --timeout 900
