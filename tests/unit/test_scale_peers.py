"""benchmarks/scale/peers.py's table: medians [min-max] a system and kiln / best peer taken round by round."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import load_script

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "scale" / "peers.py"
peers = load_script(SCRIPT, "scale_peers")


def _row(rnd: int, system: str, value: float, **extra) -> dict:
    return {"round": rnd, "system": system, **dict.fromkeys(peers.FIGURES, value), **extra}


def test_ratio_is_against_the_best_peer_of_each_round():
    rows = [_row(1, "kiln", 60.0, floor_pct=70.0), _row(1, "llamacpp", 50.0), _row(1, "ort-genai", 40.0),
            _row(2, "kiln", 30.0, floor_pct=80.0), _row(2, "llamacpp", 20.0), _row(2, "ort-genai", 60.0),
            _row(3, "kiln", 45.0, floor_pct=75.0), _row(3, "llamacpp", 45.0), _row(3, "ort-genai", 10.0)]
    text = peers.table(rows, {"kiln": "1 MiB"})
    decode = next(line for line in text.splitlines() if line.startswith("| single-stream decode"))
    # kiln 45.0 [30.0-60.0]; llama.cpp 45.0 [20.0-50.0]; per-round ratios 60/50, 30/60, 45/45 -> 1.00 [0.50-1.20]
    assert decode == ("| single-stream decode (tok/s) | 45.0 [30.0–60.0] | 45.0 [20.0–50.0] | 40.0 [10.0–60.0] "
                      "| 1.00× [0.50–1.20] |")
    assert "| weights | 1 MiB | - | - | |" in text
    assert "75.0 [70.0–80.0] % of `kiln bench`'s bandwidth floor" in text


def test_a_system_missing_from_a_round_is_left_out_of_that_rounds_ratio():
    rows = [_row(1, "kiln", 60.0, floor_pct=70.0), _row(1, "llamacpp", 30.0), _row(2, "llamacpp", 30.0)]
    text = peers.table(rows, {})
    assert "| 2.00× [2.00–2.00] |" in text


def test_decode_pairs_ratio_is_taken_pair_by_pair():
    """benchmarks/scale/decode_pairs.py: each pair's kiln / llama.cpp, not the ratio of the systems' medians."""
    pairs_script = load_script(SCRIPT.with_name("decode_pairs.py"), "scale_decode_pairs")
    pairs = [{"kiln": 40.0, "llamacpp": 20.0}, {"kiln": 30.0, "llamacpp": 30.0}, {"kiln": 10.0, "llamacpp": 40.0}]
    assert pairs_script.summary(pairs) == ("3 pairs: kiln 30.00 [10.00–40.00] tok/s, llama.cpp 30.00 [20.00–40.00] "
                                           "tok/s, kiln / llama.cpp 1.00× [0.25–2.00]")


def test_a_peer_venv_borrowing_from_a_folder_that_is_gone_is_refused_by_name(tmp_path):
    """The Python peers' venvs take torch and numpy from kiln's venv through a .pth file; when that folder is gone the
    harness names it before any round instead of failing in the peer's driver."""
    site = tmp_path / "openvino-venv" / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    kept = tmp_path / "kiln-venv-site"
    kept.mkdir()
    (site / "borrowed.pth").write_text(f"{kept}\n")
    (site / "distutils-precedence.pth").write_text("import os; x = 1\n")  # not a folder: not checked
    lay = peers.PeerLayout(tmp_path)
    peers.check_peer_venvs(lay, ["kiln", "openvino"])  # every borrowed folder exists
    gone = tmp_path / "deleted-checkout" / "site-packages"
    (site / "borrowed.pth").write_text(f"{kept}\n{gone}\n")
    with pytest.raises(SystemExit, match=f"openvino's venv .* reads packages from folders that are gone .*{gone}"):
        peers.check_peer_venvs(lay, ["kiln", "openvino"])
    peers.check_peer_venvs(lay, ["kiln", "llamacpp"])  # a peer not run is not checked
