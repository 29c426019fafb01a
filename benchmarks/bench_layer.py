"""`remoe bench --suite layer` as a script.

    python benchmarks/bench_layer.py [--quick] [--threads N] [--out PATH] ...
"""

import sys

from remoe.lab.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["--suite", "layer", *sys.argv[1:]]))
