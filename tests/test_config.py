"""ReMoEConfig: validation (one-line ConfigError naming the field), presets, round trips."""

from __future__ import annotations

import json
import math

import pytest
from transformers import AutoConfig, GenerationConfig

from remoe import PRESETS, ROUTERS, ConfigError, ReMoEConfig

MICRO = PRESETS["micro"]  # hidden 64, 4 heads, 2 kv heads, ffn 256


@pytest.mark.parametrize("overrides, field", [
    (dict(num_experts=8, top_k=9), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(alpha=1.0), "alpha"),
    (dict(alpha=0.5), "alpha"),
    (dict(alpha=math.inf), "alpha"),
    (dict(alpha=math.nan), "alpha"),
    (dict(granularity=3), "granularity"),  # 3 does not divide 256
    (dict(granularity=0), "granularity"),
    (dict(router="relu6"), "router"),
    (dict(num_heads=5), "num_heads"),  # 5 does not divide 64
    (dict(num_heads=3, num_kv_heads=3), "num_heads"),
    (dict(num_kv_heads=3), "num_kv_heads"),  # 3 does not divide 4
    (dict(hidden_size=48, num_heads=16, num_kv_heads=4), "hidden_size/num_heads"),  # odd RoPE dim
    (dict(hidden_size=0), "hidden_size"),
    (dict(vocab_size=-1), "vocab_size"),
    (dict(vocab_size=512.0), "vocab_size"),
    (dict(num_layers=0), "num_layers"),
    (dict(num_experts=0), "num_experts"),
    (dict(ffn_hidden_size=0), "ffn_hidden_size"),
    (dict(reg_type="l2"), "reg_type"),
    (dict(expert_backend="triton"), "expert_backend"),
    (dict(lambda0=0.0), "lambda0"),
    (dict(lambda0=-1e-8), "lambda0"),
    (dict(lambda0=math.inf), "lambda0"),
    (dict(lb_coeff=-0.01), "lb_coeff"),
    (dict(capacity_factor=0.0), "capacity_factor"),
    (dict(warmup_steps=-1), "warmup_steps"),
    (dict(router="topk_warmup", num_experts=4, warmup_k=6), "warmup_k"),
    (dict(sparsemixer_jitter=1.0), "sparsemixer_jitter"),
    (dict(rope_theta=0.0), "rope_theta"),
    (dict(rope_theta="big"), "rope_theta"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(init_std=-0.02), "init_std"),
])
def test_impossible_values_raise_one_line_config_error(overrides, field):
    with pytest.raises(ConfigError) as info:
        ReMoEConfig(**{**MICRO, **overrides})
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"model.{field}="), msg
    assert isinstance(info.value, ValueError)  # callers catching ValueError still work


def test_unknown_preset():
    with pytest.raises(ConfigError, match=r"^model\.preset="):
        ReMoEConfig.from_preset("huge")


@pytest.mark.parametrize("router", ROUTERS)
def test_small_expert_counts_are_valid_for_every_router(router):
    # warmup_k (default 6) only constrains the topk_warmup router
    kw = dict(warmup_k=2) if router == "topk_warmup" else {}
    cfg = ReMoEConfig(**{**MICRO, "router": router, "num_experts": 4, "top_k": 1, **kw})
    assert cfg.routing.num_experts == 4 and cfg.routing.top_k == 1


def test_edge_values_that_are_valid():
    assert ReMoEConfig(**{**MICRO, "num_experts": 8, "top_k": 8}).routing.target_sparsity == 0.0
    assert ReMoEConfig(**{**MICRO, "granularity": 256}).moe_config().d_expert == 1
    assert ReMoEConfig(**{**MICRO, "alpha": 1.0001, "lb_coeff": 0.0,
                          "warmup_steps": 0}).control.alpha == 1.0001
    assert ReMoEConfig(**{**MICRO, "num_heads": 4,
                          "num_kv_heads": 4}).backbone.num_kv_heads == 4  # MHA


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_build_and_defaults(name):
    cfg = ReMoEConfig.from_preset(name)
    for key, value in PRESETS[name].items():
        assert getattr(cfg.backbone, key) == value
    assert cfg.backbone.ffn_hidden_size == 4 * cfg.hidden_size
    r = cfg.routing
    assert (r.router, r.num_experts, r.top_k, r.granularity) == ("relu", 8, 1, 1)
    assert (cfg.control.lambda0, cfg.control.alpha, r.options.reg_type) == (1e-8, 1.2, "lb")
    assert "lb_coeff" not in cfg.to_dict()  # another router's option: not in relu's config.json
    assert cfg.routing.target_sparsity == 1 - 1 / 8
    assert cfg.head_dim * cfg.backbone.num_heads == cfg.hidden_size
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        cfg.backbone.num_layers, cfg.backbone.num_heads, cfg.backbone.num_kv_heads)
    assert not cfg.tie_word_embeddings


