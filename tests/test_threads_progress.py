"""Threads, workers and progress: --threads / num_workers: auto pick from the machine, progress refreshes by time."""
from __future__ import annotations

import os

import pytest
import torch

from vispe.data import loading
from vispe.recipes import recipe_path
from vispe.train_cli import TimedProgressBar, apply_threads, checkpoint_finished


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_threads_option_sets_torch_threads_and_refuses_bad_values(restore_threads):
    assert apply_threads(1) == 1 and torch.get_num_threads() == 1
    assert apply_threads("1") == 1
    assert apply_threads(None) == torch.get_num_threads()  # null: left as it is
    assert 1 <= apply_threads("auto") == torch.get_num_threads() <= loading._cores()
    for bad in (0, -2, "many", True):
        with pytest.raises(ValueError, match=r"--threads=.* is not valid; give a number >= 1, 'auto' or null"):
            apply_threads(bad)


def test_auto_threads_and_workers_follow_cores_load_and_processes(monkeypatch):
    monkeypatch.setattr(loading, "_cores", lambda: 8)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("LT_DEVICES", raising=False)
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))  # only this process
    assert loading.auto_threads() == 8 and loading.auto_num_workers() == 4
    monkeypatch.setattr(os, "getloadavg", lambda: (6.5, 6.0, 6.0))  # five other busy cores
    assert loading.auto_threads() == 2
    monkeypatch.setattr(os, "getloadavg", lambda: (30.0, 30.0, 30.0))
    assert loading.auto_threads() == 1
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 4 processes share the 8 cores
    assert loading.auto_threads() == 2 and loading.auto_num_workers() == 1
    monkeypatch.setattr(loading, "_cores", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert loading.auto_threads() == 1 and loading.auto_num_workers() == 0
    assert loading.resolve_num_workers("auto") == 0 and loading.resolve_num_workers(3) == 3
    with pytest.raises(ValueError, match=r"num_workers must be >= 0 .* or 'auto', got 'four'"):
        loading.resolve_num_workers("four")


def test_cpu_recipes_use_one_thread_as_the_docs_timings_did():
    import yaml

    for name in ("cifar10_cpu", "fashion_mnist", "smoke", "synthetic_tiny"):
        assert yaml.safe_load(recipe_path(name).read_text())["threads"] == 1, name
    assert yaml.safe_load(recipe_path("cifar10").read_text())["threads"] == "auto"


def test_progress_bar_refreshes_by_time(monkeypatch):
    import time

    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    bar = TimedProgressBar(interval=5.0)
    assert bar._should_update(1, 390)  # the first batch shows at once
    now[0] += 1.0
    assert not bar._should_update(2, 390)
    now[0] += 4.5  # a slow step: shown 5 s after the last refresh, whatever the batch count
    assert bar._should_update(3, 390)
    assert bar._should_update(390, 390)  # and at the end of the loop


def test_checkpoint_finished_follows_the_fit_loop_rule():
    ckpt = {"global_step": 12, "loops": {"fit_loop": {"epoch_progress": {"current": {"processed": 3}}}}}
    assert checkpoint_finished(ckpt, 3, -1) == "epoch 3 of max_epochs=3"
    assert checkpoint_finished(ckpt, 4, -1) is None  # more epochs asked: it trains further
    assert checkpoint_finished(ckpt, None, 12) == "step 12 of max_steps=12"
    assert checkpoint_finished(ckpt, None, 20) is None
    assert checkpoint_finished({"global_step": 5}, 3, -1) is None  # no loop state: not known to be finished


def test_row_progress_live_quiet_and_log_forms(monkeypatch):
    import io
    import time

    from vispe.progress import RowProgress, format_seconds

    now = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    assert format_seconds(83.4) == "1:23" and format_seconds(3725) == "1:02:05"

    def run(**kw) -> str:
        out = io.StringIO()
        p = RowProgress(3, 4, stream=out, **kw)
        p.skip_row()  # a reused result: two rows of work
        for label in ("a", "b"):
            p.start_row(label)
            for _ in range(4):
                now[0] += 10.0
                p.step()
            p.end_row()
        return out.getvalue()

    live = run(live=True)
    assert "row 1/2 a: 1/4 batches, 0:10 elapsed, ETA 1:10" in live  # 1 of 8 batches in 10 s: 70 s to go
    assert "row 2/2 b: done in 0:40, 1:20 elapsed, ETA 0:00" in live
    log = run(live=False)  # not a terminal (a log, CI): one line per row
    assert log.splitlines() == ["row 1/2 a: done in 0:40, 0:40 elapsed, ETA 0:40", "row 2/2 b: done in 0:40, 1:20 elapsed, ETA 0:00"]
    assert run(live=True, quiet=True) == ""
