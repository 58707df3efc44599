// The request options' table and its one validation (frontend/request_options.h). A new
// option is one row of kOptions; its messages come from its type and limits.
#include "frontend/request_options.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <random>

namespace burst::server {

RawValue RawValue::boolean(bool v) {
  RawValue r;
  r.kind = Kind::kBool;
  r.b = v;
  return r;
}

RawValue RawValue::integer(int64_t v) {
  RawValue r;
  r.kind = Kind::kInt;
  r.i = v;
  return r;
}

RawValue RawValue::unsigned_integer(uint64_t v) {
  RawValue r = integer(static_cast<int64_t>(v));
  r.wide = v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max());
  return r;
}

RawValue RawValue::number(double v) {
  RawValue r;
  r.kind = Kind::kNumber;
  r.d = v;
  return r;
}

RawValue RawValue::string(std::string v) {
  RawValue r;
  r.kind = Kind::kString;
  r.s = std::move(v);
  return r;
}

RawValue RawValue::array(std::vector<RawValue> v) {
  RawValue r;
  r.kind = Kind::kArray;
  r.items = std::move(v);
  return r;
}

RawValue RawValue::object(std::vector<std::pair<std::string, RawValue>> v) {
  RawValue r;
  r.kind = Kind::kObject;
  r.fields = std::move(v);
  return r;
}

