# The King James Bible as Debian's bible-kjv prints it (`bible Gen1:1-Rev22:21`), parsed into
# verses: burst-bench's KJV workload (workload.kjv_corpus) and the tiny model's training text
# (scripts/train_tiny_model.py) read it through this one parser. Standard library only.
import re


def kjv_verses(text):
    """The verses of `bible`'s output, in order, verse numbers dropped, wrapped lines joined;
    an empty string where a chapter heading stood."""
    verses = []
    for line in text.splitlines():
        if not line.strip():
            continue
        m = re.match(r"^\s+\d+ (.*)$", line)
        if m:
            verses.append(m.group(1).strip())
        elif line.startswith(" ") or not re.match(r"^\S.* \d+$", line):
            if verses:
                verses[-1] += " " + line.strip()  # a wrapped verse continues
        else:
            verses.append("")  # a chapter heading
    return verses


def kjv_chapters(text):
    """The chapters of `bible`'s output, each its verses one a line."""
    chapters, verses = [], []
    for v in kjv_verses(text) + [""]:
        if v:
            verses.append(v)
        elif verses:
            chapters.append("\n".join(verses))
            verses = []
    return chapters
