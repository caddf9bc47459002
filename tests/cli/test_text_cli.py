"""``data.source = text`` from the command line: a bad ``data.path`` is one line and exit 2, before training."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.cli_util import assert_no_elastic_report, run_cli, stderr_lines


@pytest.mark.parametrize("world", [1, 2])
def test_missing_text_path_exits_2_with_one_line(tiny: Path, world: int) -> None:
    proc = run_cli(tiny, "--data.source=text", "--data.path=missing/*.txt", f"--run.world_size={world}",
                   env={"LOWBAND_CACHE_DIR": str(tiny / "cache")})
    assert proc.returncode == 2, proc.stderr
    assert stderr_lines(proc) == ["lowband.train: error: data.path 'missing/*.txt': no such file, and no file "
                                  "matches it as a glob"]
    assert_no_elastic_report(proc)
    assert not (tiny / "runs" / "t" / "metrics.jsonl").exists()


def test_text_source_without_path_exits_2(tiny: Path) -> None:
    proc = run_cli(tiny, "--data.source=text")
    assert proc.returncode == 2
    assert stderr_lines(proc) == ["lowband.train: error: data.path must name a UTF-8 text file or a glob of them "
                                  "when data.source = text"]
