// build/bin/burst-bench: runs the load generator, bench/burst_bench.py, with /usr/bin/python3.
// An executable rather than a copy of the script because build/bin must hold ELF files only:
// bench/gpu/pack.sh (devpack) runs ldd on every file there and stops at a script. The script
// is looked up in $BURST_BENCH_SCRIPT, $BURST_SOURCE_DIR/bench, ../share/burst/bench from the
// executable (where `cmake --install` puts it, beside bin/), the source tree this was built
// from, ../../bench from the executable (.devpack/bin in a repository copy), then ./bench.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace {

bool is_file(const std::string& p) {
  struct stat st {};
  return !p.empty() && stat(p.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

std::string exe_dir() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "";
  const std::string path(buf, static_cast<size_t>(n));
  return path.substr(0, path.rfind('/'));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> candidates;
  if (const char* s = std::getenv("BURST_BENCH_SCRIPT")) candidates.emplace_back(s);
  if (const char* s = std::getenv("BURST_SOURCE_DIR")) {
    candidates.push_back(std::string(s) + "/bench/burst_bench.py");
  }
  candidates.push_back(exe_dir() + "/../share/burst/bench/burst_bench.py");
  candidates.emplace_back(BURST_BENCH_DEFAULT_SCRIPT);
  candidates.push_back(exe_dir() + "/../../bench/burst_bench.py");
  candidates.emplace_back("bench/burst_bench.py");
  std::string script;
  for (const auto& c : candidates) {
    if (is_file(c)) {
      script = c;
      break;
    }
  }
  if (script.empty()) {
    std::fprintf(stderr, "burst-bench: cannot find bench/burst_bench.py (set BURST_SOURCE_DIR "
                         "to the repository or BURST_BENCH_SCRIPT to the script)\n");
    return 127;
  }
  const char* python = std::getenv("BURST_PYTHON");
  if (!python) python = is_file("/usr/bin/python3") ? "/usr/bin/python3" : "python3";
  std::vector<char*> args;
  args.push_back(const_cast<char*>(python));
  args.push_back(script.data());
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  execvp(python, args.data());
  std::fprintf(stderr, "burst-bench: cannot run %s: %s\n", python, std::strerror(errno));
  return 127;
}
