#!/usr/bin/python3
# burst-bench's entry script, the path that build/bin/burst-bench (bench/launcher.cpp), scripts/
# and the docs run: it puts bench/ on sys.path and calls the package bench/burstbench, where the
# load generator is (its __init__.py describes the tool and its modules; `--help` prints it).
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.realpath(__file__)))

from burstbench.main import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
