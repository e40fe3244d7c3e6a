"""The adaptive policy's shared parts (core/tally.py): one decaying tally, one back-off schedule,
and a decision that says why."""

import pytest

from macspec.core.tally import Backoff, Decision, Tally
from macspec.core.tree import TreeShape


def test_a_tally_decays_older_adds():
    t = Tally(0.5)
    assert t.mean == float("inf")  # nothing counted yet
    t.add(1.0, 2.0)
    t.add(3.0, 2.0)
    assert (t.total, t.count, t.rounds, t.runs) == (3.5, 3.0, 1.5, 2)
    assert t.mean == pytest.approx(3.5 / 3.0)
    t.fade(2)  # two adds of nothing: each side a quarter, the ratio kept
    assert (t.total, t.count, t.runs) == (0.875, 0.75, 2) and t.mean == pytest.approx(3.5 / 3.0)


def stretches(backoff: Backoff, rounds: int, wins: bool = False) -> list[int]:
    """Rounds given up between probes, where every probe loses (or, with `wins`, the first
    one wins and the choice then loses again)."""
    out, given, won = [], 0, False
    for _ in range(rounds):
        if backoff.resting:
            backoff.skip()
            given += 1
        elif backoff.probe():
            out.append(given + 1)  # (the losing round that started the stretch)
            assert backoff.waited == given + 1
            given = 0
            if wins and not won:
                backoff.win()
                won = True
        else:
            backoff.lose()
    return out


def test_a_backoff_doubles_its_wait_up_to_the_cap():
    assert stretches(Backoff(2, 8), 60)[:6] == [2, 4, 8, 8, 8, 8]


def test_a_win_starts_the_wait_afresh():
    assert stretches(Backoff(2, 8), 20, wins=True) == [2, 2, 4, 8]


def test_a_backoff_is_resting_until_its_probe_is_due():
    b = Backoff(3, 32)
    assert not b.resting and not b.probe()  # nothing lost: no probe due
    b.lose()
    assert b.resting and not b.due
    b.skip()
    b.skip()
    assert not b.resting and b.due and b.probe() and not b.due


def test_a_decision_reads_as_what_ran_and_why():
    assert str(Decision(0, "priced below plain", "model K=2: expected 0.83x plain")) == (
        "plain: priced below plain (model K=2: expected 0.83x plain)"
    )
    assert str(Decision(3, "priced to pay")) == "K=3: priced to pay"
    tree = Decision(TreeShape(3, 2, 8), "tree probe")
    assert str(tree) == "tree 8 nodes: tree probe" and not tree.plain
    assert Decision(0, "nothing to propose").plain