namespace {

// Counts (min_tokens, top_k) are ints downstream; larger asks mean "no limit" and are refused
// or bounded by the scheduler's own limits. max_tokens is kept as asked (its refusal names it).
int clamp_count(int64_t v) { return static_cast<int>(std::min<int64_t>(v, int64_t{1} << 30)); }

std::string store_max_tokens(const OptionValue& v, ParsedOptions& o) {
  o.request.max_tokens = v.integer;
  o.max_tokens_given = true;
  return "";
}

std::string min_exceeds_max(int64_t min, int64_t max) {
  return "'min_tokens' (" + std::to_string(min) + ") must not exceed max_tokens (" +
         std::to_string(max) + ")";
}

std::string store_min_tokens(const OptionValue& v, ParsedOptions& o) {
  // Against a given max_tokens now; against the default once the API set it
  // (check_min_tokens).
  if (o.max_tokens_given && v.integer > o.request.max_tokens) {
    return min_exceeds_max(v.integer, o.request.max_tokens);
  }
  o.min_tokens = v.integer;
  o.request.adjust.min_tokens = clamp_count(v.integer);
  return "";
}

std::string store_top_logprobs(const OptionValue& v, ParsedOptions& o) {
  if (o.request.logprobs < 0) return "'top_logprobs' needs 'logprobs': true";
  o.request.logprobs = static_cast<int>(v.integer);
  return "";
}

using T = OptionType;
using L = OptionLimits;
constexpr double kInf = OptionLimits::kNone;

// The options, in the order they are checked and stored (a later one may look at an earlier
// one's value: max_completion_tokens overrides max_tokens, min_tokens is checked against it,
// top_logprobs needs logprobs).
const std::vector<OptionSpec> kOptions = {
    // Completions take 0 (the prompt alone, its logprobs: echo; http_api.cpp refuses 0
    // without echo); the other endpoints need a token.
    {"max_tokens", kCompletions, T::kInt, L{.lo = 0}, store_max_tokens},
    {"max_tokens", kAllEndpoints & ~kCompletions, T::kInt, L{.lo = 0, .lo_open = true},
     store_max_tokens, kGenerate},
    // OpenAI's newer name; given with max_tokens, it wins (both are checked).
    {"max_completion_tokens", kChat, T::kInt, L{.lo = 0, .lo_open = true}, store_max_tokens},
    {"temperature", kAllEndpoints, T::kNumber, L{.lo = 0},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.sampling.temperature = static_cast<float>(v.number);
       return std::string();
     }},
    {"top_p", kAllEndpoints, T::kNumber, L{.lo = 0, .hi = 1, .lo_open = true},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.sampling.top_p = static_cast<float>(v.number);
       return std::string();
     }},
    // vLLM's min_p: ids less likely than min_p times the most likely one are not drawn.
    {"min_p", kAllEndpoints, T::kNumber, L{.lo = 0, .hi = 1, .note = " (0: off)"},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.sampling.min_p = static_cast<float>(v.number);
       return std::string();
     }},
    {"top_k", kAllEndpoints, T::kInt, L{.lo = -1, .note = " (-1 and 0: off)"},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.sampling.top_k = v.integer < 0 ? 0 : clamp_count(v.integer);
       return std::string();
     }},
    {"seed", kAllEndpoints, T::kInt, L{.uint64_bits = true},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.sampling.seed = static_cast<uint64_t>(v.integer);  // gRPC's uint64 as sent
       o.seed_given = true;
       return std::string();
     }},
    {"presence_penalty", kAllEndpoints, T::kNumber, L{.lo = -2, .hi = 2},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.adjust.presence_penalty = static_cast<float>(v.number);
       return std::string();
     }},
    {"frequency_penalty", kAllEndpoints, T::kNumber, L{.lo = -2, .hi = 2},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.adjust.frequency_penalty = static_cast<float>(v.number);
       return std::string();
     }},
    {"repetition_penalty", kAllEndpoints, T::kNumber, L{.lo = 0, .lo_open = true},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.adjust.repetition_penalty = static_cast<float>(v.number);
       return std::string();
     }},
    {"logit_bias", kAllEndpoints, T::kTokenIdMap, L{.lo = -100, .hi = 100},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.adjust.logit_bias = v.id_values;
       return std::string();
     }},
    {"min_tokens", kAllEndpoints, T::kInt, L{.lo = 0}, store_min_tokens},
    {"ignore_eos", kAllEndpoints, T::kBool, L{},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.ignore_eos = v.flag;
       return std::string();
     }},
    {"stop", kAllEndpoints, T::kStrings, L{.max_count = 4},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.stop = v.strings;
       return std::string();
     }},
    {"stop_token_ids", kAllEndpoints, T::kTokenIds, L{.max_count = kMaxStopTokenIds},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.stop_token_ids = v.ids;
       return std::string();
     }},
    // vLLM's: the stop string (or stop token id's text) that ended the text is kept in it.
    {"include_stop_str_in_output", kAllEndpoints, T::kBool, L{},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.include_stop_str_in_output = v.flag;
       return std::string();
     }},
    // Chat (vLLM's): false leaves the assistant's header off the end of the templated prompt
    // (the model continues the last message instead of answering it).
    {"add_generation_prompt", kChat | kGrpcChat, T::kBool, L{},
     [](const OptionValue& v, ParsedOptions& o) {
       o.add_generation_prompt = v.flag;
       return std::string();
     }},
    // Chat (vLLM's): more variables for the chat template (enable_thinking, ...); the
    // conversation is `messages`' alone.
    {"chat_template_kwargs", kChat | kGrpcChat, T::kObject, L{.max_count = 64},
     [](const OptionValue& v, ParsedOptions& o) {
       for (const auto& [key, value] : v.fields) {
         if (key == "messages") {
           return std::string("'chat_template_kwargs' must not set 'messages'");
         }
       }
       o.chat_template_kwargs = v.fields;
       return std::string();
     }},
    {"return_progress", kAllEndpoints, T::kBool, L{},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.return_progress = v.flag;
       return std::string();
     }},
    // Completions: the number of alternatives (OpenAI's legacy API); chat and gRPC: a switch,
    // with top_logprobs for the alternatives.
    {"logprobs", kCompletions, T::kInt, L{.lo = 0, .hi = 20},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.logprobs = static_cast<int>(v.integer);
       return std::string();
     }},
    {"logprobs", kChat | kGrpcEndpoints, T::kBool, L{},
     [](const OptionValue& v, ParsedOptions& o) {
       o.request.logprobs = v.flag ? 0 : -1;
       return std::string();
     }},
    {"top_logprobs", kChat | kGrpcEndpoints, T::kInt, L{.lo = 0, .hi = 20}, store_top_logprobs},
};

// A bound as the messages print it: "2", "-100", "0.5".
std::string bound_text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// "in [-2, 2]", "in (0, 1]", ">= 0", "> 0", plus the note.
std::string range_text(const OptionLimits& l) {
  std::string s;
  if (l.lo != -kInf && l.hi != kInf) {
    s = std::string("in ") + (l.lo_open ? "(" : "[") + bound_text(l.lo) + ", " +
        bound_text(l.hi) + (l.hi_open ? ")" : "]");
  } else if (l.lo != -kInf) {
    s = (l.lo_open ? "> " : ">= ") + bound_text(l.lo);
  } else if (l.hi != kInf) {
    s = (l.hi_open ? "< " : "<= ") + bound_text(l.hi);
  }
  return s + l.note;
}

