"""Every lab number the pages quote comes from a committed summary (issue 48 item 5).

A lab claim is a block of a page -- a paragraph, a list item with its continuation lines, or a table row -- that cites
a committed sweep: `lab/<name>/` (or `<name>` alone in code, when it is a lab folder), a section of lab/README.md
("section 6"; in another page "lab/README.md ... section 6" or "§6"), or that sits in such a section of lab/README.md,
under a paragraph or list item that cites one; on the other pages also a sentence that begins "The lab" (read against
every folder). Its quoted numbers are the decimals with at least two digits after the point (accuracies 0.802,
differences −0.247, interval ends, margins, grad norms) outside code and math spans and link targets: a setting
quoted beside a lab number goes in a code span. Each must appear, as written or as its absolute value, in the
summaries of the folders the claim cites: a number printed in `summary.md` / `length.md`, a value of `summary.csv` /
`length.csv` rounded to the digits quoted, or the mean over seeds of `eval/accuracy_strict` at a logged step of one
(arm, level) of `runs.jsonl.gz` (the "eval at steps 9 / 19 / 29" columns of lab/README.md's tables). A number none of
these holds fails the test with its page and line.

Not checked: integers and one-decimal numbers (a setting such as 0.5), percentages, numbers in scientific notation,
and numbers read from the runs' full logs, which the committed folders do not keep (a mask's share of tokens, a moment
of the log-ratio): the pages say where those come from.
"""

from __future__ import annotations

import csv
import functools
import glob
import gzip
import json
import os
import re
from collections import defaultdict

import pytest

EVAL = "eval/accuracy_strict"  # the summaries' "eval acc" (lab/rc_lab.py)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAB = os.path.join(ROOT, "lab")
LAB_README = os.path.join(LAB, "README.md")
PAGES = [os.path.join(ROOT, "README.md"), LAB_README, *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]

# A quoted lab number: an optional sign, 1-2 integer digits, 2-4 decimals; not part of a longer token (a version
# 0.9.1, an arXiv id 2510.01161, a band "0.999_1.001", 1e-4, a section §12.10), not a percentage.
NUMBER = re.compile(r"(?<![\w.§])([+−-]?)(\d{1,2}\.\d{2,4})(?![\w]|\.\d|\s?%)")
CODE_SPAN = re.compile(r"`[^`]*`|\$[^$]*\$")  # code and math: settings and formulas, not quoted results
LINK_TARGET = re.compile(r"\]\([^)]*\)")
FOLDER_PATH = re.compile(r"lab/(\w+)")
FOLDER_CODE = re.compile(r"`(\w+)/?`")
SECTION_HERE = re.compile(r"\bsections? (\d+)(?:\s*(?:and|–|-|,)\s*(\d+))?")
SECTION_OF_LAB = re.compile(r"lab/README\.md\)?,?\s*(?:section|§)\s*(\d+)")
HEADING = re.compile(r"^(#+)\s+(.*)$")
ITEM = re.compile(r"^(\s*)(?:[*-]|\d+\.)\s+")


def lab_folders() -> list[str]:
    return sorted(d for d in os.listdir(LAB) if os.path.isfile(os.path.join(LAB, d, "summary.md")))


def _number_strings(text: str) -> set[str]:
    return {m[2] for m in NUMBER.finditer(text)}


def _rounded(value: float) -> set[str]:
    return {f"{abs(value):.{d}f}" for d in (2, 3, 4)}


def _step_evals(folder: str) -> set[str]:
    """Mean over seeds of the strict eval accuracy at each logged step of each (arm, level), rounded as quoted."""
    path = os.path.join(LAB, folder, "runs.jsonl.gz")
    if not os.path.exists(path):
        return set()
    at = defaultdict(list)
    with gzip.open(path, "rt") as f:
        for line in f:
            run = json.loads(line)
            cell = run["name"].rsplit("__s", 1)[0]
            for row in run["metrics"]:
                if EVAL in row:
                    at[(cell, row["step"])].append(row[EVAL])
    return {s for values in at.values() for s in _rounded(sum(values) / len(values))}


