// Chat templates (server/common/chat_template.h) and the Jinja subset that renders them
// (server/common/jinja.h). References nobody here wrote: jinja2 rendered every template of
// tests/fixtures/chat_templates/ over a few conversations as transformers renders chat templates
// (scripts/make_chat_template_cases.py wrote expected.json); the published LLaMA-2 template,
// rendered and tokenized, gives the ids of the compiled-in one. Beside them, texts derived by
// hand from what each template says, the developer role, tokenizer_config.json in its forms,
// and templates that must fail with a message instead of crashing or hanging.
#include "common/chat_template.h"

#include <gtest/gtest.h>

#include <ctime>
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
  EXPECT_EQ(jinja_error("{% call m() %}{% endcall %}"),
            "chat template, line 1: the statement '{% call %}' is not supported (for, if, set, "
            "macro, break, continue)");
  EXPECT_EQ(jinja_error("{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}"),
            "chat template, line 1: macro 'm' takes 1 argument, got 2");
  EXPECT_EQ(jinja_error("{% macro m(a) %}{% endmacro %}{{ m(b=1) }}"),
            "chat template, line 1: macro 'm' has no argument 'b'");
  EXPECT_EQ(jinja_error("{% macro m(a) %}{% endmacro %}{{ m(1, a=2) }}"),
            "chat template, line 1: macro 'm' got argument 'a' twice");
  EXPECT_EQ(jinja_error("{% if true %}{% break %}{% endif %}"),
            "chat template, line 1: '{% break %}' outside a loop");
  EXPECT_EQ(jinja_error("{% for x in [1] %}{% macro m() %}{% continue %}{% endmacro %}"
                        "{% endfor %}"),
            "chat template, line 1: '{% continue %}' outside a loop");
  EXPECT_NE(jinja_error("{{ [1, 'a'] | sort }}").find("cannot order an integer and a string"),
            std::string::npos)
      << jinja_error("{{ [1, 'a'] | sort }}");
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
  // A macro that calls itself for ever; one that doubles its text each level.
  EXPECT_EQ(jinja_error("{% macro m() %}{{ m() }}{% endmacro %}{{ m() }}"),
            "chat template, line 1: macros call each other more than 64 deep");
  EXPECT_NE(jinja_error("{% macro m(n) %}{% if n %}{{ m(n - 1) }}{{ m(n - 1) }}{% else %}x"
                        "{% endif %}{% endmacro %}{{ m(40) }}")
                .find("too many steps"),
            std::string::npos);
  // unique compares every pair: bounded like a nested loop.
  EXPECT_NE(jinja_error("{{ range(60000) | unique | length }}").find("too many steps"),
            std::string::npos);
}

