"""Side-by-side benchmarks: ``python -m lowband.bench SUITE --world N --out FILE.json``.

Each suite runs its contenders in one invocation on N ranks, alternating and repeated, and reports
medians in the JSON shape of DESIGN.md plus a Markdown table. Register a suite by adding its module
to ``SUITES``; the module defines ``run(env, opts) -> dict`` returning ``{"config": ..., "results": [...]}``
and ``add_arguments(parser)`` for its own options.
"""

SUITES: dict[str, str] = {
    "comm": "lowband.bench.comm",
    "dp": "lowband.bench.dp",
    "diloco": "lowband.bench.diloco",
    "goodput": "lowband.bench.goodput",
    "gtp": "lowband.bench.gtp",
    "link": "lowband.bench.link",
    "rekls": "lowband.bench.rekls",
    "sparse": "lowband.bench.sparse",
}
