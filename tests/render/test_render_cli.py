"""Rendering (text, HTML, matplotlib) and the command line, run as a user would."""

from __future__ import annotations

import html as html_lib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from meshgroups import Layout
from meshgroups.cli._app import main
from meshgroups.render._formats import group_ids, html, plot, text

from ..support.timing import scaled


def cli(*args, env=None, timeout=120):
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "meshgroups", *args],
        capture_output=True,
        text=True,
        timeout=scaled(timeout),
        env=full_env,
    )


def test_text_shows_grid_and_groups():
    out = text(Layout(pp=2, dp=2, cp=1, tp=4), ranks_per_node=8)
    assert "pp=1 dp=1 cp=0 |   12   13   14   15" in out
    assert "tp   4     4       [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], …  intra" in out
    assert "pp   2     8" in out and "inter" in out
    big = text(Layout(pp=16, dp=256, cp=4, tp=8))  # no grid for big worlds, still every dim
    assert "|" not in big.split("\n")[2] and big.count("\n") < 12
    views = text(Layout(pp=2, dp=4).with_views(expert=Layout(pp=2, ep=4)))
    assert "expert.ep" in views and "expert.pp" not in views


def test_group_ids_and_html():
    lay = Layout(pp=2, dp=2, tp=2)
    assert group_ids(lay, "tp").ravel().tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert group_ids(lay, "pp").ravel().tolist() == [0, 1, 2, 3, 0, 1, 2, 3]
    page = html(lay, "dp", highlight_rank=3, ranks_per_node=4)
    assert page.count("<td") == 8 + 4 and page.count("<td style='background") == 8  # + each row's nodes
    assert page.count("outline:3px solid #d62728;") == 2 and "coloured by dp" in page
    assert "border-left:3px solid #000;" not in page  # 2 columns never straddle a 4-rank node boundary
    assert "first 4 of 8192 ranks" in html(Layout(a=4096, b=2), max_cells=4)
    assert Layout(a=2)._repr_html_().startswith("<table")
    with pytest.raises(ValueError, match="unknown dim 'zz'"):
        html(lay, "zz")


def test_plot_draws_and_windows_big_worlds(tmp_path):
    fig = plot(Layout(pp=2, dp=2, cp=2, tp=4), ("dp", "cp"), ranks_per_node=8, highlight_rank=5)
    fig.savefig(tmp_path / "small.png")
    big = plot(Layout(pp=16, dp=64, cp=2, tp=8), ranks_per_node=16)
    assert "first 1024 of 16384 ranks shown" in big.axes[0].get_title()
    big.savefig(tmp_path / "big.png")
    from matplotlib.image import imread

    pixels = imread(tmp_path / "small.png")
    assert pixels.shape[0] > 200 and np.unique(pixels.reshape(-1, pixels.shape[-1]), axis=0).shape[0] > 8


def test_drawings_show_a_window_of_columns_too():
    wide = Layout(pp=2, tp=4096)
    fig = plot(wide)
    assert "first 2 rows × 64 of 4096 columns of 8192 ranks shown" in fig.axes[0].get_title()
    assert len(fig.axes[0].get_xticklabels()) <= 33
    assert "first 2 rows × 64 of 4096 columns" in html(wide)


def test_demo_checks_its_python_arguments():
    from meshgroups.cli._demo import check_args

    with pytest.raises(ValueError, match="the layout has 4 ranks"):
        check_args(Layout(dp=2, tp=2), 8, "global", 60.0)
    with pytest.raises(ValueError, match="nproc=65 must be between 1 and 64"):
        check_args(Layout(dp=65), 65, "global", 60.0)
    with pytest.raises(ValueError, match="timeout=1e-300 must be between 1 and 86400"):
        check_args(Layout(dp=2), 2, "global", 1e-300)
    with pytest.raises(TypeError):
        check_args(None, 2, "global", 60.0)  # type: ignore[arg-type]


