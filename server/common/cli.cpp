#include "common/cli.h"

#include <sstream>
#include <vector>

namespace burst::server {
namespace {

constexpr size_t kColumns = 100;
constexpr size_t kFlagColumn = 34;

// Words of `text` wrapped to `width` columns; a '\n' in the text starts a new line.
std::string wrap(const std::string& text, size_t width) {
  std::string out, line;
  std::istringstream paragraphs(text);
  std::string paragraph;
  bool first_paragraph = true;
  while (std::getline(paragraphs, paragraph)) {
    if (!first_paragraph) out += '\n';
    first_paragraph = false;
    std::istringstream words(paragraph);
    std::string word;
    line.clear();
    while (words >> word) {
      if (!line.empty() && line.size() + 1 + word.size() > width) {
        out += line + '\n';
        line.clear();
      }
      line += (line.empty() ? "" : " ") + word;
    }
    out += line;
  }
  return out;
}

// The synopsis in place of CLI11's "Usage: NAME [OPTIONS]", descriptions wrapped.
class Formatter : public CLI::Formatter {
 public:
  explicit Formatter(std::string synopsis) : synopsis_(std::move(synopsis)) {
    column_width(kFlagColumn);
  }
  std::string make_usage(const CLI::App*, std::string) const override {
    return synopsis_ + (synopsis_.empty() || synopsis_.back() == '\n' ? "" : "\n");
  }
  std::string make_option_desc(const CLI::Option* opt) const override {
    return wrap(opt->get_description(), kColumns - kFlagColumn);
  }

 private:
  std::string synopsis_;
};

// "NAME: ..." -> "NAME" (CLI11 starts its messages about an option with the option's name).
std::string option_name(const std::string& what) {
  const size_t colon = what.find(':');
  return colon == std::string::npos ? what : what.substr(0, colon);
}

// A string option read through `parse` (an engine::parse_* function): a value it refuses is a
// usage error with its message, a value it takes is stored in `target`.
template <typename T, typename Parse>
CLI::Option* add_parsed_option(CLI::App& app, const std::string& flag, T& target, Parse parse,
                               const std::string& help) {
  return app
      .add_option_function<std::string>(
          flag, [&target, parse](const std::string& v) { target = parse(v).value(); }, help)
      ->type_name("D")
      ->check([parse](const std::string& v) -> std::string {
        auto d = parse(v);
        return d.ok() ? "" : d.message();
      });
}

}  // namespace

std::unique_ptr<CLI::App> make_cli(const std::string& program, const std::string& synopsis) {
  auto app = std::make_unique<CLI::App>("", program);
  app->formatter(std::make_shared<Formatter>(synopsis));
  app->option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // Unknown arguments are collected and reported in our words, not CLI11's.
  app->allow_extras();
  return app;
}

std::string parse_cli(CLI::App& app, int argc, char** argv, bool* help) {
  *help = false;
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    *help = true;
    return "";
  } catch (const CLI::ArgumentMismatch& e) {
    // "--x: 1 required TEXT missing": the flag came last, or before another flag.
    return "missing value for " + option_name(e.what());
  } catch (const CLI::ConversionError& e) {
    // "Could not convert: --x = v".
    const std::string what = e.what();
    const std::string prefix = "Could not convert: ";
    const size_t eq = what.find(" = ");
    if (what.rfind(prefix, 0) == 0 && eq != std::string::npos) {
      return "bad value '" + what.substr(eq + 3) + "' for " +
             what.substr(prefix.size(), eq - prefix.size());
    }
    return what;
  } catch (const CLI::ParseError& e) {
    return e.what();
  }
  const std::vector<std::string> extra = app.remaining();
  if (!extra.empty()) {
    const std::string& first = extra.front();
    if (first.size() > 1 && first[0] == '-') {
      return "unknown flag " + first.substr(0, first.find('='));
    }
    return "unexpected argument " + first;
  }
  return "";
}

CLI::Option* add_attention_dtype_option(CLI::App& app, engine::AttentionDtype& target,
                                        const std::string& help) {
  return add_parsed_option(app, "--attention-dtype", target, engine::parse_attention_dtype, help);
}

CLI::Option* add_kv_cache_dtype_option(CLI::App& app, engine::KvCacheDtype& target,
                                       const std::string& help) {
  return add_parsed_option(app, "--kv-cache-dtype", target, engine::parse_kv_cache_dtype, help);
}

}  // namespace burst::server
