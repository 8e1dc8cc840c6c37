# FindCUDNN: cuDNN (9.x) headers and library.
#
# Looks in, in order: CUDNN_ROOT (CMake or environment variable), the CUDA toolkit root, and the
# system paths. A root may be an installation prefix (include/, lib/ or lib64/ below it) or a
# Python site-packages directory holding the pip wheels (nvidia/cudnn/{include,lib} from
# nvidia-cudnn-cu12/-cu13, or nvidia/cu13/{include,lib} from the CUDA 13 wheel layout), which is
# how clusters without a system cuDNN ship it.
#
# Result: CUDNN_FOUND, CUDNN_VERSION, CUDNN_INCLUDE_DIR, CUDNN_LIBRARY and the imported target
# CUDNN::cudnn.
set(_cudnn_roots)
foreach(_root "${CUDNN_ROOT}" "$ENV{CUDNN_ROOT}" "${CUDAToolkit_LIBRARY_ROOT}"
        "${CUDAToolkit_TARGET_DIR}")
  if(_root)
    list(APPEND _cudnn_roots "${_root}" "${_root}/nvidia/cudnn" "${_root}/nvidia/cu13"
         "${_root}/nvidia/cu12")
  endif()
endforeach()

find_path(CUDNN_INCLUDE_DIR cudnn_version.h HINTS ${_cudnn_roots} PATH_SUFFIXES include)
# Wheels ship only the versioned soname (libcudnn.so.9), not the unversioned link name.
find_library(CUDNN_LIBRARY NAMES cudnn libcudnn.so.9 HINTS ${_cudnn_roots}
             PATH_SUFFIXES lib lib64 lib/x64)

if(CUDNN_INCLUDE_DIR AND EXISTS "${CUDNN_INCLUDE_DIR}/cudnn_version.h")
  file(STRINGS "${CUDNN_INCLUDE_DIR}/cudnn_version.h" _cudnn_defs
       REGEX "^#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) +[0-9]+")
  foreach(_part MAJOR MINOR PATCHLEVEL)
    string(REGEX MATCH "CUDNN_${_part} +([0-9]+)" _m "${_cudnn_defs}")
    set(_cudnn_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(CUDNN_VERSION "${_cudnn_MAJOR}.${_cudnn_MINOR}.${_cudnn_PATCHLEVEL}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CUDNN REQUIRED_VARS CUDNN_LIBRARY CUDNN_INCLUDE_DIR
                                  VERSION_VAR CUDNN_VERSION)
if(CUDNN_FOUND AND NOT TARGET CUDNN::cudnn)
  add_library(CUDNN::cudnn UNKNOWN IMPORTED)
  set_target_properties(CUDNN::cudnn PROPERTIES IMPORTED_LOCATION "${CUDNN_LIBRARY}"
                                                INTERFACE_INCLUDE_DIRECTORIES "${CUDNN_INCLUDE_DIR}")
endif()
mark_as_advanced(CUDNN_INCLUDE_DIR CUDNN_LIBRARY)
