"""``train.init_from``: start a training run from existing weights (docs/CONTINUE.md).

A source is a remoe model directory (a run's ``final/``, a Hugging Face directory written by
remoe), a run checkpoint (``checkpoints/step_*``), a run directory (its ``final/``, else its
latest checkpoint), or any directory ``remoe convert`` reads: a transformers Llama (dense),
Mixtral, Qwen2-MoE or OLMoE, converted on the fly with the converter's code
(:mod:`remoe.convert`). Weights are read from safetensors only; a checkpoint's trainer state
with ``torch.load(weights_only=True)``; no code in the source directory is run.

The model config is the source's. The YAML/``--set`` ``model:`` fields are overrides, allowed
where the kept weights still mean the same:

* routing and sparsity-control fields (``router``, ``top_k``, ``reg_type``, ``lambda0``,
  ``alpha``, ``lambda_update``, ``max_active``, ``balance_bias_rate``, ...): a new router is
  put on the kept experts (``topk`` -> ``relu``: the softmax router's weights centred per
  expert, ``W - mean_e W_e``, as ``remoe convert from-hf`` does; any other swap keeps ``W``;
  router state such as a balancing offset starts fresh);
* a dense source (``router: dense``, or a transformers Llama) with a token ``model.router``
  is upcycled: every expert a copy of the dense FFN (``model.num_experts``, default the
  source config's), a fresh router (:mod:`remoe.convert.upcycle`);
* runtime fields (``expert_backend``, ``recompute_experts``), ``init_std`` (fresh parameters
  only) and ``max_position_embeddings`` (no weight depends on it);
* every other backbone field and the expert layout (``num_experts``, ``granularity``, the
  shared expert) is the shape of the weights: changing it is refused, naming the field.

The optimizer and the step count start fresh. The learning rate follows ``train.init_lr``
(:func:`start_lr`): ``peak`` (the default) is a fresh schedule, warm-up to ``train.lr`` included;
``source`` (the source run's last lr) or a number starts there without warm-up and decays by the
cosine to ``min(train.min_lr, start)``. Lambda starts from
:func:`remoe.train.init_lambda.initial_lambda` (or ``train.init_lambda``). The data's tokenizer must have the source
tokenizer's vocabulary (:func:`check_vocabulary`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remoe.errors import ConfigError

#: backbone fields a continued run may change (no weight depends on them)
FREE_BACKBONE = ("init_std", "max_position_embeddings")
#: routing fields that are the shape of the expert weights
SHAPE_ROUTING = ("num_experts", "granularity", "shared_expert_size", "shared_expert_gate")
#: FFN kinds whose weights are not experts behind a router (no swap in or out)
FFN_KINDS = ("dense", "dense_wide", "lory")
#: routers whose scores are a softmax over the experts (shift-invariant: centring W keeps them)
SOFTMAX_ROUTERS = ("topk", "topk_warmup", "sparsemixer", "expert_choice")
#: transformers model types read through the converters
HF_DENSE = ("llama",)
RECORD_FILE = "init_from.json"


@dataclass
class Source:
    """Where the weights come from, resolved: ``model_dir`` holds config.json and weights."""

    arg: str  # train.init_from as given
    model_dir: Path
    model_type: str  # remoe | llama | mixtral | qwen2_moe | olmoe
    state_file: Path | None = None  # a checkpoint's trainer_state.pt

    @property
    def tokenizer_file(self) -> Path | None:
        p = self.model_dir / "tokenizer.json"
        return p if p.is_file() else None


@dataclass
class InitModel:
    """The model a run starts from and how it was made (written to the run's init_from.json)."""

    model: Any  # ReMoEForCausalLM
    source: Source
    conversion: list[str] = field(default_factory=list)  # what was done, in order
    source_router: str = ""
    lambdas: list[float] | None = None  # the controller's first lambda(s); None: lambda0
    lambda_info: dict[str, Any] = field(default_factory=dict)  # how they were chosen
    lr_start: float | None = None  # train.init_lr resolved (None: peak, a fresh schedule)
    lr_info: str = ""  # the first line's words about the schedule

    def record(self) -> dict[str, Any]:
        return {"init_from": self.source.arg, "model_dir": str(self.source.model_dir.resolve()),
                "source_model_type": self.source.model_type,
                "source_router": self.source_router, "conversion": self.conversion,
                "lambda_start": self.lambdas, **self.lambda_info, "lr_start": self.lr_start,
                "model": _source_fields(self.model.config)}

    def write(self, run_dir: Path, controller) -> None:
        """``init_from.json`` in the run directory (``--resume`` rebuilds the model from its
        ``model``), and one line saying what the run starts from."""
        from remoe import rundir
        from remoe.rundir import files as runfiles

        rundir.atomic_write_text(run_dir / RECORD_FILE, json.dumps(self.record(), indent=2))
        lam = ""
        if controller is not None:
            how = self.lambda_info.get("lambda_rule", "model.lambda0")
            lam = f"; lambda starts at {controller.coeff:.3g} ({how})"
        runfiles.say(f"train.init_from: {self.source.model_dir} ({self.source_router}"
                     + (": " + "; ".join(self.conversion) if self.conversion else "") + ")" + lam)
        if self.lr_info:
            runfiles.say(f"train.init_from: {self.lr_info}")


# ----------------------------------------------------------------------------- the source

def _model_type(d: Path) -> str:
    try:
        doc = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ConfigError(f"train.init_from={str(d)!r}: config.json is unreadable ({e})") from None
    return str(doc.get("model_type", "")) if isinstance(doc, dict) else ""


def resolve_source(arg: str) -> Source:
    """The model directory of ``train.init_from`` (no torch; ConfigError naming the field)."""
    from remoe import rundir
    from remoe.convert.from_hf import SOURCES, UNSUPPORTED

    p = Path(arg)
    if not p.exists():
        raise ConfigError(f"train.init_from={arg!r} does not exist")
    if not p.is_dir():
        raise ConfigError(f"train.init_from={arg!r} must be a model, checkpoint or run directory")
    if (p / "config.json").is_file():
        d = p
    elif (p / "final" / "config.json").is_file():
        d = p / "final"
    else:
        d = None
        name, problem = rundir.read_latest(p / "checkpoints")
        if problem is None and (p / "checkpoints" / name / "config.json").is_file():
            d = p / "checkpoints" / name
        if d is None:
            raise ConfigError(f"train.init_from={arg!r} holds no model (expected config.json, "
                              "final/ or checkpoints/LATEST)")
    kind = _model_type(d)
    if kind in UNSUPPORTED:
        raise ConfigError(f"train.init_from={arg!r}: model_type={kind!r} cannot be converted: "
                          f"{UNSUPPORTED[kind]}")
    known = ("remoe", *HF_DENSE, *SOURCES)
    if kind not in known:
        raise ConfigError(f"train.init_from={arg!r}: model_type={kind!r} must be one of "
                          f"{', '.join(known)}")
    if not (d / "model.safetensors").is_file() and not (d / "model.safetensors.index.json").is_file():
        raise ConfigError(f"train.init_from={arg!r}: {d} has no model.safetensors (only "
                          "safetensors weights are read)")
    state = d / rundir.STATE_FILE
    return Source(arg, d, kind, state if state.is_file() else None)


def _load_base(src: Source, want_router: str | None):
    """The source as a ReMoEForCausalLM in fp32 on the CPU, with the source's own function
    (a transformers MoE with its softmax top-k router, a Llama as a dense remoe model)."""
    import torch

    from remoe import ReMoEForCausalLM
    from remoe.rundir.bars import no_hf_bars

    if src.model_type == "remoe":
        with no_hf_bars():
            model = ReMoEForCausalLM.from_pretrained(src.model_dir, dtype=torch.float32,
                                                     use_safetensors=True)
        return model, []
    from transformers import AutoModelForCausalLM

    with no_hf_bars():
        hf = AutoModelForCausalLM.from_pretrained(src.model_dir, dtype=torch.float32,
                                                  use_safetensors=True).eval()
    if src.model_type in HF_DENSE:
        return _dense_from_llama(hf), [f"{src.model_type} -> dense remoe (same function)"]
    from remoe.convert.from_hf import from_hf

    model = from_hf(hf, router="topk")
    return model, [f"{src.model_type} -> remoe topk (remoe convert from-hf --router topk: "
                   "same function)"]


def _dense_from_llama(hf):
    """A transformers Llama as a remoe ``router: dense`` model (the same function)."""
    from remoe import ReMoEConfig, ReMoEForCausalLM
    from remoe.convert import backbone

    cfg = hf.config
    kw = backbone.backbone_kwargs(cfg)
    L = kw["num_layers"]
    sd = hf.state_dict()
    state = backbone.hf_backbone_state(sd, L, tied=bool(cfg.tie_word_embeddings))
    for i in range(L):
        for ours, theirs in (("w_gate", "gate"), ("w_up", "up"), ("w_down", "down")):
            state[f"layers.{i}.ffn.ffn.{ours}.weight"] = sd[f"model.layers.{i}.mlp.{theirs}_proj.weight"]
    model = ReMoEForCausalLM(ReMoEConfig(**kw, ffn_hidden_size=cfg.intermediate_size,
                                         router="dense")).eval()
    backbone.load_exact(model, state)
    return model


# ----------------------------------------------------------------------------- overrides

def check_overrides(source_fields: dict[str, Any], overrides: dict[str, Any],
                    upcycling: bool) -> None:
    """Refuse (one line naming the field) an override of the weights' shape."""
    from remoe.model.spec import section_fields

    backbone = {f for f, (sec, _) in section_fields().items() if sec == "backbone"}
    for key, value in overrides.items():
        if key == "preset":
            raise ConfigError(f"model.preset={value!r} cannot be combined with train.init_from: "
                              "the model's shape comes from the source; remove it")
        old = source_fields.get(key)
        if value == old:
            continue
        shape = (key in backbone and key not in FREE_BACKBONE) or (
            key in SHAPE_ROUTING and not (upcycling and key == "num_experts"))
        if shape:
            raise ConfigError(f"model.{key}={value!r} differs from train.init_from's {old!r}: "
                              f"it is the shape of the kept weights (only routing and "
                              "sparsity-control fields may change)")


def _source_fields(cfg) -> dict[str, Any]:
    return {**cfg.spec.flat(), "eos_token_id": cfg.eos_token_id,
            "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id}


def apply_overrides(base, overrides: dict[str, Any], seed: int) -> tuple[Any, list[str]]:
    """The model to train: ``base`` with the routing/control ``overrides`` (see the module
    docstring); returns ``(model, what was done)``."""
    import torch

    from remoe import ReMoEConfig, ReMoEForCausalLM
    from remoe.convert.from_hf import relu_router_from_softmax

    fields = _source_fields(base.config)
    old_router = fields["router"]
    new_router = overrides.get("router", old_router)
    upcycling = old_router == "dense" and new_router != "dense"
    check_overrides(fields, overrides, upcycling)
    done: list[str] = []
    if new_router != old_router:
        if upcycling and new_router in FFN_KINDS:
            raise ConfigError(f"model.router={new_router!r}: a dense source can be upcycled to a "
                              "token-routed MoE only (e.g. model.router=relu)")
        if not upcycling and (old_router in FFN_KINDS or new_router in FFN_KINDS):
            raise ConfigError(f"model.router={new_router!r} cannot replace train.init_from's "
                              f"router {old_router!r}: the weights would not be the same experts")
    if upcycling:
        from remoe.convert.upcycle import upcycle

        E = int(overrides.get("num_experts", fields["num_experts"]))
        k = int(overrides.get("top_k", fields["top_k"]))
        if not 1 <= k <= E:
            raise ConfigError(f"model.top_k={k} must be in [1, model.num_experts={E}]")
        base = upcycle(base, E, k, seed=seed)
        done.append(f"upcycled: {E} copies of each dense FFN, fresh ReLU routers (remoe convert "
                    f"upcycle --experts {E} --top-k {k} --seed {seed})")
        fields = _source_fields(base.config)
        old_router = "relu"
    merged = {**fields, **{k: v for k, v in overrides.items() if k != "preset"}}
    try:
        new_cfg = ReMoEConfig(**merged)
    except TypeError as e:  # pragma: no cover - every key is a known field
        raise ConfigError(f"model: {e}") from None
    changed = sorted(k for k in merged if merged[k] != fields.get(k))
    if not changed:
        return base.train(), done
    torch.manual_seed(seed)
    model = ReMoEForCausalLM(new_cfg)
    sd = base.state_dict()
    own = model.state_dict()
    routers = [k for k in own if ".ffn.router." in k]
    swap = new_router != old_router
    keep = {}
    for k, v in sd.items():
        if k not in own or own[k].shape != v.shape:
            if ".ffn.router." in k:
                continue  # router state the new router does not have (e.g. a balancing offset)
            raise ConfigError(f"model: weight {k} of train.init_from does not fit the new config "
                              f"(changed: {', '.join(changed)})")
        if k.endswith(".ffn.router.weight") and swap and new_router == "relu" \
                and old_router in SOFTMAX_ROUTERS:
            v = relu_router_from_softmax(v)
        if ".ffn.router." in k and k != _router_weight(k) and swap:
            continue  # a swapped router's own state (offsets, norms) starts fresh
        keep[k] = v
    missing = [k for k in own if k not in keep]
    if any(k not in routers for k in missing):
        raise ConfigError(f"model: train.init_from has no weights for {missing[:3]} "
                          f"(changed: {', '.join(changed)})")
    with torch.no_grad():
        for k, v in keep.items():
            own[k].copy_(v)
    if swap:
        how = ("W - mean_e W_e (the same softmax router, centred)"
               if new_router == "relu" and old_router in SOFTMAX_ROUTERS else "W kept")
        done.append(f"router {old_router} -> {new_router} on the kept experts: {how}"
                    + (f"; fresh {', '.join(sorted({k.rsplit('.', 1)[1] for k in missing}))}"
                       if missing else ""))
    rest = [k for k in changed if k != "router"]
    if rest:
        done.append("changed: " + ", ".join(f"{k}={merged[k]!r}" for k in rest))
    return model.train(), done


def _router_weight(key: str) -> str:
    return key.rsplit(".router.", 1)[0] + ".router.weight"


def build(cfg, seed: int | None = None) -> InitModel:
    """The model of ``cfg.train.init_from`` with ``cfg.model``'s overrides (fp32, CPU)."""
    src = resolve_source(cfg.train.init_from)
    overrides = dict(cfg.model or {})
    base, done = _load_base(src, overrides.get("router"))
    source_router = base.config.routing.router
    model, more = apply_overrides(base, overrides, cfg.run.seed if seed is None else seed)
    check_training(cfg, model.config)
    return InitModel(model, src, done + more, source_router)


def check_training(cfg, model_cfg) -> None:
    """The config checks that need the model (load_config makes them for fresh models)."""
    tc, r, c = cfg.train, model_cfg.routing, model_cfg.control
    max_pos = model_cfg.backbone.max_position_embeddings
    if tc.seq_len > max_pos:
        raise ConfigError(f"train.seq_len={tc.seq_len} must be <= model.max_position_embeddings="
                          f"{max_pos} (train.init_from's; it may be raised with --set "
                          "model.max_position_embeddings=...)")
    if tc.expert_parallel:
        from remoe.experiment import check_expert_parallel

        check_expert_parallel(r.router, r.num_routed)
    if c.revive_after and c.revive_method == "split":
        for name in ("expert_parallel", "fsdp"):
            if getattr(tc, name):
                raise ConfigError(f"model.revive_method=split needs every expert's weights on "
                                  f"every rank; set train.{name}=false or use the hinge")


def source_lr(src: Source) -> float | None:
    """The learning rate of the source's last step: the ``lr`` of its run's ``metrics.jsonl``
    line of the checkpoint's step (a run's ``final/``: the last line); None without a log."""
    from remoe import rundir

    state_step = None
    if src.model_dir.parent.name == "checkpoints":
        run_dir = src.model_dir.parent.parent
        try:
            state_step = int(src.model_dir.name.split("_")[-1])
        except ValueError:
            return None
    else:
        run_dir = src.model_dir.parent
    log = run_dir / "metrics.jsonl"
    if not log.is_file():
        return None
    lines, _ = rundir.read_jsonl(log)
    recs = [r for _, r in lines if isinstance(r, dict) and isinstance(r.get("lr"), (int, float))
            and (state_step is None or r.get("step") == state_step)]
    return float(recs[-1]["lr"]) if recs else None


def start_lr(init: InitModel, tc) -> None:
    """Resolve ``train.init_lr`` into ``init.lr_start`` and the line that says what the run
    does with the schedule (ConfigError: ``source`` without a source log)."""
    if tc.init_lr == "peak":
        init.lr_start = None
        init.lr_info = (f"fresh schedule: the learning rate warms up again from 0 to its peak "
                        f"train.lr={tc.lr:g} over {tc.warmup_steps} steps, then decays to "
                        f"{tc.min_lr:g} (train.init_lr=peak; --set train.init_lr=source continues "
                        "at the source's last learning rate)")
        return
    if tc.init_lr == "source":
        lr = source_lr(init.source)
        if lr is None:
            raise ConfigError(f"train.init_lr=source: train.init_from={init.source.arg!r} has no "
                              "training log (metrics.jsonl) with its last learning rate; give a "
                              "number, e.g. --set train.init_lr=2e-4")
        how = "the source's last"
    else:
        lr, how = float(tc.init_lr), "train.init_lr"
    init.lr_start = lr
    end = min(tc.min_lr, lr)
    init.lr_info = (f"the learning rate starts at {how} {lr:g} without warm-up"
                    + (" and stays there (train.min_lr is not below it)" if end == lr else
                       f" and decays to {end:g} over {tc.max_steps} steps")
                    + f" (train.init_lr={tc.init_lr})")


def recorded_lr(run_dir: Path) -> float | None:
    """``lr_start`` of a run's init_from.json (None: none, or a fresh schedule)."""
    path = run_dir / RECORD_FILE
    if not path.is_file():
        return None
    v = json.loads(path.read_text(encoding="utf-8")).get("lr_start")
    return float(v) if isinstance(v, (int, float)) else None


def from_record(run_dir: Path):
    """A run's model rebuilt (fresh weights) from its init_from.json, for ``--resume``; None
    when the run has no record."""
    from remoe import ReMoEConfig, ReMoEForCausalLM

    path = run_dir / RECORD_FILE
    if not path.is_file():
        return None
    rec = json.loads(path.read_text(encoding="utf-8"))
    return ReMoEForCausalLM(ReMoEConfig(**rec["model"])).train()


# ----------------------------------------------------------------------------- tokenizer

def check_vocabulary(src: Source, data, model_cfg) -> None:
    """The data's tokenizer must produce the ids the model was trained on: the same vocabulary
    as the source's tokenizer.json (token -> id, added tokens included); a source without
    tokenizer files is only checked for size."""
    vocab = model_cfg.backbone.vocab_size
    if data.vocab_size > vocab:
        raise ConfigError(f"data.tokenizer: the data's vocabulary ({data.vocab_size} tokens) is "
                          f"larger than train.init_from's model.vocab_size={vocab}")
    if src.tokenizer_file is None:
        return
    from remoe.data.tokenizer import load_tokenizer

    theirs = load_tokenizer(src.tokenizer_file).get_vocab(with_added_tokens=True)
    ours = data.tokenizer.get_vocab(with_added_tokens=True)
    if theirs != ours:
        diff = sorted(set(theirs.items()) ^ set(ours.items()))
        raise ConfigError(f"data.tokenizer: the data's tokenizer ({len(ours)} tokens, "
                          f"{data.tokenizer_path}) has another vocabulary than train.init_from's "
                          f"({len(theirs)} tokens; e.g. {diff[0][0]!r}); set data.tokenizer="
                          f"{src.tokenizer_file}")
