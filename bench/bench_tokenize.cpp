// burst-bench-tokenize: how long Tokenizer::encode takes on a long real text, whole on one
// thread against cut into pieces (encode()'s piece size, or --piece-bytes) on 1, 2, 4, ...
// threads up to the process's encode pool's width (the last row is what encode() does). Wall
// time best and median of --reps rounds; CPU time of the process (all threads), least. The text
// is the KJV (Debian's bible-kjv, read as burst-bench's kjv workload reads it: one verse a line)
// cut at a line to about --tokens tokens, or the start of --text FILE. Every split encode is
// checked id for id against the whole text's ids; the exit status is 1 if any differs.
//
// usage: burst-bench-tokenize [--model PATH] [--tokens N] [--text FILE] [--reps R]
//                             [--piece-bytes B]
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "common/tokenizer.h"

namespace {

using burst::server::Tokenizer;

struct Args {
  std::string model = BURST_SOURCE_DIR "/models/kjv-tiny/tokenizer.model";
  std::string text_file;
  size_t tokens = 131072;
  int reps = 5;
  size_t piece_bytes = 0;  // 0: encode()'s choice
};

bool parse_size(const char* s, size_t* out) {
  char* end = nullptr;
  const unsigned long long v = std::strtoull(s, &end, 10);
  if (end == s || *end != '\0' || s[0] == '-') return false;
  *out = static_cast<size_t>(v);
  return true;
}

bool parse_args(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) return false;
    const char* v = argv[++i];
    size_t n = 0;
    if (flag == "--model") {
      a->model = v;
    } else if (flag == "--text") {
      a->text_file = v;
    } else if (flag == "--tokens" && parse_size(v, &n) && n > 0) {
      a->tokens = n;
    } else if (flag == "--reps" && parse_size(v, &n) && n > 0 && n < 1000) {
      a->reps = static_cast<int>(n);
    } else if (flag == "--piece-bytes" && parse_size(v, &n)) {
      a->piece_bytes = n;
    } else {
      return false;
    }
  }
  return true;
}

std::string trim(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t\r\n") - b + 1);
}

bool all_digits(const std::string& s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) { return c >= '0' && c <= '9'; });
}

// The KJV as bench/burstbench/workload.py's kjv_corpus() makes it: `bible`'s output with the
// verse numbers dropped, wrapped verses joined, a blank line for each chapter heading.
bool kjv_lines(std::vector<std::string>* verses) {
  FILE* pipe = popen("bible Gen1:1-Rev22:21 2>/dev/null", "r");
  if (!pipe) return false;
  std::string out;
  char buf[1 << 16];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, pipe)) > 0) out.append(buf, n);
  if (pclose(pipe) != 0 || out.empty()) return false;
  size_t start = 0;
  while (start < out.size()) {
    size_t end = out.find('\n', start);
    if (end == std::string::npos) end = out.size();
    const std::string line = out.substr(start, end - start);
    start = end + 1;
    const std::string t = trim(line);
    if (t.empty()) continue;
    const bool indented = line[0] == ' ' || line[0] == '\t';
    const size_t sp = t.find(' ');
    if (indented && sp != std::string::npos && all_digits(t.substr(0, sp))) {
      verses->push_back(trim(t.substr(sp + 1)));  // "  12 verse text"
    } else if (indented || sp == std::string::npos || !all_digits(t.substr(t.rfind(' ') + 1))) {
      if (!verses->empty()) verses->back() += " " + t;  // a wrapped verse continues
    } else {
      verses->emplace_back();  // "Genesis 2": a chapter heading
    }
  }
  return !verses->empty();
}

std::string join_lines(const std::vector<std::string>& lines, size_t count) {
  std::string text;
  for (size_t i = 0; i < count && i < lines.size(); ++i) {
    if (i > 0) text += '\n';
    text += lines[i];
  }
  return text;
}

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

// CPU time of all the process's threads: on a shared machine wall time also counts other
// processes' turns on the cores, CPU time does not.
double process_cpu_ms() {
  timespec ts{};
  if (clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts) != 0) return 0;
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

// One configuration's samples over the rounds.
struct Row {
  Row(std::string l, Tokenizer::Split s) : label(std::move(l)), split(s) {}
  std::string label;
  Tokenizer::Split split;
  std::vector<double> wall, cpu;  // ms
  size_t pieces = 0;
  bool same = true;
  double best() const { return *std::min_element(wall.begin(), wall.end()); }
  double median() const {
    std::vector<double> w = wall;
    std::sort(w.begin(), w.end());
    return w[w.size() / 2];
  }
  double least_cpu() const { return *std::min_element(cpu.begin(), cpu.end()); }
};

// One encode of `text` as the row says, its times appended; ids checked against `want`.
void time_once(const Tokenizer& tok, const std::string& text, const std::vector<int>& want,
               Row* row) {
  const double cpu0 = process_cpu_ms();
  const auto t0 = std::chrono::steady_clock::now();
  auto ids = tok.encode_split(text, false, false, row->split, &row->pieces);
  row->wall.push_back(ms_since(t0));
  row->cpu.push_back(process_cpu_ms() - cpu0);
  if (!ids.ok()) {
    std::fprintf(stderr, "burst-bench-tokenize: %s\n", ids.message().c_str());
    std::exit(1);
  }
  if (ids.value() != want) row->same = false;
}

