"""The results of `bench.run` as Markdown tables, for docs/performance.md:
`python -m bench.report [bench/results/latest.json]`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

THROUGHPUT_HEADER = [
    "concurrency",
    "bare httpx (before/after)",
    "engine SQLite",
    "SQLite/bare",
    "engine PostgreSQL",
    "PG/bare",
    "naive Prefect",
    "naive/bare",
]
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
    if not isinstance(entry, dict) or "records_per_s" not in entry:
        return "failed"
    return f"{entry['records_per_s']:,.0f}"


def _ratio(entry: Any) -> str:
    return f"{entry['ratio']:.2f}" if isinstance(entry, dict) and "ratio" in entry else "-"


def cost_rows(results: dict[str, Any]) -> list[list[str]]:
    """Where an engine chain's time goes: a row per database for the empty chain and per concurrency."""
    rows = []
    for label in ("sqlite", "postgresql"):
        empty = results.get("empty_chain", {}).get(label)
        if empty:
            rows.append(
                [
                    label,
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
        for row in results["throughput"]:
            entry = row.get(label)
            if isinstance(entry, dict) and "split" in entry:
                split = entry["split"]
                rows.append(
                    [
                        label,
                        str(row["concurrency"]),
                        f"{entry['seconds']:.1f}",
                        str(split["batches"]),
                        f"{split['engine_work_s']:.1f}",
                        f"{split['lock_s']:.2f}",
                        f"{split['prefect_other_s']:.2f}",
                        f"{entry['statements_per_record']:.2f}",
                        f"{entry['commits_per_record']:.2f}",
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
        f"SQLite {meta['sqlite']}. Sandbox latency {meta['latency_ms']} ms, batch_size {meta['batch_size']}, "
        f"{meta['records']:,} creates per run ({meta['naive_records']:,} for the naive design). "
        f"Run started {meta['started_at']}, took {meta.get('seconds', '?')} s"
        f"{' (quick mode)' if meta['quick'] else ''}.",
        "",
        _table(
            THROUGHPUT_HEADER,
            [
                [
                    str(row["concurrency"]),
                    bare_text(row.get("bare")),
                    _rate(row.get("sqlite")),
                    _ratio(row.get("sqlite")),
                    _rate(row.get("postgresql")),
                    _ratio(row.get("postgresql")),
                    _rate(row.get("naive")),
                    _ratio(row.get("naive")),
                ]
                for row in results["throughput"]
            ],
        ),
        "",
    ]
    split_rows = cost_rows(results)
    if split_rows:
        header = ["database", "concurrency", "chain s", "batches", "engine work s", "rule lock s", "Prefect other s"]
        parts += [_table([*header, "SQL/record", "commits/record"], split_rows), ""]
    cpu_rows = []
    for label in ("bare", "sqlite", "postgresql", "naive"):
        for row in results["throughput"]:
            entry = row.get(label)
            if isinstance(entry, dict) and isinstance(entry.get("cpu"), dict):
                cpu = entry["cpu"]
                busy, steal = cpu.get("machine_busy"), cpu.get("machine_steal")
                target = cpu.get("target_cpu_ms_per_record")
                cpu_rows.append(
                    [
                        label,
                        str(row["concurrency"]),
                        _rate(entry),
                        "-" if busy is None else f"{busy:.0%}",
                        "-" if steal is None else f"{steal:.0%}",
                        f"{cpu['own_cpu_ms_per_record']:.2f}",
                        "-" if target is None else f"{target:.2f}",
                    ]
                )
    if cpu_rows:
        header = ["run", "concurrency", "records/s", "machine busy", "steal", "bench process CPU ms/record"]
        parts += [_table([*header, "target CPU ms/record"], cpu_rows), ""]
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
                [[t["target"], t["measured"], "yes" if t["met"] else "**no**"] for t in results["targets"]],
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
