"""lm-eval's own command line with the ``remoe`` model registered and offline mode on.

    python -m remoe.eval.harness --model remoe --model_args pretrained=runs/tiny \\
        --tasks remoe_hellaswag --include_path .remoe_cache/data/eval_tasks/test

lm-eval's ``lm_eval`` script only knows its own models; this entry point imports
:mod:`remoe.eval.adapter` (which registers ``"remoe"``) and then runs lm-eval's CLI with the
same arguments, so every lm-eval option works unchanged.
"""

from __future__ import annotations

import sys

from remoe.eval.offline import force_offline


def main(argv: list[str] | None = None) -> None:
    force_offline()
    import remoe.eval.adapter  # noqa: F401  (registers the "remoe" model)
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