def test_paper_backbones():
    # Table 1: hidden, layers, heads, groups; context 1024; GPT-2 vocabulary padded to 50304
    for name, (d, L, h, g) in {"small": (768, 12, 12, 4), "medium": (1024, 24, 16, 4),
                               "large": (1536, 24, 16, 4)}.items():
        c = ReMoEConfig.from_preset(name)
        b = c.backbone
        assert (b.hidden_size, b.num_layers, b.num_heads, b.num_kv_heads) == (d, L, h, g)
        assert c.max_position_embeddings == 1024 and c.vocab_size == 50304


def test_moe_config_mapping():
    cfg = ReMoEConfig(**{**MICRO, "num_experts": 4, "top_k": 2, "granularity": 2,
                         "reg_type": "l1", "expert_backend": "reference", "init_std": 0.1})
    m = cfg.moe_config()
    r = m.routing
    assert (m.d_model, m.d_ffn, r.num_experts, r.top_k, r.granularity) == (64, 256, 4, 2, 2)
    assert (r.router, m.options.reg_type, r.expert_backend, m.init_std) == \
        ("relu", "l1", "reference", 0.1)
    assert (m.num_routed, m.d_expert, r.target_sparsity, m.target_density) == (8, 128, 0.5, 0.5)
    assert ReMoEConfig(router="dense").is_moe is False and cfg.is_moe


def test_top_k_round_trips_as_moe_top_k(tmp_path):
    cfg = ReMoEConfig(**{**MICRO, "num_experts": 8, "top_k": 3, "granularity": 2})
    d = cfg.to_dict()
    assert d["moe_top_k"] == 3 and "top_k" not in d
    again = ReMoEConfig.from_dict(d)
    assert again.routing.top_k == 3 and again.to_dict() == d
    cfg.save_pretrained(tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert on_disk["moe_top_k"] == 3 and "top_k" not in on_disk
    assert on_disk["model_type"] == "remoe"
    for loaded in (ReMoEConfig.from_pretrained(tmp_path), AutoConfig.from_pretrained(tmp_path)):
        assert isinstance(loaded, ReMoEConfig)
        r = loaded.routing
        assert r.top_k == 3 and r.granularity == 2 and r.num_experts == 8
        volatile = ("_name_or_path", "transformers_version")
        strip = lambda x: {k: v for k, v in x.items() if k not in volatile}  # noqa: E731
        assert strip(loaded.to_dict()) == strip(d)
    # k is not mistaken for a sampling setting by generate()
    assert GenerationConfig.from_model_config(cfg).top_k == GenerationConfig().top_k
    # the constructor default is k = 1
    assert ReMoEConfig(**MICRO).routing.top_k == 1


def test_loading_an_impossible_config_json_raises(tmp_path):
    ReMoEConfig(**MICRO).save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["moe_top_k"] = 9
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match=r"^model\.top_k=9"):
        ReMoEConfig.from_pretrained(tmp_path)


def test_from_pretrained_top_k_override(tmp_path):
    ReMoEConfig(**{**MICRO, "top_k": 2}).save_pretrained(tmp_path)
    assert ReMoEConfig.from_pretrained(tmp_path).routing.top_k == 2
    assert ReMoEConfig.from_pretrained(tmp_path, top_k=3).routing.top_k == 3


# ----------------------------------------------------------------------------- composed config

