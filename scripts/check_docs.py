#!/usr/bin/python3
"""check_docs.py: the names a design document gives must exist in the code.

Usage: scripts/check_docs.py [--root DIR] [-v] [FILE ...]
       scripts/check_docs.py --counts [--root DIR] [FILE ...]
       (default FILE: docs/architecture.md; paths are relative to the repository root)

--counts checks, instead of the names, the numbers a document says it took from a test suite
(docs/reliability.md's): each number followed by an HTML comment (invisible once rendered)
  N<!-- count: tests/server/test_x.py -->            the file's `def test_` functions
  N<!-- count: tests/server/test_x.py test_y cases -->  the items of the list literal
                                                     assigned to `cases` in function test_y
must equal what it names, counted from the file's Python syntax tree. Exit 1 when one differs
or names nothing (each is listed with the document's line).

Reads the backticked spans (`...`) of each FILE, outside fenced code blocks (```), and checks
two kinds of them; everything else is ignored. Exit 0 when every checked name exists, 1 when
some do not (each is listed with its file and line), 2 on a usage error.

Which files count as "the repository": `git ls-files --cached --others --exclude-standard`
(tracked files plus new files git does not ignore), keeping those present on disk; without
git, every file under the root except .git/, build*/ and third_party/.

1. Paths. A span is a path when it consists only of letters, digits and _ . - / * and either
   contains a '/', ends in '.*' or ends in a known extension (.h .hpp .cuh .cpp .cc .cu .proto
   .py .sh .md .json .txt .yml .yaml .cjs .safetensors .model). A path is relative to the repository root
   and must name a file or a directory of it (a trailing '/' asks for a directory). '*'
   matches within one path component, '**' across components; a glob must match at least one
   file. Spans that begin with '/' (HTTP routes, absolute paths) or '-' (flags) are not paths.
   A bare file name without a '/' is checked at the root too, so write paths in full.

2. C++ symbols: a span that is an identifier or identifiers joined by '::' or '.', optionally
   followed by '()', and looks like a type or function name:
   - it contains '::' or '.' (`runtime::generate`, `RingAttention::begin_step`,
     `StepReply.tokens`), or ends in '()';
   - or it is PascalCase (`BatchRunner`: an uppercase first letter and a lowercase letter);
   - or it is a kConstant (`kPreviousToken`);
   - or it is snake_case with an underscore (`kv_pages_needed`, `attention_cuda`).
   Every part (A and B of `A::B`) must occur as a whole word in some *.h *.hpp *.cuh *.cpp
   *.cc *.cu *.proto file or CMakeLists.txt of the repository (comments and strings included: a
   config key, a proto field or a build target counts). Not checked: single lowercase words (`step`, `launch`: too common to
   mean anything), ALL_CAPS words (environment variables, macros, gRPC codes), numbers, and
   any span with whitespace, '=', '<', '>', '$', '"', ',' or a ':' that is not '::' (commands,
   flags with values, templates, key=value settings, URLs).
"""

import argparse
import ast
import os
import re
import subprocess
import sys

PATH_EXTENSIONS = (".h", ".hpp", ".cuh", ".cpp", ".cc", ".cu", ".proto", ".py", ".sh", ".md",
                   ".json", ".txt", ".yml", ".yaml", ".cjs", ".safetensors", ".model")
SOURCE_EXTENSIONS = (".h", ".hpp", ".cuh", ".cpp", ".cc", ".cu", ".proto")
SKIP_DIRS = {".git", "third_party"}

