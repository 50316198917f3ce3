"""Faults: a rank killed mid-step, a rank that never joins, a hung collective -- every other rank
stops on its own within the configured timeout, naming the cause, and the run reports each rank's
fate (never a hang). Checkpoints: a process killed while saving leaves the previous checkpoint
loadable; a training script resumes from the last full checkpoint on another number of ranks and
ends exactly where uninterrupted single-device training does. Security: checkpoints carrying
pickled code are refused without running it; plans are JSON text; every ``torch.load`` in hapc
uses ``weights_only=True``.

The proof that nothing hangs is structural, not a stopwatch: the surviving ranks *report* an error
(they are not among the ranks the harness had to kill), and the error is the collective timeout or
the lost peer.
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import pathlib
import signal
import time
from pathlib import Path

import pytest
import torch
from harness import assert_close

import hapc
from hapc import models
from hapc.errors import DistributedRunError, HapcError
from hapc.testing import cluster_of, run_distributed

F64 = torch.float64
CLUSTER3 = cluster_of([3e9, 2e9, 1e9])
LOST_PEER = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Read error",
    "remote worker crashing",
    "Timed out",
    "timed out",
)


@pytest.fixture(scope="module")
def plan3():
    model, inputs = models.load("mlp", dtype=F64)
    return hapc.synthesize(model, CLUSTER3, inputs)


# -- a rank dies, never joins, or hangs --------------------------------------------------------------


def _killed_mid_step(rank, world, plan):
    model, inputs = models.load("mlp", dtype=F64)
    m = hapc.compile(model, CLUSTER3, inputs, plan=plan)
    loss = m(*inputs)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # between forward and backward
    loss.backward()
    return float(loss)


def test_a_rank_killed_mid_step_stops_the_others(plan3):
    with pytest.raises(DistributedRunError) as err:
        run_distributed(_killed_mid_step, 3, plan3, timeout=10)
    e = err.value
    assert e.died == {1: -signal.SIGKILL} and e.hung == []
    assert set(e.errors) == {0, 2}  # the survivors raised by themselves
    assert all(any(s in msg for s in LOST_PEER) for msg in e.errors.values()), e.errors
    assert "rank 1 died (killed by SIGKILL)" in str(e)


def _joins(rank, world):
    return rank


def test_a_rank_that_never_joins_times_out_the_rendezvous():
    with pytest.raises(DistributedRunError) as err:
        run_distributed(_joins, 3, timeout=3, absent=[2])
    e = err.value
    assert e.absent == [2] and e.hung == [] and e.died == {}
    assert set(e.errors) == {0, 1}
    assert all("timeout" in e.errors[r].lower() for r in (0, 1))  # both gave up waiting at the rendezvous
    assert "rank 2 was never started" in str(e)  # and the harness says who is missing


def _hung_collective(rank, world, plan, flag_dir):
    model, inputs = models.load("mlp", dtype=F64)
    # the job's own timeout is long (60 s); hapc's collectives give up after 3
    m = hapc.compile(model, CLUSTER3, inputs, plan=plan, timeout=3)
    loss = m(*inputs)
    flags = Path(flag_dir)
    if rank == 1:  # stuck outside the collective until the others have given up
        while len(list(flags.iterdir())) < world - 1:
            time.sleep(0.05)
        return "resumed"
    try:
        loss.backward()
        return float(loss)
    finally:
        (flags / str(rank)).touch()


def test_a_hung_collective_times_out_on_the_other_ranks(plan3, tmp_path):
    with pytest.raises(DistributedRunError) as err:
        run_distributed(_hung_collective, 3, plan3, str(tmp_path), timeout=60)
    e = err.value
    assert e.hung == [] and e.died == {}
    assert set(e.errors) == {0, 2}
    # the first rank to give up says so; a peer whose pending operation shared the pair may
    # instead see gloo close the pair "caused by" that timeout
    assert any("Timed out waiting 3000ms" in msg for msg in e.errors.values()), e.errors
    assert all("Timed out waiting 3000ms" in msg or "Application timeout" in msg for msg in e.errors.values())


def _sleeps(rank, world):
    if rank == 1:
        time.sleep(3600)
    return rank


def test_the_harness_reports_and_kills_a_rank_that_never_returns():
    with pytest.raises(DistributedRunError) as err:
        run_distributed(_sleeps, 2, timeout=1, grace=2)
    assert err.value.hung == [1] and set(err.value.errors) == set()
    assert "rank 1 hung: still running after 3s (timeout + grace); killed" in str(err.value)


def test_compile_timeout_must_be_positive():
    with pytest.raises(DistributedRunError, match="timeout must be a positive number of seconds"):
        run_distributed(_compile_with_timeout, 2, timeout=20)


def _compile_with_timeout(rank, world):
    model, inputs = models.load("mlp")
    hapc.compile(model, cluster_of([1e9, 1e9]), inputs, timeout=0)


def _slow_planner(rank, world):
    import hapc.api

    if rank == 0:  # planning outlasts the plan broadcast's timeout (a search of minutes)
        real = hapc.api.choose_plan

        def slow(*args, **kwargs):
            time.sleep(6)
            return real(*args, **kwargs)

        hapc.api.choose_plan = slow
    model, inputs = models.load("mlp")
    hapc.compile(model, cluster_of([1e9, 1e9]), inputs, timeout=2)


def test_a_rank_waiting_past_the_timeout_for_the_plan_is_told_why_and_the_fixes():
    with pytest.raises(DistributedRunError) as err:
        run_distributed(_slow_planner, 2, timeout=30)
    assert 1 in err.value.errors and not err.value.hung
    message = err.value.errors[1]
    assert "HapcError: rank 0 did not send the plan within the process group's timeout" in message
    for fix in ("time_limit=", "timeout=", "plan='plan.json'"):
        assert fix in message


def _root_fails(rank, world, what):
    from hapc._util import broadcast_json
    from hapc.errors import TraceError

    def make():
        if what == "hapc":
            raise TraceError("the model's forward must return the training loss")
        raise ValueError("a bug in the planner")

    try:
        broadcast_json(make)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "returned", ""


@pytest.mark.parametrize("what", ["hapc", "other"])
def test_an_error_preparing_the_plan_on_rank_0_is_raised_on_every_rank(what):
    # not gloo's "Connection closed by peer" on the others once rank 0 has raised and exited
    got = run_distributed(_root_fails, 3, what, timeout=30)
    if what == "hapc":  # every rank: the same class and message
        assert got == [("TraceError", "the model's forward must return the training loss")] * 3
    else:  # rank 0: its own exception; the others: a HapcError naming it
        assert got[0] == ("ValueError", "a bug in the planner")
        for name, message in got[1:]:
            assert name == "HapcError" and "rank 0 failed" in message and "ValueError: a bug in the planner" in message


def _compile_no_loss(rank, world):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))  # returns logits, not a loss
    try:
        hapc.compile(model, cluster_of([2e9, 1e9, 1e9]), (torch.randn(6, 8),), pipeline=True)
    except HapcError as exc:
        return type(exc).__name__
    return "compiled"


def test_a_model_rank_0_cannot_trace_is_refused_on_every_rank_of_a_pipeline():
    assert run_distributed(_compile_no_loss, 3, timeout=60) == ["TraceError"] * 3


# -- checkpoints --------------------------------------------------------------------------------------


def _save_and_die(path: str, where: str) -> None:
    if where == "before rename":

        def rename(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        os.replace = rename  # this child only: the new file is complete, the rename never happens
    else:
        real = torch.save

        def half(obj, f, *args, **kwargs):
            real(obj, f, *args, **kwargs)
            f.flush()
            f.truncate(f.tell() // 2)  # half written
            os.kill(os.getpid(), signal.SIGKILL)

        torch.save = half
    hapc.checkpoint.save({"model": {"w": torch.zeros(1000, dtype=F64)}, "step": 2}, path)


@pytest.mark.parametrize("where", ["mid-write", "before rename"])
def test_a_process_killed_while_saving_leaves_the_previous_checkpoint(tmp_path, where):
    path = tmp_path / "ckpt.pt"
    hapc.checkpoint.save({"model": {"w": torch.ones(1000, dtype=F64)}, "step": 1}, path)
    child = multiprocessing.get_context("fork").Process(target=_save_and_die, args=(str(path), where))
    child.start()
    child.join(30)
    assert child.exitcode == -signal.SIGKILL  # it really died inside save
    state = hapc.checkpoint.load(path)
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.ones(1000, dtype=F64))
    leftovers = [p for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".ckpt.pt.")  # the dead writer's temporary
    if where == "mid-write":  # the half-written temporary is refused, never mistaken for a checkpoint
        with pytest.raises(HapcError, match="not a readable hapc checkpoint"):
            hapc.checkpoint.load(leftovers[0])


STEPS = 4


def _train(rank, world, cluster, plan, path, crash_at):
    """A training script: resume from ``path`` if it exists, save a full checkpoint after every
    step; rank 2 is killed during step ``crash_at``."""
    model, inputs = models.load("mlp", dtype=F64)
    m = hapc.compile(model, cluster, inputs, plan=plan, timeout=5)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2, eps=1e-6)
    start = 0
    if os.path.exists(path):
        state = hapc.checkpoint.load(path)
        m.load_full_state_dict(state, opt)
        start = state["step"]
    for step in range(start, STEPS):
        opt.zero_grad()
        loss = m(*inputs)
        if step == crash_at and rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        state = m.full_state_dict(opt)
        state["step"] = step + 1
        if rank == 0:
            hapc.checkpoint.save(state, path)
    return start, m.full_state_dict(opt)


def test_training_resumes_from_the_last_full_checkpoint_on_fewer_ranks(plan3, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    with pytest.raises(DistributedRunError) as err:
        run_distributed(_train, 3, CLUSTER3, plan3, path, 2, timeout=10)
    assert err.value.died == {2: -signal.SIGKILL} and err.value.hung == []
    assert hapc.checkpoint.load(path)["step"] == 2  # steps 0 and 1 were saved, step 2 never finished

    two = cluster_of([1e9, 1e9])
    model, inputs = models.load("mlp", dtype=F64)
    plan2 = hapc.synthesize(model, two, inputs)
    resumed = run_distributed(_train, 2, two, plan2, path, -1, timeout=30)

    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-6)
    for _ in range(STEPS):  # uninterrupted single-device training
        opt.zero_grad()
        model(*inputs).backward()
        opt.step()
    want = hapc.checkpoint.full_state(model, opt)
    for start, state in resumed:
        assert start == 2
        assert_close(state, want, F64, "resumed")


# -- security ----------------------------------------------------------------------------------------


class _Touch:
    """Unpickling this would create a file: the marker of pickled code running."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.path),))


def test_a_checkpoint_carrying_pickled_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "evil.pt"
    torch.save({"model": {"w": torch.ones(2)}, "extra": _Touch(str(marker))}, path)
    with pytest.raises(HapcError) as err:
        hapc.checkpoint.load(path)
    assert "pickled objects other than tensors" in str(err.value) and "weights_only=True" in str(err.value)
    assert not marker.exists()


def test_every_torch_load_in_hapc_is_weights_only():
    """Static check of the package: ``torch.load`` always with ``weights_only=True``; no
    ``pickle.load(s)`` anywhere (plans and cluster files are parsed as JSON / TOML)."""
    calls = []
    for file in Path(hapc.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            where = f"{file.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                kw = {k.arg: k.value for k in node.keywords}
                assert "weights_only" in kw and ast.literal_eval(kw["weights_only"]) is True, where
                calls.append(where)
            if isinstance(node, ast.Attribute):
                assert ast.unparse(node) not in ("pickle.load", "pickle.loads", "pickle.Unpickler"), where
    assert len(calls) >= 2, calls  # checkpoint.load and run_distributed's results
