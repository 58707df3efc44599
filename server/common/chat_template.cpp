#include "common/chat_template.h"

#include <sys/stat.h>

#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

namespace burst::server {

namespace {

using json = nlohmann::json;

std::string trim(const std::string& s) {
  const char* ws = " \t\n\r\f\v";
  const size_t b = s.find_first_not_of(ws);
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

// OpenAI's `developer` role is what older templates call `system`.
std::vector<std::string> canonical_roles(std::vector<std::string> roles) {
  for (auto& r : roles) {
    if (r == "developer") r = "system";
  }
  return roles;
}

// A file of at most `max_bytes`, regular (a FIFO would block the start forever).
Result<std::string> read_file(const std::string& path, int64_t max_bytes) {
  struct stat st {};
  if (stat(path.c_str(), &st) != 0) return Status::error(path + ": cannot read it (absent?)");
  if (!S_ISREG(st.st_mode)) return Status::error(path + ": not a regular file");
  if (st.st_size > max_bytes) {
    return Status::error(path + ": " + std::to_string(st.st_size) + " bytes, more than " +
                         std::to_string(max_bytes));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::error(path + ": cannot open it");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

constexpr int64_t kMaxConfigBytes = int64_t{16} << 20;  // tokenizer_config.json with its tokens

// A special token as tokenizer_config.json writes it: a string or {"content": ...}.
std::string token_text(const json& cfg, const char* key, const std::string& dflt) {
  const auto it = cfg.find(key);
  if (it == cfg.end()) return dflt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object()) {
    const auto c = it->find("content");
    if (c != it->end() && c->is_string()) return c->get<std::string>();
  }
  return dflt;
}

// The chat_template field: a string, or a list of {"name", "template"} ("default" is the one
// for chats). Empty when absent.
Result<std::string> template_field(const json& cfg, const std::string& source) {
  const auto it = cfg.find("chat_template");
  if (it == cfg.end() || it->is_null()) return std::string();
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const auto& t : *it) {
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") &&
          t["template"].is_string()) {
        return t["template"].get<std::string>();
      }
    }
    return Status::error(source +
                         ": field \"chat_template\" is a list without a \"default\" "
                         "template");
  }
  return Status::error(source +
                       ": field \"chat_template\" must be a string or a list of "
                       "named templates");
}

Result<json> parse_json_file(const std::string& path) {
  auto text = read_file(path, kMaxConfigBytes);
  if (!text.ok()) return text.status();
  json cfg = json::parse(text.value(), nullptr, false);
  if (cfg.is_discarded() || !cfg.is_object()) {
    return Status::error(path + ": not a JSON object");
  }
  return cfg;
}

std::mutex g_mu;
std::shared_ptr<const ChatTemplate> g_template;

}  // namespace

