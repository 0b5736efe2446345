"""Checkpoint retention (`train.keep_checkpoints`, jobs/checkpoints.py): which steps the rule keeps given the
evaluations, and pruning real checkpoint folders on disk and in S3 (a real S3 API on loopback), a deletion
cut short included."""

from __future__ import annotations

import pytest

from cluster import storage
from jobs.checkpoints import checkpoint_path, checkpoint_steps, latest_checkpoint, prune_checkpoints, retained


@pytest.mark.parametrize(
    ("steps", "keep", "success", "protect", "kept"),
    [
        ([1, 2, 3, 4], 0, {2: 1.0}, (), {1, 2, 3, 4}),  # 0 keeps all
        ([1, 2, 3, 4, 5, 6], 2, {}, (), {5, 6}),  # no evaluations: the newest K
        ([1, 2, 3, 4, 5, 6], 2, {2: 0.5, 4: 0.75, 6: 0.25}, (), {4, 5, 6}),  # + the best
        ([1, 2, 3, 4, 5, 6], 1, {2: 0.5, 4: 0.5, 5: 0.25}, (), {4, 6}),  # a tie goes to the newer step
        ([1, 2, 3, 4, 5, 6], 2, {6: 0.9, 1: 0.1}, (), {5, 6}),  # the best is among the newest already
        ([2, 4, 6], 1, {3: 0.9, 4: 0.1}, (), {4, 6}),  # step 3 was evaluated, not checkpointed
        ([1, 2, 3, 4], 1, {}, (1, 9), {1, 4}),  # protected (the resumed-from one) if it exists
        ([3], 2, {}, (), {3}),
        ([], 2, {1: 1.0}, (), set()),
    ],
)
def test_the_retention_rule(
    steps: list[int], keep: int, success: dict[int, float], protect: tuple[int, ...], kept: set[int]
) -> None:
    assert retained(steps, keep, success, protect) == kept


def test_a_negative_count_is_named() -> None:
    with pytest.raises(ValueError, match=r"train\.keep_checkpoints must be >= 0"):
        retained([1], -1, {})


@pytest.fixture
def run(storage_root: str) -> str:
    return storage.join(storage_root, "run")


def write_checkpoint(run: str, step: int, complete: bool = True) -> None:
    folder = checkpoint_path(run, step)
    storage.write_text(storage.join(folder, "state", "shard-0"), f"weights of step {step}")
    storage.write_text(storage.join(folder, "trainer.pt"), "x")
    if complete:
        storage.write_text(storage.join(folder, "meta.json"), "{}")


def test_pruning_real_checkpoints(run: str) -> None:
    for step in range(1, 7):
        write_checkpoint(run, step, complete=step != 3)  # step 3: a save (or deletion) that died
    write_checkpoint(run, 7, complete=False)  # newer than the newest whole one: left alone
    assert checkpoint_steps(run) == ([1, 2, 4, 5, 6], [3, 7])
    deleted = prune_checkpoints(run, 1, {2: 0.9, 5: 0.5}, protect={4})
    assert deleted == [1, 3, 5]
    assert checkpoint_steps(run) == ([2, 4, 6], [7])
    assert sorted(storage.list_names(storage.join(run, "checkpoints"))) == ["step_2", "step_4", "step_6", "step_7"]
    assert storage.read_text(storage.join(checkpoint_path(run, 6), "state", "shard-0")) == "weights of step 6"
    assert latest_checkpoint(run) == checkpoint_path(run, 6)
    assert prune_checkpoints(run, 0, {}) == []  # keep all: nothing is touched
    assert prune_checkpoints(run, 3, {2: 0.9}, protect={4}) == []


def test_a_deletion_cut_short_leaves_the_newest_whole(run: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for step in (1, 2, 3):
        write_checkpoint(run, step)
    real_delete = storage.delete

    def dies_on_folders(location: str) -> None:  # meta.json goes, then the process dies
        if not location.endswith("meta.json"):
            raise KeyboardInterrupt("killed mid-delete")
        real_delete(location)

    monkeypatch.setattr(storage, "delete", dies_on_folders)
    with pytest.raises(KeyboardInterrupt):
        prune_checkpoints(run, 1, {})
    monkeypatch.setattr(storage, "delete", real_delete)
    # step_1 lost its meta.json first: it is no checkpoint any more, and the newest is untouched
    assert checkpoint_steps(run) == ([2, 3], [1])
    assert latest_checkpoint(run) == checkpoint_path(run, 3)
    assert sorted(storage.list_names(checkpoint_path(run, 3))) == ["meta.json", "state", "trainer.pt"]
    assert prune_checkpoints(run, 1, {}) == [1, 2]  # the next pruning finishes the job
    assert checkpoint_steps(run) == ([3], [])


def test_latest_checkpoint_counts_only_complete_ones(run: str) -> None:
    assert latest_checkpoint(run) is None
    for step in (1, 2, 10):
        storage.write_text(storage.join(run, "checkpoints", f"step_{step}", "state", "x"), "x")
    for step in (1, 2):  # step_10 lacks meta.json: its save died before the end
        storage.write_text(storage.join(run, "checkpoints", f"step_{step}", "meta.json"), "{}")
    assert latest_checkpoint(run) == storage.join(run, "checkpoints", "step_2")