def test_config_is_composed_of_three_sections():
    """ReMoEConfig is built from backbone + routing (+ the router's options) + sparsity-control
    sections and gives them back; each flat field lives in exactly one place; config.json
    stays flat."""
    import dataclasses

    from remoe.model.spec import SECTIONS, ModelSpec, section_fields

    cfg = ReMoEConfig(**MICRO, num_experts=16, top_k=4, lambda0=1e-6, revive_after=3)
    assert cfg.backbone.hidden_size == 64 and cfg.backbone.ffn_hidden_size == 256
    assert (cfg.routing.num_experts, cfg.routing.top_k, cfg.to_dict()["moe_top_k"]) == (16, 4, 4)
    assert (cfg.control.lambda0, cfg.control.revive_after) == (1e-6, 3)
    assert cfg.routing.target_sparsity == 0.75
    names = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)
             if f.metadata.get("flat", True)]  # options: stored flat by name
    assert len(names) == len(set(names)) == len(section_fields())
    flat, spec = cfg.to_dict(), cfg.spec
    for name in names:  # every field a top-level config.json key (k as moe_top_k)
        section = getattr(spec, section_fields()[name][0])
        assert flat["moe_top_k" if name == "top_k" else name] == getattr(section, name)
    for f in dataclasses.fields(spec.routing.options):  # and the router's options
        assert flat[f.name] == getattr(spec.routing.options, f.name)
    assert "lambda0" not in {f.name for f in dataclasses.fields(type(cfg.routing))}
    assert ModelSpec.from_flat({**MICRO, "top_k": 4, "num_experts": 16, "lambda0": 1e-6,
                                "revive_after": 3}) == cfg.spec


def test_layer_config_is_the_routing_section_itself():
    """moe_config() copies no field: the MoE layer's config (a frozen dataclass) holds the
    routing section, so a new routing field cannot be left at a second default."""
    import dataclasses

    from remoe.model.moe import MoEConfig

    cfg = ReMoEConfig(**MICRO, router="topk", num_experts=6, top_k=2, lb_coeff=0.5,
                      granularity=2, init_std=0.01)
    m = cfg.moe_config()
    assert m.routing == cfg.routing
    r = m.routing
    assert (m.d_model, m.d_ffn, m.init_std, r.num_experts, r.top_k, m.options.lb_coeff,
            r.granularity) == (64, 256, 0.01, 6, 2, 0.5, 2)
    assert r.target_sparsity == cfg.routing.target_sparsity
    assert [f.name for f in dataclasses.fields(m)] == ["d_model", "d_ffn", "routing", "init_std"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.d_model = 1
    assert not hasattr(m, "num_experts")  # no read-through: m.routing.num_experts
    kw = MoEConfig.build(d_model=64, d_ffn=256, init_std=0.01, router="topk", num_experts=6,
                         top_k=2, lb_coeff=0.5, granularity=2)  # keywords build the same section
    assert kw == m
    with pytest.raises(ConfigError, match="unknown key model.num_expert "):
        MoEConfig.build(d_model=64, d_ffn=256, num_expert=6)


def test_a_field_read_flat_names_its_section():
    """The layer config and ReMoEConfig read no field through: an old flat name fails with one
    line naming its new home; ReMoEConfig is flat only in to_dict and transformers' names."""
    cfg = ReMoEConfig(**MICRO, router="topk", num_experts=6, top_k=2)
    m = cfg.moe_config()
    for obj, name, msg in [
            (m, "num_experts", "MoEConfig has no 'num_experts': read cfg.routing.num_experts"),
            (m, "lb_coeff", "MoEConfig has no 'lb_coeff': read cfg.options.lb_coeff"),
            (m, "hidden_size", "MoEConfig has no 'hidden_size': read cfg.d_model"),
            (m, "target_sparsity", "MoEConfig has no 'target_sparsity': read "
                                   "cfg.routing.target_sparsity"),
            (cfg, "num_experts", "ReMoEConfig has no 'num_experts': read "
                                 "config.routing.num_experts"),
            (cfg, "moe_top_k", "ReMoEConfig has no 'moe_top_k': read config.routing.top_k"),
            (cfg, "lambda0", "ReMoEConfig has no 'lambda0': read config.control.lambda0"),
            (cfg, "lb_coeff", "ReMoEConfig has no 'lb_coeff': read "
                              "config.routing.options.lb_coeff")]:
        with pytest.raises(AttributeError) as e:
            getattr(obj, name)
        assert str(e.value) == msg
    with pytest.raises(AttributeError, match="^ReMoEConfig.num_experts is not set flat"):
        cfg.num_experts = 4
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.hidden_size, cfg.vocab_size) == \
        (cfg.backbone.num_layers, cfg.backbone.num_heads, 64, cfg.backbone.vocab_size)
    assert cfg.spec is cfg.spec and cfg.routing is cfg.spec.routing  # held, not rebuilt
    assert cfg.to_dict()["moe_top_k"] == 2 and cfg.to_dict()["num_experts"] == 6
    cfg.vocab_size = 640  # transformers' resize_token_embeddings
    assert cfg.spec.backbone.vocab_size == 640


