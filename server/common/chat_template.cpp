#include "common/chat_template.h"

namespace burst::server {

namespace {

std::string trim(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

}  // namespace

Result<std::vector<int32_t>> apply_llama2_chat_template(const Tokenizer& tok,
                                                        const std::vector<std::string>& roles,
                                                        const std::vector<std::string>& contents) {
  std::vector<std::string> r = roles, c = contents;
  if (r.empty()) return Status::error("'messages' must not be empty");
  if (r[0] == "system") {
    if (r.size() < 2) return Status::error("a system message must be followed by a user message");
    c[1] = "<<SYS>>\n" + c[0] + "\n<</SYS>>\n\n" + c[1];
    r.erase(r.begin());
    c.erase(c.begin());
  }
  for (size_t i = 0; i < r.size(); ++i) {
    const char* want = i % 2 == 0 ? "user" : "assistant";
    if (r[i] != want) {
      return Status::error("messages must alternate user and assistant (after an optional "
                           "system message); message " + std::to_string(i) + " is '" + r[i] +
                           "'");
    }
  }
  if (r.back() != "user") return Status::error("the last message must be from the user");
  std::vector<int32_t> ids;
  auto append = [&](const std::string& text, bool eos) -> Status {
    auto e = tok.encode(text, true, eos);
    if (!e.ok()) return Status::error("a message is not valid UTF-8: " + e.message());
    ids.insert(ids.end(), e.value().begin(), e.value().end());
    return {};
  };
  for (size_t i = 0; i + 1 < r.size(); i += 2) {
    BURST_RETURN_IF_ERROR(
        append("[INST] " + trim(c[i]) + " [/INST] " + trim(c[i + 1]) + " ", true));
  }
  BURST_RETURN_IF_ERROR(append("[INST] " + trim(c.back()) + " [/INST]", false));
  return ids;
}

}  // namespace burst::server
