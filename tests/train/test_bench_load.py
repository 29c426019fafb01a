"""remoe bench --suite load: one measured run reads tokens/s and threads back from metrics."""

from remoe.lab.bench.scale import _settings, _train


def test_settings_cover_all_cores_one_thread_and_auto():
    assert [t for _, t in _settings(2)] == ["2", "1", "auto"]
    assert [t for _, t in _settings(1)] == ["1", "auto"]


def test_one_load_run_reports_tokens_per_s_and_threads(make_overrides, tmp_path):
    extra = [o for o in make_overrides(tmp_path, "x") if not o.startswith(("run.", "train.max_steps"))]
    r = _train(None, "null", 9, tmp_path, "auto", "default", None, extra)
    assert r["tokens_per_s"] > 0 and r["steps_measured"] == 3
    assert set(r["threads_used"]) <= {1, 2} and r["threads_used"]
