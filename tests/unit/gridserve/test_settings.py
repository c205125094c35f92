"""One source for every setting: the engine options table drives the flags, the variables, the
config and the Helm values; the reference pages are generated from the code and must be current."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from gridserve import reference
from gridserve.roles import ENGINE_OPTIONS, engine_config
from gridserve.shared import config as cfg
from gridserve.shared import envs

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "helm" / "gridserve"


@pytest.fixture()
def clean_env(monkeypatch):
    """No operator ``GRIDSERVE_*`` variable may leak into defaults the pages show."""
    for name in list(os.environ):
        if name.startswith("GRIDSERVE_"):
            monkeypatch.delenv(name)


def test_the_reference_pages_match_the_code(clean_env):
    for name, build in reference.PAGES.items():
        path = reference.DOCS / name
        assert path.exists() and path.read_text(encoding="utf-8") == build(), (
            f"docs/{name} is stale: run `python -m gridserve.reference`")


def test_the_reference_lists_every_engine_option_and_every_table_variable(clean_env):
    cli, environment = reference.cli_page(), reference.environment_page()
    for option in ENGINE_OPTIONS:
        assert f"`{option.flag}`" in cli and f"`{option.env}`" in environment, option.flag
    for name in envs.VARIABLES:
        assert f"`{name}`" in environment, name


def _config_defaults() -> dict[str, object]:
    out = {}
    for section in (cfg.ModelConfig, cfg.CacheConfig, cfg.SchedulerConfig, cfg.ParallelConfig, cfg.DeviceConfig,
                    cfg.LoRAConfig):
        for f in dataclasses.fields(section):
            out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    out["distributed_executor_backend"] = out["executor_backend"]
    return out


def test_each_engine_option_sets_a_config_field_with_the_same_default(clean_env):
    defaults = _config_defaults()
    for option in ENGINE_OPTIONS:
        if option.config is None:
            continue
        assert option.config in defaults, f"{option.flag}: no config field {option.config!r}"
        if option.default is None:  # unset: the config keeps its own default
            continue
        expected = defaults[option.config]
        if option.flag == "--distributed-executor-backend":
            expected = "grpc"  # the engine command drives worker services; LLM() picks uni
        assert option.config_value(option.default) == expected, option.flag


def test_engine_config_takes_every_option_from_the_parsed_flags(llama_tiny, clean_env, monkeypatch):
    from gridserve.cli import _parser

    monkeypatch.setenv("GRIDSERVE_MAX_NUM_SEQS", "9")
    args = _parser().parse_args(["engine", "--model", str(llama_tiny), "--workers", "127.0.0.1:1",
                                 "--block-size", "32", "--no-prefix-caching", "--kv-cache-dtype", "bfloat16"])
    config = engine_config(args, ["127.0.0.1:1"])
    assert config.scheduler.max_num_seqs == 9  # from its variable
    assert config.cache.block_size == 32 and not config.cache.enable_prefix_caching
    assert config.cache.kv_cache_dtype == "bfloat16"
    assert config.parallel.executor_backend == "grpc" and config.parallel.worker_addresses == ["127.0.0.1:1"]


# engine.* values the chart uses itself; every other engine value is an engine option (engine.yaml).
CHART_ENGINE_KEYS = {"port", "image", "resources", "nodeSelector", "tolerations", "extraEnv"}
SWITCHES = {"enablePrefixCaching", "batchInvariant", "enforceEager", "enableExpertParallel"}


def _snake(key: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower()  # sprig's snakecase for these keys


def test_the_chart_sets_each_engine_value_as_the_option_variable():
    values = yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))
    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    template = (CHART / "templates" / "engine.yaml").read_text(encoding="utf-8")
    omitted = set(re.search(r"omit \$e ((?:\"\w+\" ?)+)", template).group(1).replace('"', "").split())
    assert omitted == CHART_ENGINE_KEYS | SWITCHES, "engine.yaml's omit list and this test disagree"
    declared = set()
    for option in ENGINE_OPTIONS:
        if option.helm is None:
            continue
        *parents, key = option.helm.split(".")
        node, props = values, schema["properties"]
        for part in parents:
            node, props = node[part], props[part]["properties"]
        assert key in node, f"values.yaml has no {option.helm} ({option.flag}): add it with its default"
        assert key in props, f"values.schema.json has no {option.helm} ({option.flag}): add its type"
        if parents != ["engine"]:
            continue  # set by the chart's own templates (parallel sizes, the worker's device)
        declared.add(key)
        if option.kind is bool:
            assert key in SWITCHES and option.env in template, f"engine.yaml never sets {option.env}"
        else:
            assert f"GRIDSERVE_{_snake(key).upper()}" == option.env, f"{option.helm} would set another variable"
    stray = set(values["engine"]) - CHART_ENGINE_KEYS - declared
    assert not stray, f"engine values no option declares (the chart would set unknown variables): {sorted(stray)}"


def test_every_variable_the_chart_sets_is_one_the_code_reads(clean_env):
    known = set(envs.VARIABLES) | {name for name in re.findall(r"`(GRIDSERVE_[A-Z0-9_]+)`", reference.environment_page())}
    for path in sorted((CHART / "templates").glob("*.yaml")):
        for name in re.findall(r"name: (GRIDSERVE_[A-Z0-9_]+)", path.read_text(encoding="utf-8")):
            assert name in known, f"{path.name} sets {name}, which no role reads"