PATH_CHARS = re.compile(r"^[A-Za-z0-9_.\-/*]+$")
IDENT = r"~?[A-Za-z_][A-Za-z0-9_]*"
SYMBOL = re.compile(r"^(%s)((?:(?:::|\.)%s)*)(\(\))?$" % (IDENT, IDENT))
WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def repo_files(root):
    """Relative paths of the repository's files (see the header)."""
    try:
        out = subprocess.run(
            ["git", "-C", root, "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL).stdout
        files = {p for p in out.decode("utf-8", "replace").split("\0") if p}
        return {p for p in files if os.path.isfile(os.path.join(root, p))}
    except (OSError, subprocess.CalledProcessError):
        files = set()
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames
                           if d not in SKIP_DIRS and not d.startswith("build")]
            for f in filenames:
                files.add(os.path.relpath(os.path.join(dirpath, f), root).replace(os.sep, "/"))
        return files


def source_words(root, files):
    """Every identifier-like word of the C++/CUDA/proto sources."""
    words = set()
    for p in files:
        if not p.endswith(SOURCE_EXTENSIONS) and os.path.basename(p) != "CMakeLists.txt":
            continue
        try:
            with open(os.path.join(root, p), encoding="utf-8", errors="replace") as f:
                words.update(WORD.findall(f.read()))
        except OSError:
            pass
    return words


def glob_regex(pattern):
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("^" + "".join(out) + "$")


def backticked(text):
    """(line number, span) of each `span` outside fenced code blocks."""
    spans = []
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced:
            continue
        for m in re.finditer(r"(`+)([^`]+?)\1(?!`)", line):
            spans.append((n, m.group(2).strip()))
    return spans


def classify(span):
    """'path', 'symbol' or None (not checked)."""
    if not span or span[0] in "/-" or any(c.isspace() for c in span):
        return None
    if PATH_CHARS.match(span) and ("/" in span or span.endswith((".*",) + PATH_EXTENSIONS)):
        return "path"
    m = SYMBOL.match(span)
    if not m:
        return None
    first, rest, call = m.group(1), m.group(2), m.group(3)
    if rest or call:
        return "symbol"
    name = first.lstrip("~")
    if re.match(r"^k[A-Z]", name):
        return "symbol"
    if name[0].isupper() and any(c.islower() for c in name):
        return "symbol"
    if "_" in name.strip("_") and any(c.islower() for c in name):
        return "symbol"
    return None


def path_exists(span, files, dirs):
    if "*" in span:
        rx = glob_regex(span.rstrip("/"))
        return any(rx.match(f) for f in files) or any(rx.match(d) for d in dirs)
    if span.endswith("/"):
        return span.rstrip("/") in dirs
    return span in files or span in dirs


def symbol_parts(span):
    span = span[:-2] if span.endswith("()") else span
    return [p.lstrip("~") for p in re.split(r"::|\.", span) if p]


COUNT = re.compile(r"(\d+)\s*<!--\s*count:\s*(\S+)(?:\s+(\w+)\s+(\w+))?\s*-->")


def suite_count(root, path, function, variable):
    """What a count comment names (see the header), or a string saying why it names nothing."""
    try:
        with open(os.path.join(root, path), encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError) as e:
        return "cannot read %s: %s" % (path, e)
    if function is None:
        return sum(1 for n in tree.body
                   if isinstance(n, ast.FunctionDef) and n.name.startswith("test_"))
    for n in tree.body:
        if isinstance(n, ast.FunctionDef) and n.name == function:
            for a in ast.walk(n):
                if (isinstance(a, ast.Assign) and isinstance(a.value, (ast.List, ast.Tuple)) and
                        any(isinstance(t, ast.Name) and t.id == variable for t in a.targets)):
                    return len(a.value.elts)
            return "%s in %s assigns no list to %s" % (function, path, variable)
    return "%s has no function %s" % (path, function)


def check_counts(root, doc, text):
    """The count comments of one document: (how many, [problems])."""
    problems, checked = [], 0
    for n, line in enumerate(text.splitlines(), 1):
        for m in COUNT.finditer(line):
            checked += 1
            said, path, function, variable = int(m.group(1)), m.group(2), m.group(3), m.group(4)
            got = suite_count(root, path, function, variable)
            what = path + ("" if function is None else " %s %s" % (function, variable))
            if isinstance(got, str):
                problems.append("%s:%d: %s" % (doc, n, got))
            elif got != said:
                problems.append("%s:%d: says %d, %s holds %d" % (doc, n, said, what, got))
    return checked, problems


def main(argv):
    parser = argparse.ArgumentParser(
        description="Check that the file paths and C++ symbols a document names in backticks "
                    "exist in the repository (heuristics in this script's header).")
    parser.add_argument("files", nargs="*", default=["docs/architecture.md"],
                        help="documents to check, relative to the root "
                             "(default: docs/architecture.md)")
    parser.add_argument("--root", default=None,
                        help="repository root (default: the parent of this script's folder)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="list every checked name, not only the missing ones")
    parser.add_argument("--counts", action="store_true",
                        help="check the numbers marked as taken from a test suite instead")
    args = parser.parse_args(argv)

    root = os.path.abspath(args.root or os.path.join(os.path.dirname(__file__), ".."))
    if args.counts:
        problems, checked = [], 0
        for doc in args.files:
            try:
                with open(os.path.join(root, doc), encoding="utf-8") as f:
                    c, p = check_counts(root, doc, f.read())
            except OSError as e:
                print("check_docs: cannot read %s: %s" % (doc, e.strerror), file=sys.stderr)
                return 2
            checked += c
            problems += p
        for p in problems:
            print(p)
        print("check_docs: %d count(s) checked, %d wrong" % (checked, len(problems)),
              file=sys.stderr)
        return 1 if problems or checked == 0 else 0
    files = repo_files(root)
    dirs = set()
    for f in files:
        parts = f.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    words = source_words(root, files)

    missing = []
    checked = 0
    for doc in args.files:
        path = doc if os.path.isabs(doc) else os.path.join(root, doc)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            print("check_docs: cannot read %s: %s" % (doc, e.strerror), file=sys.stderr)
            return 2
        for line, span in backticked(text):
            kind = classify(span)
            if kind is None:
                continue
            checked += 1
            if kind == "path":
                ok = path_exists(span, files, dirs)
                why = "no such file or directory"
            else:
                absent = [p for p in symbol_parts(span) if p not in words]
                ok = not absent
                why = "not in the sources: " + ", ".join(absent)
            if args.verbose:
                print("%s:%d: %s %s: %s" % (doc, line, kind, span, "ok" if ok else why))
            if not ok:
                missing.append("%s:%d: %s `%s`: %s" % (doc, line, kind, span, why))

    for m in missing:
        print(m)
    print("check_docs: %d name(s) checked, %d missing" % (checked, len(missing)),
          file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