def test_plot_without_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'meshgroups\[plot\]'"):
        plot(Layout(a=2))


@pytest.mark.processes
def test_cli_show_text_rank_and_json():
    out = cli("show", "pp=2", "dp=2", "cp=1", "tp=4", "--ranks-per-node", "8", "--rank", "5")
    assert out.returncode == 0, out.stderr
    assert "rank 5: pp=0, dp=1, cp=0, tp=1" in out.stdout and "tp group: [4, 5, 6, 7]" in out.stdout
    out = cli("show", "tp=2", "cp=1", "dp=2", "pp=2", "--order", "tp-cp-dp-pp", "--json", "--rank", "3")
    data = json.loads(out.stdout)
    assert Layout.from_dict(data["layout"]) == Layout(pp=2, dp=2, cp=1, tp=2)
    assert data["rank"]["coords"] == {"pp": 0, "dp": 1, "cp": 0, "tp": 1}
    assert data["groups"]["dp"][0] == [0, 2]
    out = cli("show", "pp=2", "dp=-1", "tp=4", "--world-size", "64")
    assert "Layout(pp=2, dp=8, tp=4)" in out.stdout
    # dims anywhere among the options; a custom name when asked for
    out = cli(
        "show", "pp=2", "--world-size", "16", "dp=-1", "tp=4", "--ranks-per-node", "8", "ddp=1", "--any-names"
    )
    assert out.returncode == 0 and "Layout(pp=2, dp=2, tp=4, ddp=1)" in out.stdout, out.stderr


