#include "actors/table/table.hpp"

int table_size() { return 0; }
