// The request options both public APIs take (sampling, logits processing, stop conditions,
// logprobs, max_tokens), as one table: per option its name, the endpoints that take it, its
// type, its limits and how a valid value is stored into a ScheduledRequest. The validation is
// written once, here: HTTP (http_api.cpp) and gRPC (grpc_api.cpp) only read the raw values of
// the table's names from their JSON body / protobuf message into RawOptions and turn an
// OptionError into their own error (400 with error.param / INVALID_ARGUMENT). Nothing throws.
// Options one API alone has (HTTP's n, best_of, echo, stream, ...; the prompt) stay in it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/jinja.h"
#include "frontend/scheduler.h"

namespace burst::server {

// Where a request comes from: an option is taken by some of these (Endpoint bits).
enum Endpoint : unsigned {
  kCompletions = 1u,  // POST /v1/completions
  kChat = 2u,         // POST /v1/chat/completions
  kGenerate = 4u,     // gRPC burst.v1.Burst/Generate
  kGrpcChat = 8u,     // gRPC burst.v1.Burst/Chat
};
constexpr unsigned kHttpEndpoints = kCompletions | kChat;
constexpr unsigned kGrpcEndpoints = kGenerate | kGrpcChat;
constexpr unsigned kAllEndpoints = kHttpEndpoints | kGrpcEndpoints;

// A value as the client sent it, before any check: JSON's kinds, which protobuf's map onto
// (integers of any width: kInt; float, double: kNumber; repeated: kArray; map: kObject with
// the keys as text). An absent option (JSON null, an unset proto field) is not in RawOptions.
struct RawValue {
  enum class Kind { kNull, kBool, kInt, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool b = false;
  int64_t i = 0;      // kInt; above INT64_MAX (`wide`): the uint64's bits
  bool wide = false;  // kInt above INT64_MAX (JSON's 2^64 - 1, protobuf's uint64)
  double d = 0;
  std::string s;
  std::vector<RawValue> items;                           // kArray
  std::vector<std::pair<std::string, RawValue>> fields;  // kObject, in the source's order

  static RawValue boolean(bool v);
  static RawValue integer(int64_t v);
  static RawValue unsigned_integer(uint64_t v);
  static RawValue number(double v);
  static RawValue string(std::string v);
  static RawValue array(std::vector<RawValue> v);
  static RawValue object(std::vector<std::pair<std::string, RawValue>> v);
};

// The options a request gave, by the table's names.
using RawOptions = std::map<std::string, RawValue>;

enum class OptionType {
  kBool,
  kInt,
  kNumber,      // an integer is a number too
  kStrings,     // a string (a list of one) or an array of non-empty strings
  kTokenIds,    // an array of token ids, each in [0, vocab)
  kTokenIdMap,  // an object of token id (its key, as text) -> number
  kObject,      // an object of any JSON values (up to max_count keys)
};

struct OptionLimits {
  static constexpr double kNone = std::numeric_limits<double>::infinity();
  // kInt, kNumber, and kTokenIdMap's values: the range (open or closed at each end).
  double lo = -kNone, hi = kNone;
  bool lo_open = false, hi_open = false;
  size_t max_count = 0;  // kStrings, kTokenIds, kTokenIdMap: the most items (0: no limit)
  const char* note = "";  // appended to the range's message (e.g. what a sentinel means)
  bool uint64_bits = false;  // kInt: a value above INT64_MAX is taken as its bits (a seed)
};

// A checked value of its option's type.
struct OptionValue {
  bool flag = false;                                // kBool
  int64_t integer = 0;                              // kInt (a wide one: its bits)
  double number = 0;                                // kNumber
  std::vector<std::string> strings;                 // kStrings
  std::vector<int32_t> ids;                         // kTokenIds
  std::vector<std::pair<int32_t, float>> id_values;  // kTokenIdMap, sorted by id
  std::vector<std::pair<std::string, RawValue>> fields;  // kObject, in the source's order
};

// What the table fills: the request, and what the APIs need to know beyond its values.
struct ParsedOptions {
  ScheduledRequest request;
  bool max_tokens_given = false;  // else the API's default applies (it depends on the prompt)
  bool seed_given = false;        // HTTP's n choices then sample with seed + i
  int64_t min_tokens = 0;         // as asked (request.adjust.min_tokens is bounded to an int)
  bool add_generation_prompt = true;  // chat: the template ends with the assistant's header
  // chat (vLLM's chat_template_kwargs): more variables for the chat template (enable_thinking).
  std::vector<std::pair<std::string, RawValue>> chat_template_kwargs;
};

struct OptionSpec {
  const char* name;    // the JSON key and the proto field's name (in the request or `sampling`)
  unsigned endpoints;  // Endpoint bits that take it
  OptionType type;
  OptionLimits limits;
  // Stores a valid value. Returns "" or why it is refused in the light of the options stored
  // before it in the table (min_tokens after max_tokens, top_logprobs after logprobs).
  std::string (*store)(const OptionValue& v, ParsedOptions& out);
  unsigned required_in = 0;  // Endpoint bits where leaving it out is an error
};

// The table, in the order its options are checked and stored.
const std::vector<OptionSpec>& option_table();

// A refused option: the parameter it names and the whole message (the same over both APIs).
struct OptionError {
  std::string param;
  std::string message;
};

// Checks `raw`'s options that `endpoint` takes, in the table's order, and stores them into
// `out` (whose request keeps the fields the table does not set: id, prompt). Before that the
// defaults that are not ScheduledRequest's own are set: temperature 1 and a random seed.
// Options of `raw` that the table does not give `endpoint` are ignored (the APIs refuse unknown
// ones themselves). The first fault is returned; `out` is then partly filled.
std::optional<OptionError> parse_options(const RawOptions& raw, Endpoint endpoint,
                                         int vocab_size, ParsedOptions& out);

// After the API set its default max_tokens (one not given depends on the prompt): min_tokens,
// as asked, must not exceed the request's max_tokens. Both APIs call it before submitting.
std::optional<OptionError> check_min_tokens(const ParsedOptions& o);

// The chat template's variables of a request's chat_template_kwargs (HTTP's JSON values and
// gRPC's google.protobuf.Struct alike), for apply_chat_template.
jinja::Dict chat_template_variables(const ParsedOptions& o);

// How many stop token ids a request may give.
constexpr size_t kMaxStopTokenIds = 64;

}  // namespace burst::server
