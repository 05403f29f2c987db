"""Which models a multi-model server offers, by name: repeated --model, --models-dir and --models-preset.

Names follow llama-server's router: a GGUF file's name without `.gguf`, a model directory's name, a Hub
name as written (ORG/NAME[:QUANT]), unless a preset section names the model. Each model gets the server's
flags with its own overrides from its preset section, as frozen configs, checked here at startup.
"""

from __future__ import annotations

import configparser
import dataclasses
import os
from dataclasses import dataclass, field

from conveyor.config import (CONTENTION_POLICIES, FLAGS, ConfigError, EngineConfig, Flag, ModelsConfig, ServerConfig,
                             parse_bool)
from conveyor.loading.gguf_split import is_later_part, part_names, whole_name
from conveyor.loading.hub import parse_hub_spec

# Preset keys that are not flags: pin (load at start, never evicted), load-on-startup (llama-server's: load at
# start, evictable), contention (this model's --models-contention).
_PRESET_ONLY = ("model", "pin", "load-on-startup", "contention")
# Server flags a model may set for itself; the rest (host, port, limits...) belong to the whole server.
_PER_MODEL_SERVER_FIELDS = ("reasoning_parser", "chat_template_kwargs")
# What a preset may not set per model: the source comes from `model`, the name from the section.
_NOT_PER_MODEL = ("model", "served_model_name")
_GLOBAL_SECTIONS = ("*",)  # llama-server's section for every model (configparser's DEFAULT works too)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    source: str  # as given: a path or a Hub name
    engine_config: EngineConfig  # the server's engine flags, this model's source and overrides
    server_config: ServerConfig  # the server's, with this model's name and per-model overrides
    pinned: bool = False
    load_on_startup: bool = False
    contention: str | None = None  # None = the server's --models-contention
    overrides: dict = field(default_factory=dict, compare=False)  # the preset's keys as given (for /v1/models)

    @property
    def starts_loaded(self) -> bool:
        return self.pinned or self.load_on_startup


def model_name(source: str) -> str:
    """llama-server's router names: file name without .gguf, directory name, or the Hub name as written."""
    path = os.path.expanduser(source)
    if os.path.exists(path):
        base = whole_name(os.path.basename(os.path.normpath(path)))
        return base[:-len(".gguf")] if base.lower().endswith(".gguf") else base
    return source


def source_bytes(source: str) -> int:
    """The weight files' size on disk (a model's first-load estimate before its memory is measured); 0 unknown."""
    path = os.path.expanduser(source)
    if os.path.isfile(path):
        return sum(os.path.getsize(p) for p in part_names(path) if os.path.exists(p))  # a split file: every part
    path = os.path.realpath(path)
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                   if f.endswith((".safetensors", ".gguf", ".bin")))
    return 0


def scan_models_dir(folder: str) -> list[tuple[str, str]]:
    """(name, source) of every model in `folder`: its GGUF files (not mmproj files or split parts) and its
    subfolders holding a Hugging Face model (config.json) or one GGUF file (named as the subfolder)."""
    path = os.path.expanduser(folder)
    if not os.path.isdir(path):
        raise ConfigError(f"--models-dir {folder}: not a directory")
    found = []
    for entry in sorted(os.listdir(path)):
        full = os.path.join(path, entry)
        if os.path.isfile(full) and _is_model_gguf(entry):
            found.append((model_name(full), full))
        elif os.path.isdir(full):
            if os.path.exists(os.path.join(full, "config.json")):
                found.append((entry, full))
                continue
            ggufs = [f for f in os.listdir(full) if _is_model_gguf(f)]
            if len(ggufs) == 1:
                found.append((entry, os.path.join(full, ggufs[0])))
    return found


def _paired_mmproj(source: str, models_dir: str | None) -> dict[str, str]:
    """A --models-dir subfolder's GGUF with one mmproj*.gguf beside it takes that projector (--mmproj), as
    llama-server's router pairs them; a GGUF directly in the folder pairs with none (which of several?)."""
    folder = os.path.dirname(source)
    if (models_dir is None or not source.lower().endswith(".gguf")
            or os.path.normpath(folder) == os.path.normpath(os.path.expanduser(models_dir))):
        return {}
    projectors = sorted(f for f in os.listdir(folder) if f.lower().startswith("mmproj") and f.lower().endswith(".gguf"))
    return {"mmproj": os.path.join(folder, projectors[0])} if len(projectors) == 1 else {}


def _is_model_gguf(filename: str) -> bool:
    """A model's GGUF: not a vision projector, and of a split file only the first part (it finds the rest)."""
    lower = filename.lower()
    return lower.endswith(".gguf") and not lower.startswith("mmproj") and not is_later_part(lower)


