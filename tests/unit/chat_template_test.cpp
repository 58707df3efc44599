// Chat templates (server/common/chat_template.h) and the Jinja subset that renders them
// (server/common/jinja.h). References nobody here wrote: jinja2 rendered every template of
// tests/fixtures/chat_templates/ over a few conversations as transformers renders chat templates
// (scripts/make_chat_template_cases.py wrote expected.json); the published LLaMA-2 template,
// rendered and tokenized, gives the ids of the compiled-in one. Beside them, texts derived by
// hand from what each template says, the developer role, tokenizer_config.json in its forms,
// and templates that must fail with a message instead of crashing or hanging.
#include "common/chat_template.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/jinja.h"
#include "common/tokenizer.h"

namespace burst::server {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kRoot = BURST_SOURCE_DIR;
const std::string kFixtures = kRoot + "/tests/fixtures/chat_templates/";

std::string read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

const Tokenizer& tok() {
  static std::unique_ptr<Tokenizer> t = [] {
    auto r = Tokenizer::load(kRoot + "/models/kjv-tiny/tokenizer.model");
    EXPECT_TRUE(r.ok()) << r.message();
    return r.ok() ? r.take() : nullptr;
  }();
  return *t;
}

ChatTemplate load(const std::string& name) {
  auto t = ChatTemplate::from_jinja(read(kFixtures + name), "<s>", "</s>", name);
  EXPECT_TRUE(t.ok()) << t.message();
  return t.ok() ? t.take() : ChatTemplate();
}

std::string render(const ChatTemplate& t, const std::vector<std::string>& roles,
                   const std::vector<std::string>& contents, bool gen = true) {
  auto r = t.render(roles, contents, gen);
  EXPECT_TRUE(r.ok()) << r.message();
  return r.ok() ? r.value() : "";
}

std::string jinja_error(const std::string& source, const jinja::Value& ctx = jinja::Dict{}) {
  auto t = jinja::Template::parse(source);
  if (!t.ok()) return t.message();
  auto r = t.value().render(ctx);
  return r.ok() ? "rendered: " + r.value() : r.message();
}

TEST(ChatTemplate, EveryTemplateRendersAsJinja2Does) {
  const json fx = json::parse(read(kFixtures + "expected.json"));
  int checked = 0;
  for (const auto& c : fx["cases"]) {
    const std::string name = c["template"], conv = c["conversation"];
    auto t = ChatTemplate::from_jinja(read(kFixtures + name), "<s>", "</s>", name);
    ASSERT_TRUE(t.ok()) << t.message();
    std::vector<std::string> roles, contents;
    for (const auto& m : fx["conversations"][conv]) {
      roles.push_back(m["role"]);
      contents.push_back(m["content"]);
    }
    auto r = t.value().render(roles, contents, c["add_generation_prompt"].get<bool>());
    const std::string where = name + " / " + conv;
    if (c.contains("error")) {
      ASSERT_FALSE(r.ok()) << where << " rendered " << r.value();
      EXPECT_EQ(r.message(), c["error"].get<std::string>()) << where;
    } else {
      ASSERT_TRUE(r.ok()) << where << ": " << r.message();
      EXPECT_EQ(r.value(), c["text"].get<std::string>()) << where;
    }
    ++checked;
  }
  EXPECT_EQ(checked, 5 * 5 * 2) << "five templates, five conversations, with and without the "
                                   "generation prompt";
}

// What each published template means, written out by hand.
TEST(ChatTemplate, PublishedTemplatesByHand) {
  const ChatTemplate chatml = load("chatml.jinja");
  EXPECT_EQ(render(chatml, {"system", "user"}, {"S", "U"}),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(render(chatml, {"user"}, {"U"}, false), "<|im_start|>user\nU<|im_end|>\n");
  const ChatTemplate zephyr = load("zephyr.jinja");
  EXPECT_EQ(render(zephyr, {"system", "user", "assistant", "user"}, {"S", "A", "B", "C"}),
            "<|system|>\nS</s>\n<|user|>\nA</s>\n<|assistant|>\nB</s>\n<|user|>\nC</s>\n"
            "<|assistant|>\n");
  const ChatTemplate mistral = load("mistral.jinja");
  EXPECT_EQ(render(mistral, {"user", "assistant", "user"}, {"A", "B", "C"}),
            "<s>[INST] A [/INST]B</s> [INST] C [/INST]");
  const ChatTemplate llama2 = load("llama2.jinja");
  // strip() runs over the system block and the first user message together: the message's
  // leading space stays inside, its trailing one goes; the answer is stripped alone.
  EXPECT_EQ(render(llama2, {"system", "user", "assistant", "user"}, {"S", " A ", " B ", "C"}),
            "<s>[INST] <<SYS>>\nS\n<</SYS>>\n\n A [/INST] B </s><s>[INST] C [/INST]");
  // Roles out of turn: the template's own raise_exception, word for word.
  auto bad = mistral.render({"user", "user"}, {"a", "b"}, true);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.message(), "Conversation roles must alternate user/assistant/user/assistant/...");
}

TEST(ChatTemplate, DeveloperIsSystem) {
  EXPECT_EQ(render(load("chatml.jinja"), {"developer", "user"}, {"D", "U"}, false),
            "<|im_start|>system\nD<|im_end|>\n<|im_start|>user\nU<|im_end|>\n");
  const ChatTemplate compiled;
  auto a = compiled.apply(tok(), {"developer", "user"}, {"Be brief.", "Who?"});
  auto b = compiled.apply(tok(), {"system", "user"}, {"Be brief.", "Who?"});
  ASSERT_TRUE(a.ok()) << a.message();
  ASSERT_TRUE(b.ok()) << b.message();
  EXPECT_EQ(a.value(), b.value());
}

// Two implementations of LLaMA-2's chat format, the compiled-in one and the published Jinja
// template rendered and cut at its special tokens, give the same ids.
TEST(ChatTemplate, PublishedLlama2TemplateGivesTheCompiledInIds) {
  const ChatTemplate jinja = load("llama2.jinja");
  const ChatTemplate compiled;
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> convs = {
      {{"user"}, {"And God said"}},
      {{"system", "user"}, {"Answer briefly.", "Who begat Enos?"}},
      {{"system", "user", "assistant", "user"},
       {"Be kind.", "In the beginning", " God created the heaven ", "and the earth?"}},
  };
  for (const auto& [roles, contents] : convs) {
    auto a = jinja.apply(tok(), roles, contents);
    auto b = compiled.apply(tok(), roles, contents);
    ASSERT_TRUE(a.ok()) << a.message();
    ASSERT_TRUE(b.ok()) << b.message();
    EXPECT_EQ(a.value(), b.value()) << contents.back();
    EXPECT_EQ(a.value().front(), tok().bos_id());
  }
  // The turn that ends with the assistant's answer ends with EOS, then BOS starts the next.
  auto ids = jinja.apply(tok(), convs[2].first, convs[2].second);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(std::count(ids.value().begin(), ids.value().end(), tok().eos_id()), 1);
  EXPECT_EQ(std::count(ids.value().begin(), ids.value().end(), tok().bos_id()), 2);
}

TEST(ChatTemplate, ModelTokenizerConfigInItsForms) {
  const fs::path dir =
      fs::temp_directory_path() / ("chat-template-test-" + std::to_string(getpid()));
  fs::create_directories(dir);
  const std::string cfg = (dir / "tokenizer_config.json").string();
  // Absent: the compiled-in template.
  auto none = ChatTemplate::for_model(dir.string(), tok());
  ASSERT_TRUE(none.ok()) << none.message();
  EXPECT_FALSE(none.value().is_jinja());
  // A string, with bos_token as an object.
  std::ofstream(cfg) << json{{"bos_token", {{"content", "<s>"}, {"lstrip", false}}},
                             {"eos_token", "</s>"},
                             {"chat_template", read(kFixtures + "chatml.jinja")}}
                            .dump();
  auto t = ChatTemplate::for_model(dir.string(), tok());
  ASSERT_TRUE(t.ok()) << t.message();
  EXPECT_TRUE(t.value().is_jinja());
  EXPECT_EQ(t.value().origin(), cfg);
  EXPECT_EQ(render(t.value(), {"user"}, {"U"}, false), "<|im_start|>user\nU<|im_end|>\n");
  // A list of named templates: "default".
  std::ofstream(cfg, std::ios::trunc)
      << json{{"chat_template",
               json::array({{{"name", "tool_use"}, {"template", "TOOLS"}},
                            {{"name", "default"}, {"template", "{{ bos_token }}D"}}})}}
             .dump();
  t = ChatTemplate::for_model(dir.string(), tok());
  ASSERT_TRUE(t.ok()) << t.message();
  EXPECT_EQ(render(t.value(), {"user"}, {"U"}), "<s>D");  // bos from the tokenizer's piece
  // No chat_template field: the compiled-in one.
  std::ofstream(cfg, std::ios::trunc) << R"({"bos_token": "<s>"})";
  t = ChatTemplate::for_model(dir.string(), tok());
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE(t.value().is_jinja());
  // A template that does not parse is an error naming the file and the line.
  std::ofstream(cfg, std::ios::trunc) << R"({"chat_template": "ok\n{% for m in messages %}"})";
  t = ChatTemplate::for_model(dir.string(), tok());
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.message().find(cfg), std::string::npos) << t.message();
  EXPECT_NE(t.message().find("line 2"), std::string::npos) << t.message();
  EXPECT_NE(t.message().find("endfor"), std::string::npos) << t.message();
  // --chat-template FILE: a template's text, or a .json file with the field.
  auto f = ChatTemplate::from_file(kFixtures + "zephyr.jinja", tok());
  ASSERT_TRUE(f.ok()) << f.message();
  EXPECT_EQ(render(f.value(), {"user"}, {"U"}), "<|user|>\nU</s>\n<|assistant|>\n");
  auto missing = ChatTemplate::from_file((dir / "absent.jinja").string(), tok());
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.message().find("absent.jinja"), std::string::npos);
  fs::remove_all(dir);
}

