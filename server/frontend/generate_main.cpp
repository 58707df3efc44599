// burst-generate: a one-off CLI. Loads a model (an HF directory or a preset with random
// weights), prefills a prompt, streams the generated text to stdout, and prints prompt tokens,
// prefill time (TTFT) and decode speed to stderr. Bad arguments: usage and exit code 2.
// Flags on CLI11 (common/cli.h).
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <optional>
#include <string>

#include "engine/backend.h"
#include "engine/parallel_layout.h"
#include "engine/random.h"
#include "runtime/driver.h"
#include "common/cli.h"
#include "common/logging.h"
#include "common/tokenizer.h"
#include "group/worker_group.h"

namespace {

// The synopsis; each flag's description is where it is declared (parse_args).
constexpr const char* kSynopsis =
    R"(usage: burst-generate (--model DIR | --preset 1b|7b|13b|70b --random-weights SEED)
                      (--prompt TEXT | --prompt-file FILE | --prompt-tokens N)
                      [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
                      [--device cpu|cuda|cuda:N] [--tokenizer FILE] [--kv-capacity N]
                      [--kv-cache-dtype auto|fp8]
                      [--workers N [--tp T]] [--layout striped|zigzag|contiguous] [--prefill-chunk N]
                      [--version] [--help]
Flags take --flag VALUE or --flag=VALUE.
)";

struct Args {
  std::string model_dir, preset, prompt, prompt_file, tokenizer, device = "cpu";
  std::optional<uint64_t> random_seed;
  int64_t prompt_tokens = 0, kv_capacity = 0, prefill_chunk = 0;
  int max_tokens = 64;
  int workers = 0;
  int tp = 1;
  burst::engine::ShardLayout layout = burst::engine::ShardLayout::kStriped;
  burst::engine::KvCacheDtype kv_cache_dtype = burst::engine::KvCacheDtype::kAuto;
  burst::engine::AttentionDtype attention_dtype = burst::engine::AttentionDtype::kAuto;
  burst::engine::SamplingParams sampling{0.8f, 40, 0.95f, 0};
};

[[noreturn]] void usage_error(const CLI::App& app, const std::string& msg) {
  std::cerr << "burst-generate: " << msg << "\n" << app.help();
  std::exit(2);
}

// Every flag, bound to its field of `a`, with its --help line.
void add_flags(CLI::App& app, Args& a, std::string& layout, bool& version) {
  app.add_option("--model", a.model_dir, "Hugging Face LLaMA directory (config.json, "
                 "*.safetensors, tokenizer.model)")->type_name("DIR");
  app.add_option("--preset", a.preset, "architecture preset (1b, 7b, 13b, 70b); needs "
                 "--random-weights SEED (no files read)")->type_name("NAME");
  app.add_option("--random-weights", a.random_seed, "the preset's weights' seed")
      ->type_name("SEED");
  app.add_option("--prompt", a.prompt, "the prompt text")->type_name("TEXT");
  app.add_option("--prompt-file", a.prompt_file, "the prompt text from a file")->type_name("FILE");
  app.add_option("--prompt-tokens", a.prompt_tokens, "a prompt of N random token ids (for "
                 "benchmarks; no tokenizer needed)")->type_name("N");
  app.add_option("--max-tokens", a.max_tokens, "tokens to generate (default 64)")->type_name("N");
  app.add_option("--temperature", a.sampling.temperature, "0 = greedy (default 0.8)")
      ->type_name("T");
  app.add_option("--top-k", a.sampling.top_k, "top-k sampling (default 40)")->type_name("K");
  app.add_option("--top-p", a.sampling.top_p, "top-p sampling (default 0.95)")->type_name("P");
  app.add_option("--seed", a.sampling.seed, "sampling seed (default 0)")->type_name("S");
  app.add_option("--device", a.device, "cpu (default) or cuda[:N]")->type_name("D");
  app.add_option("--tokenizer", a.tokenizer, "tokenizer.model (default: DIR/tokenizer.model "
                 "with --model)")->type_name("FILE");
  app.add_option("--kv-capacity", a.kv_capacity, "KV cache tokens (default: prompt + "
                 "max-tokens)")->type_name("N");
  burst::server::add_kv_cache_dtype_option(app, a.kv_cache_dtype,
                                           "what the KV cache holds: auto (the compute dtype; "
                                           "default) or fp8 (e4m3 rows with a scale per token "
                                           "and KV head: about half the bytes)");
  burst::server::add_attention_dtype_option(app, a.attention_dtype,
                                            "prefill attention's products: auto (the compute "
                                            "dtype; default) or fp8 (e4m3: the Hopper FP8 "
                                            "kernel, head_dim 128; emulated on CPUs)");
  app.add_option("--workers", a.workers, "shard the prompt over N burst-worker processes "
                 "(BurstAttention ring); without it, one in-process engine")->type_name("N");
  app.add_option("--tp", a.tp, "tensor parallelism (default 1): each T consecutive workers "
                 "split every layer's weights, the ring joins the N / T groups")->type_name("T");
  app.add_option("--layout", layout, "sequence sharding across workers: striped (default), "
                 "zigzag or contiguous")->type_name("L");
  app.add_option("--prefill-chunk", a.prefill_chunk, "prefill the prompt N tokens at a time "
                 "(each chunk one ring pass over the cached prefix; less activation memory for "
                 "prompts near the KV capacity); default: the whole prompt in one pass")
      ->type_name("N");
  app.add_flag("--version", version, "print the version and build, then exit");
}

Args parse_args(int argc, char** argv) {
  Args a;
  auto app = burst::server::make_cli("burst-generate", kSynopsis);
  std::string layout;
  bool version = false, help = false;
  add_flags(*app, a, layout, version);
  const std::string error = burst::server::parse_cli(*app, argc, argv, &help);
  if (help) {
    std::cout << app->help();
    std::exit(0);
  }
  if (!error.empty()) usage_error(*app, error);
  if (version) {
    std::cout << burst::server::version_string("burst-generate") << "\n";
    std::exit(0);
  }
  const bool have_prompt =
      app->count("--prompt") + app->count("--prompt-file") + app->count("--prompt-tokens") > 0;
  if (!layout.empty() && !burst::engine::parse_shard_layout(layout, &a.layout)) {
    usage_error(*app, "--layout is striped, zigzag or contiguous");
  }
  if (a.model_dir.empty() == a.preset.empty()) {
    usage_error(*app, "give exactly one of --model, --preset");
  }
  if (!a.preset.empty() && !a.random_seed) usage_error(*app, "--preset needs --random-weights SEED");
  if (!have_prompt) usage_error(*app, "give --prompt, --prompt-file or --prompt-tokens");
  if (a.max_tokens <= 0) usage_error(*app, "--max-tokens must be > 0");
  if (a.prompt_tokens < 0) usage_error(*app, "--prompt-tokens must be > 0");
  if (a.workers < 0 || a.workers > 64) usage_error(*app, "--workers must be in 1..64");
  if (a.tp != 1) {
    if (a.workers == 0) usage_error(*app, "--tp needs --workers (tp x the ring's ranks)");
    if (auto pl = burst::engine::ParallelLayout::of(a.workers, a.tp); !pl.ok()) {
      usage_error(*app, pl.message());
    }
  }
  if (a.prefill_chunk < 0) usage_error(*app, "--prefill-chunk must be > 0");
  if (const std::string bad = burst::engine::validate(a.sampling); !bad.empty()) {
    usage_error(*app, bad);
  }
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
    opt.kv_cache_dtype = a.kv_cache_dtype;
    opt.attention_dtype = a.attention_dtype;
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
  // The A/B switches (engine/tuning.h: BURST_PDL, BURST_ATTN_KERNEL, ...), read once here.
  auto tuning = engine::Tuning::from_env();
  if (!tuning.ok()) return tuning.status();
  auto backend = engine::make_backend(a.device, tuning.value());
  if (!backend.ok()) return backend.status();
  auto model = models::load_model(*backend.value(), spec);
  if (!model.ok()) return model.status();
  auto runner = runtime::LocalStepRunner::create(*model.value(), capacity, 0, a.kv_cache_dtype,
                                                 a.attention_dtype);
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
