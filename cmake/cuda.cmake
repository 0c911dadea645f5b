# CUDA backend detection (included from the top-level CMakeLists.txt right after the
# VOCABPIPE_CUDA option). Sets:
#   VP_HAVE_CUDA            TRUE when the CUDA language, cuBLAS/cuBLASLt and NCCL are usable
#   VP_NCCL_LIBRARY         path of libnccl
#   VP_NCCL_INCLUDE_DIR     folder holding nccl.h
#   target vp_cuda_toolkit  INTERFACE: cudart (static), the cuBLASLt and NCCL headers and the
#                           sonames to open them by at run time, VP_HAVE_CUDA=1
# VOCABPIPE_CUDA: AUTO builds the backend when nvcc is found, ON requires it, OFF skips it.
# Every CUDA folder guards its contents with if(VP_HAVE_CUDA), so a machine without nvcc builds.
include_guard(GLOBAL)
include(CheckLanguage)

if(NOT DEFINED VOCABPIPE_CUDA)
  set(VOCABPIPE_CUDA "AUTO" CACHE STRING "Build the CUDA backend: AUTO, ON or OFF")
endif()
string(TOUPPER "${VOCABPIPE_CUDA}" _vp_cuda_mode)
if(NOT _vp_cuda_mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "VOCABPIPE_CUDA must be AUTO, ON or OFF, got \"${VOCABPIPE_CUDA}\"")
endif()

set(VP_HAVE_CUDA FALSE)
if(NOT _vp_cuda_mode STREQUAL "OFF")
  # nvcc is usually not on PATH (/usr/local/cuda/bin); check_language only looks there if told.
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc CACHE FILEPATH "CUDA compiler")
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    # sm_80 (A100) and sm_90 (H100/H200); set before enable_language so CMake does not probe.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR CMAKE_CUDA_ARCHITECTURES STREQUAL "")
      set(CMAKE_CUDA_ARCHITECTURES "80;90" CACHE STRING "CUDA architectures" FORCE)
    endif()
    # The CUDA runtime is linked statically (here and for nvcc's own links): a binary then needs
    # only the driver, cuBLAS/cuBLASLt and NCCL from the host it runs on, never a libcudart of
    # the same version (scripts/gpu-bundle.sh ships binaries to hosts whose toolkit differs).
    set(CMAKE_CUDA_RUNTIME_LIBRARY Static CACHE STRING "CUDA runtime library: Static")
    enable_language(CUDA)
    # Kernels use C++17 only; nvcc 11+ supports it with every host compiler we build with.
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(CMAKE_CUDA_EXTENSIONS OFF)
    # No --use_fast_math: tanh-GELU and -inf handling of padded vocabulary rows need IEEE.
    set(CMAKE_CUDA_FLAGS_RELEASE "-O2 -DNDEBUG")
    find_package(CUDAToolkit)
    find_library(VP_NCCL_LIBRARY NAMES nccl
                 HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu)
    find_path(VP_NCCL_INCLUDE_DIR NAMES nccl.h
              HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include /usr/include)
    set(_vp_missing "")
    if(NOT CUDAToolkit_FOUND OR NOT TARGET CUDA::cublas OR NOT TARGET CUDA::cublasLt)
      list(APPEND _vp_missing "cuBLAS/cuBLASLt (CUDAToolkit)")
    endif()
    if(NOT VP_NCCL_LIBRARY OR NOT VP_NCCL_INCLUDE_DIR)
      list(APPEND _vp_missing "NCCL (libnccl, nccl.h)")
    endif()
    if(_vp_missing STREQUAL "")
      set(VP_HAVE_CUDA TRUE)
    elseif(_vp_cuda_mode STREQUAL "ON")
      message(FATAL_ERROR "VOCABPIPE_CUDA=ON but not found: ${_vp_missing}")
    else()
      message(STATUS "CUDA backend off: not found: ${_vp_missing}")
    endif()
  elseif(_vp_cuda_mode STREQUAL "ON")
    message(FATAL_ERROR "VOCABPIPE_CUDA=ON but no CUDA compiler (nvcc) was found")
  else()
    message(STATUS "CUDA backend off: no nvcc found (VOCABPIPE_CUDA=AUTO)")
  endif()
endif()

# A shared library's soname (what the loader looks for), read from the file itself.
function(vp_soname out library)
  get_filename_component(_real "${library}" REALPATH)
  execute_process(COMMAND objdump -p "${_real}" OUTPUT_VARIABLE _dump RESULT_VARIABLE _rc)
  string(REGEX MATCH "SONAME +([^\n ]+)" _m "${_dump}")
  if(NOT _rc EQUAL 0 OR NOT CMAKE_MATCH_1)
    message(FATAL_ERROR "cannot read the soname of ${library} (objdump -p)")
  endif()
  set(${out} "${CMAKE_MATCH_1}" PARENT_SCOPE)
