"""ReMoEConfig: validation (one-line ConfigError naming the field), presets, round trips."""

from __future__ import annotations

import json
import math

import pytest
from transformers import AutoConfig, GenerationConfig

from remoe import PRESETS, ROUTERS, ConfigError, ReMoEConfig

MICRO = PRESETS["micro"]  # hidden 64, 4 heads, 2 kv heads, ffn 256


@pytest.mark.parametrize("overrides, field", [
    (dict(num_experts=8, top_k=9), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(alpha=1.0), "alpha"),
    (dict(alpha=0.5), "alpha"),
    (dict(alpha=math.inf), "alpha"),
    (dict(alpha=math.nan), "alpha"),
    (dict(granularity=3), "granularity"),  # 3 does not divide 256
    (dict(granularity=0), "granularity"),
    (dict(router="relu6"), "router"),
    (dict(num_heads=5), "num_heads"),  # 5 does not divide 64
    (dict(num_heads=3, num_kv_heads=3), "num_heads"),
    (dict(num_kv_heads=3), "num_kv_heads"),  # 3 does not divide 4
    (dict(hidden_size=48, num_heads=16, num_kv_heads=4), "hidden_size/num_heads"),  # odd RoPE dim
    (dict(hidden_size=0), "hidden_size"),
    (dict(vocab_size=-1), "vocab_size"),
    (dict(vocab_size=512.0), "vocab_size"),
    (dict(num_layers=0), "num_layers"),
    (dict(num_experts=0), "num_experts"),
    (dict(ffn_hidden_size=0), "ffn_hidden_size"),
    (dict(reg_type="l2"), "reg_type"),
    (dict(expert_backend="triton"), "expert_backend"),
    (dict(lambda0=0.0), "lambda0"),
    (dict(lambda0=-1e-8), "lambda0"),
    (dict(lambda0=math.inf), "lambda0"),
    (dict(lb_coeff=-0.01), "lb_coeff"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(router="topk_warmup", num_experts=4, warmup_k=6), "warmup_k"),
    (dict(sparsemixer_jitter=1.0), "sparsemixer_jitter"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(rope_theta="big"), "rope_theta"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(init_std=-0.02), "init_std"),
])
def test_impossible_values_raise_one_line_config_error(overrides, field):
    with pytest.raises(ConfigError) as info:
        ReMoEConfig(**{**MICRO, **overrides})
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"model.{field}="), msg
    assert isinstance(info.value, ValueError)  # callers catching ValueError still work


def test_unknown_preset():
    with pytest.raises(ConfigError, match=r"^model\.preset="):
        ReMoEConfig.from_preset("huge")


@pytest.mark.parametrize("router", ROUTERS)
def test_small_expert_counts_are_valid_for_every_router(router):
    # warmup_k (default 6) only constrains the topk_warmup router
    kw = dict(warmup_k=2) if router == "topk_warmup" else {}
    cfg = ReMoEConfig(**{**MICRO, "router": router, "num_experts": 4, "top_k": 1, **kw})
    assert cfg.num_experts == 4 and cfg.moe_top_k == 1


def test_edge_values_that_are_valid():
    assert ReMoEConfig(**{**MICRO, "num_experts": 8, "top_k": 8}).target_sparsity == 0.0  # k = E
    assert ReMoEConfig(**{**MICRO, "granularity": 256}).moe_config().d_expert == 1
    assert ReMoEConfig(**{**MICRO, "alpha": 1.0001, "lb_coeff": 0.0, "warmup_steps": 0}).alpha == 1.0001
    assert ReMoEConfig(**{**MICRO, "num_heads": 4, "num_kv_heads": 4}).num_kv_heads == 4  # MHA


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_defaults(name):
    cfg = ReMoEConfig.from_preset(name)
    for key, value in PRESETS[name].items():
        assert getattr(cfg, key) == value
    assert cfg.ffn_hidden_size == 4 * cfg.hidden_size
    assert (cfg.router, cfg.num_experts, cfg.moe_top_k, cfg.granularity) == ("relu", 8, 1, 1)
    assert (cfg.lambda0, cfg.alpha, cfg.lb_coeff, cfg.reg_type) == (1e-8, 1.2, 0.01, "lb")
    assert cfg.target_sparsity == 1 - 1 / 8
    assert cfg.head_dim * cfg.num_heads == cfg.hidden_size
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        cfg.num_layers, cfg.num_heads, cfg.num_kv_heads)
    assert not cfg.tie_word_embeddings


def test_paper_backbones():
    # Table 1: hidden, layers, heads, groups; context 1024; GPT-2 vocabulary padded to 50304
    for name, (d, L, h, g) in {"small": (768, 12, 12, 4), "medium": (1024, 24, 16, 4),
                               "large": (1536, 24, 16, 4)}.items():
        c = ReMoEConfig.from_preset(name)
        assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (d, L, h, g)
        assert c.max_position_embeddings == 1024 and c.vocab_size == 50304


def test_moe_config_mapping():
    cfg = ReMoEConfig(**{**MICRO, "num_experts": 4, "top_k": 2, "granularity": 2,
                         "reg_type": "l1", "expert_backend": "reference", "init_std": 0.1})
    m = cfg.moe_config()
    assert (m.d_model, m.d_ffn, m.num_experts, m.top_k, m.granularity) == (64, 256, 4, 2, 2)
    assert (m.router, m.reg_type, m.expert_backend, m.init_std) == ("relu", "l1", "reference", 0.1)
    assert (m.num_routed, m.d_expert, m.target_sparsity) == (8, 128, 0.5)
    assert ReMoEConfig(router="dense").is_moe is False and cfg.is_moe


def test_top_k_round_trips_as_moe_top_k(tmp_path):
    cfg = ReMoEConfig(**{**MICRO, "num_experts": 8, "top_k": 3, "granularity": 2})
    d = cfg.to_dict()
    assert d["moe_top_k"] == 3 and "top_k" not in d
    again = ReMoEConfig.from_dict(d)
    assert again.moe_top_k == 3 and again.to_dict() == d
    cfg.save_pretrained(tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk["moe_top_k"] == 3 and "top_k" not in on_disk
    assert on_disk["model_type"] == "remoe"
    for loaded in (ReMoEConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        assert isinstance(loaded, ReMoEConfig)
        assert loaded.moe_top_k == 3 and loaded.granularity == 2 and loaded.num_experts == 8
        volatile = ("_name_or_path", "transformers_version")
        strip = lambda x: {k: v for k, v in x.items() if k not in volatile}  # noqa: E731
        assert strip(loaded.to_dict()) == strip(d)
    # k is not mistaken for a sampling setting by generate()
    assert GenerationConfig.from_model_config(cfg).top_k == GenerationConfig().top_k
    # the constructor default is k = 1
    assert ReMoEConfig(**MICRO).moe_top_k == 1


def test_loading_an_impossible_config_json_raises(tmp_path):
    ReMoEConfig(**MICRO).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["moe_top_k"] = 9
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"^model\.top_k=9"):
        ReMoEConfig.from_pretrained(tmp_path)


def test_from_pretrained_top_k_override(tmp_path):
    ReMoEConfig(**{**MICRO, "top_k": 2}).save_pretrained(tmp_path)
    assert ReMoEConfig.from_pretrained(tmp_path).moe_top_k == 2
    assert ReMoEConfig.from_pretrained(tmp_path, top_k=3).moe_top_k == 3
