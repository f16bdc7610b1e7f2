# The plain cores (messages/, discovery/, classifiers/, selection/) include nothing from above them
# and no CAF: `#include "actors/..."`, `"deploy/..."` or `<caf/...>` in one of them stops the
# configure naming the file. Included by KvrPlainTargets.cmake; also a script, so that a test can
# run the check over a tree of its own:
#   cmake -DKVR_CHECK_ROOT=<dir> -P cmake/KvrCoreIncludes.cmake

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
endfunction()

if(CMAKE_SCRIPT_MODE_FILE AND DEFINED KVR_CHECK_ROOT)
  kvr_check_core_includes_in("${KVR_CHECK_ROOT}")
endif()
