"""transformers' Trainer on remoe models: num_items_in_batch under gradient accumulation, the
sparsity control of ReMoETrainer (lambda per optimizer step, saved in checkpoints), gradient
checkpointing, PEFT LoRA on attention and experts (router frozen or trained), merged back."""

from __future__ import annotations

import json

import pytest
import torch

from remoe import ReMoEConfig, ReMoEForCausalLM

pytest.importorskip("accelerate")


def _model(seed=0, **over):
    torch.manual_seed(seed)
    cfg = ReMoEConfig.from_preset("micro", num_experts=4, **over)
    return ReMoEForCausalLM(cfg)


def _rows(n, seq=16, seed=1, masked=True):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, 512, (seq,), generator=g)
        labels = ids.clone()
        if masked and i % 2 == 0:  # uneven label counts: the per-token weighting matters
            labels[: seq // 2 + i] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                logging_steps=1, disable_tqdm=True, learning_rate=1e-3, max_steps=1,
                max_grad_norm=0.0, dataloader_num_workers=0, seed=0, lr_scheduler_type="constant",
                warmup_steps=0)
    base.update(kw)
    return TrainingArguments(**base)


class _GradGrab:
    """Callback: the gradients just before the first optimizer step."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Grab(TrainerCallback):
            grads = None

            def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
                if self.grads is None:
                    self.grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                                  if p.grad is not None}

        return Grab()


def _one_step(tmp_path, trainer_cls, ga, bs, rows, **trainer_kw):
    grab = _GradGrab()
    model = _model()
    t = trainer_cls(model=model, args=_args(tmp_path, per_device_train_batch_size=bs,
                                            gradient_accumulation_steps=ga),
                    train_dataset=rows, callbacks=[grab], **trainer_kw)
    t.train()
    loss = [r["loss"] for r in t.state.log_history if "loss" in r][0]
    return loss, grab.grads


@pytest.mark.parametrize("which", ["Trainer", "ReMoETrainer"])
def test_gradient_accumulation_gives_the_loss_and_gradients_of_the_whole_batch(tmp_path, which):
    from transformers import Trainer

    from remoe.hf.trainer import ReMoETrainer

    cls, kw = (Trainer, {}) if which == "Trainer" else (ReMoETrainer, {"init_lambda": 1e-30})
    rows = _rows(4)
    l1, g1 = _one_step(tmp_path / "a", cls, 1, 4, rows, **kw)
    l2, g2 = _one_step(tmp_path / "b", cls, 2, 2, rows, **kw)
    assert l1 == pytest.approx(l2, rel=1e-5)
    assert g1.keys() == g2.keys()
    for k in g1:
        assert torch.allclose(g1[k], g2[k], rtol=1e-4, atol=1e-7), k


def test_the_model_normalises_by_num_items_in_batch():
    m = _model()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :5] = -100
    mean = m(input_ids=ids, labels=labels).loss
    n = int((labels[:, 1:] != -100).sum())
    assert torch.allclose(m(input_ids=ids, labels=labels, num_items_in_batch=n).loss, mean)
    assert torch.allclose(m(input_ids=ids, labels=labels, num_items_in_batch=2 * n).loss, mean / 2)


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, 512, (4, 24), generator=torch.Generator().manual_seed(2))

    def grads(checkpointing):
        m = _model()
        if checkpointing:
            m.gradient_checkpointing_enable()
        m.train()
        out = m(input_ids=ids, labels=ids)
        (out.loss + 0.1 * out.aux.reg_loss).backward()
        return {n: p.grad for n, p in m.named_parameters()}, out.aux.active_counts_LN

    (g0, c0), (g1, c1) = grads(False), grads(True)
    assert torch.equal(c0, c1)  # the recomputation's routing is not counted again
    for k in g0:
        assert torch.allclose(g0[k], g1[k], rtol=1e-5, atol=1e-7), k
    with pytest.raises(ValueError, match="use_reentrant=True"):
        _model().gradient_checkpointing_enable({"use_reentrant": True})


def test_remoe_trainer_steps_lambda_once_per_optimizer_step_and_checkpoints_it(tmp_path):
    from remoe.hf.trainer import STATE_FILE, ReMoETrainer

    rows = _rows(16, masked=False)
    t = ReMoETrainer(model=_model(), args=_args(tmp_path, per_device_train_batch_size=2,
                                                gradient_accumulation_steps=2, max_steps=4,
                                                save_strategy="steps", save_steps=2),
                     train_dataset=rows)
    t.train()
    ctrl = t.remoe.controller
    assert ctrl.lams[0].steps == 4  # one update per optimizer step, not per micro-batch
    logs = [r for r in t.state.log_history if "loss" in r]
    lams = [r["lambda"] for r in logs]
    assert lams[0] > 1e-6 and t.remoe.lambda_rule.startswith("gradient balance")
    for a, b, r in zip(lams, lams[1:], logs):  # the sign rule on each step's sparsity
        target = t.remoe.cfg.routing.target_sparsity
        assert b == pytest.approx(a * 1.2 ** (1 if r["sparsity"] < target else -1), rel=1e-9)
    saved = json.loads((tmp_path / "checkpoint-2" / STATE_FILE).read_text())
    assert saved["controller"]["steps"] == 2
    # resuming from checkpoint-2 continues with its lambda
    t2 = ReMoETrainer(model=_model(), args=_args(tmp_path, per_device_train_batch_size=2,
                                                 gradient_accumulation_steps=2, max_steps=4,
                                                 save_strategy="no"), train_dataset=rows)
    t2.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert t2.remoe.controller.lams[0].steps == 4
    assert t2.remoe.controller.coeff == pytest.approx(ctrl.coeff, rel=1e-9)


@pytest.mark.parametrize("router", ["frozen", "trained"])
def test_lora_on_attention_and_experts_trains_and_merges_back(tmp_path, router):
    pytest.importorskip("peft")
    from remoe.hf.peft import lora_config
    from remoe.hf.trainer import ReMoETrainer
    from peft import get_peft_model

    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pm = get_peft_model(model, lora_config(model, r=4, router=router))
    names = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert any("q_proj.lora_A" in n for n in names) and any("experts" in n for n in names)
    assert any(".router." in n for n in names) == (router == "trained")
    t = ReMoETrainer(model=pm, args=_args(tmp_path, per_device_train_batch_size=4, max_steps=3,
                                          learning_rate=1e-2), train_dataset=_rows(12))
    t.train()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(5))
    pm.eval()
    with torch.no_grad():
        adapted = pm(input_ids=ids).logits
    merged = pm.merge_and_unload()
    assert isinstance(merged, ReMoEForCausalLM)
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted, atol=1e-5)
    after = merged.state_dict()
    assert after.keys() == before.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert any("experts.w_in_ND2H" in k for k in changed)
    assert any("experts.w_out_NHD" in k for k in changed)
    assert any("attn.q_proj" in k for k in changed)
    assert any(".router." in k for k in changed) == (router == "trained")
    merged.save_pretrained(tmp_path / "merged")
    again = ReMoEForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        assert torch.allclose(again(input_ids=ids).logits, adapted, atol=1e-5)


def test_remoe_trainer_under_torchrun_controls_the_all_reduced_sparsity(tmp_path, free_port):
    # two processes (gloo, CPU): both ranks start from the same lambda (gradient balance summed
    # over ranks), the controller sees the sparsity of both ranks' tokens together, every rank
    # takes the same lambda at every step, and the weights stay equal
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("ddp_trainer_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={free_port()}", str(worker), str(tmp_path)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in (0, 1)]
    assert [d["world"] for d in ranks] == [2, 2]
    a, b = ranks
    assert a["lambda_rule"] == b["lambda_rule"] and "gradient balance" in a["lambda_rule"]
    assert len(a["steps"]) == len(b["steps"]) == 6
    for sa, sb in zip(a["steps"], b["steps"]):
        assert sa["lambda"] == sb["lambda"] and sa["sparsity"] == sb["sparsity"]
        # the controller's sparsity is that of both ranks' tokens, not this rank's
        tokens = sa["local_tokens"] + sb["local_tokens"]
        pooled = (sa["local_sparsity"] * sa["local_tokens"]
                  + sb["local_sparsity"] * sb["local_tokens"]) / tokens
        assert sa["sparsity"] == pytest.approx(pooled, abs=1e-6)
    assert any(sa["local_sparsity"] != sb["local_sparsity"] for sa, sb in zip(a["steps"],
                                                                              b["steps"]))
    assert len({s["lambda"] for s in a["steps"]}) > 1  # lambda moves
    assert a["weights"] == b["weights"]