def test_old_config_json_without_newer_fields_loads(tmp_path):
    cfg = ReMoEConfig(**MICRO, lambda0=2e-8, alpha=1.5)
    cfg.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    for newer in ("sparsity_control", "lambda_update", "lambda_pi_kp", "lambda_pi_ki",
                  "revive_after", "router_module", "gate_threshold"):
        data.pop(newer)
    path.write_text(json.dumps(data))
    loaded = ReMoEConfig.from_pretrained(tmp_path)
    assert (loaded.control.lambda0, loaded.control.alpha) == (2e-8, 1.5)
    assert loaded.control.sparsity_control == "global" and loaded.control.revive_after == 0


@pytest.mark.parametrize("field, value", [("num_experts", 0), ("alpha", 1.0),
                                          ("lambda_update", "pid"), ("init_std", 0.0)])
def test_one_validation_for_python_yaml_and_spec(field, value):
    """The same one-line message from ReMoEConfig, the YAML loader and the spec itself."""
    from remoe.model.spec import ModelSpec
    from remoe.experiment import load_config

    msgs = []
    for make in (lambda: ReMoEConfig(**{**PRESETS["tiny"], field: value}),
                 lambda: load_config(None, [f"model.{field}={value}"]),
                 lambda: ModelSpec.from_flat({"preset": "tiny", field: value}).validate()):
        with pytest.raises(ConfigError) as e:
            make()
        msgs.append(str(e.value))
    assert len(set(msgs)) == 1 and msgs[0].startswith(f"model.{field}=")


def test_yaml_model_section_keeps_its_keys():
    from remoe.experiment import load_config

    cfg = load_config(None, ["model.lambda0=1e-7", "model.alpha=1.3", "model.top_k=2",
                             "model.eos_token_id=3"])
    mc = cfg.model_config(vocab_size=cfg.data.vocab_size)
    assert (mc.control.lambda0, mc.control.alpha, mc.routing.top_k, mc.eos_token_id) == \
        (1e-7, 1.3, 2, 3)
    assert cfg.model_spec().control.lambda0 == 1e-7
    with pytest.raises(ConfigError, match=r"^unknown key model\.lamda0 \(allowed: preset, "):
        load_config(None, ["model.lamda0=1e-7"])
    with pytest.raises(ConfigError, match=r"^model\.alpha='x' must be of type float$"):
        load_config(None, ["model.alpha=x"])


def test_the_model_section_is_validated_once_per_path(tmp_path, monkeypatch):
    """An experiment: load_config validates the spec, model_config serialises it unchecked; a
    saved config.json (another entry point) is validated when it loads."""
    from remoe.experiment import load_config
    from remoe.model.spec import ModelSpec

    calls = []  # the specs validated (transformers also builds default configs to compare)
    real = ModelSpec.validate
    monkeypatch.setattr(ModelSpec, "validate", lambda self, p="model.": (calls.append(self),
                                                                          real(self, p))[1])
    cfg = load_config(None, ["model.top_k=2", "model.preset=micro", "model.vocab_size=512"])
    mc = cfg.model_config(vocab_size=512, eos_token_id=3)
    assert calls == [mc.spec]
    assert (mc.routing.top_k, mc.eos_token_id, mc.hidden_size) == (2, 3, 64)
    mc.save_pretrained(tmp_path)
    calls.clear()
    assert ReMoEConfig.from_pretrained(tmp_path).spec == mc.spec and calls.count(mc.spec) == 1
    with pytest.raises(TypeError, match="'hidden_size' is a model field"):
        ReMoEConfig.from_spec(mc.spec, hidden_size=32)
    bad = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**bad, "moe_top_k": 99}))
    with pytest.raises(ConfigError, match="^model.top_k=99 must be <= model.num_experts=8$"):
        ReMoEConfig.from_pretrained(tmp_path)  # an old or edited config.json: still checked


