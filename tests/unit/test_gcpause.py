"""The cyclic garbage collector is held off while a persist job runs (save/gcpause.py),
and left as the program had it otherwise."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

import ftkit
from ftkit.save.gcpause import gc_paused
from ftkit.tiers.storage import Storage


@pytest.fixture(autouse=True)
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def test_a_persist_runs_with_the_collector_off_and_training_gets_it_back(tmp_path, monkeypatch):
    seen = []
    real = Storage.write_bytes_atomic

    def watching(self, rel, data):  # the manifest's write: inside the persist job
        seen.append(gc.isenabled())
        return real(self, rel, data)

    monkeypatch.setattr(Storage, "write_bytes_atomic", watching)
    state = {"w": torch.arange(6.0)}
    with ftkit.Checkpointer(state, [str(tmp_path)], rng=False) as ck:
        for step in (1, 2):
            ck.snapshot(step)
            ck.wait()
            assert gc.isenabled()  # between jobs, for the training thread
    assert seen and not any(seen)
    assert gc.isenabled()


def test_a_collector_the_program_turned_off_stays_off(tmp_path):
    gc.disable()
    with ftkit.Checkpointer({"w": torch.ones(3)}, [str(tmp_path)], rng=False) as ck:
        ck.snapshot(1)
        ck.wait()
    assert not gc.isenabled()


def test_overlapping_pauses_from_two_threads_resume_once_both_end():
    inside, release = threading.Event(), threading.Event()

    def other():
        with gc_paused():
            inside.set()
            release.wait(10)

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the other thread's pause still holds
    release.set()
    t.join(10)
    assert gc.isenabled()


def test_ftkit_persist_gc_on_leaves_the_collector_alone(monkeypatch):
    monkeypatch.setenv("FTKIT_PERSIST_GC", "on")
    with gc_paused():
        assert gc.isenabled()
