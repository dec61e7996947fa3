"""tools/ncu_summary.py over a small Nsight Compute source-page CSV (the profile itself needs a GPU):
stall shares, range shares and the hottest instructions come from the per-instruction samples."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from ncu_summary import hottest, range_share, read, stall_shares  # noqa: E402

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","Instructions Executed",'
          '"stall_barrier","stall_long_sb","stall_wait","stall_barrier (Not Issued)"')


@pytest.fixture
def profile(tmp_path):
    path = tmp_path / "sass.csv"
    path.write_text("\n".join([
        '"Kernel Name","_depth_frame",', HEADER,
        '"0x7f6b77eb9a60","      LDG.E R29, desc[UR20][R26.64]","10","5","0","10","0","0"',
        '"0x7f6b77eb9cf0","      LDS R27, [UR6]","60","5","50","0","10","40"',
        '"0x7f6b77ec6340","      HGMMA.64x16x16.F32 R32, gdesc[UR8], R32","30","5","0","0","30","0"',
    ]) + "\n")
    return read(str(path))


def test_stall_shares_are_over_all_samples_largest_first(profile):
    shares = stall_shares(profile)
    assert list(shares) == ["barrier", "wait", "long_sb"]   # the Not Issued column is not a reason
    assert shares == pytest.approx({"barrier": 0.5, "wait": 0.4, "long_sb": 0.1})


def test_a_range_of_short_addresses_gets_its_samples_share(profile):
    assert range_share(profile, 0xb9a00, 0xb9e00) == pytest.approx(0.7)
    assert range_share(profile, 0xc6000, 0xc7000) == pytest.approx(0.3)


def test_the_hottest_instructions_come_with_their_top_reason(profile):
    top = hottest(profile, 2)
    assert [(address, reason) for address, _, reason, _ in top] == [(0xb9cf0, "barrier"), (0xc6340, "wait")]
    assert top[0][1] == pytest.approx(0.6)
    assert top[1][3].startswith("HGMMA")
