"""The results of `bench.run` as Markdown tables, for docs/performance.md:
`python -m bench.report [bench/results/latest.json]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

MIRROR_HEADER = [
    "mirror rows",
    "table MiB",
    "scan p50 ms",
    "scan max ms",
    "scan in PG ms",
    "drain p50 ms",
    "drain max ms",
    "drain in PG ms",
    "seq scan",
    "chain peak MiB (tracemalloc)",
    "chain RSS growth MiB",
]


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" ---: " for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def bare_text(entry: Any) -> str:
    """The mean of the bare runs before and after the engine's, with both."""
    if not isinstance(entry, dict) or "records_per_s" not in entry:
        return "failed"
    if entry.get("before") and entry.get("after"):
        return f"{entry['records_per_s']:,.0f} ({entry['before']:,.0f}/{entry['after']:,.0f})"
    return f"{entry['records_per_s']:,.0f}"


def _rate(entry: Any) -> str:
    if entry is None:
        return "-"  # not measured in this row
    if not isinstance(entry, dict) or "records_per_s" not in entry:
        return "failed"
    return f"{entry['records_per_s']:,.0f}"


def _ratio(entry: Any) -> str:
    return f"{entry['ratio']:.2f}" if isinstance(entry, dict) and "ratio" in entry else "-"


def _engines(results: dict[str, Any]) -> list[str]:
    """The engine entries of a throughput row: "sqlite/grouped", "postgresql/per_record", ..."""
    return list(results["meta"].get("engines", []))


def _short(label: str) -> str:
    database, _, settle = label.partition("/")
    return f"{'SQLite' if database == 'sqlite' else 'PG'} {settle}"


def throughput_table(results: dict[str, Any]) -> str:
    """A row per (latency, concurrency): the bare client, each engine and its ratio to the bare
    client, the naive design where it ran."""
    engines = [label for label in _engines(results) if any(label in row for row in results["throughput"])]
    naive = any("naive" in row for row in results["throughput"])
    header = ["latency ms", "concurrency", "bare httpx (before/after)"]
    for label in engines:
        header += [_short(label), "/bare"]
    if naive:
        header += ["naive Prefect", "/bare"]
    rows = []
    for row in results["throughput"]:
        cells = [str(row["latency_ms"]), str(row["concurrency"]), bare_text(row.get("bare"))]
        for label in engines:
            cells += [_rate(row.get(label)), _ratio(row.get(label))]
        if naive:
            cells += [_rate(row.get("naive")), _ratio(row.get("naive"))]
        rows.append(cells)
    return _table(header, rows)


def cost_rows(results: dict[str, Any]) -> list[list[str]]:
    """Where an engine chain's time goes: a row per database for the empty chain and per engine run."""
    rows = []
    for database in ("sqlite", "postgresql"):
        empty = results.get("empty_chain", {}).get(database)
        if empty:
            rows.append(
                [
                    database,
                    "-",
                    "empty chain",
                    f"{empty['seconds']:.2f}",
                    str(empty["batches"]),
                    f"{empty['engine_work_s']:.2f}",
                    f"{empty['lock_s']:.2f}",
                    f"{empty['prefect_other_s']:.2f}",
                    "-",
                    "-",
                ]
            )
    for label in _engines(results):
        for row in results["throughput"]:
            entry = row.get(label)
            if isinstance(entry, dict) and "split" in entry:
                split = entry["split"]
                rows.append(
                    [
                        label,
                        str(row["latency_ms"]),
                        str(row["concurrency"]),
                        f"{entry['seconds']:.1f}",
                        str(split["batches"]),
                        f"{split['engine_work_s']:.1f}",
                        f"{split['lock_s']:.2f}",
                        f"{split['prefect_other_s']:.2f}",
                        f"{entry['statements_per_record']:.2f}",
                        f"{entry['commits_per_record']:.3f}",
                    ]
                )
    return rows


def _share(value: Any, fmt: str = "{:.0%}") -> str:
    return "-" if value is None else fmt.format(value)