@functools.cache
def backing(folder: str) -> frozenset[str]:
    """The numbers the committed summaries of lab/`folder` hold, as a page may quote them."""
    out: set[str] = set()
    for name in ("summary.md", "length.md"):
        path = os.path.join(LAB, folder, name)
        if os.path.exists(path):
            with open(path) as f:
                out |= _number_strings(f.read())
    for name in ("summary.csv", "length.csv"):
        path = os.path.join(LAB, folder, name)
        if os.path.exists(path):
            with open(path, newline="") as f:
                for row in csv.reader(f):
                    for cell in row:
                        try:
                            out |= _rounded(float(cell))
                        except ValueError:
                            pass
    return frozenset(out | _step_evals(folder))


@functools.cache
def lab_sections() -> dict[str, tuple[str, ...]]:
    """lab/README.md's numbered sections -> the folders its heading cites ("3–4" gives both numbers)."""
    sections = {}
    with open(LAB_README) as f:
        for line in f:
            m = HEADING.match(line)
            if m and len(m[1]) == 2:
                number = re.match(r"(\d+)(?:–(\d+))?\.", m[2])
                folders = tuple(f for f in FOLDER_PATH.findall(m[2]) if f in lab_folders())
                for n in number.groups() if number else ():
                    if n:
                        sections[n] = folders
    return sections


def cited(text: str, in_lab_readme: bool) -> set[str]:
    """The lab folders a block of text cites."""
    folders = set(lab_folders())
    out = {f for f in FOLDER_PATH.findall(text) if f in folders}
    out |= {f for f in FOLDER_CODE.findall(text) if f in folders}
    numbers = []
    if in_lab_readme:
        numbers = [n for m in SECTION_HERE.finditer(text) for n in m.groups() if n]
    numbers += SECTION_OF_LAB.findall(text)
    for n in numbers:
        out |= set(lab_sections().get(n, ()))
    return out


def blocks(text: str, in_lab_readme: bool):
    """(first line number, block text, folders it cites or inherits) for each paragraph, list item and table row.
    A block inherits the folders of its lab/README.md section, of the paragraph that opens its run of list items
    and of the list items it is nested in; a table row those of the block before the table (its caption)."""
    section: set[str] = set()
    context: set[str] = set()  # the last unindented paragraph's folders, for the list items after it
    parents: list[tuple[int, set[str]]] = []  # the open list items: (indent, folders)
    block: dict = {}  # the block being read: start, lines, inherited folders, indent if a list item
    caption: set[str] = set()
    fenced = False

    def flush():
        nonlocal block, caption, context
        if block:
            body = " ".join(block["lines"])
            folders = block["inherited"] | cited(body, in_lab_readme)
            if block["item"] is not None:
                parents.append((block["item"], folders))
            elif block["indent"] == 0:
                context = folders
            caption = folders
            yield block["start"], body, folders
        block = {}

    for i, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            yield from flush()
            fenced = not fenced
            continue
        heading = HEADING.match(line)
        if fenced or not line.strip() or heading:
            yield from flush()
            if heading:
                parents.clear()
                context = set()
                section = cited(heading[2], in_lab_readme) if in_lab_readme else set()
            continue
        if line.lstrip().startswith("|"):
            yield from flush()
            yield i, line, section | caption | cited(line, in_lab_readme)
            continue
        item = ITEM.match(line)
        if block and not item:
            block["lines"].append(line)
            continue
        yield from flush()
        indent = len(line) - len(line.lstrip())
        while parents and parents[-1][0] >= indent and (item or indent == 0):
            parents.pop()
        inherited = section | (parents[-1][1] if parents else set()) | (context if item else set())
        block = {
            "start": i,
            "lines": [line],
            "inherited": inherited,
            "item": indent if item else None,
            "indent": indent,
        }
    yield from flush()