Result<std::vector<int32_t>> apply_llama2_chat_template(const Tokenizer& tok,
                                                        const std::vector<std::string>& roles,
                                                        const std::vector<std::string>& contents) {
  std::vector<std::string> r = canonical_roles(roles), c = contents;
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
      return Status::error(
          "messages must alternate user and assistant (after an optional "
          "system message); message " +
          std::to_string(i) + " is '" + r[i] + "'");
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

Result<ChatTemplate> ChatTemplate::from_jinja(const std::string& source, std::string bos,
                                              std::string eos, std::string origin) {
  auto t = jinja::Template::parse(source);
  if (!t.ok()) return Status::error(origin + ": " + t.message());
  ChatTemplate c;
  c.jinja_ = std::make_shared<const jinja::Template>(t.take());
  c.bos_ = std::move(bos);
  c.eos_ = std::move(eos);
  c.origin_ = std::move(origin);
  return c;
}

Result<ChatTemplate> ChatTemplate::from_file(const std::string& path, const Tokenizer& tok) {
  const std::string bos = tok.piece(tok.bos_id()), eos = tok.piece(tok.eos_id());
  if (path.size() >= 5 && path.compare(path.size() - 5, 5, ".json") == 0) {
    auto cfg = parse_json_file(path);
    if (!cfg.ok()) return cfg.status();
    auto source = template_field(cfg.value(), path);
    if (!source.ok()) return source.status();
    if (source.value().empty()) return Status::error(path + ": no \"chat_template\" field");
    return from_jinja(source.value(), token_text(cfg.value(), "bos_token", bos),
                      token_text(cfg.value(), "eos_token", eos), path);
  }
  auto source = read_file(path, kMaxConfigBytes);
  if (!source.ok()) return source.status();
  return from_jinja(source.value(), bos, eos, path);
}

Result<ChatTemplate> ChatTemplate::for_model(const std::string& dir, const Tokenizer& tok) {
  const std::string path = dir + "/tokenizer_config.json";
  struct stat st {};
  if (dir.empty() || stat(path.c_str(), &st) != 0) return ChatTemplate();
  auto cfg = parse_json_file(path);
  if (!cfg.ok()) return cfg.status();
  auto source = template_field(cfg.value(), path);
  if (!source.ok()) return source.status();
  if (source.value().empty()) return ChatTemplate();
  return from_jinja(source.value(), token_text(cfg.value(), "bos_token", tok.piece(tok.bos_id())),
                    token_text(cfg.value(), "eos_token", tok.piece(tok.eos_id())), path);
}

Result<std::string> ChatTemplate::render(const std::vector<std::string>& roles,
                                         const std::vector<std::string>& contents,
                                         bool add_generation_prompt,
                                         const jinja::Dict& variables) const {
  if (!jinja_) return Status::error("the compiled-in template renders ids, not text");
  if (roles.empty()) return Status::error("'messages' must not be empty");
  const std::vector<std::string> r = canonical_roles(roles);
  jinja::List messages;
  for (size_t i = 0; i < r.size() && i < contents.size(); ++i) {
    messages.emplace_back(
        jinja::Dict{{"role", jinja::Value(r[i])}, {"content", jinja::Value(contents[i])}});
  }
  jinja::Value context(jinja::Dict{
      {"messages", jinja::Value(std::move(messages))},
      {"bos_token", jinja::Value(bos_)},
      {"eos_token", jinja::Value(eos_)},
      {"add_generation_prompt", jinja::Value(add_generation_prompt)},
  });
  // The request's variables, over these (as vLLM merges chat_template_kwargs), but the
  // conversation is the messages'.
  for (const auto& [key, value] : variables) {
    if (key != "messages") context.set(key, value);
  }
  return jinja_->render(context);
}

Result<std::vector<int32_t>> ChatTemplate::apply(const Tokenizer& tok,
                                                 const std::vector<std::string>& roles,
                                                 const std::vector<std::string>& contents,
                                                 bool add_generation_prompt,
                                                 const jinja::Dict& variables) const {
  if (!jinja_) return apply_llama2_chat_template(tok, roles, contents);
  auto text = render(roles, contents, add_generation_prompt, variables);
  if (!text.ok()) return text.status();
  const std::string& s = text.value();
  std::vector<int32_t> ids;
  auto encode = [&](size_t from, size_t to) -> Status {
    if (to <= from) return {};
    auto e = tok.encode(std::string_view(s).substr(from, to - from), false, false);
    if (!e.ok()) return Status::error("a message is not valid UTF-8: " + e.message());
    ids.insert(ids.end(), e.value().begin(), e.value().end());
    return {};
  };
  size_t pos = 0;
  while (pos < s.size()) {
    const size_t b = bos_.empty() ? std::string::npos : s.find(bos_, pos);
    const size_t e = eos_.empty() ? std::string::npos : s.find(eos_, pos);
    const size_t hit = std::min(b, e);
    if (hit == std::string::npos) break;
    BURST_RETURN_IF_ERROR(encode(pos, hit));
    ids.push_back(hit == b ? tok.bos_id() : tok.eos_id());
    pos = hit + (hit == b ? bos_.size() : eos_.size());
  }
  BURST_RETURN_IF_ERROR(encode(pos, s.size()));
  if (ids.empty()) return Status::error(origin_ + " rendered an empty prompt");
  return ids;
}

void set_chat_template(std::shared_ptr<const ChatTemplate> t) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_template = std::move(t);
}

const ChatTemplate& chat_template() {
  static const ChatTemplate kLlama2;
  std::lock_guard<std::mutex> lock(g_mu);
  return g_template ? *g_template : kLlama2;
}

Result<std::vector<int32_t>> apply_chat_template(const Tokenizer& tok,
                                                 const std::vector<std::string>& roles,
                                                 const std::vector<std::string>& contents,
                                                 bool add_generation_prompt,
                                                 const jinja::Dict& variables) {
  return chat_template().apply(tok, roles, contents, add_generation_prompt, variables);
}

}  // namespace burst::server
