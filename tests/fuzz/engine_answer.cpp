// An engine's answer as the front door reads it: the prompt's usage at the end of a completion
// (a whole JSON answer or a stream's last events, answer_usage), and the token ids of a render or
// /tokenize answer (rendered_token_ids). The engine is reached over the network and its answer
// relayed from whatever it sends. Properties: a usage is found only where the answer names one;
// token ids come as a non-empty list.
#include <string>

#include "selection/front_door/openai_api.hpp"
#include "tests/fuzz/harness.hpp"

namespace kvr::fuzz {

void engine_answer(Input input) {
  const std::string answer{as_text(input)};
  if (front_door::answer_usage(answer)) {
    KVR_FUZZ_CHECK(answer.find("\"usage\"") != std::string::npos);
  }
  for (const bool tokenize : {false, true}) {
    if (const auto ids = front_door::rendered_token_ids(answer, tokenize)) {
      KVR_FUZZ_CHECK(!ids->empty());
    }
  }
}

}  // namespace kvr::fuzz
