"""The fleet soak's growth check (``benchmarks.fleet_soak.growth``) on samples given here."""

from __future__ import annotations

from benchmarks.fleet_soak import Sample, growth


def samples(rss_mib: list[int], threads: int = 10, found_mib: list[int] | None = None) -> list[Sample]:
    """Samples whose settled RSS is ``rss_mib`` (and, unless given, their RSS as found)."""
    found_mib = rss_mib if found_mib is None else found_mib
    return [
        Sample(
            after_runs=50 * (i + 1),
            phase="soak",
            at_s=float(i),
            window_runs=50,
            rss_kib=found * 1024,
            rss_settled_kib=mib * 1024,
            threads_active=threads,
            threads=threads,
            fds=20,
            peak={},
            scheduler={},
        )
        for i, (mib, found) in enumerate(zip(rss_mib, found_mib))
    ]


def test_rss_on_a_saw_tooth_passes_though_its_last_sample_is_above_its_first():
    # The 400-run soak's samples: the end points differ by +14.5 %, the halves' medians do not.
    checked = growth(
        samples([143, 165, 212, 197, 172, 173, 171, 174, 189]), warmup=50, limit=0.1, rss_limit=0.1
    )
    assert checked["figures"]["rss_settled_kib"]["growth"] > 0.1
    assert checked["rss_halves"]["growth"] < 0
    assert checked["exceeded"] == []


def test_freed_memory_the_allocator_keeps_is_shown_not_checked():
    # A 260-run soak's RSS as found (+14 % between these halves' medians), while what the
    # process holds once collected and trimmed stays level.
    found = [145, 171, 218, 181, 218, 186, 195]
    checked = growth(
        samples([140, 141, 142, 140, 141, 142, 141], found_mib=found), warmup=10, limit=0.1, rss_limit=0.1
    )
    assert checked["figures"]["rss_kib"]["growth"] > 0.1
    assert checked["exceeded"] == []


def test_rss_growing_steadily_by_half_as_much_again_as_the_limit_fails():
    # After the warm-up: 200 MiB rising steadily to 230 MiB, +15 % end to end.
    checked = growth(samples([150, 200, 205, 210, 215, 220, 225, 230]), warmup=50, limit=0.1, rss_limit=0.1)
    assert checked["figures"]["rss_settled_kib"]["growth"] == 0.15
    assert checked["exceeded"] == ["rss_settled_kib"]


def test_with_fewer_than_four_samples_the_end_points_are_checked():
    checked = growth(samples([150, 165, 190]), warmup=50, limit=0.1, rss_limit=0.1)
    assert checked["rss_halves"] is None
    assert checked["exceeded"] == ["rss_settled_kib"]


def test_other_figures_are_still_checked_end_to_end():
    grown = samples([150, 150, 150, 150, 150])
    grown[-1].threads_active = 20
    assert "threads_active" in growth(grown, warmup=50, limit=0.1, rss_limit=0.1)["exceeded"]


def test_a_few_open_files_caught_in_passing_are_not_growth_but_a_leak_per_run_is():
    # The short soak's end points once: 64 -> 71 open files, +10.9 %, within the slack.
    passing = samples([150, 150, 150, 150, 150])
    passing[0].fds, passing[-1].fds = 64, 71
    assert growth(passing, warmup=0, limit=0.1, rss_limit=0.1)["exceeded"] == []
    # One file a run kept over 20 runs is.
    leaking = samples([150, 150, 150, 150, 150])
    leaking[0].fds, leaking[-1].fds = 64, 84
    assert growth(leaking, warmup=0, limit=0.1, rss_limit=0.1)["exceeded"] == ["fds"]


def test_artifact_rows_vary_with_timing_but_may_not_outnumber_the_task_runs():
    # Live tables: one per task run, or one for several that ended together; 3 at the end.
    varying = samples([150, 150, 150, 150, 150])
    for sample, artifacts in zip(varying, (8.4, 3.4, 4.9, 4.3, 6.25)):
        sample.rows_per_run = {"task_run": 6.2, "artifact": artifacts}
    assert growth(varying, warmup=50, limit=0.1, rss_limit=0.1)["exceeded"] == []
    varying[-1].rows_per_run = {"task_run": 6.2, "artifact": 12.4}  # two tables a task run
    assert growth(varying, warmup=50, limit=0.1, rss_limit=0.1)["exceeded"] == ["rows_per_run.artifact"]


def test_rows_per_run_are_compared_within_the_first_windows_phase():
    # A short concurrent window after the sequential ones: a third of its runs faulty,
    # a quarter of the others', so more events a run; not growth.
    mixed = samples([150, 150, 150, 150, 150])
    for sample, events in zip(mixed, (30.5, 30.3, 30.4, 30.5, 32.8)):
        sample.rows_per_run = {"events": events}
    mixed[-1].phase = "concurrent"
    checked = growth(mixed, warmup=0, limit=0.05, rss_limit=0.1)
    assert checked["rows_last"] == mixed[-2].after_runs
    assert checked["figures"]["rows_per_run.events"]["last"] == 30.5
    assert checked["exceeded"] == []
    # Growth within the phase still fails.
    mixed[-2].rows_per_run = {"events": 32.8}
    assert growth(mixed, warmup=0, limit=0.05, rss_limit=0.1)["exceeded"] == ["rows_per_run.events"]