bool in_range(double v, const OptionLimits& l) {
  if (!std::isfinite(v)) return false;
  const bool lo_ok = l.lo_open ? v > l.lo : v >= l.lo;
  const bool hi_ok = l.hi_open ? v < l.hi : v <= l.hi;
  return lo_ok && hi_ok;
}

// What a value of the option's type is, for "'name' must be ...".
std::string type_text(const OptionSpec& spec) {
  const std::string up_to =
      spec.limits.max_count > 0 ? "up to " + std::to_string(spec.limits.max_count) + " " : "";
  switch (spec.type) {
    case T::kBool: return "a boolean";
    case T::kInt: return "an integer";
    case T::kNumber: return "a number";
    case T::kStrings: return "a string or an array of " + up_to + "strings";
    case T::kTokenIds: return "an array of " + up_to + "token ids";
    case T::kTokenIdMap: return "an object of " + up_to + "token id -> number";
    case T::kObject: return "an object of " + up_to + "keys";
  }
  return "valid";
}

std::string quoted(const OptionSpec& spec) { return std::string("'") + spec.name + "'"; }

std::string vocab_text(int vocab_size) { return "[0, " + std::to_string(vocab_size) + ")"; }

bool is_number(const RawValue& v) {
  return v.kind == RawValue::Kind::kInt || v.kind == RawValue::Kind::kNumber;
}

double number_of(const RawValue& v) {
  return v.kind == RawValue::Kind::kInt ? static_cast<double>(v.i) : v.d;
}

// A token id given as text (a JSON object's key): digits only, in the vocabulary.
std::optional<int32_t> id_from_text(const std::string& key, int vocab_size) {
  int64_t id = -1;
  const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
  if (ec != std::errc() || end != key.data() + key.size() || id < 0 || id >= vocab_size) {
    return std::nullopt;
  }
  return static_cast<int32_t>(id);
}

// kBool, kInt, kNumber: the type, then the range. "" when valid.
std::string check_scalar(const OptionSpec& spec, const RawValue& raw, OptionValue& out) {
  const std::string bad_type = quoted(spec) + " must be " + type_text(spec);
  const std::string bad_range = quoted(spec) + " must be " + range_text(spec.limits);
  switch (spec.type) {
    case T::kBool:
      if (raw.kind != RawValue::Kind::kBool) return bad_type;
      out.flag = raw.b;
      return "";
    case T::kInt: {
      if (raw.kind != RawValue::Kind::kInt) return bad_type;
      // The value as received, in every refusal: 2^64 - 1 is not "-1", 10^12 not a clamp.
      const std::string got =
          ", got " + (raw.wide ? std::to_string(static_cast<uint64_t>(raw.i))
                               : std::to_string(raw.i));
      if (raw.wide && !spec.limits.uint64_bits) {
        return quoted(spec) + " must be " + range_text(spec.limits) +
               " and below 2^63" + got;
      }
      const double value =
          raw.wide ? static_cast<double>(static_cast<uint64_t>(raw.i)) : static_cast<double>(raw.i);
      if (!in_range(value, spec.limits)) return bad_range + got;
      out.integer = raw.i;
      return "";
    }
    default:
      if (!is_number(raw)) return bad_type;
      out.number = number_of(raw);
      return in_range(out.number, spec.limits) ? "" : bad_range + ", got " + bound_text(out.number);
  }
}

