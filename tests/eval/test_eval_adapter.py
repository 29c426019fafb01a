"""The lm-eval adapter: loglikelihood, greedy flag, rolling and generation match the model."""

from __future__ import annotations

import shutil

import pytest
import torch
from lm_eval.api.instance import Instance

from remoe.eval.adapter import RemoeLM


@pytest.fixture(scope="module")
def setup(make_micro_model, tokenizer_path):
    model = make_micro_model(seed=1)
    lm = RemoeLM(pretrained=model, tokenizer=tokenizer_path, batch_size=3)
    return model, lm


def direct_loglikelihood(model, tok, context: str, continuation: str) -> tuple[float, bool]:
    """lm-eval's definition computed by hand: encode context+continuation, split off the
    context's tokens, sum the continuation's log-probs, greedy = argmax matches everywhere.
    An empty context is replaced by the EOS token."""
    if context:
        whole = tok.encode(context + continuation)
        ctx = tok.encode(context)
        cont = whole[len(ctx):]
    else:
        ctx, cont = [tok.eos_token_id], tok.encode(continuation)
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids[:, :-1]).logits[0].float(), -1)
    pos = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
    target = torch.tensor(cont)
    ll = float(logp[pos, target].sum())
    greedy = bool((logp[pos].argmax(-1) == target).all())
    return ll, greedy


def _requests(pairs):
    return [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i)
            for i, p in enumerate(pairs)]


def test_loglikelihood_matches_direct_computation_with_batching(setup):
    model, lm = setup
    pairs = [("apple avocado almond", " apricot"),
             ("banana berry", " basil bread button bottle"),
             ("cherry", " cocoa"),
             ("cherry", " cocoa cedar"),  # same context, longer continuation
             ("", "anchor arrow"),  # empty context: EOS prefix
             ("alpha0word1 amber atlas apple avocado almond apricot anchor arrow", " amber")]
    got = lm.loglikelihood(_requests(pairs), disable_tqdm=True)
    assert len(got) == len(pairs)
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        ref_ll, ref_greedy = direct_loglikelihood(model, lm.tokenizer, ctx, cont)
        assert ll == pytest.approx(ref_ll, abs=1e-4), (ctx, cont)
        assert greedy == ref_greedy
        assert ll < 0


def test_greedy_flag_is_true_exactly_for_the_models_own_continuation(setup):
    model, lm = setup
    tok = lm.tokenizer
    found = None
    for ctx in ["apple avocado", "banana berry basil", "cherry cocoa", "amber atlas", "bread"]:
        ids = tok.encode(ctx)
        with torch.no_grad():
            t1 = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            t2 = int(model(input_ids=torch.tensor([ids + [t1]])).logits[0, -1].argmax())
        cont = tok.decode([t1, t2])
        if tok.encode(ctx + cont)[len(ids):] == [t1, t2] and t1 != tok.eos_token_id:
            found = (ctx, cont, ids, t1)
            break
    assert found is not None, "no context whose greedy continuation survives re-tokenisation"
    ctx, cont, ids, t1 = found
    other = next(t for t in range(1, 300) if t != t1 and tok.encode(ctx + tok.decode([t]))[len(ids):] == [t])
    (ll_g, greedy), (ll_o, not_greedy) = lm.loglikelihood(
        _requests([(ctx, cont), (ctx, tok.decode([other]))]), disable_tqdm=True)
    assert greedy is True
    assert not_greedy is False


def test_loglikelihood_rolling_is_the_sum_over_all_tokens(setup):
    model, lm = setup
    text = "banana berry basil bread button bottle bridge butter"
    (got,) = lm.loglikelihood_rolling(
        [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)],
        disable_tqdm=True)
    ref, _ = direct_loglikelihood(model, lm.tokenizer, "", text)
    assert got == pytest.approx(ref, abs=1e-4)


def test_generate_until_is_greedy_decoding(setup):
    model, lm = setup
    ctx = "apple avocado almond"
    (out,) = lm.generate_until([Instance(request_type="generate_until", doc={},
                                         arguments=(ctx, {"until": ["\n\n"], "max_gen_toks": 4,
                                                          "do_sample": False}), idx=0)],
                               disable_tqdm=True)
    ids = lm.tokenizer.encode(ctx)
    new = []
    with torch.no_grad():
        for _ in range(4):
            t = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
            if t == lm.tokenizer.eos_token_id:
                break
            new.append(t)
    ref = lm.tokenizer.decode(new).split("\n\n")[0]
    assert out == ref


def test_registered_and_loads_a_run_directory(tmp_path, make_micro_model, tokenizer_path):
    from lm_eval.api.registry import get_model

    assert get_model("remoe") is RemoeLM
    run = tmp_path / "run"
    model = make_micro_model(seed=2)
    model.save_pretrained(run / "final")
    shutil.copy(tokenizer_path, run / "final" / "tokenizer.json")
    lm = get_model("remoe").create_from_arg_string(f"pretrained={run}", {"batch_size": 2,
                                                                         "device": "cpu"})
    assert lm.tokenizer.eos_token == "<|endoftext|>" and lm.eot_token_id == lm.tokenizer.eos_token_id
    assert lm.max_length == model.config.max_position_embeddings
    (ll, _), = lm.loglikelihood(_requests([("cherry", " cocoa")]), disable_tqdm=True)
    ref, _ = direct_loglikelihood(model, lm.tokenizer, "cherry", " cocoa")
    assert ll == pytest.approx(ref, abs=1e-4)
    # a directory without a tokenizer.json is refused with a clear error
    (run / "final" / "tokenizer.json").unlink()
    from remoe.errors import ConfigError
    with pytest.raises(ConfigError, match="tokenizer"):
        RemoeLM(pretrained=str(run))
