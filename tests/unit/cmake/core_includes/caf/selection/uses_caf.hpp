// A plain core header that includes CAF: the check must refuse it.
#pragma once

#include <caf/actor.hpp>
