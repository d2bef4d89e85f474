"""Every page and notebook can be found (issue 52): each ``docs/*.md`` is in the site's navigation
(``mkdocs.yml``) and linked from the docs' front page (``docs/index.md``), each notebook is named
on the notebooks page, every relative link of the docs points at a file that exists (or at an
API reference page the site build generates), and the four user-journey pages each show the
data shard a training loop reads. No process is started: the pages' code runs in
``tests/project/test_readme.py``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))
NOTEBOOKS = sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
#: Generated at build time by tools/mkdocs_hooks.py from the packages' __all__.
REFERENCE = {"reference/meshgroups.md", "reference/transfer.md", "reference/compat.md"}
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
JOURNEYS = {
    "start-torchtitan.md": (
        'mg.local_rank("dp_replicate", "dp_shard")',
        'mg.size("dp_replicate", "dp_shard")',
    ),
    "start-megatron.md": ("ProcessGroupCollection.from_layout", "dist.get_rank(pgs.dp)", "pgs.dp.size()"),
    "start-rl.md": ('local_rank("dp")', 'size("dp")', "quantize=q", "<!-- run: gloo 4 -->"),
    "start-explore.md": ('lay.coords(5)["dp"], lay.size("dp")',),
}


def _nav_pages(text: str) -> list[str]:
    """The ``.md`` files the mkdocs nav names (``- Title: page.md`` lines under ``nav:``)."""
    nav = text[text.index("\nnav:") :]
    return re.findall(r":\s*([\w./-]+\.md)\s*$", nav, flags=re.M)


def _links(page: str) -> list[str]:
    return [m.group(1) for m in LINK.finditer((DOCS / page).read_text()) if "://" not in m.group(1)]


def test_every_page_is_in_the_site_navigation():
    nav = _nav_pages((ROOT / "mkdocs.yml").read_text())
    missing = [p for p in PAGES if p not in nav]
    assert not missing, f"docs pages in no mkdocs.yml nav entry (orphans on the site): {missing}"
    gone = [p for p in nav if p not in PAGES and p not in REFERENCE]
    assert not gone, f"mkdocs.yml nav names pages that do not exist: {gone}"
    assert set(REFERENCE) <= set(nav)


def test_every_page_is_linked_from_the_front_page():
    linked = set(_links("index.md"))
    missing = [p for p in PAGES if p != "index.md" and p not in linked]
    assert not missing, f"docs pages docs/index.md links to nowhere (orphans on GitHub): {missing}"


def test_every_notebook_is_on_the_notebooks_page():
    text = (DOCS / "notebooks.md").read_text()
    missing = [n for n in NOTEBOOKS if f"`{n}`" not in text]
    assert not missing, f"notebooks docs/notebooks.md does not describe: {missing}"
    count = {2: "Two", 3: "Three", 4: "Four", 5: "Five", 6: "Six", 7: "Seven"}.get(len(NOTEBOOKS))
    assert count is None or f"{count} notebooks" in text, f"docs/notebooks.md must say {count} notebooks"


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_point_at_files(page):
    broken = []
    for target in _links(page):
        if target in REFERENCE:
            continue
        if not (DOCS / target).resolve().exists():
            broken.append(target)
    assert not broken, f"docs/{page} links to missing files: {broken}"


def test_the_api_reference_is_reachable_without_building_the_site():
    text = (DOCS / "index.md").read_text()
    assert "python -m pydoc meshgroups" in text and "mkdocs serve" in text


@pytest.mark.parametrize("page", sorted(JOURNEYS))
def test_each_journey_page_shows_the_data_shard_and_runs(page):
    text = (DOCS / page).read_text()
    for needle in JOURNEYS[page]:
        assert needle in text, f"docs/{page} must show {needle}"
    # torchtitan and Megatron: one torchrun-style block on real processes (tests/project/test_readme.py)
    if page in ("start-torchtitan.md", "start-megatron.md"):
        assert text.count("<!-- run: gloo 4 -->") == 1
    assert "<!-- run: skip" not in text.replace("<!-- run: skip (needs vLLM", "")


def test_imports_come_from_one_place():
    """WeightSync and init_job are imported from meshgroups.transfer on every page (issue 52)."""
    for path in [ROOT / "README.md", *DOCS.glob("*.md")]:
        for line in path.read_text().splitlines():
            if re.search(r"import .*\b(WeightSync|init_job)\b", line) and "VLLMWeightSync" not in line:
                assert line.lstrip().startswith("from meshgroups.transfer import"), f"{path.name}: {line}"


def test_no_page_uses_torch_private_flatten_in_a_recipe():
    """The HSDP recipe declares its flattened dims (init_mesh(flatten=...)), not torch's _flatten."""
    for page in ("torch-bridge.md", "start-torchtitan.md"):
        code = re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)
        hsdp = [c for c in code if "fully_shard" in c]
        assert hsdp and not any("._flatten(" in c for c in hsdp), page
