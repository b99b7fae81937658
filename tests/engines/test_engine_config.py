"""One configuration: EngineConfig's settings reach the command lines, the replica's engine block and
the README with one name, one default and one description each."""

from __future__ import annotations

import argparse
import re
import typing
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from engines.drafters.factory import DRAFTERS
from engines.engine_config import (
    CLI_ALIASES,
    DrafterName,
    EngineConfig,
    add_engine_args,
    config_table,
    engine_config_from_args,
)
from engines.spec_params import SpecParams
from lyanna_kernels.dispatch import KERNEL_MODES
from lyanna_kernels.quantized_linear import QUANTIZATIONS
from serve_app.replica import EngineSettings

ROOT = Path(__file__).resolve().parents[2]


def parser_with_engine_args() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_engine_args(ap)
    return ap


def test_every_setting_has_a_description_and_the_cli_its_default():
    defaults = engine_config_from_args(parser_with_engine_args().parse_args([]))
    assert defaults == EngineConfig()
    for name, info in EngineConfig.model_fields.items():
        assert info.description, f"{name} has no description"
    assert EngineConfig().spec == SpecParams()  # the default tree is SpecParams' (one default)


def test_cli_flags_parse_into_the_config():
    args = parser_with_engine_args().parse_args(
        ["--depth", "5", "--spec-width", "3", "--num-kv-blocks", "none", "--no-lyanna-fusion", "--drafter", "eagle"]
    )
    config = engine_config_from_args(args, max_num_seqs=4)
    assert (config.spec_depth, config.spec_width, config.num_kv_blocks) == (5, 3, None)
    assert config.lyanna_fusion is False and config.drafter == "eagle" and config.max_num_seqs == 4
    assert set(CLI_ALIASES) <= set(EngineConfig.model_fields)
    with pytest.raises(SystemExit):  # argparse refuses a drafter that does not exist
        parser_with_engine_args().parse_args(["--drafter", "medusa"])


@pytest.mark.parametrize(
    "bad",
    [
        {"spec_depth": 0},
        {"max_num_seqs": 0},
        {"dtype": "float8"},
        {"kv_cache_dtype": "int4"},
        {"device": "tpu"},
        {"spec_policy": "greedy"},
        {"drafter": "draft-model"},
        {"unknown_setting": 1},
    ],
)
def test_impossible_settings_are_refused_naming_them(bad):
    with pytest.raises(ValidationError) as err:
        EngineConfig(**bad)
    assert next(iter(bad)) in str(err.value) or "draft_model" in str(err.value)


def test_the_named_choices_are_the_implementations():
    """The config's choices are what the drafter factory, the kernel dispatcher and the quantizer take."""
    assert set(typing.get_args(DrafterName)) == set(DRAFTERS)
    fields = EngineConfig.model_fields
    assert set(typing.get_args(fields["kernels"].annotation)) == set(KERNEL_MODES)
    assert set(typing.get_args(fields["quantization"].annotation)) == {*QUANTIZATIONS, "auto"}


@pytest.mark.parametrize("path", ["serve_config.yaml", "serve_config.tp2.yaml"])
def test_serve_config_engine_blocks_are_engine_configs(path):
    app = yaml.safe_load((ROOT / path).read_text())["applications"][0]
    settings = EngineSettings.model_validate(app["args"]["engine"])
    config = settings.engine_config()
    for name in EngineConfig.model_fields:
        assert getattr(config, name) == getattr(settings, name)
    assert set(EngineSettings.model_fields) - set(EngineConfig.model_fields) == {"served_model_name", "cpus_per_rank"}


def test_the_readme_configuration_table_is_the_model_s():
    readme = (ROOT / "README.md").read_text()
    match = re.search(r"<!-- engine-config:begin -->\n(.*?)\n<!-- engine-config:end -->", readme, re.S)
    assert match, "README.md has no generated configuration table (python -m engines.engine_config)"
    assert match.group(1).strip() == config_table().strip()
