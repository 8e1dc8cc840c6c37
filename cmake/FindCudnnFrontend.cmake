# FindCudnnFrontend: the cuDNN frontend, NVIDIA's header-only C++ graph API over cuDNN (1.x).
#
# Not a Debian package; its PyPI wheel (nvidia-cudnn-frontend) ships the headers under include/.
# Looks in KEEL_CUDNN_FRONTEND_ROOT (CMake variable) alone when it is set; otherwise in
# CUDNN_FRONTEND_ROOT (CMake or environment variable), ${PROJECT_SOURCE_DIR}/build/cudnn-frontend
# (where tests/run fetches it), the copy a previous configure fetched into
# ${CMAKE_BINARY_DIR}/_deps, and the system paths. A root holds include/cudnn_frontend.h (or is
# that include directory itself). Not found there, cmake/FetchCudnnFrontend.cmake takes it from an
# installed Python package (pip install nvidia-cudnn-frontend) or, when KEEL_FETCH_CUDNN_FRONTEND
# is ON (the default), downloads the pinned wheel from PyPI into ${CMAKE_BINARY_DIR}/_deps. The
# search is redone when a root or KEEL_FETCH_CUDNN_FRONTEND changes, so
# -DKEEL_CUDNN_FRONTEND_ROOT=/nonexistent configures a build without it.
#
# Result: CudnnFrontend_FOUND, CudnnFrontend_VERSION, CUDNN_FRONTEND_INCLUDE_DIR,
# CudnnFrontend_ORIGIN (how it came, for the configure summary: "fetched from PyPI", "installed
# Python package ...", empty when found by the search) and, when not found, CudnnFrontend_REASON
# (why not).
set(KEEL_CUDNN_FRONTEND_PIN 1.32.0)  # the version fetched from PyPI; tests/run pins it too
set(_fe_key "${KEEL_CUDNN_FRONTEND_ROOT}|${CUDNN_FRONTEND_ROOT}|$ENV{CUDNN_FRONTEND_ROOT}|"
            "${KEEL_FETCH_CUDNN_FRONTEND}")
string(CONCAT _fe_key ${_fe_key})
if(NOT "${_fe_key}" STREQUAL "${_KEEL_CUDNN_FRONTEND_SEARCHED}"
   OR (CUDNN_FRONTEND_INCLUDE_DIR AND NOT EXISTS "${CUDNN_FRONTEND_INCLUDE_DIR}/cudnn_frontend.h"))
  unset(CUDNN_FRONTEND_INCLUDE_DIR CACHE)
  set(_KEEL_CUDNN_FRONTEND_SEARCHED "${_fe_key}" CACHE INTERNAL "roots of the last search")
  set(_KEEL_CUDNN_FRONTEND_ORIGIN "" CACHE INTERNAL "where the cuDNN frontend was found")
endif()
unset(CudnnFrontend_REASON)

if(KEEL_CUDNN_FRONTEND_ROOT)
  find_path(CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h HINTS "${KEEL_CUDNN_FRONTEND_ROOT}"
            PATH_SUFFIXES include NO_DEFAULT_PATH)
  if(NOT CUDNN_FRONTEND_INCLUDE_DIR)
    set(CudnnFrontend_REASON
        "no cudnn_frontend.h in KEEL_CUDNN_FRONTEND_ROOT=${KEEL_CUDNN_FRONTEND_ROOT}(/include)")
  endif()
else()
  set(_fe_hints "${CUDNN_FRONTEND_ROOT}" "$ENV{CUDNN_FRONTEND_ROOT}"
                "${PROJECT_SOURCE_DIR}/build/cudnn-frontend")
  if(KEEL_FETCH_CUDNN_FRONTEND)
    list(APPEND _fe_hints "${CMAKE_BINARY_DIR}/_deps/cudnn-frontend-${KEEL_CUDNN_FRONTEND_PIN}")
  endif()
  find_path(CUDNN_FRONTEND_INCLUDE_DIR cudnn_frontend.h HINTS ${_fe_hints} PATH_SUFFIXES include)
  if(NOT CUDNN_FRONTEND_INCLUDE_DIR)
    include(${CMAKE_CURRENT_LIST_DIR}/FetchCudnnFrontend.cmake)
  endif()
endif()
# A copy an earlier configure fetched keeps saying so.
string(FIND "${CUDNN_FRONTEND_INCLUDE_DIR}" "${CMAKE_BINARY_DIR}/_deps/" _fe_at)
if(_fe_at EQUAL 0)
  set(CudnnFrontend_ORIGIN "fetched from PyPI")
else()
  set(CudnnFrontend_ORIGIN "${_KEEL_CUDNN_FRONTEND_ORIGIN}")
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
