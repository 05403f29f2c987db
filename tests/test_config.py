"""FLAGS: the seeds' spellings and environment names resolve to our fields (no model, milliseconds)."""

import dataclasses

import pytest

from conveyor.cli import build_parser
from conveyor import config
from conveyor.config import FLAGS, ConfigError, env_alias_report, load_configs


def _serve_args(*argv):
    return build_parser().parse_args(["serve", *argv])


def _engine(*argv, env=None):
    return load_configs(_serve_args(*argv), env=env or {})[0]


SEED_FLAGS = ("--draft-kind", "--prompt-lookup-max-batch", "--draft-model", "--model-draft", "--draft-block-size",
              "--no-batch", "--parallel", "--n-parallel", "--no-kv-unified", "--kv-unified", "--max-kv-size",
              "--max-batch-prefill", "--max-batch-prefill-tokens", "--prompt-cache-budget", "--apc-enabled",
              "--no-prompt-cache", "--kv-cache-budget", "--kv-admission-watermark", "--prefill-chunk-size")


def test_serve_help_lists_every_seed_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    missing = [flag for flag in SEED_FLAGS if flag not in text]
    assert not missing


def test_mlxcel_prefill_chunk_acts_like_ours():
    ours = _engine(env={"CONVEYOR_PREFILL_CHUNK_SIZE": "256"})
    seed = _engine(env={"MLXCEL_PREFILL_CHUNK": "256"})
    assert ours.prefill_chunk_size == seed.prefill_chunk_size == 256
    assert _engine().prefill_chunk_size == -1


def test_ours_win_and_the_report_says_which_was_used():
    env = {"CONVEYOR_PREFILL_CHUNK_SIZE": "128", "MLXCEL_PREFILL_CHUNK": "256", "MLXCEL_KV_ADMISSION_WATERMARK": "0.2"}
    config = _engine(env=env)
    assert config.prefill_chunk_size == 128 and config.kv_admission_watermark == 0.2
    report = env_alias_report(None, env)
    assert "MLXCEL_PREFILL_CHUNK ignored: CONVEYOR_PREFILL_CHUNK_SIZE is set and wins" in report
    assert any(line.startswith("MLXCEL_KV_ADMISSION_WATERMARK=0.2 used for kv_admission_watermark") for line in report)
    # The command line beats every environment variable.
    args = _serve_args("--prefill-chunk-size", "64")
    assert load_configs(args, env=env)[0].prefill_chunk_size == 64
    assert "MLXCEL_PREFILL_CHUNK ignored: the command line sets prefill_chunk_size" in env_alias_report(args, env)


def test_seed_values_are_translated():
    assert _engine(env={"MLXCEL_MIXED_STEP": "1"}).tick_policy == "mixed"
    assert _engine(env={"MLXCEL_MIXED_STEP": "0"}).tick_policy == "alternate"
    assert _engine(env={"MLXCEL_KV_CACHE_BUDGET": "1G"}).kv_cache_budget == "1G"
    assert _engine(env={"MLXCEL_MAX_BATCH_PREFILL_TOKENS": "0"}).max_batch_prefill_tokens == 0
    assert _engine(env={"MLXCEL_ENABLE_MTP_B1": "0"}).draft_policy == "decline"
    assert _engine(env={"MLXCEL_MTP_ADAPTIVE": "0"}).draft_policy == "enable"
    assert _engine(env={"MLXCEL_CACHE_DIR": "/tmp/x"}).cache_dir == "/tmp/x"
    with pytest.raises(ConfigError, match="MLXCEL_MIXED_STEP"):
        _engine(env={"MLXCEL_MIXED_STEP": "sometimes"})


def test_slot_and_kv_spellings():
    auto = _engine("--parallel", "-1")
    assert (auto.num_slots, auto.effective_max_batch_size, auto.effective_kv_unified) == (4, 4, True)
    assert _engine("--parallel", "-1", "--no-kv-unified").effective_kv_unified is False
    assert _engine("--parallel", "8").effective_kv_unified is False
    assert _engine("--parallel", "8", "--kv-unified").effective_kv_unified is True
    single = _engine("--no-batch", "--parallel", "8")
    assert (single.num_slots, single.effective_max_batch_size) == (1, 1)
    assert _engine("--max-kv-size", "4096").max_kv_size == 4096
    with pytest.raises(ConfigError):
        _engine("--parallel", "0")
    with pytest.raises(ConfigError, match="contradict"):
        _engine("--kv-unified", "--no-kv-unified")


def test_prompt_cache_spellings():
    assert _engine("--apc-enabled=false").enable_prefix_caching is False
    assert _engine("--apc-enabled", "true").enable_prefix_caching is True
    assert _engine("--no-prompt-cache").enable_prefix_caching is False
    assert _engine().prompt_cache_budget == "2G"
    assert _engine("--prompt-cache-budget", "512M").prompt_cache_budget == "512M"
    with pytest.raises(ConfigError):
        _engine("--prompt-cache-budget", "lots")


