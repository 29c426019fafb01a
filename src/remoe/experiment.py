"""Experiment configs: YAML files (or dicts) mapped onto dataclasses, with ``--set`` overrides.

Below every command that runs one (train, data, study, bench): :func:`load_config` takes a
path, a dict of sections or nothing (the defaults), :func:`remoe.configfile.config_path` finds the file a
command reads (:data:`DEFAULT_CONFIG` without one). An experiment has five sections: ``run``
(:class:`RunConfig`), ``model`` (``preset`` and the fields of the three model sections of
:mod:`remoe.model.spec`, flat), ``data`` (:class:`remoe.data.DataConfig`), ``train`` (:class:`TrainConfig`) and ``analysis`` (:class:`AnalysisConfig`). Unknown keys,
duplicate keys, wrong types, non-finite numbers, impossible values, a file that is not UTF-8
YAML, a section that is not a mapping and a run directory that cannot be one raise
:class:`ConfigError` naming the field, before any data or model work starts.

The dataclass defaults are the documented default run, ``configs/tiny_remoe.yaml``: an empty
YAML file (or no file) gives exactly that experiment.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from remoe import safeyaml
from remoe.configfields import build_section, check_finite, coerce, parse_override, short
from remoe.data.config import DataConfig
from remoe.errors import ConfigError, check
from remoe.model import registry
from remoe.model.spec import PRESETS, TOKEN_IDS, ModelSpec, RoutingConfig, field_types

if TYPE_CHECKING:
    from remoe.model.config import ReMoEConfig


MAX_SEED = 2**63 - 1  # torch.manual_seed and numpy's SeedSequence take any 0 <= seed < 2**64


@dataclass
class RunConfig:
    name: str = "tiny-remoe"
    out_dir: str = "runs"
    seed: int = 0

    def validate(self) -> None:
        name, out_dir = self.name, self.out_dir
        check(isinstance(name, str) and name.strip() != "" and name not in (".", "..")
              and not any(c in name for c in "/\\") and name.isprintable(),
              f"run.name={name!r} must be a directory name: not empty, '.' or '..', without "
              "'/', '\\' or control characters")
        # the run's archive (<name>.old-<time>-<n>) and temporaries must stay within NAME_MAX
        check(len(name.encode("utf-8", "replace")) <= 200, f"run.name={name[:40]!r}... is "
              f"{len(name.encode('utf-8', 'replace'))} bytes long; at most 200")
        check(isinstance(out_dir, str) and out_dir != "" and "\x00" not in out_dir,
              f"run.out_dir={out_dir!r} must be a non-empty path")
        check(isinstance(self.seed, int) and not isinstance(self.seed, bool)
              and 0 <= self.seed <= MAX_SEED, f"run.seed={self.seed!r} must be an integer in "
              f"[0, {MAX_SEED}]")
        out = Path(out_dir)
        for p in (out, *out.parents):  # the nearest existing ancestor must be a directory
            if p.exists():
                check(p.is_dir(), f"run.out_dir={out_dir!r} must be a directory, but "
                      f"{str(p)!r} is a file")
                break
        run_dir = out / name
        if run_dir.exists() or run_dir.is_symlink():
            check(run_dir.is_dir(), f"run.name={name!r}: {str(run_dir)!r} exists and is not a "
                  "directory")
            check(run_dir.resolve().parent == out.resolve(), f"run.name={name!r}: "
                  f"{str(run_dir)!r} leads outside run.out_dir={out_dir!r} (to "
                  f"{str(run_dir.resolve())!r})")


@dataclass
class TrainConfig:
    seq_len: int = 256
    micro_batch_size: int = 8  # sequences per process per micro-step
    grad_accum: int = 1  # micro-steps per optimizer step
    max_steps: int = 300  # also the horizon of the cosine schedule
    max_tokens: int | None = None  # stop once this many tokens were trained (None: no limit)
    max_flops: float | None = None  # stop once this many training FLOPs were spent
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 30
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping
    # AdamW's implementation: auto (foreach on CUDA, the single-tensor loop on CPU) | foreach |
    # fused (one kernel per parameter group; CUDA and CPU) | single (docs/SCALING.md)
    adamw_impl: str = "auto"
    # tokens per chunk of the LM head + cross-entropy in training (0: the whole micro-batch at
    # once); chunked, each chunk's logits are recomputed in backward, so the fp32 logits of the
    # micro-batch never exist at once (remoe.model.losses.chunked_lm_loss)
    loss_chunk_tokens: int = 0
    # the LM head + cross-entropy of a training forward compiled as one function (inductor
    # fuses the fp32 upcast, softmax and gather, forward and backward; no logits returned;
    # remoe.model.losses.lm_loss); not with loss_chunk_tokens > 0
    compile_loss: bool = False
    # copy each micro-batch to the GPU from pinned host memory, asynchronously (CUDA only)
    pin_memory: bool = False
    # read the next micro-batch and issue its copy before computing this one (CUDA: on a side
    # stream); the same batches
    prefetch: bool = False
    # under bf16 autocast, cast the stacked expert weights once per optimizer step instead of
    # once per micro-batch (remoe.model.experts.cast_once_per_step; not with train.fsdp)
    cast_experts_once: bool = False
    eval_every: int = 100  # 0 disables periodic validation (a final one still runs)
    eval_chunks_per_domain: int = 8
    eval_batch_size: int = 8
    save_every: int = 100  # 0: only the final checkpoint
    keep_last: int = 2
    # optimizer state in every kept checkpoint (all), or in the newest only (newest: older ones
    # keep weights, lambda controller, RNG and data position; a resume from one of them is
    # refused, so a damaged newest checkpoint no longer falls back bit-exactly)
    keep_optimizer: str = "all"
    log_every: int = 10  # console lines when not on a terminal
    tensorboard: bool = False
    device: str = "auto"  # auto | cpu | cuda
    precision: str = "auto"  # auto (fp32 on CPU, bf16 autocast on CUDA) | fp32 | bf16
    # torch intra-op threads (remoe.machine.threads), fixed when the run starts and reused on
    # resume: null = all usable cores (CPU affinity, OMP_NUM_THREADS; never the load), N = N;
    # auto = all usable cores or 1, whichever runs faster, re-timed every thread_probe_every
    # steps (faster beside busy processes, but not bit-reproducible across loads)
    num_threads: int | str | None = None
    thread_probe_every: int = 50
    # pin ATen and oneDNN to their AVX2 kernels and MKL to its vendor-neutral branch before torch
    # starts (remoe.machine.kernels), so the same config and seed give the same bits on any
    # x86-64 with AVX2; needs a fixed num_threads (docs/RELIABILITY.md)
    portable_kernels: bool = False
    # expert parallelism under torchrun: rank r holds experts [r*N/W, (r+1)*N/W) of every MoE
    # layer (remoe.distributed.expert_parallel); no-op with one process
    expert_parallel: bool = False
    # FSDP2 under torchrun: decoder blocks and root sharded over the ranks, sharded (DCP)
    # checkpoints (remoe.distributed.fsdp, remoe.distributed.dcp; docs/SCALING.md)
    fsdp: bool = False
    compile: bool = False  # torch.compile each decoder block (remoe.train.runtime); off: eager
    # the device path's plan for data-dependent routing (ReLU), the same pairs and results on
    # each: auto (capacity in one CUDA process with train.compile, without expert_parallel or
    # fsdp: 1.22x exact's tokens/s on an H200; else exact; runtime.resolve_dispatch_plan) |
    # exact (nonzero, one host sync per MoE layer) | static (padded to a static capacity: no
    # sync, but the padding rows' work and memory; docs/SCALING.md) | capacity (padded to a
    # capacity from the previous steps' counts: no sync, one graph per compiled block, a step
    # whose pairs do not fit redone; remoe.train.control.CapacityPlan)
    dispatch_plan: str = "auto"
    # start from existing weights (remoe.train.init_from, docs/CONTINUE.md): a remoe model,
    # checkpoint or run directory, or a transformers Llama / Mixtral / Qwen2-MoE / OLMoE
    # directory (converted on the fly); the model: section then holds overrides only
    init_from: str | None = None
    # lambda at the first step of an init_from run (null: measured from the model, see
    # remoe.train.init_lambda.initial_lambda; a run checkpoint's own lambda when it fits)
    init_lambda: float | None = None
    # learning rate of an init_from run (docs/CONTINUE.md): peak = a fresh schedule (warm-up to
    # train.lr, cosine to train.min_lr); source = the source run's last lr, a number = that lr:
    # then no warm-up, cosine from it to min(train.min_lr, it) (the source's last lr of a
    # finished run is its min_lr: held constant)
    init_lr: float | str = "peak"

    def validate(self) -> None:
        check_finite(self, "train")
        for name in ("seq_len", "micro_batch_size", "grad_accum", "max_steps",
                     "eval_chunks_per_domain", "eval_batch_size"):
            check(getattr(self, name) >= 1, f"train.{name}={getattr(self, name)!r} must be >= 1")
        for name in ("warmup_steps", "eval_every", "save_every", "keep_last", "log_every"):
            check(getattr(self, name) >= 0, f"train.{name}={getattr(self, name)!r} must be >= 0")
        check(self.lr > 0 and math.isfinite(self.lr), f"train.lr={self.lr!r} must be > 0")
        check(self.eps > 0, f"train.eps={self.eps!r} must be > 0 (AdamW's denominator term)")
        check(0 <= self.min_lr <= self.lr,
              f"train.min_lr={self.min_lr!r} must be in [0, train.lr={self.lr}]")
        check(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1,
              f"train.beta1/beta2=({self.beta1}, {self.beta2}) must be in [0, 1)")
        check(self.weight_decay >= 0, f"train.weight_decay={self.weight_decay!r} must be >= 0")
        check(self.grad_clip >= 0, f"train.grad_clip={self.grad_clip!r} must be >= 0")
        check(self.max_tokens is None or self.max_tokens > 0,
              f"train.max_tokens={self.max_tokens!r} must be > 0 or null")
        check(self.max_flops is None or self.max_flops > 0,
              f"train.max_flops={self.max_flops!r} must be > 0 or null")
        check(self.device in ("auto", "cpu", "cuda"),
              f"train.device={self.device!r} must be one of auto, cpu, cuda")
        check(self.precision in ("auto", "fp32", "bf16"),
              f"train.precision={self.precision!r} must be one of auto, fp32, bf16")
        check(self.num_threads is None or self.num_threads == "auto" or (
            isinstance(self.num_threads, int) and not isinstance(self.num_threads, bool)
            and self.num_threads >= 1),
              f"train.num_threads={self.num_threads!r} must be an integer >= 1, null (all usable "
              "cores) or auto (timed)")
        check(isinstance(self.thread_probe_every, int) and self.thread_probe_every >= 1,
              f"train.thread_probe_every={self.thread_probe_every!r} must be an integer >= 1")
        check(isinstance(self.fsdp, bool), f"train.fsdp={self.fsdp!r} must be true or false")
        check(self.dispatch_plan in ("auto", "exact", "static", "capacity"),
              f"train.dispatch_plan={self.dispatch_plan!r} must be auto, exact, static or "
              "capacity")
        check(self.adamw_impl in ("auto", "foreach", "fused", "single"),
              f"train.adamw_impl={self.adamw_impl!r} must be auto, foreach, fused or single")
        check(isinstance(self.loss_chunk_tokens, int) and not isinstance(self.loss_chunk_tokens,
                                                                         bool)
              and self.loss_chunk_tokens >= 0,
              f"train.loss_chunk_tokens={self.loss_chunk_tokens!r} must be an integer >= 0")
        for name in ("pin_memory", "prefetch", "cast_experts_once", "compile_loss"):
            check(isinstance(getattr(self, name), bool),
                  f"train.{name}={getattr(self, name)!r} must be true or false")
        check(not (self.compile_loss and self.loss_chunk_tokens),
              "train.compile_loss=true and train.loss_chunk_tokens > 0 both replace the LM head "
              "and loss of a training forward: choose one")
        check(not (self.cast_experts_once and self.fsdp),
              "train.cast_experts_once=true does not apply with train.fsdp=true (FSDP's "
              "mixed-precision policy casts the experts when it gathers them)")
        check(self.keep_optimizer in ("all", "newest"),
              f"train.keep_optimizer={self.keep_optimizer!r} must be all or newest")
        check(self.init_from is None or (isinstance(self.init_from, str) and self.init_from != ""),
              f"train.init_from={self.init_from!r} must be a directory or null")
        if isinstance(self.init_lr, str) and self.init_lr not in ("peak", "source"):
            try:  # YAML reads 1e-3 (no dot) as a string
                self.init_lr = float(self.init_lr)
            except ValueError:
                pass
        check(self.init_lr in ("peak", "source") or (
            isinstance(self.init_lr, (int, float)) and not isinstance(self.init_lr, bool)
            and math.isfinite(self.init_lr) and self.init_lr > 0),
              f"train.init_lr={self.init_lr!r} must be peak, source or a learning rate > 0")
        check(self.init_lr == "peak" or self.init_from is not None,
              f"train.init_lr={self.init_lr!r} needs train.init_from (a fresh run warms up to "
              "train.lr)")
        check(self.init_lambda is None or self.init_lambda > 0,
              f"train.init_lambda={self.init_lambda!r} must be > 0 or null (measured)")


@dataclass
class AnalysisConfig:
    record_masks_every: int = 2  # record calibration-set routing masks every N steps (0: off)
    calib_tokens: int = 1024  # size of the fixed calibration set for flip rates

    def validate(self) -> None:
        check(self.record_masks_every >= 0,
              f"analysis.record_masks_every={self.record_masks_every!r} must be >= 0")
        check(self.calib_tokens >= 1, f"analysis.calib_tokens={self.calib_tokens!r} must be >= 1")


@dataclass
class ExperimentConfig:
    run: RunConfig = field(default_factory=RunConfig)
    model: dict[str, Any] = field(default_factory=lambda: {"preset": "tiny"})
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)
    #: the model section parsed, once (:func:`load_config` validates it); None with
    #: ``train.init_from``, whose section holds overrides of the source's config
    spec: ModelSpec | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.spec is None and self.train.init_from is None:
            self.spec = ModelSpec.from_flat(self.model)

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out_dir) / self.run.name

    def model_spec(self, vocab_size: int | None = None) -> ModelSpec:
        """The model config (:attr:`spec`), with ``vocab_size`` (the tokenizer's) if the section
        sets none. Validated by :func:`load_config`, not here."""
        spec = self.spec if self.spec is not None else ModelSpec.from_flat(self.model)
        if vocab_size is None or "vocab_size" in self.model:
            return spec
        return dataclasses.replace(spec, backbone=dataclasses.replace(spec.backbone,
                                                                      vocab_size=vocab_size))

    def model_config(self, vocab_size: int | None = None, **hf: Any) -> "ReMoEConfig":
        """The ReMoEConfig of :meth:`model_spec` (not validated again); ``hf``: token ids, ..."""
        from remoe.model.config import ReMoEConfig

        spec = self.model_spec(vocab_size)
        if self.train.init_from is not None:  # load_config left these overrides unchecked (the
            spec.validate()  # run checks them against its source): the defaults they refine
        ids = {k: v for k, v in self.model.items() if k in TOKEN_IDS}  # model keys, no field
        return ReMoEConfig.from_spec(spec, **{**ids, **hf})

    def to_dict(self) -> dict[str, Any]:
        return {"run": dataclasses.asdict(self.run), "model": dict(self.model),
                "data": dataclasses.asdict(self.data), "train": dataclasses.asdict(self.train),
                "analysis": dataclasses.asdict(self.analysis)}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ----------------------------------------------------------------------------- loading

def _build_model_section(values: dict[str, Any]) -> dict[str, Any]:
    check(isinstance(values, dict), f"model must be a mapping, got {values!r}")
    # every model field's type; a user router's options too (its module is imported for them)
    types = field_types(values.get("router", RoutingConfig.router), values.get("router_module"))
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key == "preset":
            check(value in PRESETS, f"model.preset={value!r} must be one of {', '.join(PRESETS)}")
            out[key] = value
            continue
        check(key in types, f"unknown key model.{key} (allowed: preset, {', '.join(types)})")
        out[key] = coerce(value, types[key], f"model.{key}")
    return out


SECTIONS = ("run", "model", "data", "train", "analysis")
#: the experiment ``remoe train`` runs without a CONFIG, in a source checkout
DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny_remoe.yaml"
#: an unset model.vocab_size follows the tokenizer, rounded up to a multiple of this
VOCAB_MULTIPLE = 64


def ep_routers() -> tuple[str, ...]:
    """Routers that declare ``expert_parallel`` (token-routed, stacked experts)."""
    return tuple(n for n in registry.names() if registry.declares(n, "expert_parallel"))


def check_expert_parallel(router: str, num_routed: int, world_size: int | None = None) -> None:
    """Raise :class:`ConfigError` when ``train.expert_parallel=true`` cannot run."""
    if not registry.declares(router, "expert_parallel"):
        raise ConfigError(f"train.expert_parallel=true needs a token-routed MoE router "
                          f"({', '.join(ep_routers())}), not model.router={router!r}")
    if world_size is not None and world_size > 1 and num_routed % world_size:
        raise ConfigError(f"train.expert_parallel=true needs the number of experts "
                          f"(model.num_experts x model.granularity = {num_routed}) to be "
                          f"divisible by the world size ({world_size})")


def padded_vocab(tokenizer_vocab: int) -> int:
    """The embedding rows of a model whose ``model.vocab_size`` is unset: the tokenizer's
    vocabulary rounded up to a multiple of :data:`VOCAB_MULTIPLE`."""
    return -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def load_config(path: str | Path | dict[str, Any] | None = None,
                overrides: list[str] | None = None,
                default_file: bool = False) -> ExperimentConfig:
    """Load an experiment (a YAML file, a dict of sections, or the defaults), apply ``--set``
    overrides, validate everything.

    With ``train.init_from`` the ``model:`` section holds overrides of the source's config,
    checked against the source when the run starts (:mod:`remoe.train.init_from`); then
    ``default_file`` (``path`` is the default experiment, not the user's) drops the file's
    ``model:`` section, which describes the default model, not an override."""
    raw: dict[str, Any] = {}
    if isinstance(path, dict):  # sections given directly (remoe study): checked as a file's
        safeyaml.check_size(path)
        raw = dict(path)
    elif path is not None:
        p = Path(path)
        loaded = safeyaml.read_file(p)
        # an empty file (or only comments) is the default experiment
        raw = {} if loaded is None else loaded
        check(isinstance(raw, dict), f"config={str(p)!r} must be a mapping of sections, got "
              f"{type(raw).__name__} {short(raw)}")
    for k, v in raw.items():
        check(k in SECTIONS, f"unknown section {k!r} (allowed: {', '.join(SECTIONS)})")
        check(v is None or isinstance(v, dict), f"section {k} must be a mapping of keys "
              f"(key: value lines indented under '{k}:'), got {type(v).__name__} {short(v)}")
    # an empty section (`model:` alone, or {}) is the same as no section: its defaults
    raw = {k: dict(v) for k, v in raw.items() if v}
    file_model = raw.pop("model", None)
    set_model: dict[str, Any] = {}  # --set model.x=... refines the file's (or default) model
    for text in overrides or []:
        (section, key), value = parse_override(text)
        check(section in SECTIONS, f"--set {text!r}: unknown section {section!r} "
              f"(allowed: {', '.join(SECTIONS)})")
        if section == "model":
            set_model[key] = value
        else:
            raw.setdefault(section, {})[key] = value
    if (raw.get("train") or {}).get("init_from") is not None:
        # the model comes from the source; the section holds overrides of its config
        base = {} if default_file or file_model is None else file_model
        model, spec = _build_model_section({**base, **set_model}), None
        check("preset" not in model, f"model.preset={model.get('preset')!r} cannot be combined "
              "with train.init_from: the model's shape comes from the source; remove it")
    else:
        base = file_model if file_model is not None else {"preset": "tiny"}
        model = _build_model_section({**base, **set_model})
        spec = ModelSpec.from_flat(model)  # the one parse and validation of every model field
        spec.validate()
    cfg = ExperimentConfig(
        run=build_section(RunConfig, raw.get("run", {}), "run"),
        model=model,
        spec=spec,
        data=build_section(DataConfig, raw.get("data", {}), "data"),
        train=build_section(TrainConfig, raw.get("train", {}), "train"),
        analysis=build_section(AnalysisConfig, raw.get("analysis", {}), "analysis"),
    )
    if cfg.train.init_from is not None:  # the model checks need the source: at the run's start
        return cfg
    spec = cfg.model_spec(vocab_size=cfg.data.vocab_size)
    max_pos = spec.backbone.max_position_embeddings
    if "vocab_size" in cfg.model and cfg.data.tokenizer is None:
        # a trained byte-level BPE has the 256 bytes and an end-of-text token at least: no data
        # needs preparing to know that a smaller embedding cannot hold its ids
        check(spec.backbone.vocab_size >= 257, f"model.vocab_size={spec.backbone.vocab_size} "
              "must be >= 257: the trained byte-level tokenizer has 256 byte tokens and an "
              f"end-of-text token (data.vocab_size={cfg.data.vocab_size} asks for "
              f"{cfg.data.vocab_size}); leave model.vocab_size unset to follow the tokenizer")
    if cfg.train.expert_parallel:  # the world size is checked when training starts
        check_expert_parallel(spec.routing.router, spec.routing.num_routed)
    if spec.control.revive_after and spec.control.revive_method == "split":
        for name in ("expert_parallel", "fsdp"):  # a split copies rows across all experts
            check(not getattr(cfg.train, name), f"model.revive_method=split needs every "
                  f"expert's weights on every rank; set train.{name}=false or use the hinge")
    check(cfg.train.seq_len <= max_pos,
          f"train.seq_len={cfg.train.seq_len} must be <= model.max_position_embeddings={max_pos}")
    return cfg
