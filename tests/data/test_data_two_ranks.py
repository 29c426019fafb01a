"""Two gloo ranks train on one sharded store that a single `remoe data` prepared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from conftest import VOCAB, make_text  # noqa: E402


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_open_the_same_shards_without_building(tmp_path):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": make_text(d, i, 200), "meta": {
        "pile_set_name": d}}) + "\n" for i in range(14) for d in VOCAB))
    cache = tmp_path / "cache"
    data = ["--source", str(src), "--cache-dir", str(cache), "--vocab-size", "300",
            "--shard-bytes", "4000", "--quiet"]
    r = subprocess.run([sys.executable, "-m", "remoe.cli", "data", *data], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    shards = sorted(cache.glob("store-v2/*/shards/u*.bin"))
    assert len(shards) > 3
    before = {p: p.stat().st_mtime_ns for p in cache.glob("store-v2/**/*") if p.is_file()}
    sets = {"run.out_dir": tmp_path / "runs", "run.name": "two", "model.preset": "micro",
            "data.sources": f"[{src}]", "data.cache_dir": cache, "data.vocab_size": 300,
            "train.seq_len": 32, "train.micro_batch_size": 2, "train.grad_accum": 1,
            "train.max_steps": 2, "train.warmup_steps": 1, "train.eval_every": 2,
            "train.eval_chunks_per_domain": 1, "train.save_every": 2, "train.log_every": 0,
            "train.num_threads": 1}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
           f"--master_port={_free_port()}", "-m", "remoe.cli", "train", "--no-progress"]
    cmd += [f"--set={k}={v}" for k, v in sets.items()]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "runs/two/metrics.jsonl").read_text().splitlines()
            if x.strip()]
    assert [row["step"] for row in rows if "lm_loss" in row][-1] == 2
    after = {p: p.stat().st_mtime_ns for p in cache.glob("store-v2/**/*") if p.is_file()}
    assert after == before  # opened by both ranks, rebuilt by none
