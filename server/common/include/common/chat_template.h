// Chat templates: a conversation (roles and contents) as the prompt's token ids. Shared by the
// HTTP (OpenAI chat completions) and gRPC frontends.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/tokenizer.h"
#include "engine/status.h"

namespace burst::server {

// The LLaMA-2 chat template (Meta's reference `chat_completion`): an optional system message
// folded into the first user turn as <<SYS>>...<</SYS>>, each finished (user, assistant) pair as
// BOS "[INST] user [/INST] assistant " EOS, and the final user turn as BOS "[INST] user [/INST]".
// roles/contents are parallel; the error says what is wrong with the conversation.
Result<std::vector<int32_t>> apply_llama2_chat_template(const Tokenizer& tok,
                                                        const std::vector<std::string>& roles,
                                                        const std::vector<std::string>& contents);

}  // namespace burst::server