// kStrings, kTokenIds, kTokenIdMap, kObject: the container, its size, then every item.
std::string check_items(const OptionSpec& spec, const RawValue& raw, int vocab_size,
                        OptionValue& out) {
  const std::string bad_type = quoted(spec) + " must be " + type_text(spec);
  const size_t max = spec.limits.max_count;
  if (spec.type == T::kObject) {
    if (raw.kind != RawValue::Kind::kObject || (max > 0 && raw.fields.size() > max)) {
      return bad_type;
    }
    out.fields = raw.fields;
    return "";
  }
  if (spec.type == T::kTokenIdMap) {
    if (raw.kind != RawValue::Kind::kObject || (max > 0 && raw.fields.size() > max)) {
      return bad_type;
    }
    for (const auto& [key, v] : raw.fields) {
      const std::optional<int32_t> id = id_from_text(key, vocab_size);
      if (!id) {
        return quoted(spec) + " key '" + key + "' is not a token id in " + vocab_text(vocab_size);
      }
      if (!is_number(v) || !in_range(number_of(v), spec.limits)) {
        return quoted(spec) + " values must be numbers " + range_text(spec.limits);
      }
      out.id_values.emplace_back(*id, static_cast<float>(number_of(v)));
    }
    std::sort(out.id_values.begin(), out.id_values.end());  // one order whatever the source's
    return "";
  }
  // A lone string is a list of one (OpenAI's "stop": "x").
  const bool lone = spec.type == T::kStrings && raw.kind == RawValue::Kind::kString;
  const std::vector<RawValue> one = lone ? std::vector<RawValue>{raw} : std::vector<RawValue>{};
  const std::vector<RawValue>& items = lone ? one : raw.items;
  if ((!lone && raw.kind != RawValue::Kind::kArray) || (max > 0 && items.size() > max)) {
    return bad_type;
  }
  for (const RawValue& item : items) {
    if (spec.type == T::kStrings) {
      if (item.kind != RawValue::Kind::kString) return bad_type;
      if (item.s.empty()) return quoted(spec) + " must not hold an empty string";
      out.strings.push_back(item.s);
    } else {
      if (item.kind != RawValue::Kind::kInt) return bad_type;
      if (item.i < 0 || item.i >= vocab_size) {
        return quoted(spec) + " must hold token ids in " + vocab_text(vocab_size) + ": " +
               std::to_string(item.i) + " is not one";
      }
      out.ids.push_back(static_cast<int32_t>(item.i));
    }
  }
  return "";
}

}  // namespace

const std::vector<OptionSpec>& option_table() { return kOptions; }

std::optional<OptionError> check_min_tokens(const ParsedOptions& o) {
  if (o.min_tokens <= o.request.max_tokens) return std::nullopt;
  return OptionError{"min_tokens", min_exceeds_max(o.min_tokens, o.request.max_tokens)};
}

std::optional<OptionError> parse_options(const RawOptions& raw, Endpoint endpoint,
                                         int vocab_size, ParsedOptions& out) {
  // Both APIs' defaults where ScheduledRequest's are the engine's (greedy, seed 0).
  out.request.sampling.temperature = 1.f;
  out.request.sampling.seed = std::random_device{}();
  for (const OptionSpec& spec : kOptions) {
    if ((spec.endpoints & endpoint) == 0) continue;
    const auto it = raw.find(spec.name);
    if (it == raw.end()) {
      if (spec.required_in & endpoint) {
        return OptionError{spec.name, quoted(spec) + " is required: " + type_text(spec) + " " +
                                          range_text(spec.limits)};
      }
      continue;
    }
    OptionValue v;
    const bool scalar = spec.type == T::kBool || spec.type == T::kInt || spec.type == T::kNumber;
    std::string why = scalar ? check_scalar(spec, it->second, v)
                             : check_items(spec, it->second, vocab_size, v);
    if (why.empty()) why = spec.store(v, out);
    if (!why.empty()) return OptionError{spec.name, std::move(why)};
  }
  return std::nullopt;
}

namespace {

// A request's JSON value as a chat template variable.
jinja::Value template_value(const RawValue& v) {
  switch (v.kind) {
    case RawValue::Kind::kNull: return jinja::Value::none();
    case RawValue::Kind::kBool: return jinja::Value(v.b);
    case RawValue::Kind::kInt:
      return v.wide ? jinja::Value(static_cast<double>(static_cast<uint64_t>(v.i)))
                    : jinja::Value(v.i);
    case RawValue::Kind::kNumber: return jinja::Value(v.d);
    case RawValue::Kind::kString: return jinja::Value(v.s);
    case RawValue::Kind::kArray: {
      jinja::List items;
      for (const RawValue& x : v.items) items.push_back(template_value(x));
      return jinja::Value(std::move(items));
    }
    case RawValue::Kind::kObject: {
      jinja::Dict fields;
      for (const auto& [key, x] : v.fields) fields.emplace_back(key, template_value(x));
      return jinja::Value(std::move(fields));
    }
  }
  return jinja::Value::none();
}

}  // namespace

jinja::Dict chat_template_variables(const ParsedOptions& o) {
  jinja::Dict variables;
  for (const auto& [key, value] : o.chat_template_kwargs) {
    variables.emplace_back(key, template_value(value));
  }
  return variables;
}

}  // namespace burst::server
