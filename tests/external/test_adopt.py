"""docs/adopt.md is tested code: its scripts are the files under examples/adopt/, its diffs are those
files' real differences, and every script runs here on 2 and 4 gloo ranks against its DDP reference.

Tolerances: the examples run in float64 here (``main(dtype=torch.float64)``). Sharded AdamW against DDP
+ AdamW differs only in the summation order of the gradient average (reduce-scatter vs ring all-reduce
of 2 or 4 partial gradients; 6 steps): 1e-10 relative (~5e5 ulps of O(1) weights, eps 2.2e-16) covers
it and is far below the >1e-4 a missed weight sync or a dropped gradient row causes. OutsideGPT takes
its loss on float32 logits (as nanoGPT does), so losses compare to a few float32 ulps (eps 1.2e-7): 1e-6.
"""

from __future__ import annotations

import difflib
import importlib
import re
from pathlib import Path

import pytest
import torch

from lowband.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "adopt.md"
EXAMPLES = ROOT / "examples" / "adopt"
TOL = 1e-10
LOSS_TOL = 1e-6


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """``(language, body)`` of every fenced code block of a Markdown text."""
    return [(m.group(1), m.group(2)) for m in re.finditer(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)]


def example_diff(base: str, other: str) -> str:
    """The unified diff (no context lines) of two example files, as docs/adopt.md shows it."""
    a = (EXAMPLES / base).read_text().splitlines(keepends=True)
    b = (EXAMPLES / other).read_text().splitlines(keepends=True)
    return "".join(difflib.unified_diff(a, b, f"examples/adopt/{base}", f"examples/adopt/{other}", n=0))


def test_doc_shows_the_example_files_and_their_real_diffs() -> None:
    blocks = fenced_blocks(DOC.read_text())
    shown_files = [body for lang, body in blocks if lang in ("python", "toml") and body.startswith("# examples/adopt/")]
    diffs = [body for lang, body in blocks if lang == "diff"]
    assert shown_files and diffs
    for body in shown_files:
        name = body.splitlines()[0].removeprefix("# ")
        assert body.split("\n", 1)[1] == (ROOT / name).read_text(), f"docs/adopt.md's copy of {name} is stale"
    for body in diffs:
        header = re.match(r"--- examples/adopt/(\S+)\n\+\+\+ examples/adopt/(\S+)\n", body)
        assert header, body[:80]
        assert body == example_diff(header.group(1), header.group(2)), (
            f"docs/adopt.md's diff {header.group(1)} -> {header.group(2)} is stale; regenerate it with "
            "tests.external.test_adopt.example_diff")
    shown = {re.match(r"--- \S+\n\+\+\+ examples/adopt/(\S+)", d).group(1) for d in diffs}
    assert shown == {p.name for p in EXAMPLES.glob("*.py")} - {"ddp.py", "__init__.py"}, "every example is shown"
    assert {b.splitlines()[0] for b in shown_files} == {"# examples/adopt/ddp.py", "# examples/adopt/outside.toml"}


def test_doc_trainer_config_loads_and_builds_the_factory_model() -> None:
    from lowband.train.config import load_config
    from lowband.train.trainer import build_model_and_plan
    from tests.external.outside_gpt import OutsideGPT

    cfg = load_config(EXAMPLES / "outside.toml")
    model, plan = build_model_and_plan(cfg, torch.device("cpu"))
    assert isinstance(model, OutsideGPT) and model.transformer.wte.weight is model.lm_head.weight
    assert plan.sparse_tables[0].name == "wte" and len(plan.parallel_linears) == 4 * cfg.model.n_layer


