"""remoe convert for Qwen2-MoE and OLMoE (q/k/v biases, q/k norm, shared expert) and the dense
-> Llama export, on tiny random models built here (no downloads)."""

from __future__ import annotations

import json

import pytest
import torch

from remoe import ReMoEConfig, ReMoEForCausalLM

from .conftest import BACKBONE, randomize, run_convert, token_ids


def _save(model, path):
    model.save_pretrained(path)
    return path


def _qwen2_moe(norm_topk_prob: bool, **over):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2MoeConfig(**BACKBONE, intermediate_size=40, moe_intermediate_size=24,
                         shared_expert_intermediate_size=40, num_experts=4,
                         num_experts_per_tok=2, norm_topk_prob=norm_topk_prob, qkv_bias=True,
                         **over)
    return randomize(Qwen2MoeForCausalLM(cfg), seed=4)


def _olmoe(norm_topk_prob: bool):
    from transformers import OlmoeConfig, OlmoeForCausalLM

    torch.manual_seed(0)
    cfg = OlmoeConfig(**BACKBONE, intermediate_size=24, num_experts=4, num_experts_per_tok=2,
                      norm_topk_prob=norm_topk_prob)
    return randomize(OlmoeForCausalLM(cfg), seed=5)


def _same_logits(ours, theirs, ids):
    with torch.no_grad():
        got, want = ours(ids).logits, theirs(ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


def _cached_decoding_matches(model, ids):
    """The KV cache (k cached after its norm and RoPE) gives the full forward's last logits."""
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        out = model(ids[:, :-1], use_cache=True)
        step = model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
    assert torch.allclose(step.logits[:, -1], full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family, norm", [("qwen2_moe", False), ("qwen2_moe", True),
                                          ("olmoe", False), ("olmoe", True)])
def test_from_hf_topk_gives_the_same_logits(tmp_path, family, norm):
    src = (_qwen2_moe if family == "qwen2_moe" else _olmoe)(norm)
    assert run_convert("from-hf", _save(src, tmp_path / "src"), tmp_path / "topk",
                       "--router", "topk") == 0
    ours = ReMoEForCausalLM.from_pretrained(tmp_path / "topk").eval()
    b, r = ours.config.backbone, ours.config.routing
    assert (r.router, r.options.topk_normalize, r.num_experts, r.top_k, b.ffn_hidden_size) == \
        ("topk", norm, 4, 2, 24)
    assert (b.attention_bias, b.qk_norm, r.shared_expert_size) == \
        ((True, False, 40) if family == "qwen2_moe" else (False, True, 0))
    ids = token_ids()
    _same_logits(ours, src, ids)
    _cached_decoding_matches(ours, ids)


@pytest.mark.parametrize("family, norm", [("qwen2_moe", False), ("olmoe", True)])
def test_to_hf_writes_a_converted_qwen2_moe_or_olmoe_back(tmp_path, family, norm):
    """from-hf --router topk, then to-hf: the same transformers family, the source's logits."""
    src = (_qwen2_moe if family == "qwen2_moe" else _olmoe)(norm)
    assert run_convert("from-hf", _save(src, tmp_path / "src"), tmp_path / "ours",
                       "--router", "topk") == 0
    assert run_convert("to-hf", tmp_path / "ours", tmp_path / "back") == 0
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["norm_topk_prob"] is norm
    from transformers import AutoModelForCausalLM

    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(src)
    _same_logits(back, src, token_ids())


def test_from_hf_qwen2_moe_relu_keeps_experts_shared_expert_and_biases(tmp_path):
    src = _qwen2_moe(False)
    assert run_convert("from-hf", _save(src, tmp_path / "src"), tmp_path / "relu") == 0
    relu = ReMoEForCausalLM.from_pretrained(tmp_path / "relu").eval()
    assert relu.config.routing.router == "relu" and relu.config.routing.target_sparsity == 0.5
    hf, sd = src.state_dict(), relu.state_dict()
    p = "model.layers.1."
    assert torch.equal(sd["layers.1.ffn.experts.w_out_NHD"],
                       hf[p + "mlp.experts.down_proj"].transpose(1, 2))
    assert torch.equal(sd["layers.1.ffn.shared_expert.ffn.w_up.weight"],
                       hf[p + "mlp.shared_expert.up_proj.weight"])
    assert torch.equal(sd["layers.1.ffn.shared_expert.gate.weight"],
                       hf[p + "mlp.shared_expert_gate.weight"])
    assert torch.equal(sd["layers.1.attn.k_proj.bias"], hf[p + "self_attn.k_proj.bias"])
    w, w2 = hf[p + "mlp.gate.weight"], sd["layers.1.ffn.router.weight"]
    assert torch.allclose(w2, w - w.mean(0, keepdim=True))  # the same softmax, centred logits
    out = relu(token_ids(), labels=token_ids())
    assert torch.isfinite(out.logits).all() and 0.0 < float(out.aux.sparsity) < 1.0
    out.loss.backward()  # trainable as it is: the shared expert and the biases learn too
    assert relu.layers[0].ffn.shared_expert.gate.weight.grad.abs().sum() > 0
    assert relu.layers[0].attn.q_proj.bias.grad.abs().sum() > 0


