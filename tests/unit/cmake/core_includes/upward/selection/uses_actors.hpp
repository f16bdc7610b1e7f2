// A plain core header that includes from actors/: the check must refuse it.
#pragma once

#include "actors/actor_types.hpp"
