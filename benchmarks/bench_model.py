"""`remoe bench --suite model` as a script.

    python benchmarks/bench_model.py [--quick] [--threads N] [--out PATH] ...
"""

import sys

from remoe.lab.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["--suite", "model", *sys.argv[1:]]))
