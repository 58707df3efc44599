// The scheduling policy as a pure object, the way vLLM v1 splits it: the sequences admitted,
// the page ledger, plan() and update(). No threads, no worker group, no request streams, no
// clock: the step loop (Scheduler) owns those, asks the planner what to run, sends the plan
// and hands the outcome back. So the policy is tested without a process (planner_test.cpp):
// - admission by pages: a request's pages on every rank are reserved whole when it is admitted
//   (kv_pages_needed), so a running sequence never runs out and nothing is preempted; at most
//   max_running sequences run;
// - a step: every decoding sequence's next token first, then prefill chunks (fewest prompt
//   tokens left first, one chunk per sequence, chunks of prefill_chunk tokens, or
//   prefill_chunk_decoding while some sequence decodes) while the step's token budget
//   (max_batched_tokens) allows; a step always makes progress;
// - a prompt that fits one chunk and waits while a long prompt's full chunk would share its
//   step runs in a step of its own first, never twice in a row (a short prompt is not stuck
//   behind a long prefill, and a stream of short prompts cannot stall the long one);
// - the lookahead: while every running sequence decodes and nothing waits, the next decode step
//   (runtime::kPreviousToken rows) may be sent before this one's tokens are read;
// - finished sequences give their pages back and are released on every rank in the next plan;
// - a request of max_tokens 0 (echo of the prompt with its logprobs) is prefilled and ends with
//   its prefill, the token drawn there discarded; it holds the prompt's pages only;
// - prefix caching (striped layout): every full block of a sequence's computed tokens (one page
//   on every ring rank: ring ranks x page_size tokens, prompt and generated alike) becomes a
//   prefix block (PrefixCache; the next plan publishes it on the ranks), and an admitted
//   request starts after the longest run of cached blocks its prompt begins with (at least its
//   last token is computed: its logits are needed). Blocks are reference-counted; the ledger
//   counts the pages of blocks no sequence holds as cache pages, which admission evicts (LRU)
//   when the free pages do not suffice, never a block a running sequence holds. Requests that
//   need every prompt row computed (prompt logprobs) or their whole prompt on rank 0 (a
//   repetition penalty) do not read the cache, but publish to it;
// - fairness across client requests (ScheduledRequest::owner: the n choices of one request are
//   one owner): pick() admits round-robin, the owner with the fewest running sequences first
//   (so a newcomer also gets the next pages that free up), and an owner takes at most max_share
//   of the running slots, so a newcomer is admitted at once beside an `n: 64` request instead of
//   waiting for all its choices to end; the step's prefill budget goes round-robin too (each
//   owner's first chunk, shortest first, before any owner's second).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "engine/sharding.h"
#include "frontend/prefix_cache.h"
#include "runtime/driver.h"
#include "runtime/step.h"

namespace burst::server {

struct ScheduledRequest;

// KV pages each rank needs for a request of `prompt` tokens and `max_tokens` new ones, prefilled
// in chunks of `chunk` tokens (0: whole) and sharded by `layout` over `world` ranks: exactly
// what the ranks' paged caches will hold at its end (decode token p is cached on rank p mod N).
// mixed_chunks: the chunks may be of any lengths that are multiples of 2 x world but the last
// (SchedulerOptions::prefill_chunk_decoding): each chunk but the last then gives every rank
// exactly len / world rows, and the last one (left tokens, padded to whole parts) at most
// left / world + 2, so a rank holds at most floor(prompt / world) + 2 prompt rows, whatever the
// chunking; the pages cover that bound.
std::vector<int64_t> kv_pages_needed(int64_t prompt, int64_t max_tokens, int64_t chunk,
                                     int world, engine::ShardLayout layout, int page_size,
                                     bool mixed_chunks = false);

struct PlannerOptions {
  int world = 1;
  engine::ShardLayout layout = engine::ShardLayout::kStriped;
  int64_t prefill_chunk = 0;           // 0: whole prompts
  int64_t prefill_chunk_decoding = 0;  // the chunk of a step that also decodes (0: the same)
  int64_t max_batched_tokens = 1;      // tokens per step (> 0)
  int max_running = 64;
  bool decode_lookahead = true;
  bool prefix_caching = true;  // with the striped layout only
  // The most of the running slots that one owner's sequences hold (rounded up; its first
  // sequence always runs).
  double max_share = 0.75;
};

class Planner {
 public:
  explicit Planner(PlannerOptions options) : options_(options) {}

  // A fresh group of `pages` free pages of `page_size` tokens per rank: every sequence is
  // forgotten (the group that held them is gone) and nothing is left to release.
  void reset(int64_t pages, int page_size);

  enum class Fit { kNow, kLater, kNever };
  // Whether `r` fits the ledger now, once running sequences free pages, or never (more than a
  // rank holds); *need gets its pages per rank.
  Fit fits(const ScheduledRequest& r, std::vector<int64_t>* need) const;
  bool full() const { return static_cast<int>(seqs_.size()) >= options_.max_running; }
  // The waiting request to admit next, of `waiting` (in arrival order): owners by fewest
  // running sequences, then by their first waiting request's arrival; an owner at its share is
  // passed over. index -1: none may start now (full, or every owner at its share). A request
  // with fit kLater waits for pages and nothing passes it (a big request is not starved).
  struct Pick {
    int index = -1;
    Fit fit = Fit::kLater;
    std::vector<int64_t> need;  // its pages per rank (fits())
  };
  Pick pick(const std::vector<const ScheduledRequest*>& waiting) const;
  // Admits `r` (which the caller keeps alive until finish()) with the pages fits() found;
  // returns its sequence id.
  uint64_t admit(const ScheduledRequest& r, std::vector<int64_t> need);
  // The sequence leaves the batch (done, cancelled, failed): its pages go back to the ledger
  // and the next plan releases it on every rank.
  void finish(uint64_t id);
  // Every running sequence is dropped without a release (its group or session is gone).
  void drop_all();

