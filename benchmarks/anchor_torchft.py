#!/usr/bin/env python
"""torchft 0.2.0: recovery from a SIGKILLed replica, on CPU, with ftkit's reference model.

    .venv/bin/python benchmarks/anchor_torchft.py [--steps 60] [--kill-at 20] [--step-time 0.1] \
        [--sync-quorum --transfer-rng] [--json FILE]

Part of bench_anchors.py (part 3, through anchor_recovery.py); runs alone too.

Two replica groups of one process each (torchft ProcessGroupGloo), a torchft
lighthouse on loopback (min_replicas=1, short join timeout), ftkit's reference
trainer (ftkit.drill.reference: build / batch_for / train_step; the batch for
step N on replica r is batch_for(N, seed, rank=r)). Gradients are averaged with
manager.allreduce (one flat tensor, ReduceOp.AVG); the optimizer step goes
through torchft's OptimizerWrapper (manager.should_commit) and the LR schedule
only steps on committed steps. Each replica appends one JSON line per event
(commit/discard/quorum/heal...) to a log the parent tails.

Runs: (1) fault-free, (2) SIGKILL replica 1 after it commits --kill-at and
relaunch it at once (a new interpreter, same replica_id prefix; torchft adds a
uuid), healing live from the survivor over torchft's HTTP checkpoint transport.

Every child is started in its own process group and killed in `finally`.
"""

from __future__ import annotations

import time

_T_PROC = time.time()  # process start (before heavy imports), for the relaunch's start-up figure

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402

HERE = os.path.abspath(__file__)
FTKIT_ROOT = os.path.dirname(os.path.dirname(HERE))  # the repository


# ----------------------------------------------------------------------------- replica (child)


