# Project-wide warning and sanitizer settings, applied through kvr_apply_options(<target>).

set(KVR_WARNINGS -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wold-style-cast
  # GCC 12 flags designated initializers that leave defaulted members out; those defaults are
  # intended, and designated initializers are how kvr builds option structs.
  -Wno-missing-field-initializers)
if(KVR_WERROR)
  list(APPEND KVR_WARNINGS -Werror)
endif()

if(KVR_SANITIZE)
  # Applied globally so that every object, test and library agrees on the runtime.
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all)
  add_link_options(-fsanitize=address,undefined)
endif()

# Applies kvr's warnings to a target that kvr writes (not to generated code).
function(kvr_apply_options target)
  target_compile_options(${target} PRIVATE ${KVR_WARNINGS})
endfunction()
