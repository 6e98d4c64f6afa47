"""`tar.ustar_header` formats the bytes `tarfile` makes for the same member, byte for byte."""

import tarfile

from hypothesis import given, settings
from hypothesis import strategies as st

from gdsload.format.tar import _info, _ustar, ustar_header

NAMES = st.text(st.characters(min_codepoint=32, max_codepoint=126), min_size=1, max_size=100)
SIZES = st.one_of(st.integers(0, 8**11 - 1), st.sampled_from([0, 1, 511, 512, 4095, 4096, 8**11 - 1]))


@settings(max_examples=300, deadline=None)
@given(NAMES, SIZES, st.sampled_from([tarfile.REGTYPE, tarfile.XHDTYPE]))
def test_ustar_header_equals_tarfile(name, size, type_):
    assert ustar_header(name, size, type_) == _ustar(_info(name, size, type_))


def test_sizes_ustar_cannot_hold_are_refused_as_tarfile_refuses_them():
    import pytest

    with pytest.raises(ValueError):
        ustar_header("big.bin", 8**11)
