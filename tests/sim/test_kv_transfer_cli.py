"""`fairway kv-transfer`: a prompt's KV cache moving on a preset network, alone and shared."""

from __future__ import annotations

import pytest

from router.cli import build_parser


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    args = build_parser().parse_args(["kv-transfer", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out.splitlines()


def test_a_6k_token_prompt_across_hosts_alone_and_sharing_one_nic(capsys) -> None:
    """Llama-3-8B's KV of 6,144 tokens is 805 MB: 16 ms at 50 GB/s (400 Gb/s), 1.8 ms over
    NVLink; eight prompts leaving a host through its one NIC take eight times as long, and
    through one NIC per GPU (rails) no longer than one."""
    shared = run(capsys, "--topology", "h100-1nic", "--tokens", "6144")[-1].split()
    rails = run(capsys, "--topology", "dgx-h100", "--tokens", "6144")[-1].split()
    tokens, mb, same_host, across, eight = (float(x.replace(",", "")) for x in shared)
    assert (tokens, mb) == (6144, 805)
    assert same_host == pytest.approx(1.79, abs=0.01)
    assert across == pytest.approx(16.11, abs=0.01)
    assert eight == pytest.approx(8 * 16.1, rel=0.01)
    assert float(rails[-1]) == pytest.approx(across, abs=0.01)


def test_an_unknown_topology_is_a_clear_error(capsys) -> None:
    with pytest.raises(SystemExit, match="--topology"):
        run(capsys, "--topology", "no-such-file.yaml")
