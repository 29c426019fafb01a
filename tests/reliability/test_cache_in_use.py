"""The data cache cannot change under a running reader, and a run keeps its own tokenizer.

A run training on a cache holds ``.readers/<pid>``: ``remoe data`` with other settings on that
cache (a new vocabulary) is refused in one line naming the PID, exit 2, and leaves the cache as
it was; with the same settings it reuses the cache. Once the run is gone, the rebuild goes
ahead. The run writes ``tokenizer.json`` (its own copy) and every checkpoint and ``final/`` get
that one; a resume on a cache rebuilt with another tokenizer is refused in one line.
"""

import hashlib
import json
import os
import shutil
import signal

import pytest

import remoe.train.trainer  # noqa: F401 - imported once here, not in the forked child
from remoe.cli import main


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _cache_tokenizer(cache):
    """The tokenizer of the cache's finished sharded store (``store-v2/<key16>/``)."""
    store = cache / "store-v2"
    return store / json.loads((store / "manifest.json").read_text())["dir"] / "tokenizer.json"


@pytest.fixture
def own_cache(tmp_path, rundir_data_cfg):
    """A private copy of the session's micro cache (this test rebuilds it)."""
    cache = tmp_path / "cache"
    shutil.copytree(rundir_data_cfg.cache_dir, cache, ignore=shutil.ignore_patterns(".readers"))
    return cache


def _data_argv(cache, cfg, vocab):
    return ["data", "--set", f"data.cache_dir={cache}",
            "--set", f"data.max_bytes_per_domain={cfg.max_bytes_per_domain}",
            "--set", f"data.vocab_size={vocab}"]


def test_cache_of_a_live_run_is_not_rebuilt(own_cache, rundir_data_cfg, tmp_path, train_argv,
                                            rd, capsys):
    run = tmp_path / "live"
    argv = train_argv(tmp_path, "live", **{"data.cache_dir": own_cache,
                                           "train.max_steps": 100000, "train.eval_every": 0,
                                           "train.save_every": 2, "train.keep_last": 1})
    pid = rd.fork_main(argv, tmp_path / "live.log")
    try:
        rd.wait_for(lambda: (run / "checkpoints" / "LATEST").exists(), timeout=600)
        before = {p.relative_to(own_cache): _sha(p) for p in own_cache.rglob("*")
                  if p.is_file() and ".readers" not in p.parts and p.name != ".lock"}
        capsys.readouterr()
        code = main(_data_argv(own_cache, rundir_data_cfg, rundir_data_cfg.vocab_size + 128))
        cap = capsys.readouterr()
        err = [x for x in (cap.out + cap.err).splitlines()
               if x.strip() and not x.startswith("[remoe.data")]  # (progress lines)
        assert code == 2 and len(err) == 1, err
        assert f"in use by pid {pid}" in err[0] and "data.cache_dir" in err[0], err
        after = {p.relative_to(own_cache): _sha(p) for p in own_cache.rglob("*")
                 if p.is_file() and ".readers" not in p.parts and p.name != ".lock"}
        assert after == before  # nothing changed under the run
        # the same settings: reused, no refusal
        assert main(_data_argv(own_cache, rundir_data_cfg, rundir_data_cfg.vocab_size)) == 0
        # the run trains with its own copy of the tokenizer, which its checkpoints hold
        assert _sha(run / "tokenizer.json") == _sha(_cache_tokenizer(own_cache))
    finally:
        os.kill(pid, signal.SIGKILL)
        rd.wait_exit(pid)
    # the reader is gone: the rebuild goes ahead
    assert main(_data_argv(own_cache, rundir_data_cfg, rundir_data_cfg.vocab_size + 128)) == 0
    # and a resume of the run on the rebuilt cache (another tokenizer) is refused in one line
    capsys.readouterr()
    code = main(train_argv(tmp_path, "live", "--resume",
                           **{"data.cache_dir": own_cache, "train.max_steps": 100000,
                              "train.eval_every": 0, "train.save_every": 2, "train.keep_last": 1,
                              "data.vocab_size": rundir_data_cfg.vocab_size + 128}))
    err = [x for x in capsys.readouterr().err.splitlines() if "error" in x]
    assert code == 2 and len(err) == 1, err
    assert "is not the one this run trained with" in err[0], err


def test_checkpoints_and_final_hold_the_runs_tokenizer(tmp_path, train_argv):
    assert main(train_argv(tmp_path, "r", **{"train.max_steps": 2, "train.eval_every": 0})) == 0
    run = tmp_path / "r"
    sha = _sha(run / "tokenizer.json")
    assert _sha(run / "final" / "tokenizer.json") == sha
    assert _sha(run / "checkpoints" / "step_0000002" / "tokenizer.json") == sha


def test_cache_read_by_load_prepared_is_not_rebuilt(own_cache, rundir_data_cfg, capsys):
    # `remoe eval` and the analyses open a cache with load_prepared: while such a process holds
    # its bundle, a build with other settings is refused as for a training run
    import subprocess
    import sys

    code = ("import sys, time\n"
            "from remoe.data import load_prepared\n"
            f"b = load_prepared({str(own_cache)!r}, verify=False)\n"
            "print('ready', flush=True)\n"
            "time.sleep(600)\n")
    reader = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "ready"
        before = _sha(_cache_tokenizer(own_cache))
        argv = _data_argv(own_cache, rundir_data_cfg, rundir_data_cfg.vocab_size + 128)
        capsys.readouterr()
        assert main(argv) == 2
        assert f"in use by pid {reader.pid}" in capsys.readouterr().err
        assert _sha(_cache_tokenizer(own_cache)) == before
    finally:
        reader.kill()
        reader.wait()
    assert main(_data_argv(own_cache, rundir_data_cfg, rundir_data_cfg.vocab_size + 128)) == 0
    assert _sha(_cache_tokenizer(own_cache)) != before