endfunction()

if(VP_HAVE_CUDA)
  # cuBLASLt and NCCL are not linked: the backend opens them on first use (dlopen; see
  # worker/sharedlib/shared_library.h), so a CPU job of this build never maps them. Their sonames
  # and paths are compiled in, and listed in cuda-libraries.txt for scripts/gpu-bundle.sh.
  vp_soname(VP_CUBLASLT_SONAME "${CUDA_cublasLt_LIBRARY}")
  vp_soname(VP_NCCL_SONAME "${VP_NCCL_LIBRARY}")
  get_filename_component(_vp_cublaslt_dir "${CUDA_cublasLt_LIBRARY}" DIRECTORY)
  get_filename_component(_vp_nccl_dir "${VP_NCCL_LIBRARY}" DIRECTORY)
  file(WRITE "${CMAKE_BINARY_DIR}/cuda-libraries.txt" "${VP_CUBLASLT_SONAME}\n${VP_NCCL_SONAME}\n")
  add_library(vp_cuda_toolkit INTERFACE)
  target_link_libraries(vp_cuda_toolkit INTERFACE CUDA::cudart_static)
  target_include_directories(vp_cuda_toolkit INTERFACE ${CUDAToolkit_INCLUDE_DIRS}
                             ${VP_NCCL_INCLUDE_DIR})
  target_compile_definitions(vp_cuda_toolkit INTERFACE VP_HAVE_CUDA=1
    VP_CUBLASLT_SONAME="${VP_CUBLASLT_SONAME}"
    VP_CUBLASLT_PATH="${_vp_cublaslt_dir}/${VP_CUBLASLT_SONAME}"
    VP_NCCL_SONAME="${VP_NCCL_SONAME}" VP_NCCL_PATH="${_vp_nccl_dir}/${VP_NCCL_SONAME}")
  # cuDNN is optional: only VOCABPIPE_ATTENTION=cudnn uses it (attention_cudnn.h), opened on
  # first use like cuBLASLt. Without its graph header the backend builds without that path; the
  # bundle lists it in cuda-optional-libraries.txt (a host without it still runs everything else).
  find_path(VP_CUDNN_INCLUDE_DIR NAMES cudnn_graph.h
            HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/local/cuda/include /usr/include)
  find_library(VP_CUDNN_LIBRARY NAMES cudnn
               HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu)
  if(VP_CUDNN_INCLUDE_DIR AND VP_CUDNN_LIBRARY)
    vp_soname(VP_CUDNN_SONAME "${VP_CUDNN_LIBRARY}")
    get_filename_component(_vp_cudnn_dir "${VP_CUDNN_LIBRARY}" DIRECTORY)
    target_include_directories(vp_cuda_toolkit INTERFACE ${VP_CUDNN_INCLUDE_DIR})
    target_compile_definitions(vp_cuda_toolkit INTERFACE VP_HAVE_CUDNN=1
      VP_CUDNN_SONAME="${VP_CUDNN_SONAME}" VP_CUDNN_PATH="${_vp_cudnn_dir}/${VP_CUDNN_SONAME}")
    # cuDNN's fused-attention engines compile their kernels with NVRTC at first use: its
    # folder must be on the path too.
    set(_vp_optional "${VP_CUDNN_SONAME}\n")
    if(CUDA_nvrtc_LIBRARY)
      vp_soname(_vp_nvrtc_soname "${CUDA_nvrtc_LIBRARY}")
      string(APPEND _vp_optional "${_vp_nvrtc_soname}\n")
    endif()
    file(WRITE "${CMAKE_BINARY_DIR}/cuda-optional-libraries.txt" "${_vp_optional}")
  else()
    file(WRITE "${CMAKE_BINARY_DIR}/cuda-optional-libraries.txt" "")
    message(STATUS "cuDNN not found: VOCABPIPE_ATTENTION=cudnn is unavailable in this build")
  endif()
  message(STATUS "CUDA backend on: nvcc ${CMAKE_CUDA_COMPILER_VERSION}, "
                 "architectures ${CMAKE_CUDA_ARCHITECTURES}, NCCL ${VP_NCCL_LIBRARY}")
endif()

# The top-level add_compile_options (-Wall -Wextra -march=...) are g++ flags that nvcc rejects:
# call this on every target with .cu sources to keep them for its C++ sources only and pass
# the warnings to nvcc's host compiler instead.
function(vp_cuda_target_options target)
  get_target_property(_opts ${target} COMPILE_OPTIONS)
  if(_opts)
    set(_fixed "")
    foreach(_o IN LISTS _opts)
      list(APPEND _fixed "$<$<COMPILE_LANGUAGE:CXX>:${_o}>")
    endforeach()
    set_property(TARGET ${target} PROPERTY COMPILE_OPTIONS ${_fixed})
  endif()
  target_compile_options(${target} PRIVATE
                         $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter>)
endfunction()
