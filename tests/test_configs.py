"""Every shipped config composes and validates against its stage's schema, in every combination of the
groups it uses (targets x data sets; pipeline experiments; static trees)."""

from __future__ import annotations

import itertools

import pytest
from omegaconf import OmegaConf

from eagle_train.cli import SCHEMAS, compose
from eagle_train.config.base import CONF_DIR, to_schema

# Values a user must give on the command line (no sensible default).
REQUIRED = {
    "export": ["ckpt=runs/x/final", "out_dir=exports/x"],
    "train": ["features=runs/x/features"],
    "evaluate": ["draft.path=runs/x/final"],
}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def _groups_of(config_name: str) -> list[str]:
    defaults = OmegaConf.load(CONF_DIR / f"{config_name}.yaml").get("defaults", [])
    groups = []
    for entry in defaults:
        if isinstance(entry, dict) or OmegaConf.is_dict(entry):
            (key,) = list(entry.keys())
            if not str(key).startswith(("override", "optional")) and (CONF_DIR / str(key)).is_dir():
                groups.append(str(key))
    return groups


def _combinations():
    for name in SCHEMAS:
        groups = _groups_of(name)
        for values in itertools.product(*(_options(g) for g in groups)):
            yield name, [f"{g}={v}" for g, v in zip(groups, values, strict=True)]
    # training recipes are opt-in (`+recipe=NAME`), on top of every target
    for recipe, target in itertools.product(_options("recipe"), _options("target")):
        yield "train", [f"target={target}", f"+recipe={recipe}"]


def test_every_stage_has_a_primary_config():
    assert sorted(p.stem for p in CONF_DIR.glob("*.yaml")) == sorted(SCHEMAS)


@pytest.mark.parametrize("config_name, overrides", list(_combinations()), ids=lambda v: str(v))
def test_config_composes_and_validates(config_name, overrides):
    cfg = compose(config_name, overrides + REQUIRED.get(config_name, []))
    obj = to_schema(cfg, SCHEMAS[config_name])
    assert obj is not None
    if hasattr(obj, "target"):
        for override in overrides:
            group, value = override.split("=")
            if group == "target":  # the preset really reached the schema
                expected = OmegaConf.load(CONF_DIR / "target" / f"{value}.yaml")
                assert obj.target.name == expected.name


@pytest.mark.parametrize("preset", [t for t in _options("target") if t != "stories260k"])
@pytest.mark.parametrize("stage", ["extract", "train", "regenerate"])
def test_gpu_presets_train_on_2048_tokens(preset, stage):
    """Every GPU target preset states its training length (the reference's 2048): without it the
    default is the full context (128k for Llama-3.1) and 10-30k-token conversations reach the loss."""
    cfg = to_schema(compose(stage, [f"target={preset}", *REQUIRED.get(stage, [])]), SCHEMAS[stage])
    assert cfg.target.train_max_len == 2048 and cfg.data.max_len is None


@pytest.mark.parametrize("tree", _options("tree"))
def test_static_trees_load(tree):
    paths = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "tree" / f"{tree}.yaml"))
    assert paths, f"conf/tree/{tree}.yaml is empty"


def test_out_dir_is_where_export_and_the_pipeline_write(tmp_path):
    """Every stage that writes a directory takes out_dir= (an old name, e.g. export's out= or the
    pipeline's run_dir=, is an unknown key); the pipeline's stages and report write under it."""
    export = to_schema(compose("export", ["ckpt=runs/x/final", f"out_dir={tmp_path}"]), SCHEMAS["export"])
    assert export.out_dir == str(tmp_path)
    pipeline = to_schema(compose("pipeline", [f"out_dir={tmp_path}"]), SCHEMAS["pipeline"])
    assert pipeline.report == f"{tmp_path}/eval/report.md"
    assert f"out_dir={tmp_path}/features" in pipeline.stages["extract"].args
    for stage, old in (("export", "out"), ("pipeline", "run_dir")):
        with pytest.raises(Exception, match=f"Could not override '{old}'|Key '{old}' is not in struct"):
            compose(stage, [f"{old}={tmp_path}"])


def test_the_eagle3_demo_is_the_demo_with_its_own_settings():
    """tiny_cpu_eagle3 shares tiny_cpu's stages (one base): its commands differ only where its vars do."""
    base, eagle3 = (
        to_schema(compose("pipeline", [f"experiment={name}", "out_dir=runs/x"]), SCHEMAS["pipeline"])
        for name in ("tiny_cpu", "tiny_cpu_eagle3")
    )
    assert base.stages.keys() == eagle3.stages.keys() and eagle3.name == "tiny_cpu_eagle3"
    changed = {
        name: (
            sorted(set(spec.args) - set(eagle3.stages[name].args)),
            sorted(set(eagle3.stages[name].args) - set(spec.args)),
        )
        for name, spec in base.stages.items()
        if spec != eagle3.stages[name]
    }
    assert changed == {
        "extract": (["aux=false"], ["aux=true"]),
        "train": (["draft.type=eagle1", "max_steps=2500"], ["draft.type=eagle3", "max_steps=300"]),
    }