def quoted_numbers(block: str) -> list[str]:
    """The quoted decimals of a block, outside code and math spans and link targets, as written (sign dropped)."""
    prose = LINK_TARGET.sub("]", CODE_SPAN.sub(" ", block))
    return [m[2] for m in NUMBER.finditer(prose)]


SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z(*])")


def claims(text: str, in_lab_readme: bool):
    """(line, text, folders) of each lab claim: a block that cites or inherits folders, and, on a page other than
    lab/README.md, a sentence of an uncited block that begins "The lab" (read against every folder)."""
    for line, body, folders in blocks(text, in_lab_readme):
        if folders:
            yield line, body, folders
        elif not in_lab_readme:
            for sentence in SENTENCE.split(body):
                if sentence.lstrip("*( ").startswith("The lab"):
                    yield line, sentence, set(lab_folders())


def unbacked(text: str, in_lab_readme: bool) -> list[tuple[int, str, tuple[str, ...]]]:
    """(line, number, folders) for each quoted number of a lab claim that no summary of its folders holds."""
    out = []
    for line, body, folders in claims(text, in_lab_readme):
        held = set().union(*(backing(f) for f in folders))
        out += [(line, n, tuple(sorted(folders))) for n in quoted_numbers(body) if n not in held]
    return out


def checked(text: str, in_lab_readme: bool) -> list[tuple[int, str]]:
    return [(line, n) for line, body, _ in claims(text, in_lab_readme) for n in quoted_numbers(body)]


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_quoted_lab_number_is_in_a_committed_summary(page):
    missing = unbacked(read(page), page == LAB_README)
    assert not missing, f"{os.path.relpath(page, ROOT)}: quoted lab numbers no committed summary holds: " + "; ".join(
        f"line {line}: {n} (cites {', '.join(folders)})" for line, n, folders in missing
    )


def test_a_number_no_summary_holds_fails_and_a_held_one_passes():
    page = read(LAB_README)
    verdict = "(0.557, like naive)"  # the catalogue's M2 mask arm at k = 8 (lab/catalogue/summary.md)
    assert verdict in page and unbacked(page, True) == []
    planted = unbacked(page.replace(verdict, "(0.567, like naive)"), True)
    assert [(n, folders) for _, n, folders in planted] == [("0.567", ("catalogue", "catalogue_published"))]
    # another page: a paragraph that cites a folder is checked against that folder's summaries only
    assert unbacked("Measured (`lab/catalogue/`): OPSM ends at 0.802, naive at −0.205 below.", False) == []
    assert [n for _, n, _ in unbacked("Measured (`lab/catalogue/`): naive ends at 0.855.", False)] == ["0.855"]
    assert unbacked("Measured (`lab/staleness/`): naive ends at 0.855.", False) == []
    assert unbacked("Measured ([lab/README.md](../lab/README.md) section 1): naive ends at 0.855.", False) == []
    # text that cites no sweep is not a lab claim; settings in code spans and percentages are not quoted numbers
    assert unbacked("PPO ends at 0.123.", False) == []
    assert [n for _, n, _ in unbacked("PPO ends at 0.123. The lab: naive ends at 0.793 and 0.7931.", False)] == [
        "0.7931"
    ]
    assert quoted_numbers("bands `[0.999, 1.001]`, 1.87 % of tokens, v0.9.1, §12.10, arXiv 2510.01161, 1e-4") == []


def test_the_scan_reads_the_lab_readmes_claims():
    assert lab_sections()["6"] == ("catalogue",) and lab_sections()["3"] == lab_sections()["4"] == ("length",)
    assert lab_sections()["1"] == ("staleness",)
    found = {n: folders for _, body, folders in blocks(read(LAB_README), True) for n in quoted_numbers(body)}
    assert found["0.557"] >= {"catalogue"} and found["0.608"] >= {"staleness"}  # a verdict, a finding of "In short"
    assert len(checked(read(LAB_README), True)) > 500
