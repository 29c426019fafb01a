"""remoe convert: upcycling, Mixtral import and export, on tiny random models (no downloads).

Qwen2-MoE, OLMoE and the dense -> Llama export: test_convert_families.py."""

from __future__ import annotations

import json

import pytest
import torch

from remoe import ReMoEConfig, ReMoEForCausalLM
from remoe.model.moe import MoELayer
from remoe.model.routers.base import Routing

from .conftest import BACKBONE, randomize, run_convert, token_ids


def _one_hot_routers(model):
    """Test-only override: token t uses expert t mod N with gate exactly 1."""
    for m in model.modules():
        if isinstance(m, MoELayer):
            def forward(x_TD, ctx, N=m.cfg.num_routed):
                T = x_TD.shape[0]
                mask = torch.zeros(T, N, dtype=torch.bool)
                mask[torch.arange(T), torch.arange(T) % N] = True
                z = x_TD.new_zeros(())
                return Routing(mask.to(x_TD.dtype), mask, z, z)
            m.router.forward = forward


@pytest.fixture
def llama_dir(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    m = randomize(LlamaForCausalLM(LlamaConfig(**BACKBONE, intermediate_size=48)))
    m.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama", m


@pytest.fixture
def mixtral_dir(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    cfg = MixtralConfig(**BACKBONE, intermediate_size=24, num_local_experts=4,
                        num_experts_per_tok=2)
    m = randomize(MixtralForCausalLM(cfg), seed=3)
    m.save_pretrained(tmp_path / "mixtral")
    return tmp_path / "mixtral", m


def test_upcycle_llama_copies_everything_and_one_hot_gates_give_dense_logits(llama_dir, tmp_path):
    src, llama = llama_dir
    assert run_convert("upcycle", src, tmp_path / "up", "--experts", 4, "--top-k", 2) == 0
    moe = ReMoEForCausalLM.from_pretrained(tmp_path / "up").eval()
    b, r = moe.config.backbone, moe.config.routing
    assert (r.router, r.num_experts, r.top_k, b.rope_theta, b.rms_norm_eps, b.num_kv_heads,
            b.ffn_hidden_size, b.vocab_size) == ("relu", 4, 2, 5000.0, 1e-6, 2, 48, 96)
    hf = llama.state_dict()
    ours = moe.state_dict()
    for i in range(2):
        assert torch.equal(ours[f"layers.{i}.attn.k_proj.weight"],
                           hf[f"model.layers.{i}.self_attn.k_proj.weight"])
        assert torch.equal(ours[f"layers.{i}.ffn_norm.weight"],
                           hf[f"model.layers.{i}.post_attention_layernorm.weight"])
        w_in = ours[f"layers.{i}.ffn.experts.w_in_ND2H"]
        w_out = ours[f"layers.{i}.ffn.experts.w_out_NHD"]
        for e in range(4):
            assert torch.equal(w_in[e, :, :48], hf[f"model.layers.{i}.mlp.gate_proj.weight"].t())
            assert torch.equal(w_in[e, :, 48:], hf[f"model.layers.{i}.mlp.up_proj.weight"].t())
            assert torch.equal(w_out[e], hf[f"model.layers.{i}.mlp.down_proj.weight"].t())
        r = ours[f"layers.{i}.ffn.router.weight"]
        assert r.shape == (4, 32) and 0.01 < r.std() < 0.04  # fresh, init_std=0.02
    assert torch.equal(ours["lm_head.weight"], hf["lm_head.weight"])
    assert torch.equal(ours["embed_tokens.weight"], hf["model.embed_tokens.weight"])
    ids = token_ids()
    with torch.no_grad():
        relu_logits = moe(ids).logits
        _one_hot_routers(moe)
        got, want = moe(ids).logits, llama(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert not torch.allclose(relu_logits, want, atol=1e-2)  # the real router does change it


def test_upcycle_our_dense_model(tmp_path):
    from remoe.convert.upcycle import upcycle

    torch.manual_seed(0)
    dense = randomize(ReMoEForCausalLM(ReMoEConfig.from_preset(
        "micro", router="dense", vocab_size=80, ffn_hidden_size=96, init_std=0.01)))
    moe = upcycle(dense, experts=3, top_k=1, seed=5)
    assert moe.config.routing.router == "relu" and moe.config.backbone.init_std == 0.01
    d, m = dense.state_dict(), moe.state_dict()
    for k, v in d.items():
        if ".ffn." not in k:
            assert torch.equal(m[k], v), k
    assert 0.005 < m["layers.0.ffn.router.weight"].std() < 0.02
    ids = token_ids(80)
    with torch.no_grad():
        _one_hot_routers(moe)
        assert torch.allclose(moe(ids).logits, dense(ids).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(Exception, match="router='relu' must be 'dense'"):
        upcycle(moe, experts=3)


def test_from_hf_mixtral_topk_matches_and_relu_router_is_the_same_softmax(mixtral_dir, tmp_path):
    src, mix = mixtral_dir
    assert run_convert("from-hf", src, tmp_path / "topk", "--router", "topk") == 0
    ours = ReMoEForCausalLM.from_pretrained(tmp_path / "topk").eval()
    b, r = ours.config.backbone, ours.config.routing
    assert (r.router, r.options.topk_normalize, r.num_experts, r.top_k, b.ffn_hidden_size) == \
        ("topk", True, 4, 2, 24)
    hf, sd = mix.state_dict(), ours.state_dict()
    for i in range(2):
        assert torch.equal(sd[f"layers.{i}.ffn.router.weight"],
                           hf[f"model.layers.{i}.mlp.gate.weight"])
        assert torch.equal(sd[f"layers.{i}.ffn.experts.w_in_ND2H"],
                           hf[f"model.layers.{i}.mlp.experts.gate_up_proj"].transpose(1, 2))
        assert torch.equal(sd[f"layers.{i}.attn.q_proj.weight"],
                           hf[f"model.layers.{i}.self_attn.q_proj.weight"])
    ids = token_ids()
    with torch.no_grad():
        got, want = ours(ids).logits, mix(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()

    assert run_convert("from-hf", src, tmp_path / "relu") == 0
    relu = ReMoEForCausalLM.from_pretrained(tmp_path / "relu").eval()
    assert relu.config.routing.router == "relu" and relu.config.routing.top_k == 2
    w, w2 = hf["model.layers.0.mlp.gate.weight"], relu.state_dict()["layers.0.ffn.router.weight"]
    x = torch.randn(50, 32)
    assert torch.allclose(torch.softmax(x @ w.t(), -1), torch.softmax(x @ w2.t(), -1), atol=1e-6)
    assert torch.allclose((x @ w2.t()).mean(-1), torch.zeros(50), atol=1e-5)  # centred logits
    with torch.no_grad():
        out = relu(ids)
    assert torch.isfinite(out.logits).all() and 0.0 < float(out.aux.sparsity) < 1.0


def test_to_hf_writes_a_mixtral_with_the_same_logits(tmp_path, capsys):
    from transformers import MixtralForCausalLM

    torch.manual_seed(0)
    ours = randomize(ReMoEForCausalLM(ReMoEConfig.from_preset(
        "micro", router="topk", topk_normalize=True, num_experts=4, top_k=1, granularity=2,
        vocab_size=72, rope_theta=1e4, rms_norm_eps=1e-6)))
    ours.save_pretrained(tmp_path / "ours")
    assert run_convert("to-hf", tmp_path / "ours", tmp_path / "mix") == 0
    cfg = json.loads((tmp_path / "mix" / "config.json").read_text())
    assert cfg["model_type"] == "mixtral" and "auto_map" not in cfg
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"],
            cfg["intermediate_size"]) == (8, 2, 128)  # E*G experts of width d_ffn/G, k*G used
    mix = MixtralForCausalLM.from_pretrained(tmp_path / "mix").eval()
    ids = token_ids(72)
    with torch.no_grad():
        got, want = mix(ids).logits, ours(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("overrides, reason", [
    (dict(router="relu"), "router='relu' cannot be written as Mixtral"),
    (dict(router="topk", topk_normalize=False), "topk_normalize=false cannot be written"),
    (dict(router="expert_choice"), "router='expert_choice' cannot be written"),
])
def test_to_hf_refuses_what_is_not_lossless(tmp_path, capsys, overrides, reason):
    cfg = ReMoEConfig.from_preset("micro", vocab_size=64, num_experts=4, **overrides)
    m = ReMoEForCausalLM(cfg)
    m.save_pretrained(tmp_path / "ours")
    capsys.readouterr()  # the save's progress bar
    assert run_convert("to-hf", tmp_path / "ours", tmp_path / "mix") == 2
    err = capsys.readouterr().err.strip()
    assert reason in err and len(err.splitlines()) == 1
    assert not (tmp_path / "mix" / "config.json").exists()


def test_from_hf_refuses_qwen3_moe_with_the_reason(tmp_path, capsys):
    (tmp_path / "q").mkdir()
    (tmp_path / "q" / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert run_convert("from-hf", tmp_path / "q", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert "each query/key head on its own" in err and len(err.splitlines()) == 1
