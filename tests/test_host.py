"""tts_cli.model.host: the host copies the engine makes."""
import numpy as np
import pytest

from tts_cli.model.host import copy_keeping_gil


def test_copy_keeping_gil_writes_the_slice_and_nothing_else():
    dst = np.zeros(10, np.float32)
    src = np.arange(1, 13, dtype=np.float32).reshape(3, 4)
    copy_keeping_gil(dst, 3, src[1, :3])          # a row's leading part, as the engine copies a window's PCM
    assert dst.tolist() == [0, 0, 0, 5, 6, 7, 0, 0, 0, 0]
    copy_keeping_gil(dst, 6, src[2])
    assert dst.tolist() == [0, 0, 0, 5, 6, 7, 9, 10, 11, 12]


@pytest.mark.parametrize("start, src", [
    (8, np.ones(3, np.float32)),                  # past the end
    (-1, np.ones(3, np.float32)),
    (0, np.ones(3, np.float64)),                  # another dtype
    (0, np.ones(6, np.float32)[::2]),             # not contiguous
    (0, np.ones((2, 2), np.float32)),             # not 1-D
], ids=["past-end", "negative", "dtype", "strided", "2-d"])
def test_copy_keeping_gil_refuses_what_memmove_would_get_wrong(start, src):
    dst = np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="cannot copy"):
        copy_keeping_gil(dst, start, src)
    assert not dst.any()
