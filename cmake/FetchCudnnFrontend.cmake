# FetchCudnnFrontend: the cuDNN frontend's headers when FindCudnnFrontend.cmake's search found none.
#
# 1. An installed Python package: the nvidia-cudnn-frontend wheel installs its headers as
#    <site-packages>/include/cudnn_frontend*.h (next to the `cudnn` Python package); taken when its
#    version is at least the pinned one. The Python is the one CMake's FindPython3 picks (an
#    active virtual environment first).
# 2. With KEEL_FETCH_CUDNN_FRONTEND ON (and cuDNN found), the pinned wheel from PyPI through
#    `python3 -m pip download` (pip's own index, proxy and certificate settings apply), of which
#    only include/ is unpacked into ${CMAKE_BINARY_DIR}/_deps/cudnn-frontend-<version>/include.
#    Any wheel of a version has the same headers, so the platform and Python tags are fixed and
#    any Python with pip can fetch it. Later configures find that copy and do not download again.
#
# KEEL_CUDNN_FRONTEND_PIN (the pinned version) comes from FindCudnnFrontend.cmake. Sets
# CUDNN_FRONTEND_INCLUDE_DIR (cache; and _KEEL_CUDNN_FRONTEND_ORIGIN for a Python package) when it
# finds the headers, CudnnFrontend_REASON when it does not. Tried once per configure run: the second
# find_package(CudnnFrontend) (framework/) gets the first one's answer.
get_property(_fe_tried GLOBAL PROPERTY KEEL_CUDNN_FRONTEND_FETCH_REASON SET)
if(_fe_tried)
  get_property(CudnnFrontend_REASON GLOBAL PROPERTY KEEL_CUDNN_FRONTEND_FETCH_REASON)
  return()
endif()

find_package(Python3 COMPONENTS Interpreter QUIET)

# 1. An installed nvidia-cudnn-frontend.
set(_fe_note "")
if(Python3_EXECUTABLE)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c [=[
import importlib.metadata as md, os
try:
    d = md.distribution("nvidia-cudnn-frontend")
    h = str(d.locate_file("include/cudnn_frontend.h"))
    if os.path.isfile(h):
        print(d.version + ";" + os.path.dirname(h), end="")
except Exception:
    pass
]=]
    OUTPUT_VARIABLE _fe_installed ERROR_QUIET TIMEOUT 60)
  list(LENGTH _fe_installed _fe_n)
  if(_fe_n EQUAL 2)
    list(GET _fe_installed 0 _fe_installed_version)
    list(GET _fe_installed 1 _fe_installed_dir)
    if(_fe_installed_version VERSION_GREATER_EQUAL KEEL_CUDNN_FRONTEND_PIN)
      set(CUDNN_FRONTEND_INCLUDE_DIR "${_fe_installed_dir}" CACHE PATH
          "cuDNN frontend include directory" FORCE)
      set(_KEEL_CUDNN_FRONTEND_ORIGIN "installed Python package of ${Python3_EXECUTABLE}"
          CACHE INTERNAL "where the cuDNN frontend was found")
      set_property(GLOBAL PROPERTY KEEL_CUDNN_FRONTEND_FETCH_REASON "")
      return()
    endif()
    string(CONCAT _fe_note " (the installed Python package is ${_fe_installed_version}, older "
                           "than ${KEEL_CUDNN_FRONTEND_PIN})")
  endif()
endif()

# 2. The pinned wheel from PyPI.
if(NOT KEEL_FETCH_CUDNN_FRONTEND)
  string(CONCAT CudnnFrontend_REASON
      "frontend headers not found${_fe_note} and KEEL_FETCH_CUDNN_FRONTEND=OFF (set "
      "CUDNN_FRONTEND_ROOT, or pip install nvidia-cudnn-frontend==${KEEL_CUDNN_FRONTEND_PIN})")
