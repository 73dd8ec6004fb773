"""The docs stand on their own: no file points outside the repository, and every relative link resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Results files keep the history they were written with (their commands, the documents they cited then).
HISTORY = "docs/results/"
# Written in two parts so that this file does not name them itself.
OUTSIDE_NAMES = ("DESIGN" + ".md", "../" + "shared")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return out.splitlines()


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(encoding="utf-8"), flags=re.S)
    return {github_anchor(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def broken_links(doc: Path) -> list[str]:
    """Relative links of a markdown file whose target file (or heading, for `#anchor`) does not exist."""
    text = re.sub(r"```.*?```", "", doc.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(f"{target} (no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path})")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target} (no heading #{anchor})")
    return broken


def test_no_tracked_file_names_a_file_outside_the_repository():
    offenders = []
    for name in tracked_files():
        if name.startswith(HISTORY) or not (ROOT / name).is_file():
            continue
        text = (ROOT / name).read_bytes().decode("utf-8", errors="ignore")
        for lineno, line in enumerate(text.splitlines(), 1):
            offenders += [f"{name}:{lineno}: {bad}" for bad in OUTSIDE_NAMES if bad in line]
    assert not offenders, "files outside the repository are named:\n" + "\n".join(offenders)


def test_relative_links_in_the_docs_resolve():
    docs = [n for n in tracked_files() if n == "README.md" or re.fullmatch(r"docs/[^/]+\.md", n)]
    assert "docs/benchmarks.md" in docs and "docs/architecture.md" in docs
    broken = [f"{doc}: {link}" for doc in docs for link in broken_links(ROOT / doc)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_a_missing_target_and_a_missing_heading_are_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "other.md").write_text("# A `code` heading, with punctuation\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](other.md#a-code-heading-with-punctuation) [web](https://x.org/y) [self](#top)\n# Top\n"
        "[gone](missing.md) [bad anchor](other.md#nope)\n```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(doc) == ["missing.md (no file missing.md)", "other.md#nope (no heading #nope)"]
