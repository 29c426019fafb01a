"""The router's options in the model config: old config.json files, the options table."""

from __future__ import annotations

import json

import pytest

from remoe import PRESETS, ConfigError, ReMoEConfig

MICRO = PRESETS["micro"]


def test_config_json_of_an_earlier_version_loads(tmp_path):
    """Earlier versions stored every built-in router's options in every config.json: they load,
    each checked, and only the chosen router's are kept."""
    from remoe.model.spec import defaults

    cfg = ReMoEConfig(**MICRO, max_active=3)
    cfg.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    old = {**{k: v for k, v in defaults().items() if k not in data and k != "top_k"},
           "lb_coeff": 0.02, "warmup_k": 4, **data}  # options of other routers, as they were
    path.write_text(json.dumps(old))
    loaded = ReMoEConfig.from_pretrained(tmp_path)
    assert loaded.spec == cfg.spec and loaded.routing.options.max_active == 3
    assert not hasattr(loaded, "lb_coeff") and not hasattr(loaded, "warmup_k")
    path.write_text(json.dumps({**old, "lb_coeff": -1.0}))  # still checked
    with pytest.raises(ConfigError, match=r"^model\.lb_coeff=-1\.0 must be >= 0$"):
        ReMoEConfig.from_pretrained(tmp_path)


def test_each_builtin_declares_its_options_and_reads_only_them():
    """Every built-in router's options dataclass holds exactly the keys it reads; a model's
    config.json stores only its router's."""
    import dataclasses

    from remoe.model import registry

    for name in registry.BUILTINS:
        opts = registry.options_class(name)
        cfg = ReMoEConfig(**MICRO, router=name, **({"warmup_k": 2} if name == "topk_warmup"
                                                     else {}))
        stored = set(cfg.to_dict())
        for other in registry.light_options().values():
            for f in dataclasses.fields(other):
                mine = opts is not None and f.name in {g.name for g in dataclasses.fields(opts)}
                assert (f.name in stored) == mine, (name, f.name)
