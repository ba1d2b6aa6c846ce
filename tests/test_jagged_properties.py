"""Jagged layout properties over generated lengths (hypothesis): the host builders against
a token-by-token walk, and fit_to_capacity against a search over every common cap.

Host-side numpy only (no jit), so a few hundred examples take about a second."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemjax.data.jagged import Jagged, fit_to_capacity, layout_from_lengths, pack, validate

LENGTHS = st.lists(st.integers(0, 40), min_size=0, max_size=24)
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(lengths=LENGTHS, slack=st.integers(0, 17))
def test_layout_matches_a_token_walk(lengths, slack):
    capacity = sum(lengths) + slack
    offsets, segment_ids, positions = layout_from_lengths(lengths, capacity)
    b = len(lengths)
    want_seg, want_pos = [], []
    for sample, n in enumerate(lengths):
        want_seg += [sample] * n
        want_pos += list(range(n))
    want_seg += [b] * slack                       # padding: the sentinel B, position 0
    want_pos += [0] * slack
    assert offsets.dtype == segment_ids.dtype == positions.dtype == np.int32
    assert offsets.tolist() == [0] + np.cumsum(lengths, dtype=np.int64).tolist()
    assert segment_ids.tolist() == want_seg and positions.tolist() == want_pos


@PROPERTY
@given(lengths=LENGTHS.filter(bool), slack=st.integers(0, 9), width=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_pack_keeps_every_token_and_validates(lengths, slack, width, seed):
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(1, 1000, size=(n, width)).astype(np.int32) for n in lengths]
    j = pack(seqs, capacity=sum(lengths) + slack)
    validate(j)
    for sample, s in enumerate(seqs):
        got = np.asarray(j.values)[j.offsets[sample]:j.offsets[sample + 1]]
        np.testing.assert_array_equal(got, s)
    assert not np.asarray(j.values)[sum(lengths):].any()          # padding rows are zero
    assert np.asarray(j.lengths).tolist() == list(lengths)


@PROPERTY
@given(lengths=LENGTHS.filter(bool), seed=st.integers(0, 2**16))
def test_validate_rejects_a_moved_token(lengths, seed):
    """One token's segment id or position changed: validate names the disagreeing field."""
    capacity = sum(lengths) + 1
    offsets, segment_ids, positions = layout_from_lengths(lengths, capacity)
    rng = np.random.default_rng(seed)
    t = int(rng.integers(0, capacity))
    if rng.random() < 0.5:
        segment_ids = segment_ids.copy()
        segment_ids[t] = (segment_ids[t] + 1) % (len(lengths) + 1)
        field = "segment_ids"
    else:
        positions = positions.copy()
        positions[t] += 1
        field = "positions"
    bad = Jagged(np.zeros(capacity, np.float32), offsets, segment_ids, positions)
    with pytest.raises(ValueError, match=f"seq.{field} disagree with offsets"):
        validate(bad, "seq")


@PROPERTY
@given(lengths=LENGTHS.filter(bool), capacity=st.integers(0, 400))
def test_fit_to_capacity_is_the_largest_common_cap(lengths, capacity):
    lengths = np.asarray(lengths, np.int64)
    got = fit_to_capacity(lengths, capacity)
    if lengths.sum() <= capacity:
        assert got.tolist() == lengths.tolist()
        return
    caps = [c for c in range(int(lengths.max()) + 1) if np.minimum(lengths, c).sum() <= capacity]
    assert got.tolist() == np.minimum(lengths, max(caps)).tolist()