def test_from_hf_olmoe_relu_keeps_the_qk_norms(tmp_path):
    src = _olmoe(True)
    assert run_convert("from-hf", _save(src, tmp_path / "src"), tmp_path / "relu") == 0
    relu = ReMoEForCausalLM.from_pretrained(tmp_path / "relu").eval()
    hf, sd = src.state_dict(), relu.state_dict()
    assert torch.equal(sd["layers.0.attn.q_norm.weight"],
                       hf["model.layers.0.self_attn.q_norm.weight"])
    assert sd["layers.0.attn.k_norm.weight"].shape == (16,)  # Hkv * Dh = 2 * 8
    assert torch.equal(sd["layers.0.ffn.experts.w_in_ND2H"],
                       hf["model.layers.0.mlp.experts.gate_up_proj"].transpose(1, 2))
    with torch.no_grad():
        out = relu(token_ids())
    assert torch.isfinite(out.logits).all() and 0.0 < float(out.aux.sparsity) < 1.0


def test_from_hf_refuses_qwen2_moe_dense_layers(tmp_path, capsys):
    _save(_qwen2_moe(False, mlp_only_layers=[1]), tmp_path / "src")
    capsys.readouterr()  # the save's progress bar
    assert run_convert("from-hf", tmp_path / "src", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert "mlp_only_layers=[1]" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("router, bias", [("dense", False), ("dense", True),
                                          ("dense_wide", False)])
def test_to_hf_writes_a_dense_model_as_llama_with_the_same_logits(tmp_path, router, bias):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    ours = randomize(ReMoEForCausalLM(ReMoEConfig.from_preset(
        "micro", router=router, num_experts=2, vocab_size=72, ffn_hidden_size=48,
        attention_bias=bias, rope_theta=1e4)))
    ours.save_pretrained(tmp_path / "ours")
    assert run_convert("to-hf", tmp_path / "ours", tmp_path / "llama") == 0
    cfg = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "auto_map" not in cfg
    assert cfg["intermediate_size"] == (96 if router == "dense_wide" else 48)
    assert cfg["attention_bias"] is bias
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    _same_logits(llama, ours, token_ids(72))


@pytest.mark.parametrize("overrides, reason", [
    (dict(router="dense", qk_norm=True), "qk_norm=true cannot be written as Llama"),
    (dict(router="relu", shared_expert_size=16), "router='relu' cannot be written as Qwen2-MoE"),
    (dict(router="topk", qk_norm=True, shared_expert_size=16),
     "shared_expert_size=16 cannot be written as OLMoE"),
    (dict(router="topk", topk_normalize=True, attention_bias=True),
     "attention_bias=true cannot be written as Qwen2-MoE"),
])
def test_to_hf_refuses_parts_the_target_lacks(tmp_path, capsys, overrides, reason):
    ReMoEForCausalLM(ReMoEConfig.from_preset("micro", vocab_size=64, num_experts=4,
                                             **overrides)).save_pretrained(tmp_path / "ours")
    capsys.readouterr()
    assert run_convert("to-hf", tmp_path / "ours", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip()
    assert reason in err and len(err.splitlines()) == 1


def test_shared_expert_and_attention_options_are_off_by_default():
    """Defaults build today's model: no bias, no q/k norm, no shared expert parameters."""
    names = set(ReMoEForCausalLM(ReMoEConfig.from_preset("micro")).state_dict())
    assert not any(s in n for n in names for s in ("bias", "q_norm", "k_norm", "shared_expert"))
    with pytest.raises(Exception, match="shared_expert_size=8 needs a token router"):
        ReMoEConfig.from_preset("micro", router="lory", shared_expert_size=8)