def test_registry_knows_which_builtins_add_config_checks():
    """Validation imports (torch-heavy) router modules only for the built-ins listed in
    registry.BUILTINS_WITH_CHECKS: that list must be exactly the classes with their own hook."""
    import ast
    import inspect
    import textwrap

    from remoe.model import registry

    def checks_something(cls) -> bool:  # the hook's body is more than a docstring / pass
        src = textwrap.dedent(inspect.getsource(cls.validate_config.__func__))
        body = ast.parse(src).body[0].body
        return any(not isinstance(s, (ast.Pass, ast.Expr)) for s in body)

    own = {n for n in registry.BUILTINS if checks_something(registry.resolve(n))}
    assert own == set(registry.BUILTINS_WITH_CHECKS)
    for n in registry.BUILTINS:  # the options table is the classes' own declaration
        assert getattr(registry.resolve(n), "options", None) is registry.options_class(n), n
    with pytest.raises(ConfigError, match=r"^model\.warmup_k=9 must be <= model\.num_experts=8$"):
        ReMoEConfig(**MICRO, router="topk_warmup", warmup_k=9)


_LIGHT_COMMANDS = r"""
import contextlib, io, json, sys
from remoe.cli import main
out = {}
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            rc = main(argv)
        except SystemExit as e:
            rc = e.code
    out[" ".join(argv)] = [rc, sorted(m for m in ("torch", "transformers") if m in sys.modules)]
print(json.dumps(out))
"""


