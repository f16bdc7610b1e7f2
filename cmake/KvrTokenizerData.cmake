# The tokenizers kvr bundles (deploy/data/tokenizers/<family>.tar.xz, compressed to keep clones
# small) unpacked into the build tree, one folder per family with tokenizer.json and
# tokenizer_config.json: the tests, the benchmarks and the quickstart read them from
# KVR_TOKENIZERS_DIR. An archive is unpacked again only when it changes.
set(KVR_TOKENIZERS_DIR "${PROJECT_BINARY_DIR}/data/tokenizers")

function(kvr_unpack_tokenizers)
  file(GLOB archives "${PROJECT_SOURCE_DIR}/deploy/data/tokenizers/*.tar.xz")
  foreach(archive IN LISTS archives)
    get_filename_component(family "${archive}" NAME_WE)
    set(stamp "${KVR_TOKENIZERS_DIR}/${family}.unpacked")
    set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${archive}")
    if(NOT EXISTS "${stamp}" OR "${archive}" IS_NEWER_THAN "${stamp}")
      file(REMOVE_RECURSE "${KVR_TOKENIZERS_DIR}/${family}")
      file(ARCHIVE_EXTRACT INPUT "${archive}" DESTINATION "${KVR_TOKENIZERS_DIR}")
      file(TOUCH "${stamp}")
    endif()
  endforeach()
endfunction()

kvr_unpack_tokenizers()
