// A plain core header that includes only plain code: the check passes it.
#pragma once

#include <vector>

#include "messages/ids.hpp"
