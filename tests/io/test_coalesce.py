"""Unit tests of `coalesce`: which extents share one system read."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gdsload.errors import GdsloadError
from gdsload.io import Extent, Piece, ReadGroup, coalesce


def spans(groups: list[ReadGroup]) -> list[tuple[str, int, int]]:
    return [(g.path, g.offset, g.nbytes) for g in groups]


def test_adjacent_extents_merge_into_one_group():
    ex = [Extent("a", 0, 10), Extent("a", 10, 5), Extent("a", 15, 1)]
    groups = coalesce(ex, [0, 10, 15])
    assert spans(groups) == [("a", 0, 16)]
    assert groups[0].pieces == (Piece(0, 10, 0), Piece(10, 5, 10), Piece(15, 1, 15))
    assert groups[0].payload_nbytes == 16


def test_small_gaps_merge_and_large_gaps_split():
    ex = [Extent("a", 0, 100), Extent("a", 100 + 512, 100), Extent("a", 100 + 512 + 100 + 513, 1)]
    assert spans(coalesce(ex, [0, 100, 200], max_gap=512)) == [("a", 0, 712), ("a", 1225, 1)]
    assert len(coalesce(ex, [0, 100, 200], max_gap=0)) == 3
    assert len(coalesce(ex, [0, 100, 200], max_gap=10_000)) == 1


def test_groups_are_per_file_and_sorted_whatever_the_input_order():
    ex = [Extent("b", 50, 10), Extent("a", 10, 10), Extent("b", 0, 50), Extent("a", 0, 10)]
    groups = coalesce(ex, [0, 10, 20, 30])
    assert spans(groups) == [("a", 0, 20), ("b", 0, 60)]
    # Each piece keeps the out_offset of its own extent, not of its position in the group.
    assert groups[0].pieces == (Piece(0, 10, 30), Piece(10, 10, 10))
    assert groups[1].pieces == (Piece(0, 50, 20), Piece(50, 10, 0))


def test_zero_length_extents_are_dropped():
    assert coalesce([Extent("a", 5, 0), Extent("a", 10**12, 0)], [0, 0]) == []
    assert spans(coalesce([Extent("a", 0, 4), Extent("a", 4, 0), Extent("a", 4, 4)], [0, 4, 4])) == [("a", 0, 8)]


def test_overlapping_extents_land_in_separate_groups():
    groups = coalesce([Extent("a", 0, 10), Extent("a", 5, 10)], [0, 10])
    assert spans(groups) == [("a", 0, 10), ("a", 5, 10)]


def test_max_pieces_caps_a_group():
    ex = [Extent("a", i, 1) for i in range(10)]
    assert [len(g.pieces) for g in coalesce(ex, list(range(10)), max_pieces=4)] == [4, 4, 2]


def test_max_span_caps_a_group_but_never_splits_an_extent():
    ex = [Extent("a", i * 100, 100) for i in range(10)] + [Extent("a", 1000, 5000)]
    groups = coalesce(ex, [i * 100 for i in range(11)], max_span=300)
    assert spans(groups) == [("a", 0, 300), ("a", 300, 300), ("a", 600, 300), ("a", 900, 100), ("a", 1000, 5000)]


def test_contiguous_out_merges_only_back_to_back_destinations():
    ex = [Extent("a", 0, 4), Extent("a", 4, 4), Extent("a", 8, 4), Extent("a", 16, 4)]
    # out: first two back to back, the third elsewhere; the fourth is after a file gap.
    groups = coalesce(ex, [0, 4, 100, 12], max_gap=1024, contiguous_out=True)
    assert spans(groups) == [("a", 0, 8), ("a", 8, 4), ("a", 16, 4)]


@pytest.mark.parametrize(
    "kwargs,match",
    [({"max_gap": -1}, "max_gap"), ({"max_pieces": 0}, "max_pieces"), ({"max_span": 0}, "max_span")],
)
def test_bad_parameters_are_named(kwargs, match):
    with pytest.raises(GdsloadError, match=match):
        coalesce([Extent("a", 0, 1)], [0], **kwargs)


def test_extents_and_offsets_must_pair_up():
    with pytest.raises(GdsloadError, match="2 extents but 1 out_offsets"):
        coalesce([Extent("a", 0, 1), Extent("a", 1, 1)], [0])


extent_lists = st.lists(
    st.tuples(st.sampled_from("ab"), st.integers(0, 2000), st.integers(0, 300)), max_size=40
)


@settings(max_examples=200, deadline=None)
@given(raw=extent_lists, max_gap=st.integers(0, 500), max_pieces=st.none() | st.integers(1, 5),
       max_span=st.none() | st.integers(1, 1000), contiguous_out=st.booleans())
def test_every_extent_is_in_exactly_one_well_formed_group(raw, max_gap, max_pieces, max_span, contiguous_out):
    extents = [Extent(p, o, n) for p, o, n in raw]
    out_offsets = [i * 1000 for i in range(len(extents))]
    groups = coalesce(extents, out_offsets, max_gap=max_gap, max_pieces=max_pieces, max_span=max_span,
                      contiguous_out=contiguous_out)

    placed = sorted((g.path, p.offset, p.nbytes, p.out_offset) for g in groups for p in g.pieces)
    wanted = sorted((e.path, e.offset, e.nbytes, o) for e, o in zip(extents, out_offsets) if e.nbytes)
    assert placed == wanted
    assert [(g.path, g.offset) for g in groups] == sorted((g.path, g.offset) for g in groups)
    for g in groups:
        assert g.offset == g.pieces[0].offset and g.end == g.pieces[-1].offset + g.pieces[-1].nbytes
        assert max_pieces is None or len(g.pieces) <= max_pieces
        assert max_span is None or len(g.pieces) == 1 or g.nbytes <= max_span
        for a, b in zip(g.pieces, g.pieces[1:]):
            gap = b.offset - (a.offset + a.nbytes)
            assert 0 <= gap <= max_gap
            if contiguous_out:
                assert gap == 0 and b.out_offset == a.out_offset + a.nbytes
