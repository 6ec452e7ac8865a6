"""`fairway compare` and its report with traffic classes: per class attainment, goodput and
refusals by reason, in the terminal, the HTML and the Markdown, as each run's summary has them."""

from __future__ import annotations

import contextlib
import html.parser
import json
from pathlib import Path

import pytest

from router.cli import main

POLICIES = ["lpm", "vtc"]
CLASSES = [
    "--class", "interactive:priority=0,ttft=1,tpot=0.1,max_queue_time=5",
    "--class", "batch:priority=1,ttft=30,max_queue_time=30",
]  # fmt: skip


class Tables(html.parser.HTMLParser):
    """Each table's rows of cells, by the table's id."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[str]]] = {}
        self._rows: list[list[str]] | None = None
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "table":
            self._rows = self.tables.setdefault(dict(attrs).get("id", ""), [])
        elif tag == "tr" and self._rows is not None:
            self._rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._rows is not None:
            self._rows[-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "table":
            self._rows = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("classes")
    capture = out / "stdout.txt"
    with open(capture, "w") as f, contextlib.redirect_stdout(f):
        code = main(
            ["compare", "--trace", "gen:priority_mix", "--gen", "duration=15",
             "--gen", "batch_rate=30", "--workers", "2", "--max-num-batched-tokens", "1024",
             *CLASSES, "--admission", "--policies", ",".join(POLICIES), "--out", str(out)]
        )  # fmt: skip
    assert code == 0
    return out, capture.read_text()


def test_the_terminal_shows_each_policy_and_class(compared) -> None:
    _, stdout = compared
    lines = [line.split() for line in stdout.splitlines()]
    header = next(i for i, words in enumerate(lines) if words[:2] == ["policy", "class"])
    rows = [words[:2] for words in lines[header + 2 : header + 6]]
    assert rows == [[p, c] for p in POLICIES for c in ("interactive", "batch")]


def test_the_report_has_the_summary_figures_per_class(compared) -> None:
    out, _ = compared
    page = Tables()
    page.feed((out / "report.html").read_text())
    header, *rows = page.tables["classes"]
    assert header[:6] == ["policy", "class", "targets", "requests", "met %", "goodput/s"]
    assert [c for c in header if c.startswith("refused")] == [
        "refused queue time",
        "refused unmeetable",
        "refused rate limit",
    ]
    assert len(rows) == 2 * len(POLICIES)
    for row in rows:
        cell = dict(zip(header, row, strict=True))
        figures = json.loads((out / cell["policy"] / "summary.json").read_text())["classes"]
        expected = figures[cell["class"]]
        assert int(cell["requests"]) == expected["requests"]
        assert float(cell["met %"]) == pytest.approx(100 * expected["attainment"], rel=0.01)
        assert float(cell["goodput/s"]) == pytest.approx(expected["goodput"], rel=0.01)
        assert int(cell["refused unmeetable"]) == expected["refused"]["unmeetable"]
    summary_header = page.tables["summary"][0]
    assert {"SLO met %", "goodput req/s"} <= set(summary_header)


def test_the_markdown_twin_has_the_classes(compared) -> None:
    out, _ = compared
    text = (out / "report.md").read_text()
    assert "## Traffic classes" in text
    assert "refused unmeetable" in text
