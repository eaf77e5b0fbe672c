"""`SettleGroups`: outcomes committed together, at most N of them or T seconds apart."""

from __future__ import annotations

import threading
import time

import pytest

from delivery.settle import SettleGroups


class Commits:
    def __init__(self, fail_on: int | None = None) -> None:
        self.groups: list[list[int]] = []
        self.at: list[float] = []
        self.fail_on = fail_on
        self.errors = 0

    def __call__(self, group: list[int]) -> None:
        if self.fail_on is not None and self.fail_on in group:
            raise RuntimeError(f"cannot commit {self.fail_on}")
        self.groups.append(group)
        self.at.append(time.monotonic())

    def on_error(self) -> None:
        self.errors += 1


def test_a_group_is_committed_once_it_holds_the_most_records_it_may() -> None:
    commits = Commits()
    groups = SettleGroups(commits, commits.on_error, records=5, seconds=60)
    for i in range(12):
        groups.add(i)
    deadline = time.monotonic() + 5
    while len(commits.groups) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    # Two full groups went without waiting for the 60 s bound; the last two wait for close.
    assert commits.groups == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    groups.close(commit=True)
    assert commits.groups[-1] == [10, 11]
    assert [i for g in commits.groups for i in g] == list(range(12))


def test_a_group_is_committed_once_its_oldest_outcome_waited_the_longest_it_may() -> None:
    commits = Commits()
    groups = SettleGroups(commits, commits.on_error, records=50, seconds=0.2)
    added = time.monotonic()
    groups.add(1)
    groups.add(2)
    deadline = added + 5
    while not commits.groups and time.monotonic() < deadline:
        time.sleep(0.01)
    assert commits.groups == [[1, 2]]
    # Not before the bound, and not long after it (generous: the machine may be loaded).
    assert 0.2 <= commits.at[0] - added < 2.0
    groups.close(commit=True)
    assert commits.groups == [[1, 2]]


def test_close_without_commit_drops_what_is_gathered_and_no_commit_follows() -> None:
    commits = Commits()
    groups = SettleGroups(commits, commits.on_error, records=50, seconds=60)
    groups.add(1)
    groups.close(commit=False)
    time.sleep(0.1)
    assert commits.groups == []


def test_a_failed_commit_is_kept_the_rest_dropped_and_the_job_told_at_once() -> None:
    commits = Commits(fail_on=3)
    groups = SettleGroups(commits, commits.on_error, records=2, seconds=60)
    for i in range(8):
        groups.add(i)
    groups.close(commit=True)
    assert commits.groups == [[0, 1]]
    assert commits.errors == 1
    assert isinstance(groups.error, RuntimeError)


def test_outcomes_from_many_threads_are_each_committed_once() -> None:
    commits = Commits()
    groups = SettleGroups(commits, commits.on_error, records=50, seconds=0.2)

    def add(start: int) -> None:
        for i in range(start, start + 500):
            groups.add(i)

    threads = [threading.Thread(target=add, args=(n * 500,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    groups.close(commit=True)
    committed = [i for g in commits.groups for i in g]
    assert sorted(committed) == list(range(4000))
    assert max(len(g) for g in commits.groups) <= 50


@pytest.mark.parametrize("commit", [True, False])
def test_close_returns_only_after_a_commit_in_progress_has_finished(commit: bool) -> None:
    started, release = threading.Event(), threading.Event()
    finished: list[float] = []

    def slow(group: list[int]) -> None:
        started.set()
        release.wait(5)
        finished.append(time.monotonic())

    groups = SettleGroups(slow, lambda: None, records=1, seconds=60)
    groups.add(1)
    assert started.wait(5)
    threading.Timer(0.2, release.set).start()
    groups.close(commit=commit)
    closed = time.monotonic()
    assert finished and finished[0] <= closed


def test_workers_are_held_back_while_two_groups_wait_for_a_slow_commit() -> None:
    """However fast the workers go, what waits uncommitted (what a crash can lose) stays bounded:
    the group being committed and two more."""
    committed = 0
    lock = threading.Lock()

    def slow(group: list[int]) -> None:
        nonlocal committed
        time.sleep(0.05)
        with lock:
            committed += len(group)

    groups = SettleGroups(slow, lambda: None, records=5, seconds=60)
    most = 0
    for i in range(60):
        groups.add(i)
        with lock:
            most = max(most, i + 1 - committed)
    groups.close(commit=True)
    assert committed == 60
    assert most <= 3 * 5, most


def test_close_without_commit_releases_workers_held_back() -> None:
    release = threading.Event()

    def stuck(group: list[int]) -> None:
        release.wait(5)

    groups = SettleGroups(stuck, lambda: None, records=1, seconds=60)
    adder = threading.Thread(target=lambda: [groups.add(i) for i in range(10)])
    adder.start()
    time.sleep(0.2)
    assert adder.is_alive()  # held back: one group in the commit, two waiting
    threading.Timer(0.2, release.set).start()
    groups.close(commit=False)
    adder.join(5)
    assert not adder.is_alive()