def test_speculation_spellings():
    assert _engine("--draft-kind", "none").ngram_enabled is False
    assert _engine("--draft-kind", "prompt-lookup").ngram_enabled is True
    config = _engine("--model-draft", "/x.gguf", "--draft-block-size", "6")
    assert (config.draft_model, config.draft_block_size, config.draft_model_enabled) == ("/x.gguf", 6, True)
    assert _engine("--prompt-lookup-max-batch", "2").prompt_lookup_max_batch == 2
    with pytest.raises(ConfigError, match="needs --draft-model"):
        _engine("--draft-kind", "draft-model")
    # MTP: the seeds' --draft-kind mtp and llama-server's --spec-type mtp; the model's own head, no draft model.
    mtp = _engine("--draft-kind", "mtp")
    assert (mtp.draft_kind, mtp.ngram_enabled, mtp.draft_model_enabled) == ("mtp", False, False)
    assert _engine("--spec-type", "mtp").draft_kind == "mtp"
    assert _engine(env={"CONVEYOR_DRAFT_KIND": "mtp"}).draft_kind == "mtp"
    with pytest.raises(ConfigError, match="own MTP head"):
        _engine("--draft-kind", "mtp", "--draft-model", "/x.gguf")
    # EAGLE3: a separate drafter checkpoint, so --draft-model is required.
    eagle3 = _engine("--spec-type", "eagle3", "--draft-model", "/drafter")
    assert (eagle3.draft_kind, eagle3.ngram_enabled, eagle3.draft_model_enabled) == ("eagle3", False, False)
    with pytest.raises(ConfigError, match="eagle3 needs --draft-model PATH"):
        _engine("--draft-kind", "eagle3")
    dflash = _engine("--spec-type", "dflash", "--draft-model", "/drafter")
    assert (dflash.draft_kind, dflash.ngram_enabled, dflash.draft_model_enabled) == ("dflash", False, False)
    with pytest.raises(ConfigError, match="dflash needs --draft-model PATH"):
        _engine("--draft-kind", "dflash")


# Every flag's environment variable means what the flag means, in every boolean spelling. Generated
# from FLAGS (and the seeds' aliases), so a flag added later is covered without a new test.
TRUE_SPELLINGS = ("1", "true", "yes", "on", "TRUE", "Yes", "ON")
FALSE_SPELLINGS = ("0", "false", "no", "off", "FALSE", "No", "OFF")
_SAMPLE_TEXTS = {int: ("3", "-1"), float: ("0.25",), str: ("a:1",)}


def _flag_cases():
    """(flag, argv after `serve`, the text the variable gets) for every flag and every spelling."""
    for flag in FLAGS:
        if flag.switch:
            spellings = FALSE_SPELLINGS if flag.negate else TRUE_SPELLINGS
            yield from ((flag, [flag.names[0]], text) for text in spellings)
        elif flag.type is config._bool:
            yield from ((flag, [f"{flag.names[0]}={text}"], text) for text in TRUE_SPELLINGS + FALSE_SPELLINGS)
        else:
            for text in flag.choices or _SAMPLE_TEXTS[flag.type]:
                yield flag, [flag.names[0], text], text


def _flag_id(case):
    flag, argv, text = case
    return f"{' '.join(argv)}|{text}"


FLAG_CASES = list(_flag_cases())


@pytest.mark.parametrize("case", FLAG_CASES, ids=[_flag_id(c) for c in FLAG_CASES])
def test_every_flag_variable_means_what_the_flag_means(case):
    flag, argv, text = case
    from_flag = getattr(_serve_args(*argv), flag.dest)
    assert from_flag is not None
    if flag.repeat:  # given once, a repeatable flag means what its variable means
        assert len(from_flag) == 1
        from_flag = from_flag[0]
    for name in (flag.env, *flag.extra_env):  # ours and llama.cpp's names (extra_env) alike
        assert config._from_env(flag, {name: text}) == (from_flag, name), name


def test_every_flag_is_in_the_table():
    covered = {case[0].names[0] for case in FLAG_CASES}
    assert covered == {flag.names[0] for flag in FLAGS}
    assert all(flag.type in _SAMPLE_TEXTS or flag.choices or flag.switch or flag.type is config._bool
               for flag in FLAGS)