TEST(ChatTemplate, SpecialTokenTextBecomesTheirIds) {
  auto t = ChatTemplate::from_jinja("{{ bos_token }}A{{ eos_token }}{{ bos_token }}B", "<s>",
                                    "</s>", "inline");
  ASSERT_TRUE(t.ok());
  auto ids = t.value().apply(tok(), {"user"}, {"x"});
  ASSERT_TRUE(ids.ok()) << ids.message();
  auto a = tok().encode("A", false, false);
  auto b = tok().encode("B", false, false);
  std::vector<int32_t> want = {tok().bos_id()};
  want.insert(want.end(), a.value().begin(), a.value().end());
  want.push_back(tok().eos_id());
  want.push_back(tok().bos_id());
  want.insert(want.end(), b.value().begin(), b.value().end());
  EXPECT_EQ(ids.value(), want);
  // A template that renders nothing is refused, not an empty prompt.
  auto empty = ChatTemplate::from_jinja("{% if false %}x{% endif %}", "<s>", "</s>", "inline");
  ASSERT_TRUE(empty.ok());
  auto e = empty.value().apply(tok(), {"user"}, {"x"});
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.message().find("empty prompt"), std::string::npos);
}

TEST(Jinja, ErrorsNameTheProblemAndTheLine) {
  EXPECT_EQ(jinja_error("{{ raise_exception('no tools here') }}"), "no tools here");
  EXPECT_EQ(jinja_error("a\n{{ x | frobnicate }}"),
            "chat template, line 2: unknown filter 'frobnicate'");
  EXPECT_EQ(jinja_error("{% macro m() %}{% endmacro %}"),
            "chat template, line 1: the statement '{% macro %}' is not supported (for, if, set)");
  EXPECT_EQ(jinja_error("{{ 'a' + 1 }}"),
            "chat template, line 1: '+' between a string and an integer is not defined");
  EXPECT_EQ(jinja_error("{{ x"), "chat template, line 1: a tag is not closed with }}");
  EXPECT_EQ(jinja_error("{{ messages[0].role }}"),
            "chat template, line 1: 'messages' is undefined");
  EXPECT_EQ(jinja_error("{{ 1 // 0 }}"), "chat template, line 1: division by zero");
  EXPECT_EQ(jinja_error("{% set x.y = 1 %}"),
            "chat template, line 1: 'x' is not a namespace(): cannot set .y");
  EXPECT_EQ(jinja_error("{{ f() }}"), "chat template, line 1: unknown function 'f'");
}

