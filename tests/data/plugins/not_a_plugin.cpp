// A shared library built against the SDK that never says KVR_PLUGIN_CATALOG.
extern "C" __attribute__((visibility("default"))) int some_function() { return 42; }