// Macros, loop.cycle, break / continue and the filters chat templates with tools use (Llama 3.1's
// tojson(indent=4), gpt-oss's and Qwen3-Coder's macros and |items). Every expected text is what
// jinja2 3.1 renders with transformers' environment (trim_blocks, lstrip_blocks, loopcontrols,
// its tojson) over the same variables.
TEST(Jinja, MacrosLoopControlsAndFiltersAsJinja2RendersThem) {
  const jinja::Value msgs(jinja::List{
      jinja::Dict{{"role", "system"}, {"content", "S"}},
      jinja::Dict{{"role", "user"}, {"content", "Hi"}},
      jinja::Dict{{"role", "assistant"}, {"content", "Hello"}},
      jinja::Dict{{"role", "user"}, {"content", "Bye"}}});
  const jinja::Value tool(jinja::Dict{
      {"name", "get_weather"},
      {"parameters",
       jinja::Dict{{"type", "object"},
                   {"properties", jinja::Dict{{"city", jinja::Dict{{"type", "string"}}}}},
                   {"required", jinja::List{"city"}}}}});
  const jinja::Value ctx(jinja::Dict{
      {"xs", jinja::List{1, 2, 3}},
      {"d", jinja::Dict{{"b", 2}, {"A", 1}, {"c", 3}}},
      {"tools", jinja::List{tool}},
      {"messages", msgs},
      {"names", jinja::List{"b", "B", "a", "c", "a"}}});
  auto render_text = [&](const std::string& src) {
    auto t = jinja::Template::parse(src);
    EXPECT_TRUE(t.ok()) << t.message();
    if (!t.ok()) return std::string();
    auto r = t.value().render(ctx);
    EXPECT_TRUE(r.ok()) << r.message();
    return r.ok() ? r.value() : "";
  };
  EXPECT_EQ(render_text("{% macro greet(name, punct='!') %}Hello {{ name }}{{ punct }}"
                        "{% endmacro %}{{ greet('Ann') }} {{ greet('Bob', '?') }} "
                        "{{ greet(punct='.', name='Cy') }}"),
            "Hello Ann! Hello Bob? Hello Cy.");
  EXPECT_EQ(render_text("{% macro row(x, sep=', ', last=false) -%}\n"
                        "{{ x }}{% if not last %}{{ sep }}{% endif %}\n"
                        "{%- endmacro %}\n"
                        "{% for x in xs %}{{ row(x, last=loop.last) }}{% endfor %}"),
            "1, 2, 3");
  // A macro reads the template's top-level variables.
  EXPECT_EQ(render_text("{%- set prefix = 'P:' -%}\n"
                        "{%- macro tag(m) -%}{{ prefix }}{{ m.role | upper }}={{ m.content }}"
                        "{%- endmacro -%}\n"
                        "{%- for m in messages %}{{ tag(m) }};{% endfor %}"),
            "P:SYSTEM=S;P:USER=Hi;P:ASSISTANT=Hello;P:USER=Bye;");
  EXPECT_EQ(render_text("{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n }}*{{ fact(n - 1) }}"
                        "{% endif %}{% endmacro %}{{ fact(4) }}"),
            "4*3*2*1");
  EXPECT_EQ(render_text("{% for m in messages %}{{ loop.cycle('odd', 'even') }}:{{ m.role }} "
                        "{% endfor %}"),
            "odd:system even:user odd:assistant even:user ");
  EXPECT_EQ(render_text("{% for x in [1, 2, 3, 4, 5] %}{% if x == 2 %}{% continue %}{% endif %}"
                        "{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}"),
            "13");
  EXPECT_EQ(render_text("{{ tools[0] | tojson(indent=4) }}"),
            "{\n    \"name\": \"get_weather\",\n    \"parameters\": {\n        \"type\": "
            "\"object\",\n        \"properties\": {\n            \"city\": {\n"
            "                \"type\": \"string\"\n            }\n        },\n"
            "        \"required\": [\n            \"city\"\n        ]\n    }\n}");
  EXPECT_EQ(render_text("{{ {'a': [], 'b': {}, 'c': [1, 'x', none, true, 1.5]} | "
                        "tojson(indent=2) }}"),
            "{\n  \"a\": [],\n  \"b\": {},\n  \"c\": [\n    1,\n    \"x\",\n    null,\n"
            "    true,\n    1.5\n  ]\n}");
  EXPECT_EQ(render_text("{% for k, v in d | items %}{{ k }}={{ v }} {% endfor %}|"
                        "{% for k, v in d | dictsort %}{{ k }}={{ v }} {% endfor %}|"
                        "{% for k, v in d | dictsort(by='value', reverse=true) %}{{ k }} "
                        "{% endfor %}"),
            "b=2 A=1 c=3 |A=1 b=2 c=3 |c b A ");
  EXPECT_EQ(render_text("{{ names | unique | list }} {{ names | sort }} "
                        "{{ names | sort(case_sensitive=true, reverse=true) }} "
                        "{{ messages | sort(attribute='content') | map(attribute='content') | "
                        "join(',') }}"),
            "['b', 'a', 'c'] ['a', 'a', 'b', 'B', 'c'] ['c', 'b', 'a', 'a', 'B'] Bye,Hello,Hi,S");
  EXPECT_EQ(render_text("{{ xs | map('string') | join('-') }} {{ names | map('upper') | list }} "
                        "{{ [' a ', 'b '] | map('trim') | list }} {{ xs | map('tojson') | join }}"),
            "1-2-3 ['B', 'B', 'A', 'C', 'A'] ['a', 'b'] 123");
  EXPECT_EQ(render_text("{{ -3 | abs }} {{ (-2.5) | abs }} {{ ', '.join(names) }} "
                        "[{{ \"a\\nb\\n\\nc\" | indent(2) }}] "
                        "[{{ \"a\\nb\" | indent(first=true) }}] "
                        "[{{ \"a\\n\\nb\" | indent(width='> ', blank=true) }}]"),
            "3 2.5 b, B, a, c, a [a\n  b\n\n  c] [    a\n    b] [a\n> \n> b]");
  EXPECT_EQ(render_text("{{ messages | map(attribute='name', default='anon') | list }}"),
            "['anon', 'anon', 'anon', 'anon']");
  // transformers' strftime_now: the local date in the format given.
  char year[8];
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  std::strftime(year, sizeof(year), "%Y", &tm);
  EXPECT_EQ(render_text("{{ strftime_now('%Y') }}"), year);
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
