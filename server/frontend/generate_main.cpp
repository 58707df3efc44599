// burst-generate: a one-off CLI. Loads a model (an HF directory or a preset with random
// weights), prefills a prompt, streams the generated text to stdout, and prints prompt tokens,
// prefill time (TTFT) and decode speed to stderr. Bad arguments: usage and exit code 2.
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>

#include "engine/backend.h"
#include "engine/parallel_layout.h"
#include "engine/random.h"
#include "runtime/driver.h"
#include "common/logging.h"
#include "common/tokenizer.h"
#include "group/worker_group.h"

namespace {

constexpr const char* kUsage =
    R"(usage: burst-generate (--model DIR | --preset 1b|7b|13b|70b --random-weights SEED)
                      (--prompt TEXT | --prompt-file FILE | --prompt-tokens N)
                      [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
                      [--device cpu|cuda|cuda:N] [--tokenizer FILE] [--kv-capacity N]
                      [--workers N [--tp T]] [--layout striped|zigzag|contiguous] [--prefill-chunk N]
                      [--version] [--help]

  --model DIR          Hugging Face LLaMA directory (config.json, *.safetensors, tokenizer.model)
  --preset NAME        architecture preset; needs --random-weights SEED (no files read)
  --prompt-tokens N    a prompt of N random token ids (for benchmarks; no tokenizer needed)
  --max-tokens N       tokens to generate (default 64)
  --temperature T      0 = greedy (default 0.8); --top-k (default 40), --top-p (default 0.95)
  --seed S             sampling seed (default 0)
  --device D           cpu (default) or cuda[:N]
  --tokenizer FILE     tokenizer.model (default: DIR/tokenizer.model with --model)
  --kv-capacity N      KV cache tokens (default: prompt + max-tokens)
  --workers N          shard the prompt over N burst-worker processes (BurstAttention ring);
                       without it, one in-process engine
  --tp T               tensor parallelism (default 1): each T consecutive workers split every
                       layer's weights, the ring joins the N / T groups
  --layout L           sequence sharding across workers: striped (default), zigzag or
                       contiguous
  --prefill-chunk N    prefill the prompt N tokens at a time (each chunk one
                       ring pass over the cached prefix; less activation memory for prompts
                       near the KV capacity); default: the whole prompt in one pass
  --version            print the version and build, then exit
)";

[[noreturn]] void usage_error(const std::string& msg) {
  std::cerr << "burst-generate: " << msg << "\n" << kUsage;
  std::exit(2);
}

template <typename T>
T parse_number(const std::string& flag, const std::string& text) {
  std::istringstream is(text);
  T v{};
  if (!(is >> v) || !is.eof()) usage_error("bad value '" + text + "' for " + flag);
  return v;
}

struct Args {
  std::string model_dir, preset, prompt, prompt_file, tokenizer, device = "cpu";
  std::optional<uint64_t> random_seed;
  int64_t prompt_tokens = 0, kv_capacity = 0, prefill_chunk = 0;
  int max_tokens = 64;
  int workers = 0;
  int tp = 1;
  burst::engine::ShardLayout layout = burst::engine::ShardLayout::kStriped;
  burst::engine::SamplingParams sampling{0.8f, 40, 0.95f, 0};
};

Args parse_args(int argc, char** argv) {
  Args a;
  bool have_prompt = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (flag == "--version") {
      std::cout << burst::server::version_string("burst-generate") << "\n";
      std::exit(0);
    }
    if (i + 1 >= argc) usage_error("missing value for " + flag);
    const std::string val = argv[++i];
    if (flag == "--model") a.model_dir = val;
    else if (flag == "--preset") a.preset = val;
    else if (flag == "--random-weights") a.random_seed = parse_number<uint64_t>(flag, val);
    else if (flag == "--prompt") { a.prompt = val; have_prompt = true; }
    else if (flag == "--prompt-file") { a.prompt_file = val; have_prompt = true; }
    else if (flag == "--prompt-tokens") { a.prompt_tokens = parse_number<int64_t>(flag, val); have_prompt = true; }
    else if (flag == "--max-tokens") a.max_tokens = parse_number<int>(flag, val);
    else if (flag == "--temperature") a.sampling.temperature = parse_number<float>(flag, val);
    else if (flag == "--top-k") a.sampling.top_k = parse_number<int>(flag, val);
    else if (flag == "--top-p") a.sampling.top_p = parse_number<float>(flag, val);
    else if (flag == "--seed") a.sampling.seed = parse_number<uint64_t>(flag, val);
    else if (flag == "--device") a.device = val;
    else if (flag == "--tokenizer") a.tokenizer = val;
    else if (flag == "--kv-capacity") a.kv_capacity = parse_number<int64_t>(flag, val);
    else if (flag == "--workers") a.workers = parse_number<int>(flag, val);
    else if (flag == "--tp") a.tp = parse_number<int>(flag, val);
    else if (flag == "--prefill-chunk") a.prefill_chunk = parse_number<int64_t>(flag, val);
    else if (flag == "--layout") {
      if (!burst::engine::parse_shard_layout(val, &a.layout)) {
        usage_error("--layout is striped, zigzag or contiguous");
      }
    }
    else usage_error("unknown flag " + flag);
  }
  if (a.model_dir.empty() == a.preset.empty()) usage_error("give exactly one of --model, --preset");
  if (!a.preset.empty() && !a.random_seed) usage_error("--preset needs --random-weights SEED");
  if (!have_prompt) usage_error("give --prompt, --prompt-file or --prompt-tokens");
  if (a.max_tokens <= 0) usage_error("--max-tokens must be > 0");
  if (a.prompt_tokens < 0) usage_error("--prompt-tokens must be > 0");
  if (a.workers < 0 || a.workers > 64) usage_error("--workers must be in 1..64");
  if (a.tp != 1) {
    if (a.workers == 0) usage_error("--tp needs --workers (tp x the ring's ranks)");
    if (auto layout = burst::engine::ParallelLayout::of(a.workers, a.tp); !layout.ok()) {
      usage_error(layout.message());
    }
  }
  if (a.prefill_chunk < 0) usage_error("--prefill-chunk must be > 0");
  if (const std::string bad = burst::engine::validate(a.sampling); !bad.empty()) usage_error(bad);
  if (a.tokenizer.empty() && !a.model_dir.empty()) {
    // The model's own tokenizer when it ships one; without it only --prompt-tokens works.
    const std::string own = a.model_dir + "/tokenizer.model";
    if (std::ifstream(own).good()) a.tokenizer = own;
  }
  return a;
}

