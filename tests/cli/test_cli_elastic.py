"""``python -m meshgroups shrink`` / ``grow``: the recovery plan on the command line."""

from __future__ import annotations

import json

import pytest

from meshgroups import Layout, Topology
from meshgroups.cli._app import main
from meshgroups.cli._elastic import index_runs, ranges, rank_list
from meshgroups.elastic._plans import plan_shrink

from ..render.test_render_cli import cli


def run(capsys, *args):
    assert main(list(args)) == 0
    return capsys.readouterr().out


def test_shrink_prints_the_plan(capsys):
    out = run(capsys, "shrink", "--layout", "pp=2,dp=4,tp=8", "--lost", "13,14", "--node", "8")
    assert "shrink along dp: pp=2 × dp=4 × tp=8 = 64 (ranks 0..63)" in out
    assert "new layout: pp=2 × dp=3 × tp=8 = 48" in out
    assert "drained (alive, on a lost node): 8-12, 15" in out
    assert "spares (idle): 40-47" in out
    assert "dp index map (new<-old, for the dataloader): 0<-0, 1-2<-2-3" in out
    rows = {line.split()[0]: line.split()[1:6] for line in out.splitlines()[8:]}
    assert rows["tp"] == ["main", "8", "6", "0", "2"]  # 8 tp groups, the 2 of replica 1 gone
    assert rows["pp"] == ["main", "2", "24", "0", "8"]
    assert rows["dp"] == ["main", "4->3", "0", "16", "16"]


def test_json_matches_the_library_and_chains_into_grow(capsys, tmp_path):
    out = run(
        capsys, "shrink", "--layout", "pp=2,dp=4,tp=8", "--lost", "13,14", "--node", "8", "--json", "--full"
    )
    data = json.loads(out)
    plan = plan_shrink(Layout(pp=2, dp=4, tp=8), [13, 14], topology=Topology(node=8))
    assert data == json.loads(json.dumps(plan.summary(limit=0)))
    assert data["families"]["tp"]["gone"] == [
        [8, 9, 10, 11, 12, 13, 14, 15],
        [40, 41, 42, 43, 44, 45, 46, 47],
    ]
    path = tmp_path / "plan.json"
    path.write_text(out)
    grown = json.loads(
        run(capsys, "grow", "--from-json", str(path), "--ranks", "8-15,40-47", "--node", "8", "--json")
    )
    assert grown["new_shape"] == {"pp": 2, "dp": 4, "tp": 8} and grown["index_map"] == [0, 1, 2, None]
    assert grown["families"]["tp"]["n_kept"] == 6 and grown["families"]["tp"]["created"] == [
        list(range(8, 16)),
        list(range(40, 48)),
    ]


def test_substitute_with_spares_and_a_rank(capsys):
    out = run(
        capsys,
        "shrink",
        "--layout",
        "pp=2,dp=4,tp=8",
        "--lost",
        "13",
        "--spares",
        "64-71",
        "--node",
        "8",
        "--rank",
        "70",
        "--flatten",
        "dp,tp",
    )
    assert "substitute: pp=2 × dp=4 × tp=8" in out and "replacements: 8->64, 9->65" in out
    assert "rank 70: admitted; old coords None; new {'pp': 0, 'dp': 1, 'tp': 6}" in out
    assert "  tp            created 64-71" in out
    rows = {line.split()[0]: line.split()[1:6] for line in out.splitlines() if line.startswith("dp_tp ")}
    assert rows["dp_tp"] == ["main", "32", "1", "1", "1"]
    data = json.loads(
        run(
            capsys, "shrink", "--layout", "dp=2,tp=2", "--lost", "1", "--spares", "9", "--rank", "0", "--json"
        )
    )
    assert data["replacements"] == {"1": 9} and data["rank"]["status"] == {"dp": "kept", "tp": "created"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["shrink", "--layout", "pp=2,dp=4,tp=8", "--lost", "8-63"], "hit every replica of dp"),
        (["shrink", "--layout", "pp=2,dp=4,tp=8", "--lost", "99"], "lost rank 99 is not in the layout"),
        (["shrink", "--layout", "pp=2,dp=4,tp=8", "--lost", "3,3"], "lost names rank 3 twice"),
        (["shrink", "--layout", "pp=2,dp=4,tp=8", "--lost", "3", "--dim", "ep"], "dim 'ep' is not a dim"),
        (["shrink", "--layout", "pp=2,dp=4,tp=8", "--lost", "3", "--node", "0"], "--node must be positive"),
        (["shrink", "--layout", "pp=2,dp=4,tp=8", "--lost", "5-3"], "runs backwards"),
        (["shrink", "--layout", "pp=2,dp=4,tp=8", "--lost", "x"], "numbers or ranges"),
        (
            ["shrink", "--layout", "pp=2,dp=4,tp=8", "--lost", "3,4", "--spares", "64"],
            "2 lost ranks need 2 spares, got 1",
        ),
        (["shrink", "--lost", "3"], "give the current layout"),
        (["shrink", "pp=x", "--lost", "3"], "size of 'pp' must be an integer"),
        (["grow", "--layout", "pp=2,dp=4,tp=8", "--ranks", "64-70"], "a replica has pp=2 × tp=8 = 16 ranks"),
        (["grow", "--layout", "pp=2,dp=4,tp=8", "--ranks", "3"], "already in the layout"),
        (["grow", "--layout", "pp=2,dp=4,tp=8", "--ranks", "64-79", "--from-json", "x"], "one of them"),
        (["grow", "--from-json", "/nonexistent.json", "--ranks", "64-79"], "cannot read --from-json"),
    ],
)
def test_bad_input_exits_2_naming_the_rule(capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_helpers():
    assert rank_list("8-10,3, 12") == [8, 9, 10, 3, 12]
    assert ranges([8, 9, 10, 12, 14, 15]) == "8-10, 12, 14-15"
    assert ranges(list(range(0, 40, 2)), limit=3) == "0, 2, 4, … (20 ranks)"
    assert index_runs((0, 2, 3, 4, None, None)) == "0<-0, 1-3<-2-4, 4-5<-new"
    assert index_runs((1,)) == "0<-1"


@pytest.mark.processes
def test_runs_as_a_module():
    res = cli("shrink", "--layout", "pp=2,dp=4,tp=8", "--lost", "13,14", "--node", "8")
    assert res.returncode == 0, res.stderr
    assert "spares (idle): 40-47" in res.stdout


def test_plot_marks_ranks():
    """render.plot(marked=...) puts one symbol per marked rank on its cell, with a legend."""
    pytest.importorskip("matplotlib")
    from meshgroups.render._formats import plot

    lay = Layout(pp=2, dp=4, tp=8)
    plan = plan_shrink(lay, [13, 14], topology=Topology(node=8))
    fig = plot(lay, "dp", ranks_per_node=8, marked={"lost": plan.lost, "spare": plan.spares})
    ax = fig.axes[0]
    from matplotlib.collections import PathCollection  # what scatter draws

    points = [coll.get_offsets().tolist() for coll in ax.collections if isinstance(coll, PathCollection)]
    assert points == [[[5, 1], [6, 1]], [[c, 5] for c in range(8)]]  # (column, row) of 13, 14 and 40..47
    assert [t.get_text() for t in ax.get_legend().get_texts()][:2] == ["lost (2)", "spare (8)"]
    with pytest.raises(TypeError, match="marked\\['lost'\\] must hold int ranks"):
        plot(lay, "dp", marked={"lost": ["13"]})
    with pytest.raises(TypeError, match="marked maps at most 5 labels"):
        plot(lay, "dp", marked={str(i): [i] for i in range(6)})
