"""Evaluation: per-domain validation loss, the lm-eval adapter and offline zero-shot tasks.

* :mod:`remoe.model.losses` -- :func:`evaluate_loss` (token-weighted CE overall and per domain);
  light, used by the trainer for periodic validation.
* :mod:`remoe.eval.adapter` -- ``RemoeLM``, an lm-eval model registered as ``"remoe"``.
* :mod:`remoe.eval.builtin_tasks` -- tasks built from the held-out split of the corpus
  (``remoe_lambada``, ``remoe_hellaswag``, ``remoe_domain``) as an lm-eval task directory.
* :mod:`remoe.eval.standard` -- the paper's zero-shot tasks, run only when their data is local.
* :mod:`remoe.eval.zeroshot` -- runs task sets through ``lm_eval.simple_evaluate`` offline.
* :mod:`remoe.eval.cli` -- ``remoe eval``. See ``docs/EVAL.md``.

Importing this package does not import lm-eval (a few seconds); the submodules that need it do.
"""

__all__ = ["evaluate_loss"]


def __getattr__(name: str):
    # lazy (PEP 562): `remoe eval --help` must not import torch
    if name == "evaluate_loss":
        from remoe.model.losses import evaluate_loss

        return evaluate_loss
    raise AttributeError(f"module 'remoe.eval' has no attribute {name!r}")