def cpu_rows(results: dict[str, Any]) -> list[list[str]]:
    rows = []
    for label in ["bare", *_engines(results), "naive"]:
        for row in results["throughput"]:
            entry = row.get(label)
            if isinstance(entry, dict) and isinstance(entry.get("cpu"), dict):
                cpu = entry["cpu"]
                rows.append(
                    [
                        label,
                        str(row["latency_ms"]),
                        str(row["concurrency"]),
                        _rate(entry),
                        _share(cpu.get("machine_busy")),
                        _share(cpu.get("machine_steal")),
                        f"{cpu['own_cpu_ms_per_record']:.2f}",
                        _share(cpu.get("own_core_share"), "{:.2f}"),
                        _share(cpu.get("target_cpu_ms_per_record"), "{:.2f}"),
                        _share(cpu.get("target_core_share"), "{:.2f}"),
                    ]
                )
    return rows


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    versions = meta["versions"]
    parts = [
        f"Machine: {meta['cores']} cores ({meta['machine']}), {meta['platform']}. Python {meta['python']}, "
        f"prefect {versions['prefect']}, SQLAlchemy {versions['sqlalchemy']}, httpx {versions['httpx']}, "
        f"psycopg {versions['psycopg']}, pybreaker {versions['pybreaker']}, PostgreSQL {meta['postgresql'] or '-'}, "
        f"SQLite {meta['sqlite']}. batch_size {meta['batch_size']}, {meta['records']:,} creates per run "
        f"({meta['naive_records']:,} for the naive design). Load average {meta.get('load_average_at_start')} "
        f"at the start, {meta.get('load_average_at_end')} at the end. Run started {meta['started_at']}, took "
        f"{meta.get('seconds', '?')} s{' (quick mode)' if meta['quick'] else ''}.",
        "",
    ]
    if results["throughput"]:
        parts += ["Throughput (records/s) and engine/bare:", "", throughput_table(results), ""]
    split_rows = cost_rows(results)
    if split_rows:
        header = ["engine", "latency ms", "concurrency", "chain s", "batches", "engine work s", "rule lock s"]
        parts += [
            "Where an engine chain's time goes:",
            "",
            _table([*header, "Prefect other s", "SQL/record", "commits/record"], split_rows),
            "",
        ]
    rows = cpu_rows(results)
    if rows:
        header = ["run", "latency ms", "concurrency", "records/s", "machine busy", "steal"]
        header += ["bench process CPU ms/record", "bench process cores", "target CPU ms/record", "target cores"]
        parts += ["Where the CPU went:", "", _table(header, rows), ""]
    if results["mirror"]:
        parts.append(
            _table(
                MIRROR_HEADER,
                [
                    [
                        f"{m['rows']:,}",
                        f"{m['mirror_mib']:.0f}",
                        f"{m['scan']['median_ms']:.1f}",
                        f"{m['scan']['max_ms']:.1f}",
                        f"{m['scan']['plan']['execution_ms']:.1f}",
                        f"{m['drain']['median_ms']:.1f}",
                        f"{m['drain']['max_ms']:.1f}",
                        f"{m['drain']['plan']['execution_ms']:.1f}",
                        "yes" if m["scan"]["plan"]["seq_scan"] or m["drain"]["plan"]["seq_scan"] else "no",
                        f"{m['chain']['tracemalloc_peak_mib']:.2f}",
                        str(m["chain"]["rss_peak_growth_mib"]),
                    ]
                    for m in results["mirror"]
                ],
            )
        )
        parts.append("")
    if results["targets"]:
        parts.append(
            _table(
                ["target", "measured", "met"],
                [
                    [
                        t["target"],
                        t["measured"],
                        ("yes" if t["met"] else "**no**") + (f" ({t['note']})" if "note" in t else ""),
                    ]
                    for t in results["targets"]
                ],
            )
        )
    for failure in results.get("errors", []):
        parts.append(f"\nFAILED {failure['section']}: {failure['error']}")
    return "\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0] if args else "bench/results/latest.json")
    sys.stdout.write(markdown(json.loads(path.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
