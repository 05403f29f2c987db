"""Sweep results as a markdown table, a JSON document and (optionally) a plot."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from conveyor.bench.roofline import Roofline
from conveyor.bench.stats import LevelStats

_HEADER = (
    "| conc | reqs | errors | req/s | out tok/s | TTFT p50 | TTFT p95 | TTFT p99 "
    "| ITL p50 | ITL p95 | ITL p99 | E2E p50 | E2E p95 | E2E p99 |"
)


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _s(value_ms: float) -> str:
    return "-" if math.isnan(value_ms) else f"{value_ms / 1000.0:.2f}"


def _row(s: LevelStats, roofline: Roofline | None) -> str:
    cells = [
        str(s.concurrency), str(s.num_requests), str(s.num_errors), f"{s.requests_s:.2f}", f"{s.output_tok_s:.1f}",
        _ms(s.ttft_ms.p50), _ms(s.ttft_ms.p95), _ms(s.ttft_ms.p99),
        _ms(s.itl_ms.p50), _ms(s.itl_ms.p95), _ms(s.itl_ms.p99),
        _s(s.e2e_ms.p50), _s(s.e2e_ms.p95), _s(s.e2e_ms.p99),
    ]
    if roofline is not None and (fraction := roofline.fraction(s.output_tok_s)) is not None:
        cells.append(f"{100.0 * fraction:.1f}%")
    return "| " + " | ".join(cells) + " |"


def markdown_table(levels: list[LevelStats], roofline: Roofline | None = None, title: str = "") -> str:
    """TTFT and ITL in ms, E2E in s; a roofline column when the model's FLOPs/token are known."""
    with_roofline = roofline is not None and roofline.max_tok_s is not None
    header, align = _HEADER, "|" + "---:|" * 14
    if with_roofline:
        header += " % roofline |"
        align += "---:|"
    lines = [f"## {title}", ""] if title else []
    lines += [header, align, *(_row(s, roofline if with_roofline else None) for s in levels)]
    if with_roofline:
        lines.append(f"\nroofline: {roofline.gflops:.1f} GFLOP/s{' (measured)' if roofline.measured else ''} / "
                     f"{roofline.gflops_per_token:.3f} GFLOP/token = {roofline.max_tok_s:.1f} tok/s")
    elif roofline is not None:
        lines.append(f"\nGEMM throughput: {roofline.gflops:.1f} GFLOP/s{' (measured)' if roofline.measured else ''}; "
                     "the server reported no meta.n_params: pass --model-params or --model-gflops-per-token "
                     "for a roofline fraction")
    errors = [f"- c={s.concurrency}: {e}" for s in levels for e in s.error_samples]
    if errors:
        lines += ["", "errors (most common first):", *errors]
    return "\n".join(lines) + "\n"


def _nan_to_none(value: Any) -> Any:
    # JSON has no NaN; empty percentile sets (e.g. every request failed) become null.
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _nan_to_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_nan_to_none(v) for v in value]
    return value


def levels_payload(levels: list[LevelStats], roofline: Roofline | None) -> dict[str, Any]:
    rows = []
    for s in levels:
        row = dataclasses.asdict(s)
        row["roofline_fraction"] = roofline.fraction(s.output_tok_s) if roofline else None
        rows.append(row)
    payload: dict[str, Any] = {"levels": rows}
    if roofline is not None:
        payload["roofline"] = {**dataclasses.asdict(roofline), "max_tok_s": roofline.max_tok_s}
    return payload


def write_json(path: str | Path, payload: dict[str, Any]) -> None:
    Path(path).write_text(json.dumps(_nan_to_none(payload), indent=2) + "\n", encoding="utf-8")


def write_plot(path: str | Path, levels: list[LevelStats], title: str = "") -> None:
    """Throughput and latency percentiles against concurrency, three panels side by side."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only; never needs a display
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("--plot needs matplotlib: pip install 'conveyor[plot]' (or pip install matplotlib)") from exc
    conc = [s.concurrency for s in levels]
    fig, (ax_tput, ax_ttft, ax_itl) = plt.subplots(1, 3, figsize=(15, 4.5))
    ax_tput.plot(conc, [s.output_tok_s for s in levels], "o-", label="output tok/s")
    ax_tput.set_ylabel("output tokens/s")
    for ax, name, series in ((ax_ttft, "TTFT", "ttft_ms"), (ax_itl, "ITL", "itl_ms")):
        for q in ("p50", "p95", "p99"):
            ax.plot(conc, [getattr(getattr(s, series), q) for s in levels], "o-", label=f"{name} {q}")
        ax.set_ylabel(f"{name} (ms)")
    for ax in (ax_tput, ax_ttft, ax_itl):
        ax.set_xscale("log", base=2)
        ax.set_xticks(conc, [str(c) for c in conc])
        ax.set_xlabel("concurrency")
        ax.grid(True, alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