int fail(const std::string& msg) {
  std::cerr << "burst-generate: error: " << msg << "\n";
  return 1;
}

using namespace burst;

// The prompt's ids: --prompt-tokens random ids from the normal range of the vocabulary
// (skipping control and byte pieces), else the text (--prompt / --prompt-file) tokenized.
Result<std::vector<int32_t>> prompt_ids(const Args& a, const models::LlamaConfig& config,
                                        const server::Tokenizer* tok) {
  std::vector<int32_t> ids;
  if (a.prompt_tokens > 0) {
    ids.push_back(1);
    for (int64_t i = 1; i < a.prompt_tokens; ++i) {
      const uint64_t r = engine::splitmix64(static_cast<uint64_t>(i));
      ids.push_back(259 + static_cast<int32_t>(r % (config.vocab_size - 259)));
    }
    return ids;
  }
  if (!tok) return Status::error("a text prompt needs a tokenizer (--tokenizer FILE)");
  std::string text = a.prompt;
  if (!a.prompt_file.empty()) {
    std::ifstream f(a.prompt_file, std::ios::binary);
    if (!f) return Status::error("cannot read prompt file " + a.prompt_file);
    text.assign(std::istreambuf_iterator<char>(f), {});
  }
  auto enc = tok->encode(text, /*add_bos=*/true, /*add_eos=*/false);
  if (!enc.ok()) return Status::error("prompt: " + enc.message());
  ids.assign(enc.value().begin(), enc.value().end());
  return ids;
}

