"""`remoe bench --suite machine` as a script.

    python benchmarks/bench_machine.py [--quick] [--threads N] [--out PATH] ...
"""

import sys

from remoe.lab.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["--suite", "machine", *sys.argv[1:]]))
