# The libFuzzer build (-DKVR_FUZZ=ON, clang only; see docs/fuzzing.md). Every object is built with
# coverage instrumentation and AddressSanitizer + UndefinedBehaviorSanitizer, and any UBSan finding
# stops the run like a crash; the harness executables (tests/fuzz) add libFuzzer's main.

if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  message(FATAL_ERROR "KVR_FUZZ needs clang (e.g. -DCMAKE_CXX_COMPILER=clang++-19 "
    "-DCMAKE_C_COMPILER=clang-19); this is ${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION}")
endif()
if(KVR_SANITIZE)
  message(FATAL_ERROR "KVR_FUZZ brings its own sanitizers: leave KVR_SANITIZE off")
endif()

add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
  -fno-omit-frame-pointer)
add_link_options(-fsanitize=address,undefined)
