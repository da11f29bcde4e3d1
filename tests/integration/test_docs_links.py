"""The README and docs/ link to each other by file and heading; a moved section or renamed heading breaks those links
silently (GitHub renders a dead link without complaint). This checks every relative link and image resolves, every
``#anchor`` names a heading of its target, and the README stays a short front door (the manual lives in docs/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import REPO

ROOT = REPO
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 300

FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1", re.M | re.S)  # fenced code blocks: no links or headings inside
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target) and ![alt](target)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
EXTERNAL = ("http://", "https://", "mailto:")


def prose(path: Path) -> str:
    """The page's text without code blocks, where ``#`` and ``[x](y)`` are not markdown."""
    return FENCE.sub("", path.read_text(encoding="utf-8"))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped (hyphens kept), spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a page, with GitHub's ``-1``, ``-2`` suffixes for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for heading in HEADING.findall(prose(path)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def links(path: Path) -> list[str]:
    return LINK.findall(INLINE_CODE.sub("", prose(path)))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        if target.startswith(EXTERNAL):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"broken links in {page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_every_page_is_checked() -> None:
    assert len(PAGES) > 1 and all(p.exists() for p in PAGES)


def test_readme_is_a_short_front_door() -> None:
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move detail to docs/"


def documented_batch() -> tuple[set[str], set[str]]:
    """The batch keys (first column of the table under "### The batch") and the ``meta`` keys its prose names."""
    text = (ROOT / "docs" / "data.md").read_text(encoding="utf-8")
    section = text.split("### The batch", 1)[1].split("\n### ", 1)[0]
    keys = {k for row in re.findall(r"^\| (`.+?) \|", section, re.M) for k in re.findall(r"`(\w+)`", row)}
    meta_prose = section.split("`meta` holds", 1)[1].split("\n\n", 1)[0]
    meta = set(re.findall(r"`(\w+)", meta_prose))  # `epoch_end: True` names epoch_end
    return keys, meta


def test_the_documented_batch_is_the_batch_the_loader_yields(tmp_path, make_dataset, tiny_tokenizer):
    """The batch contract is written once, in docs/data.md: its keys and meta keys are what a packed epoch yields."""
    from nanovlm.config import load_config
    from nanovlm.data import PackedMultimodalDataModule

    make_dataset(tmp_path / "train", 40, image_token_count=4)
    cfg = load_config(["tiny_cpu.yaml"], [f"data.train=[{tmp_path / 'train'}]", "data.val=[]", "data.max_tokens=256"])
    cfg.data.num_workers = 0
    dm = PackedMultimodalDataModule(cfg.data, cfg.model, tiny_tokenizer)
    dm.setup("fit")
    keys, meta = set(), set()
    for batch in dm.train_dataloader():  # one epoch: first packs, skips and the epoch end all occur
        keys |= batch.keys()
        meta |= batch["meta"].keys()
        if batch["meta"].get("epoch_end"):
            break
    doc_keys, doc_meta = documented_batch()
    assert keys == doc_keys - {"attention_mask"}  # attention_mask: padded baselines only, as the page says
    assert meta == doc_meta
