"""``remoe convert upcycle|from-hf|to-hf SRC DST``: checkpoints in and out of remoe.

* ``upcycle SRC DST --experts E [--top-k K]``: a dense remoe model (router=dense) or a
  transformers Llama -> an E-expert ReLU ReMoE with copied experts and fresh routers;
* ``from-hf SRC DST [--router relu|topk] [--top-k K]``: a transformers Mixtral, Qwen2-MoE or
  OLMoE -> a ReMoE with its experts kept and a router initialised from the softmax router;
* ``to-hf SRC DST``: a TopK ReMoE -> a plain transformers Mixtral (topk_normalize=true), or
  Qwen2-MoE / OLMoE when it has their parts; a dense one (router dense / dense_wide) -> a
  plain transformers Llama.

See docs/CONVERT.md for the mappings and what is refused.
"""

from __future__ import annotations

import argparse


#: what each conversion does (the CLI's help, and a converted model's card)
HELPS = {"upcycle": "dense remoe / transformers Llama -> E-expert ReLU ReMoE (copied experts)",
         "from-hf": "transformers Mixtral / Qwen2-MoE / OLMoE -> ReMoE (experts kept, "
                    "router from the softmax one)",
         "to-hf": "TopK ReMoE -> transformers Mixtral / Qwen2-MoE / OLMoE, dense ReMoE -> "
                  "transformers Llama (lossless only)"}


def _command(args: argparse.Namespace) -> str:
    """The conversion as a command line (for the card), SRC and DST as given."""
    opts = {"upcycle": f" --experts {getattr(args, 'experts', '')} --top-k "
                       f"{getattr(args, 'top_k', '')} --seed {getattr(args, 'seed', '')}",
            "from-hf": f" --router {getattr(args, 'router', '')}"
                       + (f" --top-k {args.top_k}" if getattr(args, "top_k", None) else "")}
    return f"remoe convert {args.kind} {args.src} {args.dst}{opts.get(args.kind, '')}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="kind", metavar="KIND")
    sub.required = True
    for name, text in HELPS.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument("src", metavar="SRC", help="source model directory")
        p.add_argument("dst", metavar="DST", help="destination directory (new or empty)")
        p.add_argument("--force", action="store_true", help="write into a non-empty DST")
        if name == "upcycle":
            p.add_argument("--experts", type=int, required=True, help="E experts per layer")
            p.add_argument("--top-k", type=int, default=1,
                           help="k: the ReLU target sparsity is 1 - k/E (default 1)")
            p.add_argument("--seed", type=int, default=0, help="seed of the fresh routers")
        if name == "from-hf":
            p.add_argument("--router", default="relu", choices=("relu", "topk"),
                           help="relu (default): continue with ReLU routing; topk: the same "
                           "function as the source (renormalised softmax top-k)")
            p.add_argument("--top-k", type=int, default=None,
                           help="k (default: the source's num_experts_per_tok)")


def run(args: argparse.Namespace) -> int:
    from remoe.convert import io  # imports torch: not for `remoe convert --help`

    dst = io.check_destination(args.dst, args.force)
    if args.kind == "upcycle":
        from remoe.convert.upcycle import upcycle

        src = io.load_remoe(args.src) if io.model_type(args.src) == "remoe" else \
            io.load_hf(args.src, ("llama",))
        model = upcycle(src, args.experts, args.top_k, seed=args.seed)
    elif args.kind == "from-hf":
        from remoe.convert.from_hf import SOURCES, UNSUPPORTED, check_source, from_hf
        from remoe.errors import ConfigError

        kind = io.model_type(args.src)
        if kind in UNSUPPORTED:
            raise ConfigError(f"SRC model_type={kind!r} cannot be converted: {UNSUPPORTED[kind]}")
        check_source(io.load_hf_config(args.src, SOURCES))  # before loading any weight
        model = from_hf(io.load_hf(args.src, SOURCES), args.router, args.top_k)
    else:
        from remoe.convert.to_hf import check_lossless, to_hf
        from remoe.errors import ConfigError

        if io.model_type(args.src) != "remoe":
            raise ConfigError(f"SRC model_type={io.model_type(args.src)!r} must be 'remoe'")
        from remoe import ReMoEConfig

        check_lossless(ReMoEConfig.from_pretrained(args.src))  # before loading any weight
        model = to_hf(io.load_remoe(args.src))
    io.save(model, args.src, dst, command=_command(args), what=HELPS[args.kind])
    c = model.config
    print(f"remoe convert {args.kind}: wrote {dst} ({c.model_type}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters)")
    return 0
