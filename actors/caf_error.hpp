// Lets actors carry kvr::Error inside caf::error (CAF 0.17). Include only from actor code: every
// translation unit that includes CAF costs seconds of compile time.
#pragma once

#include <caf/error.hpp>
#include <caf/make_message.hpp>

#include "messages/error.hpp"

CAF_ERROR_CODE_ENUM(kvr::Error, "kvr")
