"""--cache-type-k / --cache-type-v: llama-server's spellings and variables, and the values refused with why."""

import pytest

from conveyor.cli import build_parser
from conveyor.config import ConfigError, EngineConfig, load_configs


def _engine(*argv, env=None):
    return load_configs(build_parser().parse_args(["serve", *argv]), env=env or {})[0]


def test_defaults_and_spellings():
    assert (_engine().cache_type_k, _engine().cache_type_v) == ("bf16", "bf16")
    config = _engine("--cache-type-k", "q8_0", "-ctv", "q8_0")
    assert (config.cache_type_k, config.cache_type_v) == ("q8_0", "q8_0") and config.kv_quantized
    assert _engine("-ctk", "q8_0").cache_type_v == "bf16"
    from_env = _engine(env={"CONVEYOR_CACHE_TYPE_K": "q8_0", "LLAMA_ARG_CACHE_TYPE_V": "q8_0"})
    assert (from_env.cache_type_k, from_env.cache_type_v) == ("q8_0", "q8_0")


@pytest.mark.parametrize("value,why", [("f16", "f16 KV is not offered"), ("q4_0", "q8_0 blocks only")])
def test_refused_values_say_why_and_list_the_supported_ones(value, why, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cache-type-v", value])
    err = capsys.readouterr().err
    assert why in err and "supported: bf16, q8_0" in err
    with pytest.raises(ConfigError, match=f"{why}.*supported: bf16, q8_0"):
        _engine(env={"LLAMA_ARG_CACHE_TYPE_K": value})
    with pytest.raises(ConfigError, match=f"{why}.*supported: bf16, q8_0"):
        EngineConfig(cache_type_k=value)


def test_unknown_value_is_refused():
    with pytest.raises(ConfigError, match="unknown cache_type_v 'int4'.*supported: bf16, q8_0"):
        EngineConfig(cache_type_v="int4")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--cache-type-k", "int4"])