def build_catalog(models: ModelsConfig, engine: EngineConfig, server: ServerConfig) -> list[ModelSpec]:
    """The models this server offers, in order: --model (each time given), --models-dir, --models-preset."""
    sources = list(models.models) or ([engine.model] if engine.model is not None else [])
    if len(sources) > 1 and (engine.hf_file or engine.revision):
        raise ConfigError("--hf-file and --revision name one model's file; with several models set them per "
                          "model in a --models-preset section")
    named = [(model_name(s), s) for s in sources]
    if models.models_dir is not None:
        named += scan_models_dir(models.models_dir)
    specs = [_spec(name, source, engine, server, _paired_mmproj(source, models.models_dir)) for name, source in named]
    if models.models_preset is not None:
        specs += read_presets(models.models_preset, engine, server)
    _check_unique(specs)
    if not specs:
        raise ConfigError("no models to serve: --models-dir is empty and no --model or --models-preset names one")
    return specs


def read_presets(path: str, engine: EngineConfig, server: ServerConfig) -> list[ModelSpec]:
    """llama-server's presets file: `[name]` sections, `key = value` with the long flag names without `--`."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # keys as written
    try:
        with open(os.path.expanduser(path)) as f:
            parser.read_file(f)
    except (OSError, configparser.Error) as exc:
        raise ConfigError(f"--models-preset {path}: {exc}") from None
    shared = {k: v for name in _GLOBAL_SECTIONS if parser.has_section(name) for k, v in parser.items(name)}
    specs = []
    for name in parser.sections():
        if name in _GLOBAL_SECTIONS:
            continue
        keys = {**shared, **dict(parser.items(name))}
        where = f"--models-preset {path} [{name}]"
        source = keys.get("model") or keys.get("hf-repo")
        if not source:
            raise ConfigError(f"{where}: no `model = PATH or ORG/NAME` line")
        specs.append(_spec(name, source, engine, server, keys, where))
    return specs


def _spec(name: str, source: str, engine: EngineConfig, server: ServerConfig, keys: dict[str, str],
          where: str = "") -> ModelSpec:
    if not os.path.exists(os.path.expanduser(source)) and parse_hub_spec(source) is None:
        raise ConfigError(f"{where or name}: model path not found: {source} (a path, or a Hub name ORG/NAME[:QUANT])")
    engine_values, server_values = {"model": source}, {"served_model_name": name, "strict_model_name": False}
    flags = _preset_flags()
    for key, text in keys.items():
        key = key.strip().lstrip("-")
        if key in _PRESET_ONLY or key == "hf-repo":
            continue
        flag = flags.get(key)
        if flag is None:
            raise ConfigError(f"{where}: {key!r} is not a flag a model may set (its own: any engine flag such as "
                              f"ctx-size, parallel, cache-type-k, plus {', '.join(_PRESET_ONLY)}, reasoning-parser, "
                              "chat-template-kwargs)")
        value = _flag_value(flag, text, f"{where}: {key}")
        (engine_values if flag.dest in _ENGINE_FIELDS else server_values)[flag.dest] = value
    contention = keys.get("contention")
    if contention is not None and contention not in CONTENTION_POLICIES:
        raise ConfigError(f"{where}: contention must be one of {', '.join(CONTENTION_POLICIES)}")
    try:
        return ModelSpec(name, source, dataclasses.replace(engine, **engine_values),
                         dataclasses.replace(server, **server_values),
                         pinned=parse_bool(keys.get("pin", "false")), load_on_startup=parse_bool(keys.get("load-on-startup", "false")),
                         contention=contention, overrides=dict(keys))
    except ConfigError as exc:
        raise ConfigError(f"{where or name}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or name}: {exc}") from None


_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}


def _preset_flags() -> dict[str, Flag]:
    """Preset key (a long flag name without --) -> flag, for the flags a model may set for itself."""
    allowed = (_ENGINE_FIELDS | set(_PER_MODEL_SERVER_FIELDS)) - set(_NOT_PER_MODEL)
    return {name.lstrip("-"): flag for flag in FLAGS if flag.dest in allowed
            for name in flag.names if name.startswith("--")}


def _flag_value(flag: Flag, text: str, where: str):
    refusal = flag.refusal(text)
    if refusal:
        raise ConfigError(f"{where}: {refusal}")
    try:
        if flag.switch:  # `no-prompt-cache = true` sets what the switch sets
            return parse_bool(text) != flag.negate
        value = flag.type(text)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if flag.choices and value not in flag.choices:
        raise ConfigError(f"{where}: {text!r} is not one of {', '.join(flag.choices)}")
    return value


def _check_unique(specs: list[ModelSpec]) -> None:
    seen: dict[str, str] = {}
    for spec in specs:
        if spec.name in seen:
            raise ConfigError(f"two models are named {spec.name!r} ({seen[spec.name]} and {spec.source}); name "
                              "them apart with --models-preset sections")
        seen[spec.name] = spec.source
