"""PlannedStep's sparse branch plans, with a stand-in collection (no model, no jit):
which plan each batch runs with, when a program is compiled, and the order in which
the next batch's needs are queued (before this step, so the host stays ahead)."""

import logging
import types

from gemjax.train.planned import PlannedStep


class FakeColl:
    """One switched table "t"; a batch's needs are its sparse feature "need" = (x, s)."""

    def __init__(self, log):
        self.log = log

    def has_switches(self):
        return True

    def branch_needs(self, feats):
        self.log.append(("needs", feats["need"]))
        return feats["need"]

    def branch_plan(self, feats, needs):
        return (("t", *needs),)


def batch(x, s):
    return types.SimpleNamespace(sparse={"need": (x, s)}, sequences={})


def make(log, fixed=True):
    def build(plan):
        log.append(("compile", plan))

        def fn(state, b):
            log.append(("run", plan, b.sparse["need"]))
            return state + 1, plan
        return fn
    return PlannedStep(FakeColl(log), {}, build, fixed=fixed)


def test_plans_are_reused_when_they_cover_the_batch(caplog):
    log = []
    step = make(log)
    assert step(0, batch(1, 0))[1] == (("t", 1, 0),)
    assert step(0, batch(0, 0))[1] == (("t", 1, 0),)      # covered: no new program
    assert step.plans == [(("t", 1, 0),)]
    with caplog.at_level(logging.WARNING):
        assert step(0, batch(0, 2))[1] == (("t", 0, 2),)  # sync index 2 > 0: a new one
    assert "sparse branch plan 2" in caplog.text
    assert step(0, batch(1, 1))[1] == (("t", 1, 1),)      # neither covers (1, 1)
    assert len(step.plans) == 3
    assert sum(1 for e in log if e[0] == "compile") == len(step.plans)
    # (0, 1) is covered by (0, 2) and (1, 1), equally small: the first compiled runs;
    # (1, 0) by (1, 0) itself, the smallest of the three covering it
    assert step(0, batch(0, 1))[1] == (("t", 0, 2),)
    assert step(0, batch(1, 0))[1] == (("t", 1, 0),)


def test_next_batch_needs_are_queued_before_the_step():
    log = []
    step = make(log)
    b0, b1, b2 = batch(0, 0), batch(1, 1), batch(2, 2)
    step(0, b0, next_batch=b1)
    assert log == [("needs", (0, 0)), ("needs", (1, 1)), ("compile", (("t", 0, 0),)),
                   ("run", (("t", 0, 0),), (0, 0))]
    log.clear()
    step(0, b1, next_batch=b2)   # b1's plan was made ahead: only b2's needs are asked for
    assert log[0] == ("needs", (2, 2)) and ("needs", (1, 1)) not in log
    assert ("run", (("t", 1, 1),), (1, 1)) in log
    assert log.index(("needs", (2, 2))) < log.index(("run", (("t", 1, 1),), (1, 1)))


def test_without_fixed_branches_one_program():
    log = []
    step = make(log, fixed=False)
    for n in [(0, 0), (3, 3), (1, 0)]:
        assert step(0, batch(*n), next_batch=batch(2, 2))[1] == ()
    assert step.plans == [()] and not any(e[0] == "needs" for e in log)
