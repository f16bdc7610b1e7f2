# Project-wide warning and sanitizer settings, applied through kvr_apply_options(<target>).

set(KVR_WARNINGS -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wold-style-cast
  # GCC 12 flags designated initializers that leave defaulted members out; those defaults are
  # intended, and designated initializers are how kvr builds option structs.
  -Wno-missing-field-initializers)
if(CMAKE_UNITY_BUILD AND CMAKE_CXX_COMPILER_ID STREQUAL "GNU")
  # GCC takes the sources of a unity batch for headers and warns of a class with a member of a
  # file-local type: a hazard in a header included twice, not in a source included once.
  list(APPEND KVR_WARNINGS -Wno-subobject-linkage)
endif()
if(KVR_WERROR)
  list(APPEND KVR_WARNINGS -Werror)
endif()

if(KVR_SANITIZE)
  # Applied globally so that every object, test and library agrees on the runtime. GCC's
  # type-mismatch family (null, alignment, vptr) instruments every load and store and makes a
  # third of this build's compile time: a null dereference is still reported by AddressSanitizer,
  # and the fuzz build (cmake/KvrFuzz.cmake) keeps all three over every parser of client input.
  set(kvr_ubsan_skipped null,alignment,vptr)
  add_compile_options(-fsanitize=address,undefined -fno-sanitize=${kvr_ubsan_skipped}
    -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_link_options(-fsanitize=address,undefined -fno-sanitize=${kvr_ubsan_skipped})
endif()

# Applies kvr's warnings to a target that kvr writes (not to generated code).
function(kvr_apply_options target)
  target_compile_options(${target} PRIVATE ${KVR_WARNINGS})
endfunction()