def replica_main(a: argparse.Namespace) -> int:
    import logging
    from datetime import timedelta

    import torch

    if FTKIT_ROOT not in sys.path:
        sys.path.insert(0, FTKIT_ROOT)
    from torch.distributed import TCPStore
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    from ftkit.drill.reference import build, train_step

    t_imported = time.time()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    rid = a.replica

    logf = open(a.log, "a", buffering=1)

    def emit(ev: str, **kw) -> None:
        kw.update(ev=ev, replica=rid, inc=a.incarnation, pid=os.getpid(), t=kw.get("t", time.time()))
        logf.write(json.dumps(kw) + "\n")
        logf.flush()

    emit("proc_start", t=_T_PROC)
    emit("imported", t=t_imported)

    model, raw_opt, raw_sched = build(a.seed)
    emit("built")

    # torchft requires a TCPStore per replica group; one process per group, so host it here.
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=a.pg_timeout))

    def state_dict():
        return {"model": model.state_dict(), "optim": raw_opt.state_dict(), "sched": raw_sched.state_dict()}

    def load_state_dict(sd):
        model.load_state_dict(sd["model"])
        raw_opt.load_state_dict(sd["optim"])
        raw_sched.load_state_dict(sd["sched"])

    manager = Manager(
        pg=pg,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        use_async_quorum=not a.sync_quorum,
        timeout=timedelta(seconds=a.timeout),
        quorum_timeout=timedelta(seconds=a.quorum_timeout),
        connect_timeout=timedelta(seconds=10),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=a.lighthouse,
        replica_id=f"replica_{rid}",
        hostname="127.0.0.1",
        init_sync=False,  # build(seed) gives identical weights everywhere
    )

    if a.transfer_rng:  # off by default: torchft transfers only what the user registers
        manager.register_state_dict_fn("rng", torch.set_rng_state, torch.get_rng_state)

    # --- instrumentation only: time torchft's internal phases (no change to behaviour)
    class _TimedClient:
        def __init__(self, inner):
            self._inner = inner

        def _quorum(self, **kw):
            t0 = time.time()
            q = self._inner._quorum(**kw)
            emit(
                "quorum",
                t0=t0,
                t=time.time(),
                my_step=kw.get("step"),
                quorum_id=q.quorum_id,
                replica_rank=q.replica_rank,
                replica_world_size=q.replica_world_size,
                max_step=q.max_step,
                max_world_size=q.max_world_size,
                heal=q.heal,
                recover_dst=list(q.recover_dst_replica_ranks),
                replica_ids=list(q.replica_ids),
            )
            return q

        def __getattr__(self, name):
            return getattr(self._inner, name)

    manager._client = _TimedClient(manager._client)
    tr = manager._checkpoint_transport
    _recv, _send = tr.recv_checkpoint, tr.send_checkpoint

    def _timed_recv(**kw):
        t0 = time.time()
        out = _recv(**kw)
        emit("heal_recv", t0=t0, t=time.time(), step=kw.get("step"))
        return out

    def _timed_send(**kw):
        t0 = time.time()
        out = _send(**kw)
        emit("heal_send", t0=t0, t=time.time(), step=kw.get("step"), dst=list(kw.get("dst_ranks", [])))
        return out

    tr.recv_checkpoint, tr.send_checkpoint = _timed_recv, _timed_send

    # --- torchft's optimizer wrapper; quorum is started at the top of the step (what
    # OptimizerWrapper.zero_grad does) because train_step zero-grads after its forward.
    class _Opt(OptimizerWrapper):
        committed = False

        def zero_grad(self, set_to_none: bool = True) -> None:
            self.optim.zero_grad(set_to_none)

        def step(self, closure=None) -> None:
            self.committed = False
            super().step(closure)  # steps the inner optimizer iff manager.should_commit()

    opt = _Opt(manager, raw_opt)
    # should_commit is called once per step; record its result without a second RPC
    _sc = manager.should_commit

    def _should_commit(timeout=None):
        r = _sc(timeout)
        opt.committed = r
        return r

    manager.should_commit = _should_commit

    class _Sched:  # LambdaLR steps only with a committed optimizer step
        def step(self):
            if opt.committed:
                raw_sched.step()

    def sync():
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        manager.allreduce(flat).wait()  # AVG over participants; zeroed if we are healing
        off = 0
        for g in grads:
            g.copy_(flat[off : off + g.numel()].view_as(g))
            off += g.numel()

    emit("manager_ready")
    if a.go_file:  # start barrier so the fault-free quorum forms with both replicas from step 1
        deadline = time.time() + 120
        while not os.path.exists(a.go_file) and time.time() < deadline:
            time.sleep(0.01)

    max_iters = 4 * a.steps + 100
    it = 0
    t_end = time.time() + a.max_seconds
    while manager.current_step() < a.steps and it < max_iters and time.time() < t_end:
        it += 1
        t0 = time.time()
        manager.start_quorum()  # = OptimizerWrapper.zero_grad's quorum half
        step = manager.current_step() + 1  # exact in sync mode; async: a healer's is stale (its grads are zeroed)
        t_q = time.time()
        loss = train_step(model, opt, _Sched(), step, a.seed, rid, sync)
        t1 = time.time()
        err = manager.errored()
        rec = dict(
            step=manager.current_step(),
            attempted=step,
            loss=loss,
            participants=manager.num_participants(),
            quorum_id=manager._quorum_id,
            step_s=t1 - t0,
            start_quorum_s=t_q - t0,
            t=t1,
        )
        if opt.committed:
            emit("commit", **rec)
        else:
            emit("discard", error=(str(err).splitlines()[0][:200] if err else None), **rec)
        if a.step_time:
            time.sleep(a.step_time)

    final = {"model": model.state_dict(), "optim": raw_opt.state_dict()}
    if a.final_out:
        torch.save(final, a.final_out)
    emit("done", step=manager.current_step(), iters=it)
    try:
        manager.shutdown(wait=False)
    except Exception:
        pass
    logf.close()
    os._exit(0)  # torchft's threads / servers: don't wait on them


