"""The docs cannot drift: every command shown in README.md and docs/*.md runs and prints what the
docs show (the convention is in tests/docs_examples.py and docs/development.md).

After a change of what qtool prints, `QTOOL_DOCS_UPDATE=1 .venv/bin/python -m pytest
tests/cli/test_docs.py` rewrites the shown outputs (keeping the elided `...` parts elided where it
can); review the result with `git diff` before committing it.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.docs_examples import (
    ROOT,
    RUN,
    Block,
    blocks,
    diff,
    documents,
    matches,
    normalized,
    problems_with_fences,
    refreshed,
    run,
    same_line,
    shown,
    steps,
    workspace,
)

DOCS = documents()
UPDATE = os.environ.get("QTOOL_DOCS_UPDATE") == "1"
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_fences_follow_the_convention() -> None:
    problems = [p for doc in DOCS for block in blocks(doc) for p in problems_with_fences(block)]
    assert not problems, "\n".join(problems)


def test_readme_is_a_front_page_that_links_every_doc() -> None:
    text = (ROOT / "README.md").read_text()
    top = "\n".join(text.splitlines()[:20])
    assert "make demo" in top and "make test" in top, "the two set-up commands come first"
    assert len(text.splitlines()) < 300, "README.md is the front page: move details to docs/"
    missing = [shown(d) for d in DOCS[1:] if f"({shown(d)}" not in text]
    assert not missing, f"README.md does not link {missing}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    fenced = {i for b in blocks(doc) for i in range(b.line, b.line + len(b.body) + 2)}
    lines = enumerate(doc.read_text().splitlines())
    return {_slug(line.lstrip("#")) for i, line in lines if line[:1] == "#" and i not in fenced}


@pytest.mark.parametrize("doc", DOCS, ids=shown)
def test_links_name_files_and_headings_that_exist(doc: Path) -> None:
    broken = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    assert not broken, f"{shown(doc)}: broken links {broken}"


def test_the_tour_does_not_collide_with_make_demo() -> None:
    """A new user runs `make demo` first: the docs must not write where it did (build/make-demo)."""
    runs = [b for doc in DOCS for b in blocks(doc) if b.lang in RUN and not b.option("not-run")]
    assert not [b.where for b in runs if "build/make-demo" in "\n".join(b.body)]


Edits = dict[int, tuple[int, list[str]]]  # first shown line -> (lines it replaces, new lines)


@pytest.mark.parametrize(
    ("shown_line", "printed", "same"),
    [
        ("mean KL 0.00494913 is above 0.001", "mean KL 0.00494914 is above 0.001", True),
        ("mean KL 0.00494913 is above 0.001", "mean KL 0.00494912 is above 0.001", True),
        ("mean KL 0.00494913 is above 0.001", "mean KL 0.00494915 is above 0.001", False),
        ("mean KL 0.00494913 is above 0.001", "mean KL 0.0049491 is above 0.001", False),
        ("mean KL 0.00494913 is above 0.001", "mean KL 0.00494914 is below 0.001", False),
        ("KL 1.23e-05", "KL 1.24e-05", True),
        ("KL 1.23e-05", "KL 1.23e-06", False),
        ("top-1 94.3 %", "top-1 94.2 %", True),
        ("wrote 12 tensors", "wrote 13 tensors", False),  # counts are exact
    ],
)
def test_a_figure_may_round_the_other_way_in_its_last_digit(
    shown_line: str, printed: str, same: bool
) -> None:
    assert same_line(shown_line, printed) is same


@pytest.fixture(scope="module")
def outcomes(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[Path, Future[tuple[list[str], Edits]]]]:
    """The examples of every selected document, run side by side (each document's own blocks in
    order): most of the time is interpreter start-up and imports, which overlap well."""
    selected = {
        item.callspec.params["doc"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_examples_run_and_print_what_the_docs_show"
    }
    environ = dict(os.environ)  # taken here: the workers must not iterate os.environ
    with ThreadPoolExecutor(max_workers=3) as pool:
        yield {
            doc: pool.submit(_check_document, doc, tmp_path_factory.mktemp(doc.stem), environ)
            for doc in DOCS
            if doc in selected
        }


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=shown)
def test_examples_run_and_print_what_the_docs_show(
    doc: Path, outcomes: dict[Path, Future[tuple[list[str], Edits]]]
) -> None:
    problems, edits = outcomes[doc].result()
    if edits:
        _rewrite(doc, edits)
        pytest.fail(f"rewrote {len(edits)} shown output(s) in {shown(doc)}: review `git diff`")
    assert not problems, "\n\n".join(problems)


def _check_document(doc: Path, tmp: Path, environ: dict[str, str]) -> tuple[list[str], Edits]:
    """The problems of a document's examples, and with QTOOL_DOCS_UPDATE=1 the new outputs."""
    env, problems, edits = workspace(tmp, environ), [], {}
    for block in blocks(doc):
        if block.lang not in RUN or block.option("not-run"):
            continue
        needs = block.option("needs")
        if needs and shutil.which(needs) is None:
            continue
        problems += _check(block, tmp, env, edits)
    return problems, edits


def _check(block: Block, tmp: Path, env: dict[str, str], edits: Edits) -> list[str]:
    """The problems of one block; with QTOOL_DOCS_UPDATE=1, the new outputs go to `edits`."""
    problems, results = [], run(block, tmp, env)
    for n, step in enumerate(steps(block)):
        where = f"{shown(block.doc)}:{step.line + 1}: `{step.command}`"
        if n >= len(results):
            return [*problems, f"{where}: did not run (its block stopped before it)"]
        code, out = results[n]
        if code != 0 and not step.status_shown:
            tail = "\n".join(out.splitlines()[-5:])
            problems.append(f"{where}: exit code {code} (show it with `$ echo $?`)\n{tail}")
        if step.expected is None:
            continue
        want, got = normalized(step.expected, tmp), normalized(out, tmp)
        if matches(want, got):
            continue
        if UPDATE and (code == 0 or step.status_shown):
            new = refreshed(list(step.expected), normalized(out, tmp, timings=False))
            edits[step.out_start] = (len(step.expected), [block.indent + line for line in new])
        # Against the printed lines elided as the docs elide them, so the diff shows what changed.
        problems.append(
            f"{where}: printed something else\n{diff(want, refreshed(want, got), shown(block.doc))}"
        )
    return problems


def _rewrite(doc: Path, edits: Edits) -> None:
    lines = doc.read_text().splitlines()
    for start in sorted(edits, reverse=True):
        count, new = edits[start]
        lines[start : start + count] = [line.rstrip() for line in new]
    doc.write_text("\n".join(lines) + "\n")
