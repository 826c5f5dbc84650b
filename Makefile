# dispatch: the one entry point.
#   make            build everything (gcc, warnings are errors)
#   make test       install missing packages, build, run every Criterion suite
#   make sanitize   the same suites built with -fsanitize=address,undefined
#   make demo       train the example MLP through a local dispatch-server
#   make demo-gpt   train the character-level GPT through a local dispatch-server
#   make bench      benchmarks, each figure beside its limit
#   make bench-quick  every benchmark row at tiny sizes, CSV checked (CI)
#   make fuzz       libFuzzer targets for a bounded time
#   make mutate     tests/mutations.txt, one mutation at a time: killed or survived
#   make test-gpu   on a GPU: the CUDA backend against the CPU op by op, and
#                   dispatch-server --device all on cuda:0 through the client,
#                   the MLP demo on local:cuda:0 and on the server's cuda:0
#   make bench-gpu  on a GPU: matmul beside cuBLAS, upload/read beside the
#                   raw socket, the MLP step on cuda:0 beside the local CPU
#   make gpu-bundle  build/gpu-bundle.tar.xz: the GPU programs, their
#                   libraries and data for a GPU host without the packages
#                   (make gpu-bundle-check: unpacked and run here, no GPU)
#   (CUDA=0 skips the CUDA backend, the plugin build/dispatch-cuda.so; by
#   default it is built when nvcc is found; CUDA_ARCHS=90 builds one arch)
#   make install PREFIX=/usr/local [DESTDIR=...]   (make uninstall: the same files)
#   make clean

ifeq ($(origin CC),default)
  CC := gcc
endif
BUILD ?= build
PREFIX ?= /usr/local
# The version is defined once, in include/dispatch_version.h; the
# soname, the .pc and CMake files and dispatch-server --version take it
# from there.
VERSION_H := include/dispatch_version.h
version_part = $(shell sed -n 's/^\#define DISPATCH_VERSION_$(1) \([0-9][0-9]*\)$$/\1/p' $(VERSION_H))
VERSION_MAJOR := $(call version_part,MAJOR)
VERSION_MINOR := $(call version_part,MINOR)
VERSION_PATCH := $(call version_part,PATCH)
VERSION := $(VERSION_MAJOR).$(VERSION_MINOR).$(VERSION_PATCH)
ifeq ($(VERSION_MAJOR)$(VERSION_MINOR)$(VERSION_PATCH),)
  $(error cannot read the version from $(VERSION_H))
endif

PKGS := libuv libprotobuf-c openssl zlib libcjson libmicrohttpd
PKG_CFLAGS = $(shell pkg-config --cflags $(PKGS) 2>/dev/null)
PKG_LIBS = $(shell pkg-config --libs $(PKGS) 2>/dev/null)
BLAS_CFLAGS := -I/usr/include/x86_64-linux-gnu
BLAS_LIBS := -lopenblas

OPT ?= -O2
# -fvisibility=hidden: a symbol leaves libdispatch-client.so only when its
# declaration carries DISPATCH_API (dispatch_version.h) and the version
# script lists it; executables linked from the same objects are unaffected.
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -g $(OPT) -fPIC -fvisibility=hidden \
  -Wall -Wextra -Werror -Wno-unused-parameter -pthread \
  -DDISPATCH_VERSION_STRING='"$(VERSION)"'
ifeq ($(SAN),1)
  CFLAGS_BASE += -fsanitize=address,undefined -fno-omit-frame-pointer \
    -fno-sanitize-recover=undefined
  LDFLAGS += -fsanitize=address,undefined
endif
# DSP_DEBUG=1 compiles the server's debug checks in (-DDSP_DEBUG=1:
# SV_DEBUG_CHECK in server/sv.h, the thread and idle rules its comments
# state, checked where connections and sessions are made, handed over and
# freed; a broken rule aborts). On in the sanitize build (SAN=1).
DSP_DEBUG ?= $(SAN)
ifeq ($(DSP_DEBUG),1)
  CFLAGS_BASE += -DDSP_DEBUG=1
endif
# include/: the public headers common/, server/ and client/ all use (the
# error table and the version); client/include/: the library's own header
INCLUDES := -Icommon -Iinclude -Iclient/include -Iclient -Iserver -I$(BUILD)/gen
ALL_CFLAGS = $(CFLAGS_BASE) $(INCLUDES) $(BLAS_CFLAGS) $(PKG_CFLAGS) $(CFLAGS)
LIBS = $(PKG_LIBS) $(BLAS_LIBS) -lm -pthread

# CUDA backend (common/cuda/): built whenever nvcc is found, so every CI
# run compiles it; CUDA=0 skips it. It is the plugin $(BUILD)/dispatch-cuda.so
# (common/cuda_plugin.h), which dispatch-server, libdispatch-client and the
# GPU programs load at run time for a cuda device: none of them links
# CUDA, one server binary serves CPU and GPU hosts. dispatch-server-cuda is
# kept as a link to dispatch-server for scripts that name it.
# $(CUDA_A), the backend's objects in an archive, is linked directly only
# by tests/test_cuda_host (the kernels' host-side math).
NVCC ?= $(firstword $(shell command -v nvcc 2>/dev/null) $(wildcard /usr/local/cuda/bin/nvcc))
CUDA ?= $(if $(NVCC),1,0)
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(NVCC))
# The GPUs a user may have: Turing (sm_75: T4), Ampere (sm_80: A100,
# sm_86: A10/RTX 30), Ada (sm_89: L4/L40/RTX 40), Hopper (sm_90: H100/H200),
# Blackwell (sm_100: B200, sm_120: RTX 50), each as machine code, plus the
# PTX of the newest for GPUs after these. Volta (sm_70/72) is left out:
# CUDA 13's nvcc no longer builds it (nvcc --list-gpu-arch). CUDA_ARCHS
# narrows the list for a quick build: make CUDA_ARCHS=90.
CUDA_ARCHS ?= 75 80 86 89 90 100 120
NVCC_ARCH ?= $(foreach a,$(CUDA_ARCHS),-gencode arch=compute_$(a),code=sm_$(a)) \
  -gencode arch=compute_$(lastword $(CUDA_ARCHS)),code=compute_$(lastword $(CUDA_ARCHS))
NVCC_FLAGS = -std=c++17 $(OPT) -g $(NVCC_ARCH) -Werror all-warnings \
  -Xcompiler -fPIC,-Wall,-Wextra,-Werror,-Wno-unused-parameter \
  -Icommon -Icommon/cuda -Iinclude