// The request through N worker processes (the prompt sharded by sequence, the BurstAttention
// ring per layer), or (--workers 0) one in-process engine; *where names what ran it.
Result<runtime::GenerateStats> run(const Args& a, const runtime::GenerateRequest& req,
                                   int64_t capacity, const runtime::TokenCallback& on_token,
                                   std::string* where) {
  const models::ModelSpec spec{a.model_dir, a.preset, a.random_seed.value_or(0), {}};
  if (a.workers > 0) {
    server::WorkerGroupOptions opt;
    opt.model = spec;
    opt.workers = a.workers;
    opt.tp = a.tp;
    opt.device = a.device;
    opt.kv_capacity = capacity;
    opt.layout = a.layout;
    opt.prefill_chunk = a.prefill_chunk;
    auto group = server::WorkerGroup::start(opt);
    if (!group.ok()) return group.status();
    *where = std::to_string(a.workers) + " workers" +
             (a.tp > 1 ? " (tp " + std::to_string(a.tp) + ")" : "") + " on " +
             group.value()->info().device;
    auto stats = runtime::generate(*group.value(), req, on_token);
    // Host clock: on the CPU the ring's compute and its waits; on a GPU only the time to
    // queue the launches, so nothing is printed there (burst-bench-ring times the ring on
    // GPUs with events).
    if (stats.ok() && a.device == "cpu") {
      std::fprintf(stderr, "burst-generate: ring attention %.1f ms compute, %.1f ms exposed "
                   "communication (rank 0)\n", stats.value().ring_compute_ms,
                   stats.value().ring_wait_ms);
    }
    return stats;
  }
  auto backend = engine::make_backend(a.device);
  if (!backend.ok()) return backend.status();
  auto model = models::load_model(*backend.value(), spec);
  if (!model.ok()) return model.status();
  auto runner = runtime::LocalStepRunner::create(*model.value(), capacity);
  if (!runner.ok()) return runner.status();
  *where = "device " + backend.value()->name();
  return runtime::generate(*runner.value(), req, on_token);
}

void print_stats(const runtime::GenerateStats& s, const std::string& where) {
  const double tps = s.generated_tokens > 1 ? (s.generated_tokens - 1) * 1000.0 / s.decode_ms : 0;
  std::fprintf(stderr,
               "burst-generate: %s, prompt %lld tokens, prefill (TTFT) %.1f ms "
               "(%.0f tok/s), generated %lld tokens, decode %.1f tok/s, finish %s\n",
               where.c_str(), static_cast<long long>(s.prompt_tokens), s.prefill_ms,
               s.prompt_tokens * 1000.0 / s.prefill_ms,
               static_cast<long long>(s.generated_tokens), tps,
               runtime::finish_reason_name(s.finish_reason));
}

}  // namespace

int main(int argc, char** argv) {
  Args a = parse_args(argc, argv);
  auto config = a.model_dir.empty() ? models::preset_config(a.preset)
                                    : models::load_config(a.model_dir);
  if (!config.ok()) return fail(config.message());
  // A layout the model cannot take: refused before any worker starts.
  if (std::string e = models::tensor_parallel_error(config.value(), a.tp); !e.empty()) {
    return fail(e);
  }
  std::unique_ptr<server::Tokenizer> tok;
  if (!a.tokenizer.empty()) {
    auto t = server::Tokenizer::load(a.tokenizer);
    if (!t.ok()) return fail(t.message());
    tok = t.take();
  }
  runtime::GenerateRequest req;
  req.max_tokens = a.max_tokens;
  req.sampling = a.sampling;
  req.prefill_chunk = a.prefill_chunk;
  req.layout = a.layout;
  auto ids = prompt_ids(a, config.value(), tok.get());
  if (!ids.ok()) return fail(ids.message());
  req.prompt = ids.take();
  const int64_t capacity =
      a.kv_capacity > 0 ? a.kv_capacity : static_cast<int64_t>(req.prompt.size()) + a.max_tokens;

  std::optional<server::StreamDecoder> stream;
  if (tok) {
    stream.emplace(*tok, req.prompt.back());
    if (a.prompt_tokens == 0) std::cout << (a.prompt_file.empty() ? a.prompt : "") << std::flush;
  }
  const int32_t eos = config.value().eos_token_id;
  auto print_token = [&](int32_t id) {
    if (id == eos) return true;
    std::cout << (stream ? stream->push(id) : std::to_string(id) + " ") << std::flush;
    return true;
  };
  std::string where;
  auto stats = run(a, req, capacity, print_token, &where);
  if (stream) std::cout << stream->flush();
  std::cout << std::endl;
  if (!stats.ok()) return fail(stats.message());
  print_stats(stats.value(), where);
  return 0;
}
