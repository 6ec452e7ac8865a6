"""The comparison report: built from small runs, parsed back, and looked at in Chromium."""

from __future__ import annotations

import html.parser
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dashboards.report import load_run
from router.cli import main

POLICIES = ["lpm", "vtc", "least_load"]


class Page(html.parser.HTMLParser):
    """Tables and images of the report."""

    def __init__(self) -> None:
        super().__init__()
        self.images: list[dict[str, str]] = []
        self.rows: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "img":
            self.images.append(dict(attrs))
        elif tag == "tr":
            self.rows.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.rows[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


@pytest.fixture(scope="module")
def compared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("compare")
    code = main(
        [
            "compare",
            "--trace",
            "gen:flood",
            "--gen",
            "duration=20",
            "--workers",
            "2",
            "--policies",
            ",".join(POLICIES),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    return out


def test_report_holds_every_policy_plot_and_number(compared: Path) -> None:
    page = Page()
    page.feed((compared / "report.html").read_text())
    header, *rows = page.rows
    assert [r[0] for r in rows] == POLICIES
    for row in rows:
        summary = json.loads((compared / row[0] / "summary.json").read_text())
        cell = dict(zip(header, row, strict=True))
        assert float(cell["TTFT mean s"]) == pytest.approx(summary["ttft"]["mean"], rel=0.01)
        assert float(cell["hit rate %"]) == pytest.approx(
            100 * summary["prefix_cache"]["hit_rate"], rel=0.01
        )
    assert len(page.images) == 4
    assert all(img["src"].startswith("data:image/png;base64,") for img in page.images)
    md = (compared / "report.md").read_text()
    assert all(p in md for p in POLICIES) and "Best" in md


def test_report_from_existing_runs_including_a_live_recording(compared: Path, tmp_path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(compared / "vtc" / "requests.csv", live / "requests.csv")  # same columns
    out = tmp_path / "r.html"
    assert main(["report", str(compared / "lpm"), str(live), "--out", str(out)]) == 0
    names = [load_run(compared / "lpm").name, load_run(live).name]
    assert names == ["lpm", "live (live)"]
    assert "live (live)" in out.read_text()


def test_bad_run_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no requests.csv"):
        load_run(tmp_path)
    (tmp_path / "requests.csv").write_text("id,client\nx,y\n")
    with pytest.raises(ValueError, match=r"requests.csv:2: cannot read row"):
        load_run(tmp_path)


@pytest.mark.slow
def test_chromium_shows_the_plots(compared: Path, tmp_path: Path) -> None:
    browser = shutil.which("chromium")
    if browser is None:
        pytest.skip("Debian's chromium is not installed (make test installs it)")
    shot = tmp_path / "report.png"
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--window-size=1280,2400",
            f"--screenshot={shot}",
            (compared / "report.html").as_uri(),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    not_white = (pixels < 0.95).any(axis=-1)
    assert not_white.mean() > 0.05, "the page is (nearly) blank"
    # Plot lines are coloured: matplotlib's default blue must appear somewhere.
    blue = np.abs(pixels - np.array([0x1F, 0x77, 0xB4]) / 255).max(axis=-1) < 0.08
    assert blue.sum() > 500, "no plotted lines visible"
    assert re.search(r"<figure", (compared / "report.html").read_text())


@pytest.mark.slow
def test_compare_runs_policies_as_ray_tasks(tmp_path: Path) -> None:
    import tempfile

    from tests.live_helpers import fairway_run, python_run, ray_head

    temp = Path(tempfile.mkdtemp(prefix="fw-ray-", dir="/tmp"))  # short: Ray's socket paths
    # A head of the test's own, stopped by its pids: never `ray stop`, which stops every Ray
    # cluster on the host.
    with ray_head(temp) as head:
        out = tmp_path / "cmp"
        argv = ["compare", "--trace", "gen:few_shot", "--gen", "num_requests=200",
                "--workers", "2", "--policies", "lpm,round_robin", "--out", str(out),
                "--ray-address", head.address]  # fmt: skip
        done = fairway_run(argv)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "compare: runs as Ray tasks on the cluster at" in done.stderr
        # The head's workers ran them: each Ray worker process logs under the head's session.
        assert list(temp.glob("session_*/logs/worker-*.out")), "no Ray worker was started"
        for name in ("lpm", "round_robin"):
            assert json.loads((out / name / "summary.json").read_text())["completed"] == 200
        assert (out / "report.html").exists()
        # A process that joined this head already (a notebook's) and asks for another cluster
        # is told so, by the flag's name, and keeps its own.
        script = (
            "import sys, ray\n"
            "from router.cli import main\n"
            "ray.init(address=sys.argv[1], log_to_driver=False)\n"
            "code = main(['compare', '--trace', 'gen:few_shot', '--gen', 'num_requests=20',\n"
            "             '--policies', 'round_robin', '--out', sys.argv[2],\n"
            "             '--ray-address', '127.0.0.1:1'])\n"
            "assert ray.is_initialized()\n"
            "sys.exit(code)\n"
        )
        joined = python_run(["-c", script, head.address, str(tmp_path / "other")], 120)
        assert joined.returncode == 2, joined.stderr[-3000:]
        assert "--ray-address: this process has joined the Ray cluster at" in joined.stderr
    shutil.rmtree(temp, ignore_errors=True)
