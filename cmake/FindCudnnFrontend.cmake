# FindCudnnFrontend: the cuDNN frontend, NVIDIA's header-only C++ graph API over cuDNN (1.x).
#
# Not a Debian package; its PyPI wheel (nvidia-cudnn-frontend) ships the headers under include/,
# which tests/run fetches into build/cudnn-frontend/. Looks in KEEL_CUDNN_FRONTEND_ROOT (CMake
# variable) alone when it is set; otherwise in CUDNN_FRONTEND_ROOT (CMake or environment
# variable), ${PROJECT_SOURCE_DIR}/build/cudnn-frontend and the system paths. A root holds
# include/cudnn_frontend.h (or is that include directory itself). The search is redone when the
# root changes, so -DKEEL_CUDNN_FRONTEND_ROOT=/nonexistent configures a build without it.
#
# Result: CudnnFrontend_FOUND, CudnnFrontend_VERSION, CUDNN_FRONTEND_INCLUDE_DIR.
set(_fe_key "${KEEL_CUDNN_FRONTEND_ROOT}|${CUDNN_FRONTEND_ROOT}|$ENV{CUDNN_FRONTEND_ROOT}")
if(NOT "${_fe_key}" STREQUAL "${_KEEL_CUDNN_FRONTEND_SEARCHED}")
  unset(CUDNN_FRONTEND_INCLUDE_DIR CACHE)
  set(_KEEL_CUDNN_FRONTEND_SEARCHED "${_fe_key}" CACHE INTERNAL "roots of the last search")
endif()

if(KEEL_CUDNN_FRONTEND_ROOT)
  find_path(CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h HINTS "${KEEL_CUDNN_FRONTEND_ROOT}"
            PATH_SUFFIXES include NO_DEFAULT_PATH)
else()
  find_path(CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h
            HINTS "${CUDNN_FRONTEND_ROOT}" "$ENV{CUDNN_FRONTEND_ROOT}"
                  "${PROJECT_SOURCE_DIR}/build/cudnn-frontend"
            PATH_SUFFIXES include)
endif()

if(CUDNN_FRONTEND_INCLUDE_DIR AND EXISTS "${CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend_version.h")
  file(STRINGS "${CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend_version.h" _fe_defs
       REGEX "^#define CUDNN_FRONTEND_(MAJOR|MINOR|PATCH)_VERSION +[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    string(REGEX MATCH "CUDNN_FRONTEND_${_part}_VERSION +([0-9]+)" _m "${_fe_defs}")
    set(_fe_${_part} "${CMAKE_MATCH_1}")
  endforeach()
  set(CudnnFrontend_VERSION "${_fe_MAJOR}.${_fe_MINOR}.${_fe_PATCH}")
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(CudnnFrontend REQUIRED_VARS CUDNN_FRONTEND_INCLUDE_DIR
                                  VERSION_VAR CudnnFrontend_VERSION)
mark_as_advanced(CUDNN_FRONTEND_INCLUDE_DIR)