TEST(Jinja, HostileTemplatesAreBounded) {
  // A loop that would print for minutes, a string that would fill memory, nesting that would
  // overflow the stack: each an error.
  EXPECT_NE(jinja_error("{% for i in range(60000) %}{% for j in range(60000) %}x{% endfor %}"
                        "{% endfor %}")
                .find("too many steps"),
            std::string::npos);
  EXPECT_NE(jinja_error("{{ range(100000000) }}").find("range() too long"), std::string::npos);
  EXPECT_NE(jinja_error("{{ 'x' * 1000000000 }}").find("too long"), std::string::npos);
  std::string ifs;
  for (int i = 0; i < 1000; ++i) ifs += "{% if true %}";
  EXPECT_NE(jinja_error(ifs).find("nests too deeply"), std::string::npos);
  EXPECT_NE(jinja_error("{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}")
                .find("nests too deeply"),
            std::string::npos);
  EXPECT_NE(jinja_error("{{ 9223372036854775807 + 1 }}").find("overflow"), std::string::npos);
}

TEST(Jinja, WhitespaceControlAndBlocksAsTransformersRendersThem) {
  auto render_text = [](const std::string& src) {
    auto t = jinja::Template::parse(src);
    EXPECT_TRUE(t.ok()) << t.message();
    auto r = t.value().render(jinja::Dict{{"xs", jinja::Value(jinja::List{1, 2, 3})}});
    EXPECT_TRUE(r.ok()) << r.message();
    return r.ok() ? r.value() : "";
  };
  // trim_blocks: the newline after a block tag goes; lstrip_blocks: the indentation before it.
  EXPECT_EQ(render_text("{% for x in xs %}\n  {{ x }}\n{% endfor %}\n"), "  1\n  2\n  3\n");
  EXPECT_EQ(render_text("a  {%- if true -%}  b  {%- endif -%}  c"), "abc");
  EXPECT_EQ(render_text("{{- ' x ' -}}"), " x ");
  EXPECT_EQ(render_text("{# c #}\nz"), "z");
  EXPECT_EQ(render_text("{% set s %}in{{ 1 }}{% endset %}[{{ s }}]"), "[in1]");
  EXPECT_EQ(render_text("{% for x in xs %}{% if loop.index0 is even %}{{ x }}{% endif %}"
                        "{% endfor %}"),
            "13");
  EXPECT_EQ(render_text("{{ xs[1:] }} {{ xs[-1] }} {{ 3 in xs }} {{ 4 not in xs }}"),
            "[2, 3] 3 True True");
  EXPECT_EQ(render_text("{% for x in [] %}a{% else %}empty{% endfor %}"), "empty");
}

}  // namespace
}  // namespace burst::server
