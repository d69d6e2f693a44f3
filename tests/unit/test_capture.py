"""State capture: what can be stored without pickle, and exact round trips."""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest
import torch

from ftkit.errors import CaptureError, StateMismatchError
from ftkit.save.capture import apply, capture, decode
from ftkit.save.rng import rng_state, set_rng_state


def test_skeleton_round_trips_types_json_cannot_express():
    value = {
        "tuple": (1, 2.5, "x"),
        3: [None, True],
        "inf": float("inf"),
        "nan": float("nan"),
        "$tensor": "not a tensor",
        "nested": {"t": torch.arange(3)},
        "size": torch.Size([2, 3]),
    }
    cs = capture({"v": value}, rng=False)
    names = dict(cs.tensors)
    out = decode(cs.skeleton["entries"]["v"]["value"], names)
    assert out["tuple"] == (1, 2.5, "x") and out[3] == [None, True]
    assert out["inf"] == math.inf and math.isnan(out["nan"])
    assert out["$tensor"] == "not a tensor"
    assert torch.equal(out["nested"]["t"], torch.arange(3))
    assert out["size"] == (2, 3)
    assert list(names) == ["v/nested/t"]


def test_lambda_in_state_is_refused_naming_the_key():
    with pytest.raises(CaptureError, match=r"'extra/hook'.*function.*pickle"):
        capture({"extra": {"hook": lambda x: x}}, rng=False)


def test_arbitrary_object_is_refused_naming_the_key():
    class Thing:
        pass

    with pytest.raises(CaptureError, match=r"'cfg/1'"):
        capture({"cfg": [1, Thing()]}, rng=False)


def test_numpy_arrays_round_trip_or_are_refused_naming_the_key():
    """A big-endian array is stored with its values (in this machine's byte order); an array
    torch has no dtype for (strings, datetimes) is a CaptureError naming its key."""
    big = np.arange(6, dtype=">f4").reshape(2, 3)
    cs = capture({"data": {"big": big}}, rng=False)
    out = decode(cs.skeleton["entries"]["data"]["value"], dict(cs.tensors))
    assert out["big"].dtype == np.float32 and np.array_equal(out["big"], big)
    for bad in (np.array(["a", "b"]), np.array(["2026-12-04"], dtype="datetime64[D]")):
        with pytest.raises(CaptureError, match=rf"'data/labels'.*numpy {re.escape(str(bad.dtype))}"):
            capture({"data": {"labels": bad}}, rng=False)


def test_optimizer_state_keeps_int_keys_and_tuples():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], betas=(0.8, 0.9))
    p.grad = torch.ones(3)
    opt.step()
    cs = capture({"optim": opt}, rng=False)
    sd = decode(cs.skeleton["entries"]["optim"]["value"], dict(cs.tensors))
    assert list(sd["state"]) == [0]
    assert sd["param_groups"][0]["betas"] == (0.8, 0.9)


def test_rng_state_round_trip_draws_the_same_numbers():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    saved = capture({}, rng=True)
    expect = (random.random(), np.random.rand(), torch.rand(2))
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    set_rng_state(decode(saved.rng, dict(saved.tensors)))
    got = (random.random(), np.random.rand(), torch.rand(2))
    assert expect[0] == got[0] and expect[1] == got[1] and torch.equal(expect[2], got[2])
    assert "numpy" in rng_state()


def test_apply_checks_everything_before_changing_anything():
    a = {"w": torch.zeros(2, 3), "m": torch.nn.Linear(3, 2), "n": 1}
    cs = capture({"w": torch.ones(2, 3), "m": torch.nn.Linear(4, 2), "n": 5}, rng=False)
    before = a["m"].weight.clone()
    with pytest.raises(StateMismatchError, match=r"m/weight: shape \(2, 4\) in checkpoint, \(2, 3\) live"):
        apply(a, cs.skeleton, dict(cs.tensors))
    assert torch.equal(a["w"], torch.zeros(2, 3)) and torch.equal(a["m"].weight, before) and a["n"] == 1


def test_apply_names_missing_and_unexpected_module_keys():
    cs = capture({"m": torch.nn.Sequential(torch.nn.Linear(2, 2))}, rng=False)
    live = {"m": torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))}
    with pytest.raises(StateMismatchError, match=r"keys missing from checkpoint: 1.weight, 1.bias"):
        apply(live, cs.skeleton, dict(cs.tensors))


def test_rng_state_in_the_format_1_form_still_restores():
    import random

    version, internal, gauss = random.getstate()
    old_form = {"python": (version, list(internal), gauss)}  # how format version 1 decoded it
    expected = [random.random() for _ in range(3)]
    random.seed(12345)
    set_rng_state(old_form)
    assert [random.random() for _ in range(3)] == expected
