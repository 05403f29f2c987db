"""docs/server.md documents every flag of `conveyor serve --help`, with the default --help prints.

Reads the argparse parser itself (built from config.FLAGS), so a flag added later is covered.
"""

from __future__ import annotations

import re
from pathlib import Path

from conveyor.cli import build_parser

DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"
_DEFAULT = re.compile(r"\(default: ([^)]*)\)")


def _serve_options() -> dict[str, str]:
    """Canonical option -> the default its --help text states."""
    subparsers = next(a for a in build_parser()._actions if a.dest == "command")
    serve = subparsers.choices["serve"]
    options = {}
    for action in serve._actions:
        if not action.option_strings or action.dest == "help":
            continue
        stated = _DEFAULT.findall(action.help or "")
        assert stated, f"{action.option_strings[0]}: --help does not state a default"
        options[action.option_strings[0]] = stated[-1]
    return options


def _doc_rows() -> dict[str, str]:
    """Every `| `--flag`, ... | default | ... |` table row of docs/server.md: flag -> default cell."""
    rows = {}
    for line in DOCS.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`-"):
            continue
        for name in re.findall(r"`(-[^`]+)`", cells[0]):
            rows[name] = cells[1].replace("`", "")
    return rows


def test_every_serve_flag_is_documented_with_its_default():
    options, rows = _serve_options(), _doc_rows()
    assert len(options) >= 30
    missing = sorted(set(options) - set(rows))
    assert not missing, f"flags of `conveyor serve --help` missing from docs/server.md: {missing}"
    # The cell may explain the value after it: "0 (= --parallel)" states the default 0.
    wrong = {name: (rows[name], default) for name, default in options.items()
             if not re.fullmatch(re.escape(default) + r"(\s.*)?", rows[name])}
    assert not wrong, f"docs/server.md default != --help default (docs, help): {wrong}"


def test_help_prints_the_config_defaults():
    options = _serve_options()
    assert options["--speculative-max-rows"] == "16"
    assert options["--parallel"] == "4"
    assert options["--metrics"] == "off" and options["--no-prompt-cache"] == "off"
    assert options["--api-key"] == "none"


def _parser_defaults() -> dict[str, str]:
    """Canonical option -> the value a bare `conveyor serve` resolves to (no flags, empty environment)."""
    from dataclasses import asdict

    from conveyor.config import FLAGS, load_cluster_config, load_configs, load_models_config

    resolved = {}
    for config in (*load_configs(None, env={}), load_cluster_config(None, env={}), load_models_config(None, env={})):
        resolved.update(asdict(config))
    defaults = {}
    for flag in FLAGS:
        value = resolved[flag.dest]
        if flag.switch:
            defaults[flag.names[0]] = "on" if value != flag.negate else "off"
        else:
            defaults[flag.names[0]] = "none" if value is None else str(value)
    return defaults


def test_every_doc_row_states_the_default_the_parser_resolves():
    """Beyond --help's text: the value a bare start really gets (a field default changed without the doc fails)."""
    rows = _doc_rows()
    wrong = {name: (rows.get(name), default) for name, default in _parser_defaults().items()
             if name not in rows or not re.fullmatch(re.escape(default) + r"(\s.*)?", rows[name])}
    assert not wrong, f"docs/server.md default != resolved default (docs, resolved): {wrong}"


def test_every_seed_variable_we_read_is_documented_as_read_and_not_as_unread():
    from conveyor.config import FLAGS, SEED_ENV_ALIASES

    text = DOCS.read_text()
    read = {alias.name for alias in SEED_ENV_ALIASES} | {n for f in FLAGS for n in f.extra_env if n.startswith("MLXCEL_")}
    table = set(re.findall(r"^\| `(MLXCEL_[A-Z0-9_]+)` \|", text, flags=re.M))
    assert read <= table, f"read but missing from the seed-variable table: {sorted(read - table)}"
    unread = text[text.index("Not read, because"):]
    unread = unread[:unread.index("\n\n")]
    listed = set(re.findall(r"`(MLXCEL_[A-Z0-9_]+)", unread))
    assert not read & listed, f"read, yet listed as not read: {sorted(read & listed)}"
    assert len(listed) >= 8


def test_the_derived_prefill_token_cap_is_stated_as_the_code_applies_it():
    from conveyor.engine.scheduling_policy import ADAPTIVE_CHUNK_DECODING, SchedulerConfig

    assert SchedulerConfig(max_batch_prefill=4).batch_prefill_token_cap(2048) == 2 * 4 * ADAPTIVE_CHUNK_DECODING
    row = next(line for line in DOCS.read_text().splitlines() if line.startswith("| `--max-batch-prefill-tokens`"))
    assert f"min(chunk, {ADAPTIVE_CHUNK_DECODING})" in row
