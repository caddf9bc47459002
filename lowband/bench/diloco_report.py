"""Merge ``diloco`` bench outputs into one bytes-vs-loss table and Pareto plot.

``python -m lowband.bench.diloco_report A.json B.json ... --out bench_out/diloco-sweep``

A sweep can be split over several ``python -m lowband.bench diloco`` invocations (run side by side);
each runs its own ``ddp`` reference on the same seed and data. The report checks that every file's
``ddp`` row has the same final validation loss and total wire bytes (a reproducibility check: refuses
otherwise), keeps one, recomputes ``wire_ratio_vs_ddp``, ``val_loss_ratio_vs_ddp`` and ``pareto`` over
all rows, and writes ``<out>.json``, ``<out>.md`` (the table) and ``<out>.png`` (loss vs bytes, log x).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lowband.bench.diloco import mark_pareto, pareto_markdown, pareto_plot


def merge(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One result list: the (identical) ddp row first, then every DiLoCo row of every document.

    Raises:
        ValueError: a document without a ``ddp`` row, or ddp rows that differ between documents.
    """
    refs = []
    rows: list[dict[str, Any]] = []
    for i, d in enumerate(docs):
        ddp = [r for r in d["results"] if r["name"] == "ddp"]
        if not ddp:
            raise ValueError(f"diloco_report: input {i} has no ddp row")
        refs.append(ddp[0])
        rows += [r for r in d["results"] if r["name"] != "ddp"]
    key = {(r["val_loss_final"], r["wire_bytes_total"]) for r in refs}
    if len(key) != 1:
        raise ValueError(f"diloco_report: the ddp reference differs between inputs: {sorted(key)}")
    results = [refs[0], *rows]
    ref = results[0]
    for r in results:
        r["wire_ratio_vs_ddp"] = r["wire_bytes_total"] / ref["wire_bytes_total"]
        r["val_loss_ratio_vs_ddp"] = r["val_loss_final"] / ref["val_loss_final"]
    mark_pareto(results)
    return results


def write_report(stem: str, doc: dict[str, Any], table: str, plot: Callable[[Path], bool]) -> None:
    """Write ``<stem>.json`` (``doc``), ``<stem>.md`` (``table``) and ``<stem>.png`` (``plot(path)``), then
    print the table: the outputs of both report tools."""
    out = Path(stem)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    out.with_suffix(".md").write_text(table)
    plot(out.with_suffix(".png"))
    print(table)


def report_args(module: str, inputs_help: str, title: str, argv: list[str] | None) -> argparse.Namespace:
    """The command line both report tools share: input files, ``--out`` stem, ``--title``."""
    p = argparse.ArgumentParser(prog=f"python -m lowband.bench.{module}")
    p.add_argument("inputs", nargs="+", help=inputs_help)
    p.add_argument("--out", required=True, help="output stem (writes .json, .md, .png)")
    p.add_argument("--title", default=title)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = report_args("diloco_report", "diloco bench JSON files", "", argv)
    try:
        docs = [json.loads(Path(f).read_text()) for f in a.inputs]
        results = merge(docs)
    except (OSError, KeyError, json.JSONDecodeError) as e:
        print(f"diloco_report: not a readable diloco bench document ({type(e).__name__}: {e})", file=sys.stderr)
        return 2
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    write_report(a.out, {**docs[0], "results": results, "merged_from": a.inputs}, pareto_markdown(results),
                 lambda path: pareto_plot(results, path, title=a.title))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
