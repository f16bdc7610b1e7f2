#include "actors/node/node.hpp"

#include <caf/actor_system.hpp>
