# FindNCCL: NVIDIA's collective communication library (2.x) headers and library.
#
# Looks in, in order: NCCL_ROOT (CMake or environment variable), the CUDA toolkit root, and the
# system paths. A root may be an installation prefix (include/, lib/ or lib64/ below it) or a
# Python site-packages directory holding the pip wheels (nvidia/nccl/{include,lib} from
# nvidia-nccl-cu12/-cu13, or nvidia/cu13/{include,lib}).
#
# Result: NCCL_FOUND, NCCL_VERSION, NCCL_INCLUDE_DIR, NCCL_LIBRARY and the imported target
# NCCL::nccl.
set(_nccl_roots)
foreach(_root "${NCCL_ROOT}" "$ENV{NCCL_ROOT}" "${CUDAToolkit_LIBRARY_ROOT}"
        "${CUDAToolkit_TARGET_DIR}")
  if(_root)
    list(APPEND _nccl_roots "${_root}" "${_root}/nvidia/nccl" "${_root}/nvidia/cu13"
         "${_root}/nvidia/cu12")
  endif()
endforeach()

find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_roots} PATH_SUFFIXES include)
# Wheels ship only the versioned soname (libnccl.so.2), not the unversioned link name.
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_roots} PATH_SUFFIXES lib lib64)

if(NCCL_INCLUDE_DIR AND EXISTS "${NCCL_INCLUDE_DIR}/nccl.h")
  file(STRINGS "${NCCL_INCLUDE_DIR}/nccl.h" _nccl_defs REGEX "^#define NCCL_(MAJOR|MINOR|PATCH) +[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "NCCL_${_part} +([0-9]+)" _m "${_nccl_defs}")
    set(_nccl_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(NCCL_VERSION "${_nccl_MAJOR}.${_nccl_MINOR}.${_nccl_PATCH}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL REQUIRED_VARS NCCL_LIBRARY NCCL_INCLUDE_DIR
                                  VERSION_VAR NCCL_VERSION)
if(NCCL_FOUND AND NOT TARGET NCCL::nccl)
  add_library(NCCL::nccl UNKNOWN IMPORTED)
  set_target_properties(NCCL::nccl PROPERTIES IMPORTED_LOCATION "${NCCL_LIBRARY}"
                                              INTERFACE_INCLUDE_DIRECTORIES "${NCCL_INCLUDE_DIR}")
endif()
mark_as_advanced(NCCL_INCLUDE_DIR NCCL_LIBRARY)