@pytest.mark.parametrize("alias", config.SEED_ENV_ALIASES, ids=lambda a: a.name)
def test_every_seed_variable_means_what_our_flag_means(alias):
    flag = next(f for f in FLAGS if f.dest == alias.dest and not f.switch)
    if alias.convert is str:  # a plain alias: the same text as our flag's
        for text in flag.choices or _SAMPLE_TEXTS[flag.type]:
            assert config._from_env(flag, {alias.name: text})[0] == getattr(_serve_args(flag.names[0], text), flag.dest)
        return
    # A boolean seed variable: every spelling of one truth value gives the same flag value, and it is a
    # value our flag accepts.
    on = {config._from_env(flag, {alias.name: text})[0] for text in TRUE_SPELLINGS}
    off = {config._from_env(flag, {alias.name: text})[0] for text in FALSE_SPELLINGS}
    assert len(on) == len(off) == 1 and on != off
    for value in on | off:
        assert getattr(_serve_args(flag.names[0], value), flag.dest) == value


@pytest.mark.parametrize("text", TRUE_SPELLINGS + FALSE_SPELLINGS)
def test_the_two_variables_that_were_inverted(text):
    value = text.lower() in ("1", "true", "yes", "on")
    engine = _engine(env={"CONVEYOR_ENABLE_PREFIX_CACHING": text, "CONVEYOR_BATCH_INVARIANT": text})
    assert engine.enable_prefix_caching is value and engine.batch_invariant is value
    # The flag still wins over the variable, and means the same as the variable's "off".
    args = ("--no-prompt-cache", "--no-batch-invariant")
    flagged = _engine(*args, env={"CONVEYOR_ENABLE_PREFIX_CACHING": text, "CONVEYOR_BATCH_INVARIANT": text})
    assert flagged.enable_prefix_caching is False and flagged.batch_invariant is False


def test_help_names_the_variable_with_the_value_that_means_the_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "[env CONVEYOR_ENABLE_PREFIX_CACHING=0]" in text and "[env CONVEYOR_BATCH_INVARIANT=0]" in text
    assert "[env CONVEYOR_METRICS=1]" in text and "[env CONVEYOR_PORT]" in text


def test_a_bad_variable_names_itself():
    with pytest.raises(ConfigError, match="CONVEYOR_ENABLE_PREFIX_CACHING"):
        _engine(env={"CONVEYOR_ENABLE_PREFIX_CACHING": "maybe"})
    with pytest.raises(ConfigError, match="CONVEYOR_PARALLEL"):
        _engine(env={"CONVEYOR_PARALLEL": "four"})


def test_decode_storage_backend_is_accepted_as_the_seeds_spell_it():
    assert _engine().decode_storage_backend == "auto"
    assert _engine("--decode-storage-backend", "paged").decode_storage_backend == "paged"
    assert _engine(env={"CONVEYOR_DECODE_STORAGE_BACKEND": "paged"}).decode_storage_backend == "paged"


@pytest.mark.parametrize(("dest", "value"), sorted(config.REFUSED_VALUES), ids=lambda v: str(v))
def test_a_seed_value_we_lack_is_refused_naming_what_we_offer(dest, value, capsys):
    message = config.REFUSED_VALUES[(dest, value)]
    flag = config._FLAG_BY_DEST[dest]
    with pytest.raises(SystemExit) as exc:
        _serve_args(flag.names[0], value.upper())
    assert exc.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())
    with pytest.raises(ConfigError, match=f"^{flag.env}='{value}': ") as refused:
        if dest in {f.name for f in dataclasses.fields(config.ModelsConfig)}:
            config.load_models_config(None, env={flag.env: value})
        else:
            _engine(env={flag.env: value})
    assert message in str(refused.value)


def test_every_draft_kind_is_offered():
    assert not any(dest == "draft_kind" for dest, _ in config.REFUSED_VALUES)  # dflash was refused before #43
    assert {"draft-model", "mtp", "eagle3", "dflash", "prompt-lookup", "auto"} <= set(config.DRAFT_KINDS)


def test_model_given_twice_is_a_multi_model_server_and_once_is_the_engine_model():
    args = _serve_args("--model", "a.gguf", "-m", "b", "--models-max", "2")
    engine, _ = config.load_configs(args, env={})
    models = config.load_models_config(args, env={})
    assert engine.model is None and models.models == ("a.gguf", "b") and models.enabled and models.models_max == 2
    args = _serve_args("--model", "a.gguf")
    assert config.load_configs(args, env={})[0].model == "a.gguf"
    assert not config.load_models_config(args, env={}).enabled


@pytest.mark.parametrize(("flags", "message"), [
    (("--models-memory-budget", "auto"), "models_memory_budget must be none or a byte count"),
    (("--models-max", "0"), "models_max must be at least 1"),
    (("--models-wait-timeout", "0"), "models_wait_timeout must be positive"),
    (("--models-background-share", "0"), "models_background_share must be in"),
])
def test_bad_models_flags_are_refused_with_the_reason(flags, message):
    with pytest.raises(config.ConfigError, match=message):
        config.load_models_config(_serve_args(*flags), env={})

