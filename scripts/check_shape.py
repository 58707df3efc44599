#!/usr/bin/python3
"""check_shape.py: no production file over 800 lines, no host C++ function over 80 lines.

Usage: scripts/check_shape.py [--root DIR] [--max-file N] [--max-function N] [FILE ...]
       (default FILE: the C++, CUDA and Python sources git knows under kernels/ engine/ models/
       runtime/ server/ bench/ scripts/; paths are relative to the repository root)

Prints one line per violation, `path:line name N lines`, and exits 1 when there is any, 0
when there is none, 2 on a usage error.

1. Files: a source file (.h .hpp .cuh .cpp .cc .cu .py) over --max-file lines (800), except
   under kernels/cuda/ (the CUDA kernels: one tuned kernel family a file). Reported at line 1
   with the name `file`.

2. Functions: a C++ function body over --max-function lines (80), counted from the line of
   its opening brace to the line of its closing brace, both included. A function is a brace
   block opened at namespace or class scope after a parameter list (free functions, member
   functions defined in or out of their class, constructors with their initializer lists,
   operators) or after `= [...](...)` (a lambda held by a variable at namespace scope).
   Lambdas and blocks inside a function count toward that function. The scanner matches
   braces and skips comments, string and character literals (raw strings too) and
   preprocessor lines. Device code (`__global__` or `__device__` in the declaration) is not
   checked: a kernel's length follows its tuning. Python functions are not checked.

Which files: `git ls-files --cached --others --exclude-standard` (tracked files plus new files
git does not ignore) under the directories above, present on disk; tests/ and data are not
production sources and are not read.
"""
import argparse
import os
import re
import subprocess
import sys

DIRS = ("kernels", "engine", "models", "runtime", "server", "bench", "scripts")
CXX_EXT = (".h", ".hpp", ".cuh", ".cpp", ".cc", ".cu")
SOURCE_EXT = CXX_EXT + (".py",)
FILE_EXEMPT = ("kernels/cuda/",)

KEYWORD_SCOPE = re.compile(
    r"^(?:(?:inline|export)\s+)?(namespace|class|struct|union|enum|extern)\b")
RAW_PREFIX = re.compile(r'(?:u8|u|U|L)?R"')
NOT_NAMES = {"if", "for", "while", "switch", "return", "sizeof", "alignof", "decltype",
             "noexcept", "static_assert", "requires", "catch", "throw", "alignas"}