elseif(DEFINED CUDNN_FOUND AND NOT CUDNN_FOUND)
  string(CONCAT CudnnFrontend_REASON "frontend headers not found, and not fetched: cuDNN itself "
                                     "is missing")
else()
  set(_fe_pythons)
  foreach(_py "${Python3_EXECUTABLE}" /usr/bin/python3)
    if(_py AND EXISTS "${_py}" AND NOT _py IN_LIST _fe_pythons)
      list(APPEND _fe_pythons "${_py}")
    endif()
  endforeach()
  set(_fe_pip "")
  foreach(_py IN LISTS _fe_pythons)
    execute_process(COMMAND "${_py}" -m pip --version RESULT_VARIABLE _fe_rc OUTPUT_QUIET
                    ERROR_QUIET TIMEOUT 60)
    if(_fe_rc EQUAL 0)
      set(_fe_pip "${_py}")
      break()
    endif()
  endforeach()
  if(NOT _fe_pip)
    string(CONCAT CudnnFrontend_REASON
        "frontend headers not found${_fe_note}, and no Python with pip to fetch them (install "
        "python3-pip, or set CUDNN_FRONTEND_ROOT)")
  else()
    set(_fe_dir "${CMAKE_BINARY_DIR}/_deps/cudnn-frontend-${KEEL_CUDNN_FRONTEND_PIN}")
    set(_fe_tmp "${CMAKE_BINARY_DIR}/_deps/cudnn-frontend-download")
    message(STATUS "keel: fetching the cuDNN frontend ${KEEL_CUDNN_FRONTEND_PIN} headers (PyPI "
                   "nvidia-cudnn-frontend) into ${_fe_dir}")
    file(REMOVE_RECURSE "${_fe_tmp}" "${_fe_dir}")
    file(MAKE_DIRECTORY "${_fe_tmp}")
    execute_process(
      COMMAND "${_fe_pip}" -m pip download -q --disable-pip-version-check --no-deps
              --only-binary=:all: --platform manylinux_2_28_x86_64 --python-version 3.11
              --implementation cp --retries 1 --timeout 30 -d "${_fe_tmp}"
              "nvidia-cudnn-frontend==${KEEL_CUDNN_FRONTEND_PIN}"
      RESULT_VARIABLE _fe_rc OUTPUT_VARIABLE _fe_log ERROR_VARIABLE _fe_log TIMEOUT 300)
    file(GLOB _fe_wheel "${_fe_tmp}/*.whl")
    if(_fe_rc EQUAL 0 AND _fe_wheel)
      list(GET _fe_wheel 0 _fe_wheel)
      file(ARCHIVE_EXTRACT INPUT "${_fe_wheel}" DESTINATION "${_fe_tmp}/unpacked"
           PATTERNS "include/*")
    endif()
    if(EXISTS "${_fe_tmp}/unpacked/include/cudnn_frontend.h")
      file(RENAME "${_fe_tmp}/unpacked" "${_fe_dir}")
      set(CUDNN_FRONTEND_INCLUDE_DIR "${_fe_dir}/include" CACHE PATH
          "cuDNN frontend include directory" FORCE)
    else()
      # pip's last line says why (no network, no such version, a proxy's refusal).
      string(STRIP "${_fe_log}" _fe_log)
      string(REGEX REPLACE ".*\n" "" _fe_last "${_fe_log}")
      if(NOT _fe_last)
        set(_fe_last "exit status ${_fe_rc}, no wheel")
      endif()
      string(CONCAT CudnnFrontend_REASON
          "frontend headers not found${_fe_note}, and fetching PyPI "
          "nvidia-cudnn-frontend==${KEEL_CUDNN_FRONTEND_PIN} failed (${_fe_last}); set "
          "CUDNN_FRONTEND_ROOT, or reconfigure to retry")
    endif()
    file(REMOVE_RECURSE "${_fe_tmp}")
  endif()
endif()
set_property(GLOBAL PROPERTY KEEL_CUDNN_FRONTEND_FETCH_REASON "${CudnnFrontend_REASON}")