def test_help_print_config_and_config_errors_import_neither_torch_nor_transformers(tmp_path):
    """`--help`, `--print-config` and a config error must not pay for importing torch
    or transformers (seconds). Checked by sys.modules in a fresh interpreter, not by timing."""
    import subprocess
    import sys

    cases = [["--help"], *[[c, "--help"] for c in ("data", "train", "eval", "analyze", "report",
                                                    "bench", "study", "convert")],
             ["train", "--print-config"], ["train", "--set", "model.num_experts=0"],
             ["train", "--set", "model.router=topk", "--print-config"]]
    done = subprocess.run([sys.executable, "-c", _LIGHT_COMMANDS, json.dumps(cases)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["train --set model.num_experts=0"][0] == 2
    assert result["train --print-config"][0] == 0
    heavy = {cmd: mods for cmd, (_, mods) in result.items() if mods}
    assert heavy == {}, f"these commands imported heavy modules: {heavy}"


def test_public_names_are_lazy_and_register_auto_classes():
    """`import remoe` imports nothing heavy; the names still resolve, and using the config
    registers model_type "remoe" with transformers' AutoConfig."""
    import subprocess
    import sys

    code = ("import sys, remoe; light = not {'torch', 'transformers'} & set(sys.modules); "
            "from remoe import ReMoEConfig, Router, register_router, ModelSpec, LambdaController; "
            "from transformers import AutoConfig; "
            "print(light, AutoConfig.for_model('remoe').__class__ is ReMoEConfig)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.stdout.split() == ["True", "True"], done.stderr


def test_every_routing_and_control_field_is_declared_once():
    """a routing or sparsity-control field, or a built-in router's option, has one declaration
    with a default, in its section dataclass or its router's options dataclass. A class anywhere in remoe that declares the same name with a literal
    default is a second definition (the MoE layer's config used to copy 24 of them), unless it
    is listed here as a different quantity that shares the name."""
    import ast
    import dataclasses
    from pathlib import Path

    from remoe.model.spec import RoutingConfig, SparsityControlConfig

    other_quantities = {
        ("TrainConfig", "warmup_steps"): "the learning-rate warm-up, not topk_warmup's",
        ("RoutingStats", "top_k"): "a measured model's k, recorded with its statistics",
        ("RoutingStats", "num_experts"): "ditto",
        ("RoutingStats", "granularity"): "ditto",
        ("FlipSeries", "num_experts"): "the N of recorded masks",
    }
    from remoe.model import registry

    options = list(registry.light_options().values())
    names = {f.name for cls in (RoutingConfig, SparsityControlConfig, *options)
             for f in dataclasses.fields(cls)} - {"options"}  # (Router.options: the class's)
    src = Path(__file__).resolve().parents[1] / "src" / "remoe"
    found: dict[str, list[str]] = {}
    for path in src.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for st in node.body:
                if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) \
                        and st.target.id in names and isinstance(st.value, ast.Constant) \
                        and (node.name, st.target.id) not in other_quantities:
                    found.setdefault(st.target.id, []).append(f"{path.name}:{node.name}")
    twice = {k: v for k, v in found.items() if len(v) > 1}
    assert not twice, twice
    sections = {"RoutingConfig", "SparsityControlConfig",
                *(c.__name__ for o in options for c in o.__mro__)}
    assert all(v[0].split(":")[1] in sections for v in found.values()), found
    assert len(found) == len(names)


def test_a_user_routers_options_are_model_fields(tmp_path, monkeypatch):
    """register_router(options=...): the options go through ReMoEConfig, config.json, the
    layer's config and replace(), are type-checked, and may not shadow a model field."""
    import dataclasses

    from remoe import register_router
    from remoe.model import registry

    # the registry is process-wide: this test's routers leave with it
    monkeypatch.setattr(registry, "_user", dict(registry._user))
    monkeypatch.setattr(registry, "_options", dict(registry._options))
    from remoe.model.moe import MoEConfig
    from remoe.model.routers.relu import ReLURouter

    @dataclasses.dataclass(frozen=True)
    class Opts:
        sharpness: float = 1.0
        mode: str = "a"

    @register_router("relu_opts_cfgtest", options=Opts)
    class R(ReLURouter):
        pass

    cfg = ReMoEConfig(**MICRO, router="relu_opts_cfgtest", sharpness=2.5)
    o = cfg.routing.options
    assert (o.sharpness, o.mode) == (2.5, "a")  # set and defaulted; stored flat in config.json
    cfg.save_pretrained(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["sharpness"] == 2.5 and data["mode"] == "a"
    assert data["router_module"] == __name__  # recorded, so the model loads where it imports
    again = ReMoEConfig.from_pretrained(tmp_path)
    assert again.routing == cfg.routing and again.routing.options.sharpness == 2.5
    layer = cfg.moe_config()
    assert layer.options.sharpness == 2.5 and layer.routing.replace(mode="b").options.mode == "b"
    assert isinstance(MoEConfig.build(d_model=8, d_ffn=16, router="relu_opts_cfgtest").options,
                      Opts)
    with pytest.raises(ConfigError, match=r"model.sharpness='x' must be of type float"):
        ReMoEConfig(**MICRO, router="relu_opts_cfgtest", sharpness="x")
    from remoe.model.spec import ModelSpec

    with pytest.raises(ConfigError, match="unknown key model.sharpnes "):
        ModelSpec.from_flat({"router": "relu_opts_cfgtest", "sharpnes": 1.0})
    with pytest.raises(ConfigError, match="unknown key model.sharpness "):  # not the router's
        ModelSpec.from_flat({"router": "relu", "sharpness": 1.0})

    @dataclasses.dataclass(frozen=True)
    class Clash:
        num_experts: int = 4

    @register_router("relu_clash_cfgtest", options=Clash)
    class C(ReLURouter):
        pass

    with pytest.raises(ConfigError, match="declares option 'num_experts', which is already a "):
        ReMoEConfig(**MICRO, router="relu_clash_cfgtest")

    from remoe.model.routers.options import ReLUOptions

    @dataclasses.dataclass(frozen=True)
    class MoreReLU(ReLUOptions):  # a ReLU router's options, and one of its own
        sharpness: float = 1.0

    @register_router("relu_more_cfgtest", options=MoreReLU)
    class M(ReLURouter):
        pass

    more = ReMoEConfig(**MICRO, router="relu_more_cfgtest", max_active=2, sharpness=3.0)
    router = more.moe_config().options
    assert (router.max_active, router.sharpness, more.routing.options.max_active) == (2, 3.0, 2)
    from remoe.model.moe import build_router

    assert build_router(more.moe_config()).max_active == 2  # ReLURouter reads its options
