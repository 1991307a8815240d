"""Guard 1 per policy: a workflow's dispatch is bounded by every running policy's window."""

from __future__ import annotations

import pytest

from broker.schema import ControlRecord
from consumers.admission import Admission
from consumers.turns import Turns


def _record(kind: str, policy: str, version: int, consumed: int) -> ControlRecord:
    return ControlRecord(kind=kind, run="r", policy=policy, version=version, groups_consumed=consumed)


def test_the_slowest_trainer_bounds_the_dispatch() -> None:
    # solver: η = 4, 8 groups per step → 40; verifier: η = 1, 8 per step → 16.
    admission = Admission({"solver": 40, "verifier": 16})
    assert admission.free(0) == 16 and admission.window == 16
    admission.observe(_record("version", "solver", 3, consumed=24))
    assert admission.free(16) == 0  # the verifier has consumed nothing: its 16 are all in flight
    admission.observe(_record("version", "verifier", 1, consumed=8))
    assert admission.free(16) == 8
    assert admission.in_flight(16) == {"solver": -8, "verifier": 8}
    assert admission.consumed == 8
    # The solver's window binds once it lags: 40 in flight for it.
    assert admission.free(64) == 0
    admission.observe(_record("version", "verifier", 5, consumed=60))
    assert admission.free(64) == 0  # solver: 64 − 24 = 40 in flight, its whole window
    admission.observe(_record("version", "solver", 4, consumed=32))
    assert admission.free(64) == 8


def test_a_finished_policy_no_longer_bounds_the_others() -> None:
    admission = Admission({"solver": 10, "verifier": 10})
    admission.observe(_record("finished", "solver", 7, consumed=10))
    assert not admission.all_finished
    admission.observe(_record("version", "verifier", 2, consumed=30))
    assert admission.free(35) == 5  # only the verifier counts now
    assert admission.consumed == 30
    admission.observe(_record("finished", "verifier", 9, consumed=40))
    assert admission.all_finished and admission.free(40) == 0


def test_records_of_other_policies_and_old_counts_are_ignored() -> None:
    admission = Admission({"solver": 4})
    admission.observe(_record("version", "someone-else", 9, consumed=100))
    assert admission.free(0) == 4
    admission.observe(_record("version", "solver", 3, consumed=4))
    admission.observe(_record("version", "solver", 2, consumed=2))  # an older announcement read late
    assert admission.free(4) == 4
    assert admission.dispatch_versions() == {"solver": 3}


def test_windows_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least one policy"):
        Admission({})
    with pytest.raises(ValueError, match="at least 1"):
        Admission({"a": 0})


def test_alternating_policies_take_turns_in_order() -> None:
    turns = Turns(["solver", "verifier"], steps=25)
    assert turns.active({}, set()) == "solver"
    assert turns.active({"solver": 24, "verifier": 0}, set()) == "solver"
    assert turns.active({"solver": 25, "verifier": 0}, set()) == "verifier"
    assert turns.active({"solver": 25, "verifier": 25}, set()) == "solver"
    assert turns.active({"solver": 50, "verifier": 25}, {"verifier"}) == "solver"  # the other one finished
    assert turns.active({"solver": 50, "verifier": 25}, {"solver", "verifier"}) is None
    with pytest.raises(ValueError, match="at least 1"):
        Turns(["a"], steps=0)


def test_only_the_active_policy_bounds_dispatch_when_they_alternate() -> None:
    admission = Admission({"solver": 16, "verifier": 16}, Turns(["solver", "verifier"], steps=2))
    admission.observe(_record("version", "solver", 2, consumed=64))
    # The verifier's turn: its 16 in flight fill its window, however far the solver got.
    assert admission.free(16) == 0
    admission.observe(_record("version", "verifier", 1, consumed=8))
    assert admission.free(16) == 8
    admission.observe(_record("version", "verifier", 2, consumed=16))
    # The solver's turn again: only its window counts (64 consumed of 70 dispatched).
    assert admission.free(70) == 10