def _run_example(name: str, **kw) -> dict:
    mod = importlib.import_module(f"examples.adopt.{name}")
    out = mod.main(dtype=torch.float64, **kw)
    model = out.pop("model")
    res = {"losses": out.pop("losses"), "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    if "muon" in out:
        names = {id(p): n for n, p in model.named_parameters()}
        res["muon"] = [names[id(p)] for p in out.pop("muon")]
        out.pop("opt")
    if "stats" in out:
        st = out.pop("stats")
        res["sparse_mode"] = st.mode
    return {**res, **out}


def _ddp_untied_reference(steps: int = 6) -> dict:
    """examples/adopt/ddp.py with the head untied (the sparse-table example's model), float64."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.external.outside_gpt import OutsideConfig, random_batch, seeded_model

    rank = dist.get_rank()
    model = seeded_model(1337, rank, OutsideConfig(tie=False), dtype=torch.float64)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for step in range(steps):
        x, y = random_batch(step, rank)
        _, loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def assert_same_training(out: list[dict], ref: list[dict]) -> None:
    for o, r in zip(out, ref, strict=True):
        assert o["params"].keys() == r["params"].keys()
        for k, v in r["params"].items():
            torch.testing.assert_close(o["params"][k], v, rtol=TOL, atol=TOL, msg=k)
        torch.testing.assert_close(torch.tensor(o["losses"]), torch.tensor(r["losses"]), rtol=LOSS_TOL, atol=0)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_adamw_example_equals_the_ddp_example(world: int) -> None:
    ref = run_ranks(_run_example, world, "ddp")
    out = run_ranks(_run_example, world, "sharded_adamw")
    assert_same_training(out, ref)
    for o in out[1:]:  # ranks were seeded apart; both sync rank 0's weights and stay equal
        assert all(torch.equal(v, out[0]["params"][k]) for k, v in o["params"].items())


@pytest.mark.parametrize("world", [2, 4])
def test_sparse_table_example_equals_ddp_on_the_untied_model(world: int) -> None:
    ref = run_ranks(_ddp_untied_reference, world)
    out = run_ranks(_run_example, world, "sparse_table")
    assert_same_training(out, ref)
    assert all(o["sparse_mode"] == "sparse" for o in out)


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_muon_example_splits_by_the_plan_and_keeps_ranks_equal(world: int) -> None:
    out = run_ranks(_run_example, world, "sharded_muon")
    assert out[0]["muon"] == [f"transformer.h.{i}.{m}.weight" for i in range(2)
                              for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
    for o in out:
        assert o["muon"] == out[0]["muon"]
        assert all(torch.equal(v, out[0]["params"][k]) for k, v in o["params"].items())  # all-gathered
        assert all(torch.isfinite(torch.tensor(o["losses"])))
    # Muon at lr 0.02 moves the hidden matrices: every one differs from its (rank 0) initial value
    from tests.external.outside_gpt import seeded_model

    init = seeded_model(1337, 0, dtype=torch.float64).state_dict()
    for name in out[0]["muon"]:
        assert not torch.allclose(out[0]["params"][name], init[name], atol=1e-4), name


@pytest.mark.parametrize("world", [2, 4])
def test_diloco_example_syncs_fragments_across_replicas(world: int) -> None:
    out = run_ranks(_run_example, world, "diloco")
    assert [o["outer_steps"] for o in out] == [out[0]["outer_steps"]] * world
    assert out[0]["outer_steps"] == 4  # 8 steps, 2 fragments, each synced every 4 steps


@pytest.mark.parametrize("world", [2, 4])
def test_gtp_example_equals_the_ddp_example(world: int) -> None:
    ref = run_ranks(_run_example, world, "ddp")
    out = run_ranks(_run_example, world, "gtp")
    assert_same_training(out, ref)


def changed_code_lines(base: str, other: str) -> int:
    """Code lines of ``other`` that differ from ``base`` (a replaced line once; the module docstring,
    comments and blank lines aside): the count docs/adopt.md's table reports."""
    def code(name: str) -> list[str]:
        text = (EXAMPLES / name).read_text()
        m = re.match(r'\s*""".*?"""\n', text, re.S)
        body = text[m.end():] if m else text
        return [ln.split("  #")[0].rstrip() for ln in body.splitlines()
                if ln.strip() and not ln.strip().startswith("#")]

    a, b = code(base), code(other)
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def test_doc_table_of_changed_lines_is_counted_from_the_files() -> None:
    rows = re.findall(r"^\| `(\w+\.py)` \| (\d+) \|", DOC.read_text(), re.M)
    assert {name for name, _ in rows} == {p.name for p in EXAMPLES.glob("*.py")} - {"ddp.py", "__init__.py"}
    for name, count in rows:
        assert changed_code_lines("ddp.py", name) == int(count), name
