"""Every ```python block of README.md and docs/*.md runs, on 2 gloo ranks.

[Note: how the guide's snippets run]
* Each page's python blocks run in order in one namespace (like a notebook), on every rank
  of one world of 2, inside a process group that already exists (as under torchrun;
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` are set). A snippet's own
  ``dist.init_process_group(...)`` is then a no-op, and ``dist.destroy_process_group()``
  is deferred to the end of the page, so snippets can read like whole scripts.
* The working directory is a fresh folder per page, shared by both ranks (checkpoint paths
  such as ``"ckpt"`` are relative to it).
* A hidden HTML comment right before a block runs first, in the same namespace:
  ``<!-- snippet-setup: from tests.doc_fixtures import MyTransformer, loader -->``. It is
  for the user's own code a snippet assumes (their model, their data); the shared stand-ins
  live in ``tests/doc_fixtures.py``.
* Blocks fenced as ```bash, ```text or plain ``` are not run. Use them for shell commands
  and output, never for Python the reader is meant to run.

All pages run in one spawn; each page's outcome (or traceback, with the page's line
numbers) is reported by its own test case.
"""

from __future__ import annotations

import os
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.dist.harness import run_ranks

ROOT = Path(__file__).resolve().parents[2]
SETUP_PATTERN = re.compile(r"<!--\s*snippet-setup:(.*)-->", re.DOTALL)
FENCE_PATTERN = re.compile(r"^```([\w+-]*)\s*$")


@dataclass(frozen=True)
class Snippet:
    page: str  # path relative to the repository root
    line: int  # 1-based line of the first code line
    setup: str  # code of the snippet-setup comment ("" if none)
    code: str


def pages() -> list[str]:
    found = ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
    return [p for p in found if (ROOT / p).exists()]


def extract(page: str, text: str) -> list[Snippet]:
    """The ```python blocks of ``text``, each with the setup comment right before it."""
    snippets = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        match = FENCE_PATTERN.match(lines[index])
        if match is None:
            index += 1
            continue
        end = next((j for j in range(index + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{page}:{index + 1}: code fence never closed")
        if match.group(1) == "python":
            code = "\n".join(lines[index + 1 : end])
            snippets.append(Snippet(page, index + 2, _setup_before(lines[:index]), code))
        index = end + 1
    return snippets


def _setup_before(lines: list[str]) -> str:
    """The code of a snippet-setup comment that ends right before a fence, else ``""``."""
    before = "\n".join(lines).rstrip()
    if not before.endswith("-->"):
        return ""
    match = SETUP_PATTERN.fullmatch(before[before.rfind("<!--") :])
    return match.group(1).strip() if match else ""


def _run_page(snippets: list[Snippet], folder: str, sync: Callable[[], None]) -> str | None:
    """Run one page's snippets; ``None`` or the traceback of the first failure.

    Every rank runs every snippet in one shared folder (a checkpoint is written there by
    all ranks and read back by all), so ``sync()`` runs after each snippet: a file that
    every rank writes (``ds_config.json``) is complete everywhere before any rank's next
    snippet reads it.
    """
    namespace: dict = {"__name__": "__snippet__"}
    os.makedirs(folder, exist_ok=True)
    os.chdir(folder)
    for snippet in snippets:
        try:
            if snippet.setup:
                exec(compile(snippet.setup, f"{snippet.page} (snippet-setup)", "exec"), namespace)
            # Leading blank lines make tracebacks show the page's own line numbers.
            source = "\n" * (snippet.line - 1) + snippet.code
            exec(compile(source, snippet.page, "exec"), namespace)
            sync()
        except BaseException:  # noqa: BLE001 - reported per page to the parent
            report = f"{snippet.page}:{snippet.line}:\n{traceback.format_exc()}"
            # Also now: a failure on one rank can leave the other in a collective, and the
            # run may then die before the parent hears back.
            print(f"snippet failed on this rank: {report}", file=sys.stderr, flush=True)
            return report
    return None


def snippets_worker(rank: int, world_size: int, work_root: str, by_page: dict) -> dict:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    real_init, real_destroy = dist.init_process_group, dist.destroy_process_group
    dist.init_process_group = lambda *args, **kwargs: None  # the harness's group stands in
    dist.destroy_process_group = lambda *args, **kwargs: None
    results = {}
    try:
        for page, snippets in by_page.items():
            folder = os.path.join(work_root, page.replace("/", "_"))
            results[page] = (len(snippets), _run_page(snippets, folder, dist.barrier))
            dist.barrier()  # both ranks finished the page before the next one starts
    finally:
        dist.init_process_group, dist.destroy_process_group = real_init, real_destroy
        os.chdir(ROOT)
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    by_page = {page: extract(page, (ROOT / page).read_text()) for page in pages()}
    results = run_ranks(snippets_worker, 2, str(tmp_path_factory.mktemp("snippets")), by_page)
    return by_page, results


@pytest.mark.parametrize("page", pages())
def test_page_snippets_run(page, outcomes):
    by_page, results = outcomes
    for rank, result in enumerate(results):
        count, error = result[page]
        assert error is None, f"rank {rank}: {error}"
        assert count == len(by_page[page])


def test_guide_has_runnable_snippets():
    counts = {page: len(extract(page, (ROOT / page).read_text())) for page in pages()}
    assert counts["README.md"] >= 1, counts
    assert sum(counts.values()) >= 10, counts


def test_extract_reads_fences_and_setup_comments():
    text = "\n".join(
        [
            "# Title",
            "<!-- snippet-setup: x = 1",
            "y = 2 -->",
            "",
            "```python",
            "print(x + y)",
            "```",
            "```bash",
            "torchrun train.py",
            "```",
            "<!-- snippet-setup: w = 0 -->",
            "```python",
            "z = 3",
            "```",
            "<!-- an ordinary comment -->",
            "```python",
            "v = 4",
            "```",
        ]
    )
    first, second, third = extract("page.md", text)
    assert (first.line, first.setup, first.code) == (6, "x = 1\ny = 2", "print(x + y)")
    assert (second.line, second.setup, second.code) == (13, "w = 0", "z = 3")
    assert (third.line, third.setup, third.code) == (17, "", "v = 4")
    with pytest.raises(ValueError, match="page.md:1: code fence never closed"):
        extract("page.md", "```python\nx = 1\n")
