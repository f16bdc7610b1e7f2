// Makes the example catalog a plugin: `kvr node --plugin libkvr_example_policies.so` registers
// its types (`cache-headroom`, `tool-turn-local`, `lmetric`, `sticky-until-saturated`) before the
// router-policy YAML is resolved.
#include <kvr/plugin.hpp>

#include "example_catalog.hpp"

KVR_PLUGIN_CATALOG(kvr::examples::register_example_catalog)
