"""How compute_on_gpus evens its shares' ends: the calling share takes the remote shares'
lag in roots, learned from when the shares of the last call ended."""

from __future__ import annotations

import pytest

from prefect_gpu_dask.worker.compute import ShareEnds, _root_counts, next_lead


def ends_of(lead: float, roots: int, parts: int, per_root_s: float, lag_s: float) -> ShareEnds:
    """When the shares of one call end if each root takes ``per_root_s`` everywhere and a
    remote share is read ``lag_s`` later than it would be if it ran here."""
    counts, _ = _root_counts(roots, parts, 0, lead)
    own_done = counts[0] * per_root_s
    others_done = max(count * per_root_s for count in counts[1:]) + lag_s
    return ShareEnds(counts[0], own_done, others_done)


@pytest.mark.parametrize("parts", [2, 4])
def test_the_calling_share_learns_to_take_the_remote_lag(parts):
    lead, gaps = 0.0, []
    for _ in range(8):
        ends = ends_of(lead, 100, parts, per_root_s=0.0055, lag_s=0.022)
        gaps.append(ends.others_done_s - ends.own_done_s)
        lead = next_lead(lead, ends)
    assert gaps[0] == pytest.approx(0.022)  # an even split waits the whole lag
    assert abs(gaps[-1]) <= 0.0055  # within one root's time of even ends
    assert 3 <= lead <= 5  # 22 ms of lag is four 5.5 ms roots


def test_a_slower_calling_gpu_gives_roots_away():
    # The calling share ended last: it takes fewer roots next time.
    lead = next_lead(0.0, ShareEnds(own_roots=50, own_done_s=0.40, others_done_s=0.30))
    assert lead < 0
    assert _root_counts(100, 2, 0, lead)[0][0] < 50


def test_a_lead_stays_within_bounds_and_every_part_keeps_roots():
    for roots, parts in [(4, 2), (64, 2), (100, 8), (17, 3)]:
        for lead in (-1e9, -3.0, 0.0, 2.5, 1e9):
            counts, kept = _root_counts(roots, parts, 1, lead)
            assert sum(counts) == roots and min(counts) >= 1
            assert -roots / parts / 2 <= kept <= roots / parts
    assert _root_counts(100, 2, None, 10.0) == ([50, 50], 0.0)  # no share of its own: even
    assert _root_counts(100, 2, 1, 4.0) == ([48, 52], 4.0)


def test_nothing_is_learned_from_a_share_without_roots_or_time():
    assert next_lead(2.0, ShareEnds(0, 0.1, 0.2)) == 2.0
    assert next_lead(2.0, ShareEnds(10, 0.0, 0.2)) == 2.0
