// Chat templates: a conversation (roles and contents) as the prompt's token ids. Shared by the
// HTTP (OpenAI chat completions) and gRPC frontends. The template is the model's own when its
// tokenizer_config.json has a `chat_template` (or the operator's --chat-template FILE), rendered
// by the Jinja subset of common/jinja.h; otherwise LLaMA-2's, compiled in.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/jinja.h"
#include "common/tokenizer.h"
#include "engine/status.h"

namespace burst::server {

// The LLaMA-2 chat template (Meta's reference `chat_completion`): an optional system message
// folded into the first user turn as <<SYS>>...<</SYS>>, each finished (user, assistant) pair as
// BOS "[INST] user [/INST] assistant " EOS, and the final user turn as BOS "[INST] user [/INST]".
// roles/contents are parallel; the error says what is wrong with the conversation. A
// `developer` message (OpenAI's newer name) is a system message.
Result<std::vector<int32_t>> apply_llama2_chat_template(const Tokenizer& tok,
                                                        const std::vector<std::string>& roles,
                                                        const std::vector<std::string>& contents);

class ChatTemplate {
 public:
  ChatTemplate() = default;  // LLaMA-2's, compiled in

  // A Jinja template's text. bos / eos: the text of the special tokens as the template writes
  // them (bos_token, eos_token; "<s>", "</s>" for LLaMA's vocabulary); `origin` names where it
  // came from in messages.
  static Result<ChatTemplate> from_jinja(const std::string& source, std::string bos,
                                         std::string eos, std::string origin);
  // --chat-template FILE: the file holds a template's text, or is a tokenizer_config.json
  // (a .json file: its "chat_template"). bos / eos from the tokenizer's pieces.
  static Result<ChatTemplate> from_file(const std::string& path, const Tokenizer& tok);
  // The model's: DIR/tokenizer_config.json's chat_template (a string, or a list of named
  // templates: "default") with its bos_token / eos_token; LLaMA-2's when the file or the field
  // is absent. A template that is present but does not parse is an error, not a fallback.
  static Result<ChatTemplate> for_model(const std::string& dir, const Tokenizer& tok);

  bool is_jinja() const { return jinja_ != nullptr; }
  const std::string& origin() const { return origin_; }

  // The prompt as text, the special tokens written as their text (Jinja templates only).
  // Variables: messages (role, content), bos_token, eos_token, add_generation_prompt, then
  // `variables` (a request's chat_template_kwargs: enable_thinking, ...), which override those
  // but `messages`. The compiled-in template reads none.
  Result<std::string> render(const std::vector<std::string>& roles,
                             const std::vector<std::string>& contents,
                             bool add_generation_prompt,
                             const jinja::Dict& variables = {}) const;
  // The prompt's ids. A Jinja template's text is cut at each bos / eos text, which become the
  // tokenizer's BOS / EOS ids; the pieces between are encoded without BOS, as transformers
  // tokenizes a rendered chat (add_special_tokens=False). A template error (raise_exception, an
  // unsupported construct, a type error) is an error naming it.
  Result<std::vector<int32_t>> apply(const Tokenizer& tok, const std::vector<std::string>& roles,
                                     const std::vector<std::string>& contents,
                                     bool add_generation_prompt = true,
                                     const jinja::Dict& variables = {}) const;

 private:
  std::shared_ptr<const jinja::Template> jinja_;
  std::string bos_, eos_;
  std::string origin_ = "LLaMA-2 (compiled in)";
};

// The template both APIs use: set once at start-up, before serving (LLaMA-2's until then).
void set_chat_template(std::shared_ptr<const ChatTemplate> t);
const ChatTemplate& chat_template();
// chat_template().apply(...).
Result<std::vector<int32_t>> apply_chat_template(const Tokenizer& tok,
                                                 const std::vector<std::string>& roles,
                                                 const std::vector<std::string>& contents,
                                                 bool add_generation_prompt = true,
                                                 const jinja::Dict& variables = {});

}  // namespace burst::server