// The text's lines: --text FILE's, else the KJV's; *source names it. False (said on stderr)
// when there is none.
bool read_lines(const Args& a, std::vector<std::string>* lines, std::string* source) {
  if (!a.text_file.empty()) {
    std::ifstream in(a.text_file, std::ios::binary);
    const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.good() && !in.eof()) {
      std::fprintf(stderr, "burst-bench-tokenize: cannot read %s\n", a.text_file.c_str());
      return false;
    }
    for (size_t s = 0; s < all.size();) {
      size_t e = all.find('\n', s);
      if (e == std::string::npos) e = all.size();
      lines->push_back(all.substr(s, e - s));
      s = e + 1;
    }
    *source = a.text_file;
  } else {
    if (!kjv_lines(lines)) {
      std::fprintf(stderr,
                   "burst-bench-tokenize: the KJV needs the `bible` command (Debian package "
                   "bible-kjv); or pass --text FILE\n");
      return false;
    }
    *source = "KJV (bible-kjv), from Genesis 1:1";
  }
  if (lines->empty()) {
    std::fprintf(stderr, "burst-bench-tokenize: empty text\n");
    return false;
  }
  return true;
}

// The first *count lines whose text holds about `target` tokens (*tokens of them): guess from
// the bytes a token took so far, three rounds (a line is ~30 tokens, so this lands within a
// line or two of the target). False (said on stderr) when encode fails.
bool cut_to_tokens(const Tokenizer& tok, const std::vector<std::string>& lines, size_t target,
                   std::string* text, size_t* count, size_t* tokens) {
  std::vector<size_t> line_end(lines.size());  // bytes of join_lines(lines, i + 1)
  for (size_t i = 0, b = 0; i < lines.size(); ++i) line_end[i] = b += lines[i].size() + (i > 0);
  *count = lines.size();
  for (int round = 0; round < 4; ++round) {
    *text = join_lines(lines, *count);
    auto ids = tok.encode(*text, false, false);
    if (!ids.ok()) {
      std::fprintf(stderr, "burst-bench-tokenize: %s\n", ids.message().c_str());
      return false;
    }
    *tokens = ids.value().size();
    if (*tokens == target || round == 3) break;
    const double want_bytes = static_cast<double>(text->size()) * target / *tokens;
    const size_t next = static_cast<size_t>(
        std::lower_bound(line_end.begin(), line_end.end(), static_cast<size_t>(want_bytes)) -
        line_end.begin());
    const size_t clamped = std::min(std::max<size_t>(next + 1, 1), lines.size());
    if (clamped == *count) break;
    *count = clamped;
  }
  return true;
}

// The rows timed: the whole text on one thread, then split on 1, 2, 4, ... threads up to the
// encode pool's width.
std::vector<Row> rows_to_time(const Tokenizer::Split& whole, size_t piece_bytes) {
  std::vector<Row> rows;
  rows.emplace_back("whole text, 1 thread", whole);
  std::vector<size_t> counts;
  for (size_t t = 1; t < Tokenizer::encode_threads(); t *= 2) counts.push_back(t);
  counts.push_back(Tokenizer::encode_threads());
  for (size_t t : counts) {
    char label[64];
    std::snprintf(label, sizeof label, "split, %zu thread%s", t, t == 1 ? "" : "s");
    rows.emplace_back(label, Tokenizer::Split{piece_bytes, t});
  }
  return rows;
}

// The table of rows; whether every row's ids were the whole text's.
bool print_rows(const std::vector<Row>& rows) {
  std::printf("%-28s %8s %10s %10s %10s %8s\n", "", "pieces", "best ms", "median ms", "cpu ms",
              "speedup");
  bool all_same = true;
  for (const Row& row : rows) {
    all_same = all_same && row.same;
    std::printf("%-28s %8zu %10.1f %10.1f %10.1f %7.2fx%s\n", row.label.c_str(), row.pieces,
                row.best(), row.median(), row.least_cpu(), rows[0].best() / row.best(),
                row.same ? "" : "  IDS DIFFER");
  }
  std::printf("ids: %s\n", all_same ? "identical to the whole text's" : "DIFFER");
  return all_same;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!parse_args(argc, argv, &a)) {
    std::fprintf(stderr,
                 "usage: burst-bench-tokenize [--model PATH] [--tokens N] [--text FILE] "
                 "[--reps R] [--piece-bytes B]\n");
    return 2;
  }
  auto loaded = Tokenizer::load(a.model);
  if (!loaded.ok()) {
    std::fprintf(stderr, "burst-bench-tokenize: %s\n", loaded.message().c_str());
    return 1;
  }
  const Tokenizer& tok = *loaded.value();

  std::vector<std::string> lines;
  std::string source;
  if (!read_lines(a, &lines, &source)) return 1;
  std::string text;
  size_t count = 0, tokens = 0;
  if (!cut_to_tokens(tok, lines, a.tokens, &text, &count, &tokens)) return 1;

  std::printf("text: %s, %zu lines, %zu bytes, %zu tokens\n", source.c_str(), count, text.size(),
              tokens);
  std::printf("pool: %zu threads at most (hardware_concurrency %u, cap %zu); split %s\n",
              Tokenizer::encode_threads(), std::thread::hardware_concurrency(),
              Tokenizer::kMaxEncodeThreads, tok.can_split() ? "allowed" : "not allowed");

  const Tokenizer::Split whole{std::numeric_limits<size_t>::max(), 1};
  auto reference = tok.encode_split(text, false, false, whole);
  if (!reference.ok()) {
    std::fprintf(stderr, "burst-bench-tokenize: %s\n", reference.message().c_str());
    return 1;
  }
  const std::vector<int>& want = reference.value();

  std::vector<Row> rows = rows_to_time(whole, a.piece_bytes);
  // Round by round, every row once a round: on a shared machine a busy spell then slows every
  // row alike instead of whichever row it fell on.
  for (int r = 0; r < a.reps; ++r) {
    for (Row& row : rows) time_once(tok, text, want, &row);
  }
  return print_rows(rows) ? 0 : 1;
}
