"""AutoTokenizer + batched left-padded generate and pipeline("text-generation") work out of the
box on a saved directory and agree with unpadded, one-prompt generation."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

PROMPTS = ["alpha beta gamma river stone", "the", "cloud paper light of the sound and"]


def test_batched_left_padded_generation_matches_unpadded(save_micro):
    d, _ = save_micro("gen", seed=2)
    tok = AutoTokenizer.from_pretrained(d)
    assert (tok.eos_token, tok.pad_token, tok.padding_side) == ("<|endoftext|>",) * 2 + ("left",)
    model = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    assert (batch["attention_mask"][:, 0] == 0).any()  # left padding happened
    out = model.generate(**batch, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    batched = [o[-12:].tolist() for o in out]
    for p, got in zip(PROMPTS, batched):
        one = tok(p, return_tensors="pt")
        alone = model.generate(**one, max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert alone[0, -12:].tolist() == got, p
    # the generated tokens are the argmax of a plain forward pass (the KV cache is exact)
    one = tok(PROMPTS[0], return_tensors="pt")["input_ids"]
    full = torch.cat([one, torch.tensor([batched[0][:-1]])], 1)
    with torch.no_grad():
        logits = model(full).logits[0, one.shape[1] - 1:]
    assert logits.argmax(-1).tolist() == batched[0]
    pipe = pipeline("text-generation", model=model, tokenizer=tok)
    res = pipe(PROMPTS, batch_size=3, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    for p, r, got in zip(PROMPTS, res, batched):
        assert r[0]["generated_text"] == p + tok.decode(got)
