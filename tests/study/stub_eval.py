"""A stand-in for ``remoe eval RUN --tasks T --no-loss [--limit N]`` in the study tests.

Writes ``RUN/eval_results.json`` in remoe eval's layout with two tasks; appends
``eval <run name> <argv>`` to ``<study out>/stub_calls.log``. Env: STUB_EVAL_FAIL (a run name
that exits with status 4).
"""

import json
import os
import sys
from pathlib import Path

run_dir, argv = Path(sys.argv[1]), sys.argv[2:]
tasks = argv[argv.index("--tasks") + 1]
limit = int(argv[argv.index("--limit") + 1]) if "--limit" in argv else None
with open(run_dir.parent.parent / "stub_calls.log", "a") as fh:
    fh.write(f"eval {run_dir.name} {' '.join(argv)}\n")
if os.environ.get("STUB_EVAL_FAIL") == run_dir.name:
    print("stub eval: simulated failure", flush=True)
    sys.exit(4)
seed = int(run_dir.name.rsplit("-s", 1)[1])
doc = {"split": None, "limit": limit,
       "tasks": {"selection": tasks, "columns": [["t_a", "Task A* (acc)", "acc"],
                                                 ["t_b", "Task B* (MI)", "acc_mutual_info"]]},
       "models": [{"name": run_dir.name, "zero_shot": {
           "t_a": {"acc": 0.25 + 0.1 * seed}, "t_b": {"acc": 0.0, "acc_mutual_info": 0.5}}}]}
(run_dir / "eval_results.json").write_text(json.dumps(doc))
