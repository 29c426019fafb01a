"""Helpers of the converter tests: tiny random models (no downloads) and the CLI."""

from __future__ import annotations

import torch

from remoe.cli import main

BACKBONE = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def randomize(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # large enough that every weight matters in the logits
            noise = torch.randn(p.shape, generator=g)
            p.copy_(noise * 0.3 if p.dim() > 1 else 1.0 + 0.1 * noise)  # norms near 1
    return model.eval()


def token_ids(vocab=96):
    return torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(1))


def run_convert(*argv):
    return main(["convert", *map(str, argv)])
