"""remoe bench --suite scale: the harness (torchrun worker, metrics, per-rank peak RSS) on one
process with a micro model; the 2- and 4-process layouts are exercised by test_fsdp_train."""

from remoe.lab.bench.scale import LAYOUTS, run_scale


def test_scale_rows(micro_data_cfg):
    extra = ["model.preset=micro", "train.seq_len=32", "train.micro_batch_size=2",
             f"data.cache_dir={micro_data_cfg.cache_dir}",
             f"data.max_bytes_per_domain={micro_data_cfg.max_bytes_per_domain}",
             f"data.vocab_size={micro_data_cfg.vocab_size}"]
    res = run_scale(None, worlds=(1,), steps=3, extra=extra)
    assert set(LAYOUTS) == {"ddp", "fsdp", "fsdp+ep"}
    (row,) = res["rows"]  # one process: one row (nothing is sharded in any layout)
    assert row["world"] == 1 and row["layout"].startswith("1 process")
    assert row["step_tokens"] == 2 * 33
    assert row["tokens_per_s"] > 0 and row["tokens_per_s_per_rank"] == row["tokens_per_s"]
    assert len(row["peak_rss_mb"]) == 1 and 50 < row["peak_rss_mb_max"] < 20_000
    assert row["steps_measured"] == 1  # steps after the first two