  // A prefill chunk of a step: prompt rows [start, start + len) of sequence `id`.
  struct Chunk {
    uint64_t id = 0;
    int64_t start = 0, len = 0;
  };
  struct Plan {
    runtime::StepPlan step;
    std::vector<Chunk> chunks;  // the step's prefill chunks, in plan order
  };
  // The next step (empty seqs and release: nothing to run).
  Plan plan();
  // Whether the step after `p` (in flight, its tokens not read) may be sent now: lookahead on,
  // `p` decodes only, every running sequence decodes and nothing waits for admission.
  bool can_look_ahead(const Plan& p, bool queue_empty) const;
  // The decode step after `p`: each of its sequences still running and not ending by
  // max_tokens at `p` feeds the token `p` draws (kPreviousToken). Takes the releases due.
  Plan continue_decode(const Plan& p);
  // Releases, publishes and evictions that found no step to go with (a lookahead with no
  // rows): they go with the next.
  void keep(runtime::StepPlan leftover);

  // What a step's outcome did to one running sequence.
  struct Progress {
    uint64_t id = 0;
    int64_t prefilled = 0;      // prompt rows done, after this step's chunk
    bool prefill_done = false;  // the chunk was the prompt's last
  };
  struct Token {
    uint64_t id = 0;
    int32_t token = 0;
    bool ends = false;     // the sequence is done with this token (finish() it)
    bool is_stop = false;  // it ended on a stop token (EOS unless ignore_eos; stop_token_ids):
                           // the token has no text
    runtime::FinishReason reason = runtime::FinishReason::kLength;  // when `ends`
    // A prompt-only request (max_tokens 0): its prefill ran for the prompt's logprobs and the
    // token its last chunk drew is no output (not counted, not sent); it `ends` with "length".
    bool discard = false;
  };
  struct Update {
    std::vector<Progress> chunks;
    std::vector<Token> tokens;  // in running order
    size_t dropped = 0;         // tokens of sequences that had ended (a lookahead's)
  };
  // Applies a step's outcome: the chunks' progress, then each sampled token (EOS `eos`).
  // Sequences that end here are finished already (pages back, released next plan).
  Update update(const Plan& p, const std::vector<runtime::SampledToken>& tokens, int32_t eos);

  // A running sequence's scheduling state.
  struct Seq {
    uint64_t id = 0;
    const ScheduledRequest* request = nullptr;
    std::vector<int64_t> pages;  // reserved per rank
    int64_t prefilled = 0;       // prompt tokens cached (from prefix blocks or computed)
    int64_t generated = 0;
    int32_t last_token = -1;
    std::vector<int32_t> output;  // the generated ids (prefix blocks of a longer chat)
    // Prefix caching: the blocks it holds (the cached prefix it started from, then a block for
    // each full block of its own tokens), how many of them it found cached, how many of its
    // own pages became blocks.
    std::vector<int64_t> blocks;
    int64_t hits = 0;
    int64_t cached = 0;  // prompt tokens it did not compute: hits x block tokens
    int64_t published = 0;
    int64_t prompt_len() const;
    bool decoding() const { return prefilled >= prompt_len(); }
  };
  const Seq* find(uint64_t id) const;
  size_t running() const { return seqs_.size(); }
  const std::vector<int64_t>& free_pages() const { return free_pages_; }
  const PlannerOptions& options() const { return options_; }
  const PrefixCache& prefix_cache() const { return cache_; }
  // Pages (per rank) of prefix blocks that no running sequence reserved: held for reuse.
  int64_t cached_pages() const { return cached_pages_; }
  uint64_t evicted_blocks() const { return evicted_; }  // since start
  // Whether requests may start from prefix blocks (on, striped layout).
  bool caching() const;

 private:
  Seq* find_mut(uint64_t id);
  runtime::SeqWork decode_row(const Seq& s, int32_t token, int64_t pos) const;
  runtime::SeqWork prefill_row(const Seq& s, int64_t len) const;
  // Prefill chunks into `p` while `budget` lasts (decode rows are in already).
  void add_prefills(Plan& p, int64_t budget, int64_t chunk);
  // The cached blocks r's prompt starts with that r may use.
  std::vector<int64_t> hits_for(const ScheduledRequest& r) const;
  // The owner whose share `r` counts against: its request's, or a sequence alone.
  static uint64_t owner_of(const ScheduledRequest& r);
  // Every full block of s's computed tokens not yet a block of s becomes one (publish).
  void publish_blocks(Seq& s);
  // What the next plan carries besides its rows.
  void take_pending(runtime::StepPlan& step);

  PlannerOptions options_;
  int page_size_ = 0;
  int64_t pages_ = 0;                // per rank, of a fresh group
  std::vector<int64_t> free_pages_;  // per rank: the ledger (mirrors the ranks' caches)
  std::vector<std::unique_ptr<Seq>> seqs_;  // in admission order
  std::vector<uint64_t> to_release_;
  std::vector<runtime::PublishBlock> to_publish_;
  std::vector<int64_t> to_evict_;
  PrefixCache cache_;
  int64_t cached_pages_ = 0;
  uint64_t evicted_ = 0;
  bool deferred_full_ = false;  // the last plan left a full prefill chunk for this one
  uint64_t next_id_ = 1;
};

}  // namespace burst::server
