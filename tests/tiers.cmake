# Test tiers: every ctest entry carries labels saying what kind of test it is, and the entries
# that tests/quick.txt names carry `quick` as well (tests/run --quick runs ctest -L quick).
#
#   unit   in process, one binary
#   e2e    starts keel's binaries (keel-train, keel-ckpt, keel-bench), mpiexec or a script
#   mpi    a tests/parallel binary under mpiexec
#   emu    the CUDA backend on the CUDA emulator (tests/cuda_emu)
#   gpu    keel_gpu_tests, on a lent GPU (every test skips without one)
#   slow   a minute or more, or tests already run, again under a second configuration
#   quick  the quick tier (tests/quick.txt)
#
# tests/quick.txt has two kinds of line: "BINARY REGEX" selects the tests of a gtest binary (each
# its own ctest entry) whose names match REGEX; "NAME" alone selects the ctest entry NAME (an MPI
# binary at one rank count, a script). gtest_discover_tests names its tests at build time, so the
# label cannot be set here on what it finds: keel_quick_finish() writes a script that ctest runs
# after defining them. Every line must select something: one that selects nothing adds a failing
# entry (quick.list, label quick) naming it, so tests/run --quick and ctest -L quick fail rather
# than quietly run less.

set(keel_quick_file ${CMAKE_CURRENT_LIST_DIR}/quick.txt)
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${keel_quick_file})
file(STRINGS ${keel_quick_file} keel_quick_lines REGEX "^[^#]")
set(keel_quick_keys "")  # the binaries and ctest entries quick.txt names
foreach(line ${keel_quick_lines})
  if(NOT line MATCHES "^([A-Za-z0-9_.-]+)([ \t]+([^ \t]+))?[ \t]*$")
    message(FATAL_ERROR "${keel_quick_file}: neither \"BINARY REGEX\" nor \"NAME\": ${line}")
  endif()
  list(APPEND keel_quick_keys ${CMAKE_MATCH_1})
  if(NOT CMAKE_MATCH_3 STREQUAL "")
    set_property(GLOBAL APPEND PROPERTY keel_quick_re_${CMAKE_MATCH_1} "${CMAKE_MATCH_3}")
  else()
    set_property(GLOBAL PROPERTY keel_quick_entry_${CMAKE_MATCH_1} 1)
  endif()
endforeach()
list(REMOVE_DUPLICATES keel_quick_keys)
set_property(GLOBAL PROPERTY keel_quick_taken "")

# keel_discover(TARGET LABELS [gtest_discover_tests options]): the binary's tests through
# gtest_discover_tests, labelled LABELS (a list), and quick where quick.txt's lines for TARGET
# match. gtest_discover_tests passes on only the first entry of a list-valued property, so a
# binary with more than one label, or with tests in quick.txt, is labelled by keel_quick_finish().
function(keel_discover target labels)
  list(GET labels 0 first)
  gtest_discover_tests(${target} DISCOVERY_TIMEOUT 60 ${ARGN}
                       PROPERTIES ENVIRONMENT "OMP_NUM_THREADS=2" LABELS ${first})
  get_property(res GLOBAL PROPERTY keel_quick_re_${target})
  list(LENGTH labels n)
  if(res OR n GREATER 1)
    set_property(DIRECTORY APPEND PROPERTY keel_relabelled ${target})
    set_property(DIRECTORY PROPERTY keel_labels_${target} "${labels}")
  endif()
endfunction()

# keel_quick_finish(GUARD [ALL]): after the last test of a directory. Adds quick to the labels of
# the directory's ctest entries that quick.txt names, and writes the script that labels its
# discovered tests when ctest reads them (quick on those quick.txt names); a line for them that
# selects nothing adds the failing entry GUARD naming it. With ALL (the last directory),
# quick.txt's names that no directory took count as selecting nothing too.
function(keel_quick_finish guard)
  string(CONCAT script
    "# Written by tests/tiers.cmake: the labels of discovered tests, quick on those tests/quick.txt"
    " names.\nset(keel_quick_unmatched \"\")\n")
  foreach(key ${keel_quick_keys})
    get_property(entry GLOBAL PROPERTY keel_quick_entry_${key})
    if(entry AND TEST ${key})
      get_test_property(${key} LABELS labels)
      if(NOT labels)
        set(labels "")
      endif()
      set_tests_properties(${key} PROPERTIES LABELS "${labels};quick")
      set_property(GLOBAL APPEND PROPERTY keel_quick_taken ${key})
    endif()
  endforeach()
  get_property(targets DIRECTORY PROPERTY keel_relabelled)
  foreach(target ${targets})
    set_property(GLOBAL APPEND PROPERTY keel_quick_taken ${target})
    get_property(labels DIRECTORY PROPERTY keel_labels_${target})
    get_property(res GLOBAL PROPERTY keel_quick_re_${target})
    set(i 0)
    foreach(re ${res})
      string(APPEND script "set(n${i} 0)\n")
      math(EXPR i "${i} + 1")
    endforeach()
    string(APPEND script "foreach(t IN LISTS ${target}_TESTS)\n  set(l \"${labels}\")\n")
    set(i 0)
    foreach(re ${res})
      string(APPEND script "  if(t MATCHES [==[${re}]==])\n    set(l \"${labels};quick\")\n"
                           "    math(EXPR n${i} \"\${n${i}} + 1\")\n  endif()\n")
      math(EXPR i "${i} + 1")
    endforeach()
    string(APPEND script "  set_tests_properties(\${t} PROPERTIES LABELS \"\${l}\")\nendforeach()\n")
    set(i 0)
    foreach(re ${res})
      string(APPEND script "if(n${i} EQUAL 0)\n"
                           "  list(APPEND keel_quick_unmatched [==[${target} ${re}]==])\nendif()\n")
      math(EXPR i "${i} + 1")
    endforeach()
  endforeach()
  if("ALL" IN_LIST ARGN)
    get_property(taken GLOBAL PROPERTY keel_quick_taken)
    set(untaken ${keel_quick_keys})
    if(taken)
      list(REMOVE_ITEM untaken ${taken})
    endif()
    foreach(key ${untaken})
      string(APPEND script "list(APPEND keel_quick_unmatched [==[${key} (not in this build)]==])\n")
    endforeach()
  endif()
  # The guard prints its message and, being WILL_FAIL, fails because the printing succeeded.
  string(APPEND script "if(keel_quick_unmatched)\n"
    "  list(JOIN keel_quick_unmatched \" | \" what)\n"
    "  add_test(${guard} \"${CMAKE_COMMAND}\" -E echo \"tests/quick.txt: these lines select no"
    " test: \${what}\")\n"
    "  set_tests_properties(${guard} PROPERTIES WILL_FAIL TRUE LABELS quick)\n"
    "endif()\n")
  set(file ${CMAKE_CURRENT_BINARY_DIR}/keel_quick_labels.cmake)
  file(WRITE ${file} "${script}")
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES ${file})
endfunction()