# ----------------------------------------------------------------------------- parent


class Job:
    """The children of one run, each in its own process group; kill_all in finally."""

    def __init__(self, d: str, lighthouse: str, a: argparse.Namespace, name: str):
        self.d, self.lh, self.a, self.name = d, lighthouse, a, name
        self.log = os.path.join(d, f"{name}.jsonl")
        self.go = os.path.join(d, f"{name}.go")
        open(self.log, "w").close()
        self.procs: dict[tuple[int, int], subprocess.Popen] = {}
        self.spawn_t: dict[tuple[int, int], float] = {}
        self.stderr: dict[tuple[int, int], str] = {}
        self._off = 0
        self._buf = ""
        self.events: list[dict] = []

    def spawn(self, rid: int, inc: int, final_out: str | None) -> None:
        a = self.a
        env = dict(os.environ)
        env["OMP_NUM_THREADS"] = "1"
        env["PYTHONPATH"] = FTKIT_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        cmd = [
            sys.executable,
            HERE,
            "--_replica",
            str(rid),
            "--_incarnation",
            str(inc),
            "--_log",
            self.log,
            "--_lighthouse",
            self.lh,
            "--steps",
            str(a.steps),
            "--step-time",
            str(a.step_time),
            "--seed",
            str(a.seed),
            "--pg-timeout",
            str(a.pg_timeout),
            "--timeout",
            str(a.timeout),
            "--quorum-timeout",
            str(a.quorum_timeout),
            "--max-seconds",
            str(a.max_seconds),
        ]
        if a.sync_quorum:
            cmd.append("--sync-quorum")
        if a.transfer_rng:
            cmd.append("--transfer-rng")
        if final_out:
            cmd += ["--_final-out", final_out]
        if inc == 0:
            cmd += ["--_go-file", self.go]
        errp = os.path.join(self.d, f"{self.name}.r{rid}.i{inc}.stderr")
        self.stderr[(rid, inc)] = errp
        self.spawn_t[(rid, inc)] = time.time()
        self.procs[(rid, inc)] = subprocess.Popen(
            cmd, cwd=FTKIT_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(errp, "w"), start_new_session=True
        )

    def poll(self) -> list[dict]:
        with open(self.log) as f:
            f.seek(self._off)
            data = f.read()
            self._off = f.tell()
        self._buf += data
        new = []
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            if line.strip():
                ev = json.loads(line)
                self.events.append(ev)
                new.append(ev)
        return new

    def kill(self, key) -> None:
        p = self.procs[key]
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill_all(self) -> None:
        for key, p in self.procs.items():
            if p.poll() is None:
                self.kill(key)
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def errors(self) -> list[str]:
        """Distinct WARNING/ERROR lines (and tracebacks' last line) from the children's stderr."""
        out: list[str] = []
        for key, path in self.stderr.items():
            try:
                lines = open(path, errors="replace").read().splitlines()
            except OSError:
                continue
            for ln in lines:
                if any(s in ln for s in ("ERROR", "WARNING", "Error", "error", "Traceback")) and "pynvml" not in ln:
                    s = f"r{key[0]}.i{key[1]}: {ln.strip()[:240]}"
                    if s not in out:
                        out.append(s)
        return out[:25]


