# The plugin SDK suite's fixture (ctest runs it once before the suite's tests, which each run in
# a process of their own): `cmake --install` of the SDK into <OUT>/prefix, then the example
# plugins, the example actor client and the test plugins built against that prefix alone.
#   cmake -DKVR_BUILD_DIR=... -DKVR_SOURCE_DIR=... -DKVR_CXX_COMPILER=... -DOUT=... -P <this>
# <OUT>/prepared is written last: the suite builds its own copy when it is missing or older than
# the build's kvr.
file(REMOVE_RECURSE "${OUT}")
file(MAKE_DIRECTORY "${OUT}")

function(step)
  execute_process(COMMAND ${ARGV} RESULT_VARIABLE status OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "${ARGV} failed (${status}):\n${out}")
  endif()
endfunction()

step(${CMAKE_COMMAND} --install "${KVR_BUILD_DIR}" --prefix "${OUT}/prefix" --component sdk)
foreach(project_and_build
    "deploy/examples|examples" "deploy/examples/actor_client|actor_client"
    "tests/data/plugins|test-plugins")
  string(REPLACE "|" ";" parts "${project_and_build}")
  list(GET parts 0 project)
  list(GET parts 1 build)
  step(${CMAKE_COMMAND} -S "${KVR_SOURCE_DIR}/${project}" -B "${OUT}/${build}"
    "-DCMAKE_PREFIX_PATH=${OUT}/prefix" "-DCMAKE_CXX_COMPILER=${KVR_CXX_COMPILER}"
    -DCMAKE_BUILD_TYPE=Release)
  step(${CMAKE_COMMAND} --build "${OUT}/${build}")
endforeach()
file(WRITE "${OUT}/prepared" "")