@pytest.mark.processes
def test_cli_big_worlds_print_a_bounded_summary():
    out = cli("show", "pp=16", "dp=256", "cp=4", "tp=8", "--rank", "5")
    assert out.returncode == 0, out.stderr
    assert max(map(len, out.stdout.splitlines())) < 400
    assert "(256 ranks)" in out.stdout and "--full prints all" in out.stdout
    out = cli("show", "pp=16", "dp=256", "cp=4", "tp=8", "--json")
    data = json.loads(out.stdout)
    assert len(out.stdout) < 100_000 and data["omitted_groups"]["cp"] == 32768 - 8
    assert "--full" in data["note"] and len(data["groups"]["tp"]) == 8
    full = cli("show", "pp=2", "dp=64", "tp=8", "--json", "--full")
    assert len(json.loads(full.stdout)["groups"]["tp"]) == 128 and "omitted_groups" not in full.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["show", "pp=2", "tp=3", "--world-size", "16"], "pp=2 × tp=3 = 6 does not match world_size=16"),
        (["show", "dp=-1", "tp=3", "--world-size", "16"], "tp=3 does not divide world_size=16"),
        (["show", "tp=x"], "size of 'tp' must be an integer in digits 0-9, got 'x'"),
        (["show", "dp=-1", "tp=2"], "dp=-1 needs --world-size N to infer it from"),
        (["show", "tp"], "dims are name=size words like tp=4, got 'tp'"),
        (["show", "tp=2", "tp=2"], "duplicate dim name 'tp'"),
        (["show", "tp=0"], "tp=0: dim sizes must be positive"),
        (["show", "tp=2", "--rank", "9"], "--rank 9 is not in the layout"),
        (["show", "tp=2", "dp=2", "--order", "tp-dp-pp"], "token 'pp' of order 'tp-dp-pp' has no size"),
        (["show", "tp=2", "xp=2", "--order", "tp-xp"], "--order token 'xp' is not one of Megatron's"),
        (["show", "tp=2", "--order", ""], "--order is empty"),
        (["show", "dpp=2", "tp=2"], "unknown dim 'dpp': did you mean"),
        (["show", "tp=2", "--ranks-per-node", "0"], "--ranks-per-node must be positive"),
        (["show", "tp=2", "--rank", "-1"], "must be >= 0"),
        (["plot", "tp=2", "--color-by", "zz"], "unknown dim 'zz'"),
        (["plot", "tp=2", "--dpi", "0"], "--dpi must be positive"),
        (["plot", "tp=2", "-o", "/nonexistent/dir/x.png"], "cannot write -o /nonexistent/dir/x.png"),
        (["demo", "--nproc", "4", "tp=8"], "the layout has 8 ranks but --nproc 4"),
        (["demo", "--nproc", "65"], "--nproc must be at most 64"),
        (["demo", "--timeout", "1e308"], "--timeout must be between 1 and 86400 seconds"),
        (["plot", "tp=2", "--dpi", "9000"], "--dpi must be at most 400"),
        (["plot", "tp=2", "-o", ""], "-o needs a file name such as layout.png, got ''"),
        (["demo", "--timeout", "0"], "--timeout must be positive"),
        (["demo", "--timeout", "-5"], "--timeout must be positive"),
        (["demo", "--nproc", "0"], "--nproc must be positive"),
        (["show"], "give at least one dim"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_cli_bad_arguments_exit_2_without_traceback(args, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(args)  # in-process: the parser, not the interpreter's start-up, is under test
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert message in err and "Traceback" not in err


@pytest.mark.processes
def test_cli_bad_argument_in_a_real_process_prints_no_traceback():
    out = cli("show", "tp=1_000")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "size of 'tp' must be an integer in digits 0-9, got '1_000'" in out.stderr


@pytest.mark.processes
def test_cli_plot_writes_png(tmp_path):
    out = cli(
        "plot", "pp=2", "dp=2", "tp=4", "-o", str(tmp_path / "l.png"), "--color-by", "dp,tp", "--rank", "3"
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "l.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.processes
def test_cli_demo_on_real_processes():
    out = cli("demo", "--nproc", "4", "dp=-1", "tp=2", timeout=180)  # dp=-1: filled from --nproc
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all 16 checks passed" in out.stdout  # 4 ranks × (3 groups each (dp, tp, dp×tp) + a DTensor)
    assert "4 processes (spawned on 127.0.0.1, gloo)" in out.stdout


@pytest.mark.processes
def test_cli_demo_joins_torchrun():
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        # no --node: torchrun's own parser refuses it (a prefix of its --node-rank) before the
        # demo sees it; under torchrun the node is torchrun's LOCAL_WORLD_SIZE
        [*cmd, "-m", "meshgroups", "demo", "dp=2", "--json"],
        capture_output=True,
        text=True,
        timeout=scaled(180),
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads(out.stdout)  # one JSON document (issue 52's CLI convention), rank 0's
    assert data["processes"] == 2 and data["how"] == "torchrun, gloo" and data["ok"] and data["checks"] > 0
    assert data["node"] == 2 and data["nodes"] == {"dp": "intra"}  # LOCAL_WORLD_SIZE=2


def test_demo_report_names_the_failing_group():
    from meshgroups.cli._demo import report

    results = [
        {"rank": 0, "build_seconds": 0.01, "checks": 2, "failures": []},
        {
            "rank": 1,
            "build_seconds": 0.02,
            "checks": 2,
            "failures": ["group dp [0, 1]: all_reduce gave 2, expected 3"],
        },
    ]
    text_out, ok = report(Layout(dp=2), results, None, "test")
    assert not ok and "FAILED: 1 of 4 checks" in text_out and "group dp [0, 1]" in text_out


@pytest.mark.processes
def test_console_script_is_installed():
    from pathlib import Path

    script = Path(sys.executable).parent / "meshgroups"
    assert script.exists(), "pip install should create the meshgroups command"
    out = subprocess.run([str(script), "show", "tp=2"], capture_output=True, text=True, timeout=scaled(60))
    assert out.returncode == 0 and "Layout(tp=2)" in out.stdout


def test_cli_place_json_reads_back_and_names_the_megatron_order(tmp_path, capsys):
    assert (
        main(
            [
                "place",
                "tp=4",
                "dp=2",
                "pp=2",
                "--topology",
                "node=4,domain=8",
                "--fast-first",
                "tp,dp",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["megatron_order"] == "tp-dp-pp" and data["span"]["tp"] == "node"
    (tmp_path / "placed.json").write_text(json.dumps(data))
    assert main(["show", "--from-json", str(tmp_path / "placed.json")]) == 0
    assert "Layout(tp=4, dp=2, pp=2, strides=(1, 4, 8))" in capsys.readouterr().out


@pytest.mark.processes
def test_cli_output_cut_by_a_closed_pipe_prints_no_traceback():
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshgroups", "show", "a=4096", "b=16", "--any-names", "--full"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith("Layout(a=4096, b=16)")
    proc.stdout.close()  # the reader leaves, as `| head -1` does
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in err


def test_render_docstring_examples_run():
    import doctest

    import meshgroups.render._figure
    import meshgroups.render._formats
    import meshgroups.render._spans
    import meshgroups.render._window

    modules = (
        meshgroups.render._window,
        meshgroups.render._formats,
        meshgroups.render._figure,
        meshgroups.render._spans,
    )
    results = [doctest.testmod(m) for m in modules]
    assert all(r.failed == 0 for r in results) and sum(r.attempted for r in results) >= 1


def test_every_colour_drawn_is_in_the_legend_and_rows_name_their_nodes():
    """Issue 52: a legend for every colour and outline, node labels, the rank named."""
    from meshgroups.layout import Topology
    from meshgroups.render import legend

    # a re-placed layout: a row of the drawing spans two nodes, and its label says which
    placed = Layout.place({"pp": 2, "dp": 4, "tp": 2}, Topology(node=4), fast_first=("dp",))
    for lay, by, node, rank in [
        (Layout(pp=2, dp=2, tp=4), "tp", 4, 5),
        (Layout(pp=2, dp=16, tp=4), "dp", 8, 9),
        (placed, "dp", 4, 3),
    ]:
        keys = legend(lay, by, ranks_per_node=node, highlight_rank=rank)
        fig = plot(lay, by, ranks_per_node=node, highlight_rank=rank)
        ax = fig.axes[0]
        shown = [t.get_text() for t in ax.get_legend().get_texts()]
        assert shown == [k["label"] for k in keys]
        # every colour in the image is a legend entry's colour, and every entry's colour is drawn
        image = ax.get_images()[0]
        drawn = {
            "#{:02x}{:02x}{:02x}".format(*(round(255 * v) for v in image.cmap(image.norm(g))[:3]))
            for g in np.unique(image.get_array())
        }
        assert drawn == {k["colour"] for k in keys if k["kind"] == "colour"}
        assert {"outline", "rank", "node boundary"} <= {k["kind"] for k in keys}
        assert any(f"red outline: rank {rank}'s {by} group" in s for s in shown)
        coords = ", ".join(f"{d}={c}" for d, c in lay.coords(rank).items())
        assert f"rank {rank} ({coords}, node {rank // node})" in " ".join(shown)
        nodes = [t.get_text() for t in ax.child_axes[0].get_yticklabels()]
        assert nodes and all(n.startswith("node") for n in nodes)
        page = html(lay, by, ranks_per_node=node, highlight_rank=rank)
        assert all(k["colour"] in page and html_lib.escape(str(k["label"])) in page for k in keys)
        assert "<th>nodes</th>" in page and f"rank {rank} in red" in page
    # the re-placed layout's rows: each label names the nodes its ranks sit on
    labels = [t.get_text() for t in ax.child_axes[0].get_yticklabels()]
    rows = [placed.grid.reshape(-1, placed.shape[-1])[r] for r in range(len(labels))]
    from meshgroups.render._legend import row_nodes

    assert labels == [row_nodes(r, 4) for r in rows]