class Lighthouse:
    """torchft's lighthouse: the `torchft_lighthouse` console script on 127.0.0.1 (its log kept),
    or, where that script is missing, torchft._torchft.LighthouseServer in this process."""

    def __init__(self, a: argparse.Namespace, log: str):
        self.proc = None
        self.server = None
        self.log = log
        exe = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")
        if os.path.exists(exe):
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            self.proc = subprocess.Popen(
                [
                    exe,
                    "--bind",
                    f"127.0.0.1:{port}",
                    "--min_replicas",
                    "1",
                    "--join_timeout_ms",
                    str(a.join_timeout_ms),
                    "--heartbeat_timeout_ms",
                    str(a.heartbeat_timeout_ms),
                ],
                stdout=open(log, "w"),
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            self.addr = f"http://127.0.0.1:{port}"
            deadline = time.time() + 20
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"torchft_lighthouse exited {self.proc.returncode}: {open(log).read()[-300:]}")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    if time.time() > deadline:
                        raise RuntimeError("torchft_lighthouse did not listen within 20 s") from None
                    time.sleep(0.05)
        else:
            from torchft._torchft import LighthouseServer

            self.server = LighthouseServer(
                bind="127.0.0.1:0",
                min_replicas=1,
                join_timeout_ms=a.join_timeout_ms,
                heartbeat_timeout_ms=a.heartbeat_timeout_ms,
            )
            self.addr = self.server.address()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        if self.server is not None:
            self.server.shutdown()

    def status_lines(self, t0: float, t1: float) -> list[str]:
        """The lighthouse's distinct 'Quorum status' reasons logged between t0 and t1 (epoch s)."""
        import datetime
        import re

        out: list[str] = []
        try:
            lines = open(self.log, errors="replace").read().splitlines()
        except OSError:
            return out
        for ln in lines:
            m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+) \[\w+\] \[[^]]+\] - Quorum status: (.*)", ln)
            if not m:
                continue
            t = datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f").timestamp()
            if t0 <= t <= t1 and m.group(2) not in out:
                out.append(m.group(2))
        return out[:10]


def run_job(a, d: str, name: str, kill_at: int | None, finals: dict[str, str]) -> dict:
    res: dict = {"name": name}
    lh = Lighthouse(a, os.path.join(d, f"{name}.lighthouse.log"))  # a fresh lighthouse per run
    job = Job(d, lh.addr, a, name)
    try:
        for rid in (0, 1):
            job.spawn(rid, 0, finals.get(f"r{rid}"))
        ready: set = set()
        deadline = time.time() + a.max_seconds + 60
        t_kill = None
        done: set = set()
        while time.time() < deadline:
            for ev in job.poll():
                key = (ev["replica"], ev["inc"])
                if ev["ev"] == "manager_ready" and ev["inc"] == 0:
                    ready.add(ev["replica"])
                    if ready == {0, 1}:
                        open(job.go, "w").close()
                        res["t_go"] = time.time()
                if ev["ev"] == "done":
                    done.add(key)
                if (
                    kill_at is not None
                    and t_kill is None
                    and ev["ev"] == "commit"
                    and key == (1, 0)
                    and ev["step"] >= kill_at
                ):
                    job.kill((1, 0))
                    t_kill = time.time()
                    job.spawn(1, 1, finals.get("r1"))  # the relaunch, as torchrun/its launcher would
                    res["t_kill"] = t_kill
                    res["killed_after_step"] = ev["step"]
            if all(p.poll() is not None for p in job.procs.values()):
                break
            # a child that died without 'done' (other than the one we killed): stop the run
            if any(p.poll() is not None and k not in done and k != (1, 0) for k, p in job.procs.items()):
                time.sleep(0.5)
                job.poll()
                res["child_died"] = sorted(
                    f"r{k[0]}.i{k[1]}"
                    for k, p in job.procs.items()
                    if p.poll() is not None and k not in done and k != (1, 0)
                )
                break
            time.sleep(0.005)
        job.poll()
        res["timed_out"] = any(p.poll() is None for p in job.procs.values())
        res["exit_codes"] = {f"r{k[0]}.i{k[1]}": p.poll() for k, p in job.procs.items()}
    finally:
        job.kill_all()
        lh.stop()
    res["events"] = job.events
    res["lighthouse"] = lh
    res["spawn_t"] = {f"r{k[0]}.i{k[1]}": v for k, v in job.spawn_t.items()}
    res["child_errors"] = job.errors()
    return res