CUDA_CFLAGS = -I$(CUDA_HOME)/include -Icommon/cuda
CUDA_LIBS = -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcublas -lcudart -lstdc++
CUDA_A := $(BUILD)/libdspcuda.a
CUDA_PLUGIN := $(BUILD)/dispatch-cuda.so
# the kernels are rebuilt when CUDA_ARCHS changes
CUDA_ARCH_STAMP := $(BUILD)/gen/cuda-archs
ifeq ($(CUDA),1)
  ifneq ($(strip $(CUDA_ARCHS)),$(strip $(shell cat $(CUDA_ARCH_STAMP) 2>/dev/null)))
    $(shell mkdir -p $(BUILD)/gen && echo '$(strip $(CUDA_ARCHS))' >$(CUDA_ARCH_STAMP))
  endif
endif

# The MPI plugin (server/mpi/): dlopen-ed by dispatch-server --mpi, so the
# server links no MPI and starts without mpirun; built when Open MPI's
# development files are there (make deps installs libopenmpi-dev).
MPI_PLUGIN := $(BUILD)/dispatch-mpi.so
MPI_PKG := $(shell pkg-config --exists ompi-c 2>/dev/null && echo 1)
MPI_CFLAGS = $(shell pkg-config --cflags ompi-c 2>/dev/null)
MPI_LIBS = $(shell pkg-config --libs ompi-c 2>/dev/null)
MPI_BIN := $(if $(MPI_PKG),$(MPI_PLUGIN))
# Open MPI alone (bench/mpi/allreduce.c): the group bench's fair limit
MPI_BENCH := $(if $(MPI_PKG),$(BUILD)/bench/mpi_allreduce)
# The NCCL plugin (server/nccl/): the all-reduce of CUDA tensors on the
# GPUs, dlopen-ed by the group thread of dispatch-server --mpi when the
# server has a CUDA device; built with the CUDA backend when the toolkit
# holds nccl.h (NCCL_HOME to look elsewhere). The server links no NCCL.
NCCL_PLUGIN := $(BUILD)/dispatch-nccl.so
NCCL_HOME ?= $(CUDA_HOME)
NCCL_BIN := $(if $(filter 1,$(CUDA)),$(if $(wildcard $(NCCL_HOME)/include/nccl.h),$(NCCL_PLUGIN)))
# its GPU check (tests/gpu/nccl_check) and the one-rank MPI stand-in the
# GPU bundle's group of one runs with (tests/gpu/mpi_single.c)
NCCL_GPU_BIN := $(if $(NCCL_BIN),$(NCCL_BIN) $(BUILD)/tests/gpu/nccl_check $(BUILD)/tests/gpu/mpi-single.so)

