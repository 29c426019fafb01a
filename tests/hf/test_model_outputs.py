"""The forward's transformers arguments: the KV cache under ``past_key_values=`` and
``cache=`` (transformers 5.24 passes the latter), a static cache refused in one line,
``output_hidden_states`` honoured, ``output_attentions`` refused, ``return_dict=False``."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from remoe import ReMoEConfig, ReMoEForCausalLM

IDS = torch.tensor([[5, 17, 200, 3, 44, 9, 120, 7], [8, 8, 9, 100, 101, 2, 0, 64]])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = ReMoEConfig.from_preset("micro", vocab_size=320, num_experts=4,
                                  max_position_embeddings=64)
    m = ReMoEForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else None
    return m


@pytest.mark.parametrize("name", ["past_key_values", "cache"])
def test_the_cache_under_either_name_continues_the_prefix(model, name):
    with torch.no_grad():
        full = model(IDS).logits[:, -1]
        prefix = model(IDS[:, :-1], use_cache=True)
        cache = prefix.past_key_values if hasattr(prefix, "past_key_values") else prefix.cache
        assert cache.get_seq_length() == IDS.shape[1] - 1
        step = model(IDS[:, -1:], use_cache=True, **{name: cache})
    assert torch.allclose(step.logits[:, -1], full, atol=1e-5, rtol=0)


def test_two_different_caches_are_refused(model):
    with pytest.raises(ValueError, match="pass past_key_values= or cache=, not both"):
        model(IDS, past_key_values=DynamicCache(config=model.config),
              cache=DynamicCache(config=model.config))


def test_static_cache_is_refused_in_one_line(model):
    with pytest.raises(ValueError) as err:
        model.generate(IDS[:, :4], attention_mask=torch.ones_like(IDS[:, :4]),
                       cache_implementation="static", max_new_tokens=3, do_sample=False)
    msg = str(err.value)
    assert "\n" not in msg and "dynamic KV cache only" in msg and "cache_implementation" in msg


def test_hidden_states_are_returned(model):
    with torch.no_grad():
        out = model(IDS, output_hidden_states=True)
        plain = model(IDS)
    hs = out.hidden_states
    L = model.config.backbone.num_layers
    assert isinstance(hs, tuple) and len(hs) == L + 1
    assert all(h.shape == (2, IDS.shape[1], model.config.hidden_size) for h in hs)
    assert torch.equal(hs[0], model.embed_tokens(IDS))  # the embeddings first
    assert torch.equal(model.lm_head(hs[-1]), out.logits)  # the last one after the final norm
    assert torch.equal(out.logits, plain.logits) and plain.hidden_states is None
    model.config.output_hidden_states = True  # the config's default is honoured too
    try:
        with torch.no_grad():
            assert len(model(IDS).hidden_states) == L + 1
    finally:
        model.config.output_hidden_states = False


def test_output_attentions_is_refused(model):
    with pytest.raises(ValueError, match="output_attentions=True is not supported"):
        model(IDS, output_attentions=True)


def test_return_dict_false_returns_a_tuple(model):
    with torch.no_grad():
        out = model(IDS, labels=IDS)
        tup = model(IDS, labels=IDS, return_dict=False)
        nolabels = model(IDS, return_dict=False)
    assert type(tup) is tuple and torch.equal(tup[0], out.loss) and torch.equal(tup[1], out.logits)
    assert type(nolabels) is tuple and torch.equal(nolabels[0], out.logits)


@pytest.mark.parametrize("over", [{}, {"router": "lory", "lory_segment_len": 3}])
def test_left_padded_batch_generates_what_each_prompt_generates_alone(over):
    """Lory's segments start at each sequence's first real token (ctx.pad_left)."""
    torch.manual_seed(1)
    cfg = ReMoEConfig.from_preset("micro", vocab_size=320, num_experts=4,
                                  max_position_embeddings=64, **over)
    m = ReMoEForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else None
    prompts = [[5, 17, 200, 3, 44], [8], [9, 100, 7, 7, 31, 250, 1]]
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kw = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    for cache in (True, False):
        batched = m.generate(input_ids=ids, attention_mask=mask, use_cache=cache, **kw)[:, -10:]
        for p, got in zip(prompts, batched.tolist()):
            alone = m.generate(input_ids=torch.tensor([p]), use_cache=cache, **kw)[0, -10:]
            assert alone.tolist() == got, (over, cache, p)
