"""Every file the README and docs/ point to exists: markdown links (relative to the page) and
backticked repository paths such as `bench/results/...` or `tools/depth_bench.py --rows 64`
(relative to the repository root)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "tools" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Top-level folders whose paths a page may name in backticks.
TREE = ("bench/", "docs/", "tools/", "tests/", "tts_cli/", "kernels/", "recipes/", "examples/")
LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")


def cited(page: Path) -> set[str]:
    """Repository-relative paths the page points to."""
    text = page.read_text(encoding="utf-8")
    paths = set()
    for target in LINK.findall(text):
        target = target.split("#", 1)[0]
        if not target or re.match(r"[a-z]+:", target):   # in-page anchor, http:, mailto:
            continue
        paths.add((page.parent / target).resolve().relative_to(ROOT).as_posix())
    for code in CODE.findall(text):
        # The path a command runs: past leading VAR=value words and the interpreter.
        words = [w for w in code.split() if "=" not in w or w.startswith(TREE)]
        while words and words[0] in ("bash", "python", "python3", "git", "show"):
            words = words[1:]
        path = words[0].rstrip("/.,:;") if words else ""
        placeholder = re.search(r"[*?<>]|\.\.\.", path) or any(re.fullmatch(r"[A-Z_]+", part) for part in path.split("/"))
        if path.startswith(TREE) and not placeholder:
            paths.add(path)
    return paths


def test_the_pages_exist():
    assert [p for p in PAGES if not p.exists()] == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_cited_file_exists(page):
    missing = sorted(p for p in cited(page) if not (ROOT / p).exists())
    assert missing == [], f"{page.relative_to(ROOT)} cites missing files: {missing}"


def test_a_missing_file_is_caught(tmp_path, monkeypatch):
    page = ROOT / "docs" / "_probe.md"
    monkeypatch.setattr(Path, "read_text", lambda self, encoding=None: (
        "[x](../bench/results/none.json) `tools/no_such_tool.py --rows 1` `docs/bench.md` "
        "`git show 0dace44:tools/gone.py`"))
    # a file named as it was at a commit (`git show COMMIT:path`) is no file of the tree
    assert cited(page) == {"bench/results/none.json", "tools/no_such_tool.py", "docs/bench.md"}


def test_the_usage_page_gives_the_slot_and_call_defaults_the_code_has():
    """docs/usage.md's option table: `--rows auto`'s choices and `--batch-size`'s CUDA default, which
    follow tts_cli.engine.AUTO_ROWS (a change there once left the page at 16 x 512)."""
    from tts_cli.cli import CALL_ROWS_PER_SLOT
    from tts_cli.engine import AUTO_ROWS
    table = [line for line in (ROOT / "docs" / "usage.md").read_text().splitlines() if line.startswith("| `--")]
    rows = {re.split(r"(?<!\\)\|", line)[1].strip(): line for line in table}
    assert f"the most of {', '.join(map(str, AUTO_ROWS))} slots" in rows["`--rows auto\\|N`"]
    assert f"{CALL_ROWS_PER_SLOT} x {AUTO_ROWS[0]} with `auto`" in rows["`--batch-size N`"]
