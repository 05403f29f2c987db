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
