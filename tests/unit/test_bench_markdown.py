"""``lowband.bench.harness.markdown_table``: a contender that failed (its result row holds the error, no
timings) is listed with its error instead of stopping the report (the link suite's JSON, table and plot
were written, then the summary table raised ``KeyError``)."""

from __future__ import annotations

from lowband.bench.harness import markdown_table


def test_failed_contender_row_is_listed_with_its_error() -> None:
    ok = {"name": "ddp", "step_time_s_median": 0.5, "wire_bytes_per_step_per_rank": 1000,
          "optimizer_state_bytes_per_rank": 8, "peak_memory_bytes": 64, "final_loss": 3.2, "ratio_vs": {"ddp": 1.0}}
    failed = {"name": "gtp-fp8", "error": "ConfigError: gtp.gather = fp8 needs ..."}
    doc = {"suite": "link", "world_size": 2, "backend": "gloo", "device": "cpu", "torch": "x", "results": [ok, failed]}
    lines = markdown_table(doc).splitlines()
    assert lines[-2] == "| ddp | 0.5000 | 1,000 | 8 | 64 | 3.2000 | ddp: 1.000 |"
    assert lines[-1] == "| gtp-fp8 | error: ConfigError: gtp.gather = fp8 needs ... | | | | | |"
