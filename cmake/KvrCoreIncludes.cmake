# The plain cores (messages/, discovery/, classifiers/, selection/) include nothing from above them
# and no CAF: `#include "actors/..."`, `"deploy/..."` or `<caf/...>` in one of them stops the
# configure naming the file. The other way round, actors/ holds CAF code only: each of its files
# includes CAF or another actors/ header, or is the header of a source file that does (the node's
# CAF-free facade); plain code belongs in a core. Included by KvrPlainTargets.cmake; also a
# script, so that a test can run the check over a tree of its own:
#   cmake -DKVR_CHECK_ROOT=<dir> -P cmake/KvrCoreIncludes.cmake

cmake_policy(SET CMP0057 NEW)  # if(IN_LIST) in script mode too

function(kvr_check_core_includes_in root)
  get_filename_component(root "${root}" ABSOLUTE)
  foreach(core messages discovery classifiers selection)
    file(GLOB_RECURSE sources "${root}/${core}/*.hpp" "${root}/${core}/*.cpp")
    foreach(source IN LISTS sources)
      file(STRINGS "${source}" forbidden REGEX "^#include (\"(actors|deploy)/|<caf/)")
      if(forbidden)
        file(RELATIVE_PATH name "${root}" "${source}")
        message(FATAL_ERROR
          "${name} is in a plain core but includes from above it or CAF: ${forbidden}")
      endif()
    endforeach()
  endforeach()
  # actors/: CAF code is a file that includes CAF, or an actors/ header that is CAF code, or the
  # header of a source file that is; computed to a fixed point, so a plain file cannot pass by
  # including its own header or another plain actors/ file.
  file(GLOB_RECURSE actor_sources RELATIVE "${root}" "${root}/actors/*.hpp" "${root}/actors/*.cpp")
  set(caf_code)
  foreach(source IN LISTS actor_sources)
    file(STRINGS "${root}/${source}" direct REGEX "^#include <caf/")
    if(direct)
      list(APPEND caf_code "${source}")
    endif()
    file(STRINGS "${root}/${source}" lines REGEX "^#include \"actors/")
    string(REGEX REPLACE "#include \"([^\"]+)\"" "\\1" includes_${source} "${lines}")
  endforeach()
  set(grew TRUE)
  while(grew)
    set(grew FALSE)
    foreach(source IN LISTS actor_sources)
      if(source IN_LIST caf_code)
        continue()
      endif()
      set(reaches_caf FALSE)
      foreach(included IN LISTS includes_${source})
        if(NOT included STREQUAL source AND included IN_LIST caf_code)
          set(reaches_caf TRUE)
        endif()
      endforeach()
      string(REGEX REPLACE "\\.hpp$" ".cpp" implementation "${source}")
      if(NOT implementation STREQUAL source AND implementation IN_LIST caf_code)
        set(reaches_caf TRUE)
      endif()
      if(reaches_caf)
        list(APPEND caf_code "${source}")
        set(grew TRUE)
      endif()
    endforeach()
  endwhile()
  foreach(source IN LISTS actor_sources)
    if(NOT source IN_LIST caf_code)
      message(FATAL_ERROR
        "${source} is under actors/ but is plain code (reaches no CAF include): move it to its core")
    endif()
  endforeach()
endfunction()

if(CMAKE_SCRIPT_MODE_FILE AND DEFINED KVR_CHECK_ROOT)
  kvr_check_core_includes_in("${KVR_CHECK_ROOT}")
endif()