def strip_code(text):
    """The text with comments, string and char literals and preprocessor lines blanked out
    (newlines kept, so that offsets give line numbers)."""
    out = []
    i, n = 0, len(text)
    line_start = True
    while i < n:
        c = text[i]
        if line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if line_start and c == "#":  # preprocessor line, with its continuations
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                out.append(" ")
                i += 1
            continue
        line_start = False
        if c == "\n":
            line_start = True
            out.append(c)
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif RAW_PREFIX.match(text, i) and (i == 0 or not re.match(r"\w", text[i - 1])):
            q = text.index('"', i)
            m = re.match(r'"([^()\\\s]{0,16})\(', text[q:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', q)
            end = n if end < 0 else end + len(m.group(1)) + 2
            out.append('""' + re.sub(r"[^\n]", " ", text[i + 2:end]))
            i = end
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum():
                out.append(" ")  # digit separator: 1'000'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(c + c + " " * (j - i - 2) if j - i >= 2 else c * (j - i))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def drop_template_prefix(header):
    """`template <...> int f(...)` -> `int f(...)` (default template arguments hold '=')."""
    while True:
        m = re.match(r"\s*template\s*<", header)
        if not m:
            return header
        depth, j = 1, m.end()
        while j < len(header) and depth:
            depth += {"<": 1, ">": -1}.get(header[j], 0)
            j += 1
        header = header[j:]


def top_level(header):
    """The header with everything inside (), [] and {} removed (the brackets kept)."""
    out, depth = [], 0
    for c in header:
        if c in "([{":
            if depth == 0:
                out.append(c)
            depth += 1
        elif c in ")]}":
            depth = max(depth - 1, 0)
            if depth == 0:
                out.append(c)
        elif depth == 0:
            out.append(c)
    return "".join(out)


def function_name(header):
    """The name before the first top-level '(' of a declaration header."""
    flat = top_level(header)
    k = flat.find("(")
    if k < 0:
        return None
    m = re.search(r"((?:[A-Za-z_~]\w*\s*::\s*)*"
                  r"(?:operator\s*(?:\(\)|[^\w\s(]+|\w[\w:<>\s*&]*)|~?[A-Za-z_]\w*))"
                  r"\s*(?:<[^()]*>)?\s*$", flat[:k])
    if not m:
        return None
    name = re.sub(r"\s*::\s*", "::", re.sub(r"\s+", " ", m.group(1).strip()))
    return None if name in NOT_NAMES else name


def classify(header):
    """What a '{' opened at namespace or class scope after `header` starts:
    ('scope', None), ('function', name), ('member_init', None) or ('init', None)."""
    h = drop_template_prefix(header)
    h = re.sub(r"^\s*(?:(?:public|private|protected)\s*:(?!:)\s*)+", "", h).strip()
    if not h:
        return "init", None
    flat = top_level(h)
    m = KEYWORD_SCOPE.match(flat)
    if m and "(" not in flat:
        return ("init", None) if m.group(1) == "enum" else ("scope", None)
    if m and m.group(1) == "extern" and re.match(r'extern\s*""\s*$', flat):
        return "scope", None
    # A lambda held by a variable: `auto f = [..](..) {`.
    lm = re.search(r"([A-Za-z_]\w*)\s*(?:\[[^\]]*\]\s*)?=\s*\[\]\s*(?:\(\))?[^=]*$", flat)
    if lm:
        return "function", lm.group(1)
    if "(" not in flat:
        return "init", None
    # Braced member initializer inside a constructor's initializer list: `: a_{x}, b_{y} {`.
    close = flat.find(")")
    tail = flat[close + 1:]
    if re.search(r"(?<!:):(?!:)", tail) \
            and re.search(r"(?:^|[,:])\s*[A-Za-z_][\w:]*\s*(?:<[^()]*>)?\s*$", tail) \
            and not re.search(r"\)\s*$", tail):
        return "member_init", None
    before_brace = flat.rstrip()
    if before_brace.endswith(("=", ",", "(", "return")):
        return "init", None
    eq = re.search(r"(?<![=!<>+\-*/%&|^])=(?!=)", flat[:flat.find("(")])
    if eq and "operator" not in flat[:eq.start() + 1]:
        return "init", None  # `T x = f(...){`, `auto v = std::array{...}`: not a definition
    name = function_name(h)
    if name is None:
        return "init", None
    return "function", name


def check_functions(path, text, limit):
    code = strip_code(text)
    violations = []
    # Stack entries: [kind, open_line, name, device]
    stack = []
    header_start = 0
    line = 1
    for i, c in enumerate(code):
        if c == "\n":
            line += 1
        elif c == "{":
            in_body = any(e[0] in ("function", "inner", "init", "member_init") for e in stack)
            if in_body:
                stack.append(["inner", line, None, False])
                continue
            header = code[header_start:i]
            kind, name = classify(header)
            device = bool(re.search(r"\b__(?:global|device)__\b", header))
            stack.append([kind, line, name, device])
            if kind == "scope":
                header_start = i + 1
        elif c == "}":
            if not stack:
                header_start = i + 1
                continue
            kind, open_line, name, device = stack.pop()
            if kind == "function":
                n = line - open_line + 1
                if n > limit and not device:
                    violations.append((path, open_line, name, n))
            if kind in ("function", "scope") and not any(
                    e[0] in ("function", "inner", "init", "member_init") for e in stack):
                header_start = i + 1
        elif c == ";":
            if not any(e[0] in ("function", "inner", "init", "member_init") for e in stack):
                header_start = i + 1
    return violations


def source_files(root):
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others",
                              "--exclude-standard", "--"] + list(DIRS),
                             check=True, capture_output=True, text=True).stdout
        files = out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        files = []
        for d in DIRS:
            for dp, dns, fns in os.walk(os.path.join(root, d)):
                dns[:] = [x for x in dns if x != "__pycache__"]
                files += [os.path.relpath(os.path.join(dp, f), root) for f in fns]
    return sorted({f for f in files
                   if f.endswith(SOURCE_EXT) and os.path.isfile(os.path.join(root, f))})


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    ap.add_argument("--max-file", type=int, default=800)
    ap.add_argument("--max-function", type=int, default=80)
    ap.add_argument("files", nargs="*")
    a = ap.parse_args()
    files = a.files or source_files(a.root)
    violations = []
    for f in files:
        p = os.path.join(a.root, f)
        try:
            with open(p, encoding="utf-8", errors="replace") as fh:
                text = fh.read()
        except OSError as e:
            print(f"check_shape: {f}: {e}", file=sys.stderr)
            return 2
        lines = text.count("\n") + (0 if text.endswith("\n") or not text else 1)
        if lines > a.max_file and not f.startswith(FILE_EXEMPT):
            violations.append((f, 1, "file", lines))
        if f.endswith(CXX_EXT):
            violations += check_functions(f, text, a.max_function)
    for path, line, name, n in violations:
        print(f"{path}:{line} {name} {n} lines")
    print(f"check_shape: {len(files)} file(s) checked, {len(violations)} violation(s)",
          file=sys.stderr)
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