# ----------------------------------------------------------------------------- analysis


def load_state(path: str):
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def bit_equal(x, y) -> bool:
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (
            isinstance(x, torch.Tensor)
            and isinstance(y, torch.Tensor)
            and x.dtype == y.dtype
            and x.shape == y.shape
            and torch.equal(x, y)
        )
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(bit_equal(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(bit_equal(i, j) for i, j in zip(x, y))
    return x == y


def max_abs_diff(x, y) -> float:
    m = 0.0
    for k in x["model"]:
        m = max(m, (x["model"][k].double() - y["model"][k].double()).abs().max().item())
    return m


def commits(evs, rid, inc=None):
    return [e for e in evs if e["ev"] == "commit" and e["replica"] == rid and (inc is None or e["inc"] == inc)]


def r3(x):
    return None if x is None else round(x, 3)


def analyze_fault_free(res: dict) -> dict:
    evs = res["events"]
    t_go = res.get("t_go")
    c0, c1 = commits(evs, 0), commits(evs, 1)
    steps0 = [e["step"] for e in c0]
    step_s = sorted(e["step_s"] for e in c0[5:]) or [0.0]
    return {
        "committed_steps_r0": len(c0),
        "committed_steps_r1": len(c1),
        "discarded": sum(1 for e in evs if e["ev"] == "discard"),
        "contiguous_r0": steps0 == list(range(1, len(steps0) + 1)),
        "participants_always_2": all(e["participants"] == 2 for e in c0 + c1),
        "quorums_formed": len({e["quorum_id"] for e in evs if e["ev"] == "quorum"}),
        "median_step_s_excl_sleep": r3(step_s[len(step_s) // 2]),
        "wall_s_go_to_last_commit": r3(max(e["t"] for e in c0) - t_go) if c0 and t_go else None,
        "final_loss_r0": c0[-1]["loss"] if c0 else None,
        "timed_out": res["timed_out"],
        "exit_codes": res["exit_codes"],
    }


def analyze_fault(res: dict, steps: int) -> dict:
    evs = res["events"]
    out: dict = {"timed_out": res["timed_out"], "exit_codes": res["exit_codes"]}
    tk = res.get("t_kill")
    if tk is None:
        out["error"] = "kill never happened"
        return out
    K = res["killed_after_step"]
    out["killed_after_step"] = K
    # (a) survivor
    s_after = [e for e in evs if e["replica"] == 0 and e["t"] > tk and e["ev"] in ("commit", "discard")]
    first_commit = next((e for e in s_after if e["ev"] == "commit" and e["step"] > K), None)
    disc = [e for e in s_after if e["ev"] == "discard" and (first_commit is None or e["t"] <= first_commit["t"])]
    out["survivor_next_commit_s"] = r3(first_commit["t"] - tk) if first_commit else None
    out["survivor_next_commit_step"] = first_commit["step"] if first_commit else None
    out["survivor_next_commit_participants"] = first_commit["participants"] if first_commit else None
    out["survivor_discarded_steps_before_it"] = len(disc)
    out["survivor_discard_errors"] = sorted({e["error"] for e in disc if e.get("error")})
    out["survivor_discarded_total"] = sum(1 for e in evs if e["replica"] == 0 and e["ev"] == "discard")
    # longest survivor step after the kill (how long it blocked)
    s_steps = [e for e in s_after if e["t"] - tk < 60]
    if s_steps:
        longest = max(s_steps, key=lambda e: e["step_s"])
        out["survivor_longest_step_s"] = r3(longest["step_s"])
        out["survivor_longest_step_at"] = longest["attempted"]
    qs = [e for e in evs if e["ev"] == "quorum" and e["replica"] == 0 and e["t"] > tk]
    if qs and res.get("lighthouse"):  # why the survivor's quorum waited, in the lighthouse's words
        out["lighthouse_status_kill_to_survivor_quorum"] = res["lighthouse"].status_lines(tk, qs[0]["t"] + 0.01)
    if qs:
        out["survivor_first_quorum_wait_after_kill_s"] = r3(qs[0]["t"] - qs[0]["t0"])
        out["survivor_first_quorum_after_kill"] = {
            "ids": qs[0]["replica_ids"],
            "quorum_id": qs[0]["quorum_id"],
            "dt_from_kill_s": r3(qs[0]["t"] - tk),
        }
    alone = [e["step"] for e in commits(evs, 0) if e["participants"] == 1]
    out["survivor_steps_trained_alone"] = alone
    # (b) relaunch
    t_spawn = res["spawn_t"].get("r1.i1")
    ri = [e for e in evs if e["replica"] == 1 and e["inc"] == 1]

    def first(ev):
        return next((e for e in ri if e["ev"] == ev), None)

    ps, imp, bl, mr, q1 = (first(x) for x in ("proc_start", "imported", "built", "manager_ready", "quorum"))
    hr = first("heal_recv")
    c1 = [e for e in ri if e["ev"] == "commit"]
    out["relaunch"] = {
        "spawn_after_kill_s": r3(t_spawn - tk) if t_spawn else None,
        "interpreter_start_s": r3(ps["t"] - t_spawn) if ps and t_spawn else None,
        "imports_s": r3(imp["t"] - ps["t"]) if imp and ps else None,
        "build_reference_model_s": r3(bl["t"] - imp["t"]) if bl and imp else None,
        "torchft_manager_init_s": r3(mr["t"] - bl["t"]) if mr and bl else None,
        "first_quorum_wait_s": r3(q1["t"] - q1["t0"]) if q1 else None,
        "startup_to_first_quorum_s": r3(q1["t"] - t_spawn) if q1 and t_spawn else None,
        "first_quorum": {k: q1[k] for k in ("my_step", "max_step", "heal", "replica_ids", "max_world_size")}
        if q1
        else None,
        "heal_recv_s": r3(hr["t"] - hr["t0"]) if hr else None,
        "healed_to_step": hr["step"] if hr else None,
        "first_commit_step": c1[0]["step"] if c1 else None,
        "first_commit_participants": c1[0]["participants"] if c1 else None,
    }
    out["replacement_caught_up_s"] = r3(c1[0]["t"] - tk) if c1 else None
    sends = [e for e in evs if e["ev"] == "heal_send" and e["replica"] == 0]
    out["survivor_heal_send_s"] = r3(sends[0]["t"] - sends[0]["t0"]) if sends else None
    # (c) steps lost: committed steps later rolled back. torchft never rolls back a commit;
    # check the survivor's committed steps are 1..N without gaps/repeats, and the replacement
    # resumed right after the survivor's step it healed from.
    s_steps_all = [e["step"] for e in commits(evs, 0)]
    out["survivor_commits_contiguous_1_to_N"] = s_steps_all == list(range(1, steps + 1))
    k_steps = [e["step"] for e in commits(evs, 1, 0)]
    out["killed_replica_last_commit"] = k_steps[-1] if k_steps else None
    redone = sorted(set(k_steps) & set(e["step"] for e in c1))
    out["committed_steps_redone"] = redone
    out["steps_lost"] = len(redone)
    if c1 and hr:
        out["replacement_resumed_at"] = c1[0]["step"]
    # batches of replica 1 never trained (the survivor's solo steps + the heal step in async mode)
    part1 = {e["step"] for e in commits(evs, 1)}
    out["replica1_batches_skipped_steps"] = [s for s in range(1, steps + 1) if s not in part1 or s in alone]
    out["replacement_discards"] = sum(1 for e in ri if e["ev"] == "discard")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kill-at", type=int, default=20)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--join-timeout-ms", type=int, default=500, help="lighthouse join timeout")
    p.add_argument(
        "--heartbeat-timeout-ms", type=int, default=5000, help="lighthouse heartbeat timeout (torchft default)"
    )
    p.add_argument("--pg-timeout", type=float, default=5.0, help="ProcessGroupGloo timeout, s")
    p.add_argument("--timeout", type=float, default=10.0, help="Manager timeout (collectives, commit, checkpoint), s")
    p.add_argument("--quorum-timeout", type=float, default=30.0, help="Manager quorum timeout, s")
    p.add_argument(
        "--sync-quorum", action="store_true", help="use_async_quorum=False (default: torchft's async quorum)"
    )
    p.add_argument(
        "--transfer-rng",
        action="store_true",
        help="also register torch's RNG state (dropout) with the manager, so a healed replica gets the peer's",
    )
    p.add_argument("--max-seconds", type=float, default=90.0, help="per-run bound on each replica")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, stderr, final states)")
    # child mode
    p.add_argument("--_replica", type=int, dest="replica", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_incarnation", type=int, dest="incarnation", default=0, help=argparse.SUPPRESS)
    p.add_argument("--_log", dest="log", help=argparse.SUPPRESS)
    p.add_argument("--_lighthouse", dest="lighthouse", help=argparse.SUPPRESS)
    p.add_argument("--_final-out", dest="final_out", help=argparse.SUPPRESS)
    p.add_argument("--_go-file", dest="go_file", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.replica is not None:
        return replica_main(a)

    import shutil

    t_start = time.time()
    d = tempfile.mkdtemp(prefix="torchft_recovery_")
    result: dict = {
        "tool": "torchft",
        "config": {
            k: getattr(a, k)
            for k in (
                "steps",
                "kill_at",
                "step_time",
                "seed",
                "join_timeout_ms",
                "heartbeat_timeout_ms",
                "pg_timeout",
                "timeout",
                "quorum_timeout",
                "sync_quorum",
                "transfer_rng",
            )
        },
    }
    try:
        from importlib.metadata import version

        import torch

        result["versions"] = {"torch": torch.__version__, "torchft": version("torchft")}

        finals = {
            "ff": {"r0": os.path.join(d, "ff_r0.pt"), "r1": os.path.join(d, "ff_r1.pt")},
            "fault": {"r0": os.path.join(d, "fault_r0.pt"), "r1": os.path.join(d, "fault_r1.pt")},
        }
        # 1. fault-free
        print(f"[torchft] fault-free run: 2 replicas x {a.steps} steps ...", flush=True)
        try:
            ff = run_job(a, d, "ff", None, finals["ff"])
            result["fault_free"] = analyze_fault_free(ff)
            result["fault_free"]["child_errors"] = ff["child_errors"]
        except Exception as e:
            result["fault_free"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        # 2. fault
        print(f"[torchft] fault run: SIGKILL replica 1 after step {a.kill_at}, relaunch at once ...", flush=True)
        try:
            fr = run_job(a, d, "fault", a.kill_at, finals["fault"])
            result["fault"] = analyze_fault(fr, a.steps)
            result["fault"]["child_errors"] = fr["child_errors"]
        except Exception as e:
            result["fault"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
        # (d) final state comparisons
        cmp: dict = {}
        st = {}
        for run, fs in finals.items():
            for r, path in fs.items():
                if os.path.exists(path):
                    st[f"{run}_{r}"] = load_state(path)

        def eq(x, y):
            if x in st and y in st:
                return {
                    "model_equal": bit_equal(st[x]["model"], st[y]["model"]),
                    "optim_equal": bit_equal(st[x]["optim"], st[y]["optim"]),
                    "max_abs_param_diff": max_abs_diff(st[x], st[y]),
                }
            return f"missing state: {[k for k in (x, y) if k not in st]}"

        cmp["fault_free_r0_vs_r1"] = eq("ff_r0", "ff_r1")
        cmp["fault_r0_vs_r1"] = eq("fault_r0", "fault_r1")
        cmp["fault_r0_vs_fault_free_r0"] = eq("fault_r0", "ff_r0")
        cmp["fault_r1_vs_fault_free_r0"] = eq("fault_r1", "ff_r0")
        result["final_state"] = cmp
        if a.keep:
            result["tmpdir"] = d
    except Exception as e:
        result.setdefault("error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
    result["wall_s"] = r3(time.time() - t_start)
    print_summary(result)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if "error" not in result else 1


def print_summary(r: dict) -> None:
    c = r["config"]
    print(
        f"\n== torchft {r.get('versions', {}).get('torchft', '?')} recovery (CPU, gloo, 2 replica groups x 1 proc), "
        f"{c['steps']} steps, kill replica 1 after step {c['kill_at']}, step-time {c['step_time']} s, "
        f"{'sync' if c['sync_quorum'] else 'async'} quorum{', RNG transferred' if c.get('transfer_rng') else ''}, "
        f"join {c['join_timeout_ms']} ms, "
        f"heartbeat {c['heartbeat_timeout_ms']} ms"
    )
    if "error" in r:
        print("ERROR:", r["error"])
    ff = r.get("fault_free", {})
    if ff:
        if "error" in ff:
            print("fault-free: ERROR", ff["error"])
        else:
            print(
                f"fault-free: commits r0={ff['committed_steps_r0']} r1={ff['committed_steps_r1']}, "
                f"discarded={ff['discarded']}, 2 participants every step={ff['participants_always_2']}, "
                f"median step {ff['median_step_s_excl_sleep']} s (+sleep), wall {ff['wall_s_go_to_last_commit']} s"
            )
    f = r.get("fault", {})
    if f:
        if "error" in f:
            print("fault: ERROR", f["error"])
        else:
            rl = f.get("relaunch", {})
            print(f"fault: killed replica 1 after its step {f.get('killed_after_step')}")
            print(
                f"  (a) survivor's next commit: {f.get('survivor_next_commit_s')} s after the kill "
                f"(step {f.get('survivor_next_commit_step')}, "
                f"{f.get('survivor_next_commit_participants')} participant(s)); "
                f"discarded before it: {f.get('survivor_discarded_steps_before_it')} "
                f"{f.get('survivor_discard_errors')}; longest survivor step {f.get('survivor_longest_step_s')} s; "
                f"trained alone at steps {f.get('survivor_steps_trained_alone')}"
            )
            print(f"  lighthouse after the kill: {f.get('lighthouse_status_kill_to_survivor_quorum')}")
            print(
                f"  relaunch start-up: spawn->first quorum {rl.get('startup_to_first_quorum_s')} s "
                f"(interpreter {rl.get('interpreter_start_s')}, imports {rl.get('imports_s')}, "
                f"ftkit build() {rl.get('build_reference_model_s')}, "
                f"torchft Manager {rl.get('torchft_manager_init_s')}, "
                f"quorum wait {rl.get('first_quorum_wait_s')})"
            )
            print(
                f"  (b) replacement caught up (first commit after heal): {f.get('replacement_caught_up_s')} s "
                "after the kill; "
                f"healed to step {rl.get('healed_to_step')} in {rl.get('heal_recv_s')} s (HTTP), first commit step "
                f"{rl.get('first_commit_step')}"
            )
            print(
                f"  (c) committed steps lost/redone: {f.get('steps_lost')} {f.get('committed_steps_redone')}; "
                f"survivor commits 1..N contiguous: {f.get('survivor_commits_contiguous_1_to_N')}; "
                f"replica-1 batches never trained at steps {f.get('replica1_batches_skipped_steps')}"
            )
    fs = r.get("final_state", {})
    for k, v in fs.items():
        print(f"  (d) {k}: {v}")
    print(f"wall {r.get('wall_s')} s")


if __name__ == "__main__":
    sys.exit(main())