# ---------------------------------------------------------------- sources
PROTO_SRC := $(wildcard proto/*.proto)
GEN_C := $(patsubst proto/%.proto,$(BUILD)/gen/%.pb-c.c,$(PROTO_SRC))
GEN_H := $(GEN_C:.c=.h)
# common/cpu/: the CPU backend (kernels); common/cuda/ joins when built
COMMON_SRC := $(wildcard common/*.c common/cpu/*.c)
SERVER_SRC := $(filter-out server/main.c,$(wildcard server/*.c))
CLIENT_SRC := $(wildcard client/*.c)
TEST_HELPER_SRC := $(wildcard tests/helpers/*.c)
TEST_SRC := $(wildcard tests/test_*.c)
EXAMPLE_SRC := $(wildcard examples/*.c)
EXAMPLE_LIB_SRC := $(wildcard examples/lib/*.c)
BENCH_SRC := $(wildcard bench/*.c)
CUDA_SRC_C := $(wildcard common/cuda/*.c)
CUDA_SRC_CU := $(wildcard common/cuda/*.cu)

obj = $(patsubst %.c,$(BUILD)/obj/%.o,$(1))
COMMON_OBJ := $(call obj,$(COMMON_SRC)) $(GEN_C:.c=.o)
SERVER_OBJ := $(call obj,$(SERVER_SRC))
CLIENT_OBJ := $(call obj,$(CLIENT_SRC))
TEST_HELPER_OBJ := $(call obj,$(TEST_HELPER_SRC))
TEST_BIN := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_SRC))
EXAMPLE_BIN := $(patsubst examples/%.c,$(BUILD)/examples/%,$(EXAMPLE_SRC))
EXAMPLE_LIB_OBJ := $(call obj,$(EXAMPLE_LIB_SRC))
BENCH_BIN := $(patsubst bench/%.c,$(BUILD)/bench/%,$(BENCH_SRC))
CUDA_OBJ := $(call obj,$(CUDA_SRC_C)) $(patsubst %.cu,$(BUILD)/obj/%.cu.o,$(CUDA_SRC_CU))
ifeq ($(CUDA),1)
  CUDA_BIN := $(CUDA_PLUGIN) $(BUILD)/tests/gpu/cuda_ops $(BUILD)/tests/gpu/cuda_server \
    $(BUILD)/bench/gpu/matmul_cuda \
    $(if $(wildcard server/main.c),$(BUILD)/dispatch-server-cuda)
endif

# The op table's client surface, made from DSP_OP_MAP (common/dsp.h) at
# build time (docs/architecture.md, "One op, one row"): ops.txt has one
# "name signature surface" line per row; the version script and the
# exported-symbol list are the hand-written files plus the API rows; the
# Python package reads ops.txt and dispatch_cdef.h, the public header
# preprocessed for cffi.
OPS_TXT := $(BUILD)/gen/ops.txt
CLIENT_MAP := $(BUILD)/gen/dispatch-client.map
EXPORTED_TXT := $(BUILD)/gen/exported.txt
PY_CDEF := $(BUILD)/gen/dispatch_cdef.h

SERVER_BIN := $(BUILD)/dispatch-server
CLIENT_A := $(BUILD)/libdispatch-client.a
CLIENT_SO := $(BUILD)/libdispatch-client.so.$(VERSION)
CLIENT_SONAME := libdispatch-client.so.$(VERSION_MAJOR)
COMMON_A := $(BUILD)/libdspcommon.a
# server-side objects (everything but main) for tests and fuzzers
SERVER_A := $(BUILD)/libdspserver.a

# keep objects and generated headers that make would treat as intermediate
.SECONDARY:

.PHONY: all deps test test-run python-test deploy-test container sanitize demo demo-gpt bench bench-quick mutate fuzz install uninstall clean test-gpu bench-gpu gpu-bundle gpu-bundle-check
all: $(if $(wildcard server/main.c),$(SERVER_BIN)) $(CLIENT_A) $(CLIENT_SO) $(TEST_BIN) $(EXAMPLE_BIN) $(BENCH_BIN) $(CUDA_BIN) $(MPI_BIN) $(MPI_BENCH) $(NCCL_GPU_BIN)

deps:
	@scripts/deps.sh

# ---------------------------------------------------------------- rules
$(BUILD)/gen/%.pb-c.c $(BUILD)/gen/%.pb-c.h: proto/%.proto
	@mkdir -p $(BUILD)/gen
	protoc-c --proto_path=proto --c_out=$(BUILD)/gen $<

$(BUILD)/gen/%.pb-c.o: $(BUILD)/gen/%.pb-c.c
	$(CC) $(filter-out -Werror,$(ALL_CFLAGS)) -c $< -o $@

# client/op_rows.in expands DSP_OP_MAP into "@@ name signature surface"
$(OPS_TXT): client/op_rows.in common/dsp.h
	@mkdir -p $(dir $@)
	$(CC) -E -P -x c $(INCLUDES) $< | \
	  grep -o '@@ [a-z0-9_]* [A-Z_]* [A-Z]*' | cut -c4- >$@.tmp
	@test -s $@.tmp || { echo "$@: no rows from DSP_OP_MAP" >&2; exit 1; }
	@mv $@.tmp $@

# the hand-written list with the API rows in place of its marker line
$(CLIENT_MAP): client/dispatch-client.map $(OPS_TXT)
	awk 'NR == FNR { if ($$3 == "API") ops = ops "    dispatch_" $$1 ";\n"; next } \
	  /^ *\/\* @DSP_OP_MAP@ \*\/$$/ { printf "%s", ops; n++; next } { print } \
	  END { if (n != 1) { print FILENAME ": want one @DSP_OP_MAP@ line" > "/dev/stderr"; exit 1 } }' \
	  $(OPS_TXT) $< >$@.tmp
	@mv $@.tmp $@

# what nm -D must print: tests/abi/exported.txt plus the API rows
$(EXPORTED_TXT): tests/abi/exported.txt client/dispatch-client.map $(OPS_TXT)
	node=$$(sed -n 's/^\([A-Z0-9_]*\) {.*/\1/p' client/dispatch-client.map); \
	{ cat tests/abi/exported.txt; \
	  awk -v node="$$node" '$$3 == "API" { print "dispatch_" $$1 "@@" node }' $(OPS_TXT); } | \
	  LC_ALL=C sort >$@.tmp
	@mv $@.tmp $@

# The public header as cffi's cdef takes it: preprocessed (macros
# expanded, DISPATCH_API's attribute dropped), comments kept for the
# docstrings, the two system headers it includes stubbed (cffi knows
# size_t and the intN_t types itself).
$(PY_CDEF): $(wildcard include/*.h client/include/*.h)
	@mkdir -p $(BUILD)/gen/cdef-stub
	@: >$(BUILD)/gen/cdef-stub/stddef.h; : >$(BUILD)/gen/cdef-stub/stdint.h
	$(CC) -E -P -C -nostdinc -I$(BUILD)/gen/cdef-stub -Iinclude -Iclient/include \
	  client/include/dispatch_client.h | \
	  sed 's/__attribute__((visibility("default")))//' >$@.tmp
	@mv $@.tmp $@

# The CPU kernels are plain loops: GCC's -O2 alone vectorizes only loops
# that need no alias check or remainder. These flags let it vectorize the
# rest (clang, which builds the fuzzers, has no -fvect-cost-model and
# vectorizes on its own); nothing is reassociated (no -ffast-math), so
# results are the same bits, and -fno-math-errno only drops errno, which
# no kernel reads.
KERNEL_CFLAGS = -fno-math-errno $(if $(findstring clang,$(CC)),,\
  -ftree-vectorize -fvect-cost-model=dynamic)
$(BUILD)/obj/common/cpu/%.o: ALL_CFLAGS += $(KERNEL_CFLAGS)
# common/half.c: its portable conversion loops are kernels too
$(BUILD)/obj/common/half.o: ALL_CFLAGS += $(KERNEL_CFLAGS)

$(BUILD)/obj/%.o: %.c $(GEN_H)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -MMD -MP -c $< -o $@

$(call obj,$(CUDA_SRC_C)): ALL_CFLAGS += $(CUDA_CFLAGS)

$(BUILD)/obj/%.cu.o: %.cu $(wildcard common/cuda/*.h) common/dsp.h include/dispatch_errors.h $(CUDA_ARCH_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCC_FLAGS) -c $< -o $@

$(CUDA_A): $(CUDA_OBJ)
	@rm -f $@
	ar rcs $@ $^

# The plugin: the backend with its own copy of the common code it calls
# (hidden; the loader checks that both sides were built alike), linked
# with cuBLAS and the CUDA runtime; it exports dispatch_cuda_plugin_v1 only.
$(CUDA_PLUGIN): $(CUDA_OBJ) $(COMMON_A) common/cuda/dispatch-cuda.map
	$(CC) $(LDFLAGS) -shared -Wl,-z,defs -Wl,--exclude-libs,ALL \
	  -Wl,--version-script=common/cuda/dispatch-cuda.map -o $@ $(CUDA_OBJ) \
	  $(COMMON_A) -Wl,--as-needed $(CUDA_LIBS) $(LIBS)

# the CUDA kernels include the scalar math and the half conversions they
# share with the CPU loops
$(patsubst %.cu,$(BUILD)/obj/%.cu.o,$(CUDA_SRC_CU)): common/scalar_math.h common/half.h

$(COMMON_A): $(COMMON_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(SERVER_A): $(SERVER_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(SERVER_BIN): $(BUILD)/obj/server/main.o $(SERVER_A) $(COMMON_A)
	$(CC) $(LDFLAGS) -o $@ $^ $(LIBS)

$(MPI_PLUGIN): server/mpi/engine.c server/group_mpi.h
	$(CC) $(ALL_CFLAGS) $(MPI_CFLAGS) -fPIC -shared -Wl,-z,defs -o $@ $< \
	  $(LDFLAGS) $(MPI_LIBS)

$(MPI_BENCH): bench/mpi/allreduce.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(MPI_CFLAGS) -o $@ $< $(LDFLAGS) $(MPI_LIBS)

# exports dispatch_nccl_engine_v1 only (-fvisibility=hidden elsewhere)
$(NCCL_PLUGIN): server/nccl/engine.c server/group_nccl.h server/group_mpi.h
	$(CC) $(ALL_CFLAGS) $(addprefix -I,$(addsuffix /include,$(sort $(NCCL_HOME) $(CUDA_HOME)))) \
	  -fPIC -shared -Wl,-z,defs -o $@ $< $(LDFLAGS) \
	  $(foreach d,$(sort $(NCCL_HOME) $(CUDA_HOME)),-L$(d)/lib64 -Wl,-rpath,$(d)/lib64) \
	  -lnccl -lcudart

# the name of the CUDA server before the plugin, kept for scripts and
# units that use it: the same binary
$(BUILD)/dispatch-server-cuda: $(SERVER_BIN)
	ln -sf $(notdir $<) $@

$(CLIENT_A): $(CLIENT_OBJ) $(COMMON_OBJ)
	@rm -f $@
	ar rcs $@ $^

# $(CLIENT_MAP) lists every exported function by name;
# tests/abi/check-exports.sh compares what the library exports with
# $(EXPORTED_TXT). The Python package's files are made with the library.
$(CLIENT_SO): $(CLIENT_OBJ) $(COMMON_OBJ) $(CLIENT_MAP) | $(EXPORTED_TXT) $(PY_CDEF)
	$(CC) $(LDFLAGS) -shared -Wl,-soname,$(CLIENT_SONAME) \
	  -Wl,--version-script=$(CLIENT_MAP) \
	  -o $@ $(CLIENT_OBJ) $(COMMON_OBJ) $(LIBS)
	ln -sf $(notdir $@) $(BUILD)/$(CLIENT_SONAME)
	ln -sf $(CLIENT_SONAME) $(BUILD)/libdispatch-client.so
comma := ,

$(BUILD)/tests/%: tests/%.c $(TEST_HELPER_OBJ) $(CLIENT_A) $(SERVER_A) $(GEN_H)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Itests -MMD -MP -o $@ $< $(TEST_HELPER_OBJ) \
	  $(SERVER_A) $(CLIENT_A) $(LDFLAGS) -lcriterion $(LIBS)

# suites that also run the CUDA backend when it is built: the host checks
# of its kernels' math (linked with the backend's archive; they also open
# it: without a GPU, a clear error and no crash) and the conformance suite
# over the op table (through the plugin; without a GPU it prints "cuda:
# skipped (no GPU): REASON")
$(BUILD)/tests/test_cuda_host: tests/test_cuda_host.c $(TEST_HELPER_OBJ) $(CLIENT_A) $(SERVER_A) $(GEN_H) $(if $(filter 1,$(CUDA)),$(CUDA_A))
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Itests -Icommon/cuda -DDSP_CUDA_BUILT=$(CUDA) \
	  $(if $(filter 1,$(CUDA)),$(CUDA_CFLAGS)) -MMD -MP -o $@ $< $(TEST_HELPER_OBJ) \
	  $(SERVER_A) $(if $(filter 1,$(CUDA)),$(CUDA_A)) $(CLIENT_A) $(LDFLAGS) \
	  -lcriterion $(LIBS) $(if $(filter 1,$(CUDA)),$(CUDA_LIBS))

# the programs that load the plugin need it built; none links CUDA
PLUGIN_DEP = $(if $(filter 1,$(CUDA)),$(CUDA_PLUGIN))
$(BUILD)/tests/test_backend_ops $(BUILD)/tests/test_cuda_plugin: $(BUILD)/tests/%: tests/%.c $(TEST_HELPER_OBJ) $(CLIENT_A) $(SERVER_A) $(GEN_H) $(PLUGIN_DEP)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Itests -DDSP_CUDA_BUILT=$(CUDA) -MMD -MP -o $@ $< \
	  $(TEST_HELPER_OBJ) $(SERVER_A) $(CLIENT_A) $(LDFLAGS) -lcriterion $(LIBS)

# a plugin of another ABI number, which the loader must refuse
# (the plugin stand-ins carry the version the loader compares: rebuilt
# when it changes)
$(BUILD)/tests/fake-cuda-plugin.so: tests/fake_cuda_plugin.c common/cuda_plugin.h include/dispatch_version.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -shared -o $@ $<
$(BUILD)/tests/test_cuda_plugin: $(BUILD)/tests/fake-cuda-plugin.so
# a NCCL plugin of another ABI number, which the group's loader must
# refuse, and stand-ins of both plugins for a mixed group (rank 0's
# tensors called CUDA tensors, NCCL never started); the suite also checks
# the real plugin when it is built
$(BUILD)/tests/fake-nccl-plugin.so: tests/fake_nccl_plugin.c server/group_nccl.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -DFAKE_NCCL_STALE=1 -shared -o $@ $<
$(BUILD)/tests/fake-nccl-host.so: tests/fake_nccl_plugin.c server/group_nccl.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -shared -o $@ $<
$(BUILD)/tests/fake-cuda-place.so: tests/fake_cuda_place_plugin.c common/cuda_plugin.h include/dispatch_version.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -shared -o $@ $<
$(BUILD)/tests/test_nccl_plugin: tests/test_nccl_plugin.c $(TEST_HELPER_OBJ) $(CLIENT_A) $(SERVER_A) $(GEN_H) $(BUILD)/tests/fake-nccl-plugin.so $(BUILD)/tests/fake-nccl-host.so $(BUILD)/tests/fake-cuda-place.so $(NCCL_BIN) $(SERVER_BIN)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Itests -DDSP_NCCL_BUILT=$(if $(NCCL_BIN),1,0) -MMD -MP \
	  -o $@ $< $(TEST_HELPER_OBJ) $(SERVER_A) $(CLIENT_A) $(LDFLAGS) -lcriterion $(LIBS)
# test_group runs the data-parallel example against its ranks
$(BUILD)/tests/test_group: $(BUILD)/examples/train_mlp_dp

$(BUILD)/tests/gpu/%: tests/gpu/%.c $(CLIENT_A) $(PLUGIN_DEP)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -MMD -MP -o $@ $< $(CLIENT_A) $(LDFLAGS) $(LIBS)

# the NCCL plugin driven directly on cuda:0: links the CUDA runtime for its
# own device memory, loads the plugin with dlopen
$(BUILD)/tests/gpu/nccl_check: tests/gpu/nccl_check.c server/group_nccl.h $(CLIENT_A) $(NCCL_BIN)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(CUDA_CFLAGS) -MMD -MP -o $@ $< $(CLIENT_A) $(LDFLAGS) \
	  $(LIBS) -L$(CUDA_HOME)/lib64 -Wl,-rpath,$(CUDA_HOME)/lib64 -lcudart -ldl
$(BUILD)/tests/gpu/mpi-single.so: tests/gpu/mpi_single.c server/group_mpi.h server/group_nccl.h
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -shared -Wl,-z,defs -o $@ $<

# cuBLAS called directly beside the backend: this one links CUDA
$(BUILD)/bench/gpu/%: bench/gpu/%.c $(CLIENT_A) $(PLUGIN_DEP)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) $(CUDA_CFLAGS) -MMD -MP -o $@ $< $(CLIENT_A) \
	  $(LDFLAGS) $(LIBS) $(CUDA_LIBS)

$(BUILD)/examples/%: examples/%.c $(EXAMPLE_LIB_OBJ) $(CLIENT_A)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Iexamples/lib -MMD -MP -o $@ $< $(EXAMPLE_LIB_OBJ) \
	  $(CLIENT_A) $(LDFLAGS) $(LIBS)

# the health check of the container and the Kubernetes readiness probe
$(BUILD)/dispatch-probe: deploy/dispatch-probe.c $(CLIENT_A)
	$(CC) $(ALL_CFLAGS) -MMD -MP -o $@ $< $(CLIENT_A) $(LDFLAGS) $(LIBS)

$(BUILD)/bench/%: bench/%.c $(CLIENT_A) $(SERVER_A)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -MMD -MP -o $@ $< $(SERVER_A) $(CLIENT_A) $(LDFLAGS) $(LIBS)

# the load benchmark shares its driver with tests/test_load.c
LOAD_HELPERS := $(call obj,tests/helpers/load.c tests/helpers/server_proc.c tests/helpers/wire.c)
$(BUILD)/bench/load: bench/load.c $(LOAD_HELPERS) $(CLIENT_A) $(SERVER_A)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_CFLAGS) -Itests -MMD -MP -o $@ $< $(LOAD_HELPERS) $(SERVER_A) $(CLIENT_A) $(LDFLAGS) $(LIBS)

# ---------------------------------------------------------------- commands
# Each suite prints Criterion's synthesis line; the run fails if any fails.
test: deps
	@$(MAKE) --no-print-directory all
	@$(MAKE) --no-print-directory test-run

# Beside the suites: the exported symbols against tests/abi/exported.txt,
# and an install into a temporary DESTDIR that programs are built against
# (README's compile lines and CMake; with the sanitizers under SAN=1).
# Under SAN=1 every sanitizer report (the suites' and the servers' they
# start, which exit after the test's last check) goes to a file, and any
# file fails the run: a server that crashed at shutdown passed before.
# A suite's runner that exits with ASan's code 86 (set here) while every
# report it wrote was dropped by scripts/san-filter.sh (a leak Criterion's
# runner made itself) passes; any report kept fails the run, exit code or not.
SAN_LOG_ENV = $(if $(filter 1,$(SAN)),ASAN_OPTIONS=log_path=$$sanlog/asan:exitcode=86 \
  UBSAN_OPTIONS=log_path=$$sanlog/ubsan:print_stacktrace=1)
test-run: $(TEST_BIN) $(CLIENT_A) $(CLIENT_SO) $(if $(wildcard server/main.c),$(SERVER_BIN)) $(MPI_BIN)
	@failed=; sanlog=$$(mktemp -d); for t in $(TEST_BIN); do \
	  echo "== $$t"; \
	  $(SAN_LOG_ENV) DISPATCH_SERVER_BIN=$(abspath $(SERVER_BIN)) $$t --jobs 2; \
	  rc=$$?; \
	  scripts/san-filter.sh $$sanlog; \
	  if ls $$sanlog/* >/dev/null 2>&1; then \
	    echo "sanitizer reports during $$t:"; cat $$sanlog/*; \
	    rm -f $$sanlog/*; failed="$$failed $$t(sanitizer)"; \
	  elif [ $$rc -eq 86 ] && [ "$(SAN)" = 1 ]; then \
	    echo "$$t: exit 86 came from the filtered report above"; rc=0; fi; \
	  [ $$rc -eq 0 ] || failed="$$failed $$t(exit $$rc)"; \
	done; rmdir $$sanlog; \
	scripts/san-filter.sh --self-test || failed="$$failed san-filter-self-test"; \
	scripts/check-readme.sh || failed="$$failed check-readme"; \
	$(MAKE) --no-print-directory deploy-test || failed="$$failed deploy-test"; \
	echo "== tests/abi/check-exports.sh"; \
	tests/abi/check-exports.sh $(BUILD)/libdispatch-client.so \
	  || failed="$$failed check-exports"; \
	echo "== tests/install/check-install.sh"; \
	BUILD=$(BUILD) CC=$(CC) \
	  SAN_FLAGS="$(if $(filter 1,$(SAN)),-fsanitize=address$(comma)undefined)" \
	  tests/install/check-install.sh || failed="$$failed check-install"; \
	echo "== tests/install/check-python.sh"; \
	BUILD=$(BUILD) PYTHON=$(PYTHON) SAN_PRELOAD="$(PY_SAN_PRELOAD)" \
	  tests/install/check-python.sh || failed="$$failed check-python"; \
	$(MAKE) --no-print-directory python-test || failed="$$failed python-test"; \
	if [ -n "$$failed" ]; then echo "TESTS FAILED:$$failed"; exit 1; fi; \
	echo "ALL SUITES PASSED"

# The Python package's pytest suite (python/tests) against this build's
# library and server; prints pytest's summary line, everything on failure.
# Under SAN=1 the interpreter, not built with ASan, gets the sanitizer
# runtimes preloaded so it can load the ASan library (its own leaks at exit
# are not ours: leak detection off); a binding that freed a tensor twice or
# used a closed device's memory fails here.
PYTHON ?= /usr/bin/python3
PY_SAN_PRELOAD = $(if $(filter 1,$(SAN)),$(shell $(CC) -print-file-name=libasan.so) \
  $(shell $(CC) -print-file-name=libubsan.so))
PY_SAN_ENV = $(if $(filter 1,$(SAN)),LD_PRELOAD="$(PY_SAN_PRELOAD)" \
  ASAN_OPTIONS=detect_leaks=0:log_path=$$log.asan UBSAN_OPTIONS=log_path=$$log.ubsan)
# The package is the one pip installs: python/ goes into a throwaway
# virtual environment, $(BUILD)/pyvenv (--system-site-packages: numpy,
# cffi, pytest, torch are Debian's), and the suite runs with its
# interpreter; conftest stops the run if dispatch comes from the source tree.
PYVENV = $(BUILD)/pyvenv
python-test: $(CLIENT_SO) $(BUILD)/tests/ckpt_tool $(if $(wildcard server/main.c),$(SERVER_BIN)) $(MPI_BIN)
	@echo "== python/tests (pytest$(if $(filter 1,$(SAN)), with the ASan library), the package pip-installed in $(PYVENV))"; \
	PYTHON=$(PYTHON) scripts/python-package.sh venv $(PYVENV) || exit 1; \
	log=$$(mktemp); \
	$(PY_SAN_ENV) DISPATCH_SERVER_BIN=$(abspath $(SERVER_BIN)) \
	DISPATCH_CLIENT_LIB=$(abspath $(BUILD)/libdispatch-client.so) \
	DISPATCH_CKPT_TOOL=$(abspath $(BUILD)/tests/ckpt_tool) \
	DISPATCH_TEST_INSTALLED=1 \
	PYTHONDONTWRITEBYTECODE=1 $(PYVENV)/bin/python -m pytest -q -p no:cacheprovider \
	  python/tests >$$log 2>&1; rc=$$?; \
	if [ $$rc -ne 0 ]; then cat $$log $$log.*san.* 2>/dev/null; \
	else tail -n 1 $$log; fi; \
	rm -f $$log $$log.*san.*; exit $$rc

# deploy/: the systemd unit verified, the server started as an unprivileged
# user with the files and modes deploy/README.md documents, a TLS client
# with the token, and the Kubernetes manifests checked offline
# (deploy/tests/run.sh says what each check is). Needs root to switch users.
deploy-test: $(if $(wildcard server/main.c),$(SERVER_BIN)) $(BUILD)/dispatch-probe $(BUILD)/examples/first_program
	@BUILD=$(BUILD) PYTHON=$(PYTHON) deploy/tests/run.sh

# deploy/Containerfile built with podman (not part of test: slow, and needs
# podman, debootstrap and a network mirror); see deploy/README.md
container:
	@deploy/container-build.sh

# the same, then deploy/Containerfile.cuda on top (the CUDA plugin and the
# toolkit's runtime libraries), checked with every library resolved in the
# image but the driver's libcuda.so.1
.PHONY: container-cuda
container-cuda:
	@deploy/container-build.sh --cuda

sanitize: deps
	@$(MAKE) --no-print-directory BUILD=build-san SAN=1 OPT=-O1 test-run

# GPU runs, one script each (scripts/gpu.sh): every program prints
# "cuda: skipped (no GPU)" and exits 0 when no device can be opened; it
# never reports a pass it did not run.
GPU_TEST_BIN = $(CUDA_PLUGIN) $(BUILD)/tests/gpu/cuda_ops $(BUILD)/tests/gpu/cuda_server \
  $(BUILD)/tests/test_backend_ops $(SERVER_BIN) $(BUILD)/examples/train_mlp \
  $(NCCL_GPU_BIN)
GPU_BENCH_BIN = $(CUDA_PLUGIN) $(BUILD)/tests/gpu/cuda_ops $(BUILD)/bench/gpu/matmul_cuda \
  $(BUILD)/bench/bulk $(BUILD)/bench/mlp $(BUILD)/bench/gpt \
  $(SERVER_BIN) $(BUILD)/fortunes

# make gpu-bundle: $(BUILD)/gpu-bundle.tar.xz, the GPU programs with the
# shared libraries they load and their data, for a GPU host without the
# Debian packages (scripts/gpu-bundle.sh says what it holds); unpacked
# there, dispatch-gpu/run.sh runs scripts/gpu.sh with no build step.
# make gpu-bundle-check unpacks it into an empty folder and runs it here
# (no GPU: every program up to its "cuda: skipped (no GPU)" or refusal),
# each program's libraries resolved from the bundle with the loader's
# cache off (scripts/gpu-bundle-check.sh).
GPU_BUNDLE_BIN = $(CUDA_PLUGIN) $(SERVER_BIN) $(BUILD)/tests/gpu/cuda_ops \
  $(BUILD)/tests/gpu/cuda_server $(BUILD)/tests/test_backend_ops \
  $(BUILD)/bench/gpu/matmul_cuda $(BUILD)/bench/bulk $(BUILD)/bench/mlp \
  $(BUILD)/bench/gpt $(BUILD)/examples/train_mlp $(BUILD)/fortunes \
  $(NCCL_GPU_BIN)
gpu-bundle:
	@if [ "$(CUDA)" != 1 ]; then echo "gpu-bundle: no nvcc (or CUDA=0): nothing to bundle"; exit 1; fi
	@$(MAKE) --no-print-directory $(GPU_BUNDLE_BIN)
	@BUILD=$(BUILD) PYTHON=$(PYTHON) scripts/gpu-bundle.sh

gpu-bundle-check: gpu-bundle
	@BUILD=$(BUILD) scripts/gpu-bundle-check.sh

# the GPT bench's corpus, copied for a GPU host that has no Debian packages
# (scripts/gpu.sh falls back to it); empty when this machine has none either
$(BUILD)/fortunes:
	mkdir -p $@
	-cp -p /usr/share/games/fortunes/* $@/ 2>/dev/null
test-gpu:
	@if [ "$(CUDA)" != 1 ]; then echo "cuda: skipped (backend not built: no nvcc, or CUDA=0)"; exit 0; fi; \
	$(MAKE) -s --no-print-directory $(GPU_TEST_BIN) || exit 1; \
	BUILD=$(BUILD) scripts/gpu.sh test

bench-gpu:
	@if [ "$(CUDA)" != 1 ]; then echo "cuda: skipped (backend not built: no nvcc, or CUDA=0)"; exit 0; fi; \
	$(MAKE) -s --no-print-directory $(GPU_BENCH_BIN) || exit 1; \
	BUILD=$(BUILD) scripts/gpu.sh bench

demo: deps
	@$(MAKE) --no-print-directory all
	@BUILD=$(BUILD) scripts/demo.sh

# the character-level GPT (examples/train_gpt.c) trained through a server
# on loopback, 2000 steps (GPT_STEPS=N; GPT_LOCAL=1 also trains it LOCAL)
demo-gpt: deps
	@$(MAKE) --no-print-directory $(SERVER_BIN) $(BUILD)/examples/train_gpt
	@BUILD=$(BUILD) scripts/demo-gpt.sh

# the programs and the server, then scripts/bench.sh runs them and writes
# bench/results.csv
bench: deps
	@$(MAKE) --no-print-directory $(if $(wildcard server/main.c),$(SERVER_BIN)) $(BENCH_BIN) $(CLIENT_SO) $(MPI_BIN) $(MPI_BENCH)
	@BUILD=$(BUILD) PYTHON=$(PYTHON) scripts/bench.sh

# every benchmark row at tiny sizes, no goal judged; fails unless the CSV
# holds every row of bench/expected-rows.txt with numeric fields (for CI)
bench-quick: deps
	@$(MAKE) --no-print-directory $(if $(wildcard server/main.c),$(SERVER_BIN)) $(BENCH_BIN) $(CLIENT_SO) $(MPI_BIN) $(MPI_BENCH)
	@BENCH_QUICK=1 BUILD=$(BUILD) PYTHON=$(PYTHON) scripts/bench.sh

# Applies each mutation of tests/mutations.txt to a scratch copy of the
# tree (never this checkout), rebuilds there, runs the suites it names,
# and prints KILLED/SURVIVED per mutation; fails on a survivor.
# MUTATE=name1,name2 runs only those.
mutate: deps
	@scripts/mutate.sh tests/mutations.txt $(subst $(comma), ,$(MUTATE))

# libFuzzer targets (clang, fuzzer+address+undefined) built in build-fuzz/,
# each run FUZZ_SECONDS from tests/fuzz_corpus/<target>/; not part of test.
FUZZ_SECONDS ?= 60
fuzz: deps
	@FUZZ_SECONDS=$(FUZZ_SECONDS) fuzz/run.sh

# make install [PREFIX=/usr/local] [DESTDIR=/staging]: dispatch-server and
# dispatch-probe, the CUDA backend plugin when it is built
# (PREFIX/lib/dispatch/dispatch-cuda.so, where the server and the library
# look for it) and beside it the group's MPI and NCCL plugins
# (dispatch-mpi.so, dispatch-nccl.so) when they are built, libdispatch-client (shared with its soname links, static),
# the public headers of include/ and client/include/ side by side in one
# folder (self-contained: -I PREFIX/include is all a program needs), the
# pkg-config file, the CMake package, the man pages, and in
# PREFIX/share/doc/dispatch the READMEs and docs/server.md, with deploy/'s
# systemd unit (its paths moved to PREFIX) and make-certs.sh: the files
# the unit's Documentation= names. Files with @VERSION@/@MAJOR@/@PREFIX@
# get them filled in here. Into the running system (DESTDIR empty) as
# root it then runs ldconfig, so the new library is found at once
# (LDCONFIG= skips it; a PREFIX whose lib/ is not in /etc/ld.so.conf needs
# a line there). make uninstall removes exactly these files.
BINDIR = $(PREFIX)/bin
LIBDIR = $(PREFIX)/lib
INCDIR = $(PREFIX)/include
MANDIR = $(PREFIX)/share/man
DOCDIR = $(PREFIX)/share/doc/dispatch
PLUGINDIR = $(LIBDIR)/dispatch
# the Python package's declarations and op table (python/dispatch/_lib.py
# looks for them in ../share/dispatch of the library's folder)
PYDATADIR = $(PREFIX)/share/dispatch
CMAKEDIR = $(LIBDIR)/cmake/dispatch-client
PUBLIC_H := $(wildcard include/*.h client/include/*.h)
MAN_PAGES := docs/man/dispatch-server.1 docs/man/libdispatch-client.3
DOC_FILES := README.md docs/server.md
LDCONFIG ?= ldconfig
INSTALL_PLUGIN := $(BUILD)/dispatch-cuda.so
SUBST = sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(VERSION)|g' \
  -e 's|@MAJOR@|$(VERSION_MAJOR)|g'
# ldconfig when installing into (or removing from) the running system as root
RUN_LDCONFIG = if [ -z "$(DESTDIR)" ] && [ -n "$(LDCONFIG)" ] && [ "$$(id -u)" = 0 ]; then \
  echo "$(LDCONFIG)"; $(or $(LDCONFIG),:); fi
install: $(if $(wildcard server/main.c),$(SERVER_BIN)) $(BUILD)/dispatch-probe $(CLIENT_A) $(CLIENT_SO) $(PLUGIN_DEP) $(MPI_BIN) $(NCCL_BIN)
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(LIBDIR)/pkgconfig \
	  $(DESTDIR)$(INCDIR) $(DESTDIR)$(CMAKEDIR) \
	  $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man3 $(DESTDIR)$(PYDATADIR) \
	  $(DESTDIR)$(DOCDIR)/deploy
	$(if $(wildcard server/main.c),install -m 755 $(SERVER_BIN) $(DESTDIR)$(BINDIR)/)
	install -m 755 $(BUILD)/dispatch-probe $(DESTDIR)$(BINDIR)/
	if [ -f $(INSTALL_PLUGIN) ]; then install -d $(DESTDIR)$(PLUGINDIR) && \
	  install -m 755 $(INSTALL_PLUGIN) $(DESTDIR)$(PLUGINDIR)/; fi
	if [ -f $(MPI_PLUGIN) ]; then install -d $(DESTDIR)$(PLUGINDIR) && \
	  install -m 755 $(MPI_PLUGIN) $(DESTDIR)$(PLUGINDIR)/; fi
	if [ -f $(NCCL_PLUGIN) ]; then install -d $(DESTDIR)$(PLUGINDIR) && \
	  install -m 755 $(NCCL_PLUGIN) $(DESTDIR)$(PLUGINDIR)/; fi
	install -m 644 $(CLIENT_A) $(DESTDIR)$(LIBDIR)/
	install -m 755 $(CLIENT_SO) $(DESTDIR)$(LIBDIR)/
	ln -sf $(notdir $(CLIENT_SO)) $(DESTDIR)$(LIBDIR)/$(CLIENT_SONAME)
	ln -sf $(CLIENT_SONAME) $(DESTDIR)$(LIBDIR)/libdispatch-client.so
	install -m 644 $(PUBLIC_H) $(DESTDIR)$(INCDIR)/
	install -m 644 $(PY_CDEF) $(OPS_TXT) $(DESTDIR)$(PYDATADIR)/
	$(SUBST) client/dispatch-client.pc.in > $(DESTDIR)$(LIBDIR)/pkgconfig/dispatch-client.pc
	$(SUBST) client/dispatch-clientConfig.cmake.in > $(DESTDIR)$(CMAKEDIR)/dispatch-clientConfig.cmake
	$(SUBST) client/dispatch-clientConfigVersion.cmake.in > $(DESTDIR)$(CMAKEDIR)/dispatch-clientConfigVersion.cmake
	$(SUBST) docs/man/dispatch-server.1 > $(DESTDIR)$(MANDIR)/man1/dispatch-server.1
	$(SUBST) docs/man/libdispatch-client.3 > $(DESTDIR)$(MANDIR)/man3/libdispatch-client.3
	install -m 644 $(DOC_FILES) $(DESTDIR)$(DOCDIR)/
	install -m 644 deploy/README.md $(DESTDIR)$(DOCDIR)/deploy/
	install -m 755 deploy/make-certs.sh $(DESTDIR)$(DOCDIR)/deploy/
	sed 's|/usr/local/|$(PREFIX)/|g' deploy/dispatch-server.service \
	  > $(DESTDIR)$(DOCDIR)/deploy/dispatch-server.service
	@$(RUN_LDCONFIG)

uninstall:
	rm -f $(DESTDIR)$(BINDIR)/dispatch-server \
	  $(DESTDIR)$(BINDIR)/dispatch-probe \
	  $(DESTDIR)$(PLUGINDIR)/dispatch-cuda.so \
	  $(DESTDIR)$(PLUGINDIR)/dispatch-mpi.so \
	  $(DESTDIR)$(PLUGINDIR)/dispatch-nccl.so \
	  $(DESTDIR)$(LIBDIR)/libdispatch-client.a \
	  $(DESTDIR)$(LIBDIR)/$(notdir $(CLIENT_SO)) \
	  $(DESTDIR)$(LIBDIR)/$(CLIENT_SONAME) \
	  $(DESTDIR)$(LIBDIR)/libdispatch-client.so \
	  $(addprefix $(DESTDIR)$(INCDIR)/,$(notdir $(PUBLIC_H))) \
	  $(DESTDIR)$(LIBDIR)/pkgconfig/dispatch-client.pc \
	  $(DESTDIR)$(CMAKEDIR)/dispatch-clientConfig.cmake \
	  $(DESTDIR)$(CMAKEDIR)/dispatch-clientConfigVersion.cmake \
	  $(DESTDIR)$(MANDIR)/man1/dispatch-server.1 \
	  $(DESTDIR)$(MANDIR)/man3/libdispatch-client.3 \
	  $(DESTDIR)$(PYDATADIR)/$(notdir $(PY_CDEF)) \
	  $(DESTDIR)$(PYDATADIR)/$(notdir $(OPS_TXT)) \
	  $(addprefix $(DESTDIR)$(DOCDIR)/,$(notdir $(DOC_FILES))) \
	  $(addprefix $(DESTDIR)$(DOCDIR)/deploy/,README.md make-certs.sh dispatch-server.service)
	-rmdir $(DESTDIR)$(CMAKEDIR) $(DESTDIR)$(PYDATADIR) $(DESTDIR)$(PLUGINDIR) \
	  $(DESTDIR)$(DOCDIR)/deploy $(DESTDIR)$(DOCDIR) 2>/dev/null
	@$(RUN_LDCONFIG)

# make install-python [PREFIX=/usr/local] [DESTDIR=/staging]: the Python
# package (python/) with pip for $(PYTHON), offline, into PREFIX's
# site-packages, where it finds PREFIX/lib/libdispatch-client.so.0 and
# PREFIX/share/dispatch of make install by itself; make uninstall-python
# removes exactly the files pip recorded (scripts/python-package.sh).
.PHONY: install-python uninstall-python
install-python:
	@PYTHON=$(PYTHON) scripts/python-package.sh install "$(PREFIX)" "$(DESTDIR)"
uninstall-python:
	@PYTHON=$(PYTHON) scripts/python-package.sh uninstall "$(PREFIX)" "$(DESTDIR)"
install: install-python
uninstall: uninstall-python

# The server integration suites with dispatch-server under valgrind
# (server_proc.c honours DISPATCH_SERVER_WRAP); a leak or memory error makes
# the server exit 99, which the suites' exit-status checks catch.
.PHONY: valgrind
# --fair-sched=yes: valgrind runs one thread at a time, and by default a
# thread that computes (a worker in a long matmul) may take the lock back
# again and again, starving the server's loop thread; test_server_autodiff's
# fairness test (one worker, two sessions) failed that way in CI.
# (test_client_remote is left out: under valgrind's emulated CPU OpenBLAS
# picks other kernels, so the server's sums no longer match the local
# process bit for bit, which that suite asserts.)
VALGRIND_SUITES = $(filter $(BUILD)/tests/test_server_% $(BUILD)/tests/test_auth \
  $(BUILD)/tests/test_limits $(BUILD)/tests/test_tls $(BUILD)/tests/test_reload \
  $(BUILD)/tests/test_zero_size $(BUILD)/tests/test_memory \
  $(BUILD)/tests/test_wire_req,$(TEST_BIN))
valgrind: $(VALGRIND_SUITES) $(SERVER_BIN)
	@fail=0; for t in $(VALGRIND_SUITES); do \
	  echo "== $$t (server under valgrind)"; \
	  DISPATCH_SERVER_BIN=$(abspath $(SERVER_BIN)) \
	  DISPATCH_SERVER_WRAP="valgrind --fair-sched=yes --leak-check=full --error-exitcode=99 --quiet --suppressions=$(abspath tests/valgrind-server.supp)" \
	  $$t --jobs 2 || fail=1; \
	done; \
	if [ $$fail -ne 0 ]; then echo "VALGRIND FAILED"; exit 1; fi; echo "VALGRIND CLEAN"

clean:
	rm -rf build build-san build-fuzz

-include $(shell find $(BUILD)/obj $(BUILD)/tests $(BUILD)/examples $(BUILD)/bench -name '*.d' 2>/dev/null)
