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
        if a.crash_after is not None and manager.current_step() >= a.crash_after:
            # --schedule's crash: an exception in the training loop, uncaught, so the process exits non-zero
            emit("crash", step=manager.current_step())
            raise RuntimeError(f"injected crash: replica {rid} after committing step {manager.current_step()}")
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

    def spawn(self, rid: int, inc: int, final_out: str | None, crash_after: int | None = None) -> None:
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
        if crash_after is not None:
            cmd += ["--_crash-after", str(crash_after)]
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

    def signal(self, key, sig: int) -> None:
        try:
            os.killpg(self.procs[key].pid, sig)
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


# ----------------------------------------------------------------------------- --schedule mode

FAULT_KINDS = ("kill", "crash", "hang", "node")
CRASH_EXIT_BOUND_S = 30.0  # a crashed replica that has not exited by then is SIGKILLed (and this is recorded)


def parse_schedule(spec: str, n: int, steps: int) -> list[dict]:
    """`kind@STEP:replica=R` / `node@STEP:replicas=A+B`, comma-separated; kinds: kill, crash, hang, node."""
    import re

    faults = []
    for part in (x.strip() for x in spec.split(",")):
        if not part:
            continue
        m = re.fullmatch(r"([a-z]+)@(\d+):replicas?=(\d+(?:\+\d+)*)", part)
        if not m:
            raise ValueError(f"bad fault {part!r}: want kind@STEP:replica=R or node@STEP:replicas=A+B")
        kind, step, ids = m.group(1), int(m.group(2)), m.group(3)
        targets = sorted({int(x) for x in ids.split("+")})
        if kind not in FAULT_KINDS:
            raise ValueError(f"bad fault {part!r}: kind must be one of {', '.join(FAULT_KINDS)}")
        if any(t >= n for t in targets):
            raise ValueError(f"bad fault {part!r}: only replicas 0..{n - 1} exist")
        if kind != "node" and len(targets) != 1:
            raise ValueError(f"bad fault {part!r}: only node takes several replicas")
        if len(targets) == n:
            raise ValueError(f"bad fault {part!r}: no replica would survive it")
        if not 1 <= step < steps:
            raise ValueError(f"bad fault {part!r}: the step must be in 1..{steps - 1}")
        target = ("replicas=" + "+".join(map(str, targets))) if kind == "node" else f"replica={targets[0]}"
        faults.append({"kind": kind, "step": step, "targets": targets, "target": target})
    if not faults:
        raise ValueError("empty --schedule")
    return faults


def run_schedule_job(a, d: str, name: str, n: int, faults: list[dict], finals: dict[str, str]) -> dict:
    """n replica groups; each fault in `faults` fires when its (first) target replica has committed its
    step: kill/node SIGKILL + relaunch at once; hang SIGSTOP, SIGKILL after --hang-kill-after-ms, relaunch;
    crash: the replica raises at the top of its next step (--_crash-after), relaunched when it exits.
    `faults` (copies) come back with what happened: t_fault, trigger, new_inc, ... With no faults: fault-free."""
    fs = [dict(f, fired=False) for f in faults]
    res: dict = {"name": name, "faults": fs}
    lh = Lighthouse(a, os.path.join(d, f"{name}.lighthouse.log"))  # a fresh lighthouse per run
    job = Job(d, lh.addr, a, name)
    cur = {r: 0 for r in range(n)}  # each replica's live incarnation
    expected_exit: set = set()  # incarnations we killed, or that crash on purpose
    hang_due: list[tuple[float, dict, tuple[int, int]]] = []  # SIGKILL the stopped replica at t
    crash_wait: dict[tuple[int, int], dict] = {}  # crashed, waiting for the process to exit

    def crash_after(r: int) -> int | None:  # a relaunch still carries a crash that has not fired yet
        return next((f["step"] for f in fs if f["kind"] == "crash" and not f["fired"] and r in f["targets"]), None)

    def relaunch(f: dict, r: int) -> None:
        cur[r] += 1
        job.spawn(r, cur[r], finals.get(f"r{r}"), crash_after(r))
        f.setdefault("new_inc", {})[str(r)] = cur[r]
        f.setdefault("t_spawn", {})[str(r)] = job.spawn_t[(r, cur[r])]

    try:
        for r in range(n):
            job.spawn(r, 0, finals.get(f"r{r}"), crash_after(r))
        ready: set = set()
        done: set = set()
        deadline = time.time() + a.max_seconds + 60
        while time.time() < deadline:
            exited = {k for k, p in job.procs.items() if p.poll() is not None}  # before reading the log
            for ev in job.poll():
                key = (ev["replica"], ev["inc"])
                if ev["ev"] == "manager_ready" and ev["inc"] == 0:
                    ready.add(ev["replica"])
                    if len(ready) == n:
                        open(job.go, "w").close()
                        res["t_go"] = time.time()
                elif ev["ev"] == "done":
                    done.add(key)
                elif ev["ev"] == "crash":
                    f = next(
                        (f for f in fs if f["kind"] == "crash" and not f["fired"] and key[0] in f["targets"]), None
                    )
                    if f is not None:
                        f.update(fired=True, t_fault=ev["t"], trigger={"replica": key[0], "step": ev["step"]})
                        f["live_inc"] = {str(x): i for x, i in cur.items()}
                        f["old_inc"] = {str(key[0]): key[1]}
                        expected_exit.add(key)
                        crash_wait[key] = f
                elif ev["ev"] == "commit":
                    for f in fs:
                        r = ev["replica"]
                        if f["fired"] or f["kind"] == "crash" or r not in f["targets"] or ev["step"] < f["step"]:
                            continue
                        if key != (r, cur[r]):
                            continue
                        victims = [(t, cur[t]) for t in f["targets"]]
                        if f["kind"] == "hang":
                            job.signal(victims[0], signal.SIGSTOP)
                            t = time.time()
                            hang_due.append((t + a.hang_kill_after_ms / 1000.0, f, victims[0]))
                        else:  # kill, node: SIGKILL the target(s) together, relaunch at once
                            for v in victims:
                                job.kill(v)
                            t = time.time()
                        expected_exit.update(victims)
                        f.update(fired=True, t_fault=t, trigger={"replica": r, "step": ev["step"]})
                        f["live_inc"] = {str(x): i for x, i in cur.items()}
                        f["old_inc"] = {str(v[0]): v[1] for v in victims}
                        if f["kind"] != "hang":
                            for v in victims:
                                relaunch(f, v[0])
            now = time.time()
            for item in [h for h in hang_due if h[0] <= now]:  # the health check gives up on the hung replica
                hang_due.remove(item)
                _, f, v = item
                job.kill(v)
                f["t_killed"] = time.time()
                relaunch(f, v[0])
            for key, f in list(crash_wait.items()):
                p = job.procs[key]
                if p.poll() is not None:
                    f["t_exit"], f["exit_code"] = time.time(), p.returncode
                    del crash_wait[key]
                    relaunch(f, key[0])
                elif now - f["t_fault"] > CRASH_EXIT_BOUND_S and not f.get("forced_kill"):
                    job.kill(key)
                    f["forced_kill"] = True
            if not hang_due and not crash_wait and all(p.poll() is not None for p in job.procs.values()):
                break
            died = sorted(k for k in exited if k not in done and k not in expected_exit)
            if died:  # a child that died unplanned: stop the run
                res["child_died"] = [f"r{k[0]}.i{k[1]}" for k in died]
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


def analyze_fault_free_n(res: dict, n: int) -> dict:
    evs = res["events"]
    t_go = res.get("t_go")
    cs = {r: commits(evs, r) for r in range(n)}
    step_s = sorted(e["step_s"] for e in cs[0][5:]) or [0.0]
    last = max((e["t"] for c in cs.values() for e in c), default=None)
    return {
        "replicas": n,
        "committed_steps": {f"r{r}": len(c) for r, c in cs.items()},
        "discarded": sum(1 for e in evs if e["ev"] == "discard"),
        "contiguous": all([e["step"] for e in c] == list(range(1, len(c) + 1)) for c in cs.values()),
        f"participants_always_{n}": all(e["participants"] == n for c in cs.values() for e in c),
        "quorums_formed": len({e["quorum_id"] for e in evs if e["ev"] == "quorum"}),
        "median_step_s_excl_sleep": r3(step_s[len(step_s) // 2]),
        "wall_s_go_to_last_commit": r3(last - t_go) if last and t_go else None,
        "final_loss_r0": cs[0][-1]["loss"] if cs[0] else None,
        "timed_out": res["timed_out"],
        "exit_codes": res["exit_codes"],
    }


def analyze_schedule(res: dict, n: int, steps: int) -> dict:
    """Per fault: survivors' next commit, the replacement(s)' first commit, committed steps redone;
    per replica: every step 1..S committed (over its incarnations), none twice."""
    evs = res["events"]
    out: dict = {"faults": []}
    for f in res["faults"]:
        o: dict = {"kind": f["kind"], "target": f["target"], "step": f["step"]}
        if not f["fired"]:
            o["error"] = "never fired"
            out["faults"].append(o)
            continue
        tf, K, targets = f["t_fault"], f["trigger"]["step"], f["targets"]
        o["fired_after_step"] = K
        if f["kind"] == "node":
            o["fired_by_replica"] = f["trigger"]["replica"]
        # survivors: the other replicas that were training when it fired (not a replacement still starting)
        live = {r: f["live_inc"][str(r)] for r in range(n) if r not in targets}
        survivors = [r for r, i in live.items() if any(e["t"] < tf for e in commits(evs, r, i))]
        o["survivors"] = [f"r{r}" for r in survivors]
        o["still_recovering_from_earlier_fault"] = [f"r{r}" for r in live if r not in survivors]
        # (a) survivors: each one's first commit past the step the fault fired after; the figure is the last of them
        nxt = {}
        for s in survivors:
            e = next((e for e in commits(evs, s) if e["t"] > tf and e["step"] > K), None)
            nxt[s] = e
        got = [e for e in nxt.values() if e]
        o["survivors_next_commit_s"] = r3(max(e["t"] for e in got) - tf) if len(got) == len(survivors) else None
        o["survivors_next_commit_s_each"] = {f"r{s}": (r3(e["t"] - tf) if e else None) for s, e in nxt.items()}
        o["survivors_next_commit_step"] = max((e["step"] for e in got), default=None)
        o["survivors_next_commit_participants"] = min((e["participants"] for e in got), default=None)
        o["survivors_discards_before_it"] = sum(
            1
            for e in evs
            if e["ev"] == "discard"
            and e["replica"] in nxt
            and e["t"] > tf
            and (not nxt[e["replica"]] or e["t"] <= nxt[e["replica"]]["t"])
        )
        # (b) the replacement(s): first commit of the incarnation this fault launched
        rep = {}
        for r in targets:
            inc = f.get("new_inc", {}).get(str(r))
            ri = [e for e in evs if e["replica"] == r and e["inc"] == inc] if inc is not None else []
            c = [e for e in ri if e["ev"] == "commit"]
            q1 = next((e for e in ri if e["ev"] == "quorum"), None)
            hr = next((e for e in ri if e["ev"] == "heal_recv"), None)
            t_spawn = f.get("t_spawn", {}).get(str(r))
            # its first quorum's max_step: below the step the fault fired after = no trained peer to heal from
            done_t = [e["t"] for e in evs if e["ev"] == "done" and e["replica"] in survivors]
            mr = next((e for e in ri if e["ev"] == "manager_ready"), None)
            rep[r] = {
                "first_quorum_max_step": q1["max_step"] if q1 else None,
                "first_quorum_size": len(q1["replica_ids"]) if q1 else None,
                "started_without_a_trained_peer": bool(q1 and q1["max_step"] < K),
                "survivors_had_finished_before_it_was_ready": bool(
                    mr and survivors and len(done_t) == len(survivors) and max(done_t) < mr["t"]
                ),
                "spawn_after_fault_s": r3(t_spawn - tf) if t_spawn else None,
                "startup_to_first_quorum_s": r3(q1["t"] - t_spawn) if q1 and t_spawn else None,
                "healed_to_step": hr["step"] if hr else None,
                "heal_recv_s": r3(hr["t"] - hr["t0"]) if hr else None,
                "first_commit_step": c[0]["step"] if c else None,
                "caught_up_s": r3(c[0]["t"] - tf) if c else None,
            }
            # (c) steps lost: steps the old incarnation committed that the new one committed again
            old = {e["step"] for e in commits(evs, r, f["old_inc"][str(r)])}
            rep[r]["committed_steps_redone"] = sorted(old & {e["step"] for e in c})
            rep[r]["last_commit_before_fault"] = max(old) if old else None
        ups = [v["caught_up_s"] for v in rep.values()]
        o["replacement_caught_up_s"] = max(ups) if ups and None not in ups else None
        o["steps_lost"] = max(len(v["committed_steps_redone"]) for v in rep.values())
        o["replacements"] = {f"r{r}": v for r, v in rep.items()}
        t_back = max((tf + u for u in ups if u is not None), default=None)  # survivors' steps until all were back
        fewer = sorted(
            {
                e["step"]
                for s in survivors
                for e in commits(evs, s)
                if e["t"] > tf and (t_back is None or e["t"] <= t_back) and e["participants"] < n
            }
        )
        o["survivors_steps_with_fewer_than_all"] = fewer
        if f["kind"] == "hang":
            o["hung_replica_killed_after_s"] = r3(f["t_killed"] - tf) if f.get("t_killed") else None
        if f["kind"] == "crash":
            o["crash_exit_seen_after_s"] = r3(f["t_exit"] - tf) if f.get("t_exit") else None
            o["crash_exit_code"] = f.get("exit_code")
            o["crash_exit_forced_by_sigkill"] = bool(f.get("forced_kill"))
        out["faults"].append(o)
    per = {}
    for r in range(n):
        st = [e["step"] for e in commits(evs, r)]
        missing = sorted(set(range(1, steps + 1)) - set(st))
        twice = sorted({s for s in st if st.count(s) > 1})
        per[f"r{r}"] = {"missing_steps": missing, "steps_committed_twice": twice}
    out["per_replica"] = per
    out["every_replica_committed_every_step"] = all(not v["missing_steps"] for v in per.values())
    out["no_step_committed_twice"] = all(not v["steps_committed_twice"] for v in per.values())
    # a healed replica gets the state, not the steps it was down for: did some replica commit each step?
    out["job_committed_every_step"] = {e["step"] for e in evs if e["ev"] == "commit"} >= set(range(1, steps + 1))
    out["discarded_total"] = sum(1 for e in evs if e["ev"] == "discard")
    out["timed_out"] = res["timed_out"]
    out["exit_codes"] = res["exit_codes"]
    if res.get("child_died"):
        out["child_died"] = res["child_died"]
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
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="per-run bound on each replica (default 90; with --schedule 300)",
    )
    p.add_argument("--replicas", type=int, default=2, help="replica groups (1 process each); other than 2: --schedule")
    p.add_argument(
        "--schedule",
        help="instead of the single kill: a fault-free and one faulted run of --replicas replicas under this "
        "schedule, e.g. kill@70:replica=1,hang@160:replica=2,node@250:replicas=0+1,crash@340:replica=3 "
        "(each fires when its replica has committed the step; node: the first of its replicas)",
    )
    p.add_argument(
        "--hang-kill-after-ms",
        type=int,
        default=None,
        help="hang: the launcher/health check SIGKILLs the stopped replica after this many ms "
        "(default: --heartbeat-timeout-ms)",
    )
    p.add_argument("--keep", action="store_true", help="keep the temp dir (logs, stderr, final states)")
    # child mode
    p.add_argument("--_replica", type=int, dest="replica", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_incarnation", type=int, dest="incarnation", default=0, help=argparse.SUPPRESS)
    p.add_argument("--_log", dest="log", help=argparse.SUPPRESS)
    p.add_argument("--_lighthouse", dest="lighthouse", help=argparse.SUPPRESS)
    p.add_argument("--_final-out", dest="final_out", help=argparse.SUPPRESS)
    p.add_argument("--_go-file", dest="go_file", help=argparse.SUPPRESS)
    p.add_argument("--_crash-after", type=int, dest="crash_after", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.replica is not None:
        return replica_main(a)
    if a.max_seconds is None:
        a.max_seconds = 300.0 if a.schedule else 90.0
    if a.hang_kill_after_ms is None:
        a.hang_kill_after_ms = a.heartbeat_timeout_ms
    if a.schedule:
        return schedule_main(a)
    if a.replicas != 2:
        p.error("--replicas other than 2 needs --schedule")

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


def schedule_main(a: argparse.Namespace) -> int:
    """--schedule: a fault-free run and one faulted run of a.replicas replicas; result["schedule"]."""
    import shutil

    t_start = time.time()
    n = a.replicas
    keys = ("steps", "step_time", "seed", "join_timeout_ms", "heartbeat_timeout_ms", "hang_kill_after_ms")
    keys += ("pg_timeout", "timeout", "quorum_timeout", "sync_quorum", "transfer_rng", "replicas", "schedule")
    result: dict = {"tool": "torchft", "config": {k: getattr(a, k) for k in keys}}
    sched: dict = {"faults": [], "bit_exact": False, "max_abs_param_diff": None}
    result["schedule"] = sched
    d = tempfile.mkdtemp(prefix="torchft_schedule_")
    try:
        if n < 2:
            raise ValueError("--schedule needs --replicas 2 or more")
        faults = parse_schedule(a.schedule, n, a.steps)
        from importlib.metadata import version

        import torch

        result["versions"] = {"torch": torch.__version__, "torchft": version("torchft")}
        finals = {run: {f"r{r}": os.path.join(d, f"{run}_r{r}.pt") for r in range(n)} for run in ("ff", "sched")}
        print(f"[torchft] fault-free run: {n} replicas x {a.steps} steps ...", flush=True)
        t0 = time.time()
        ff = run_schedule_job(a, d, "ff", n, [], finals["ff"])
        result["fault_free"] = analyze_fault_free_n(ff, n)
        result["fault_free"]["child_errors"] = ff["child_errors"]
        result["fault_free"]["run_wall_s"] = r3(time.time() - t0)
        print(f"[torchft] faulted run: {a.schedule} ...", flush=True)
        t0 = time.time()
        fr = run_schedule_job(a, d, "sched", n, faults, finals["sched"])
        sched.update(analyze_schedule(fr, n, a.steps))
        sched["child_errors"] = fr["child_errors"]
        sched["run_wall_s"] = r3(time.time() - t0)
        # final states: every replica of the faulted run against the fault-free run's replica 0
        st = {}
        for run, fs in finals.items():
            for r, path in fs.items():
                if os.path.exists(path):
                    st[f"{run}_{r}"] = load_state(path)
        missing = [k for k in [f"ff_r{r}" for r in range(n)] + [f"sched_r{r}" for r in range(n)] if k not in st]
        if "ff_r0" in st:
            ref = st["ff_r0"]
            result["fault_free"]["replicas_identical"] = all(
                bit_equal(st[k]["model"], ref["model"]) and bit_equal(st[k]["optim"], ref["optim"])
                for k in st
                if k.startswith("ff_")
            )
            cmp = {}
            for r in range(n):
                x = st.get(f"sched_r{r}")
                if x is not None:
                    cmp[f"r{r}"] = {
                        "model_equal": bit_equal(x["model"], ref["model"]),
                        "optim_equal": bit_equal(x["optim"], ref["optim"]),
                        "max_abs_param_diff": max_abs_diff(x, ref),
                    }
            sched["final_state_vs_fault_free_r0"] = cmp
            sched["bit_exact"] = not missing and all(v["model_equal"] and v["optim_equal"] for v in cmp.values())
            sched["max_abs_param_diff"] = max((v["max_abs_param_diff"] for v in cmp.values()), default=None)
        if missing:
            sched["error"] = f"missing final state: {missing}"
        else:
            unfired = [f"{f['kind']}@{f['step']}" for f in sched["faults"] if f.get("error")]
            if unfired:
                sched["error"] = f"faults never fired: {unfired}"
            elif fr.get("child_died") or fr["timed_out"]:
                sched["error"] = f"run incomplete: died {fr.get('child_died')}, timed out {fr['timed_out']}"
        if a.keep:
            result["tmpdir"] = d
    except Exception as e:
        sched.setdefault("error", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}")
    finally:
        if not a.keep:
            shutil.rmtree(d, ignore_errors=True)
    result["wall_s"] = r3(time.time() - t_start)
    print_schedule_summary(result)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if "error" not in sched else 1


def print_schedule_summary(r: dict) -> None:
    c, s = r["config"], r["schedule"]
    print(
        f"\n== torchft {r.get('versions', {}).get('torchft', '?')} under a fault schedule (CPU, gloo, "
        f"{c['replicas']} replica groups x 1 proc), {c['steps']} steps, step-time {c['step_time']} s, "
        f"{'sync' if c['sync_quorum'] else 'async'} quorum{', RNG transferred' if c.get('transfer_rng') else ''}, "
        f"heartbeat {c['heartbeat_timeout_ms']} ms, hung replica killed after {c['hang_kill_after_ms']} ms"
    )
    ff = r.get("fault_free", {})
    if ff:
        print(
            f"fault-free: commits {ff.get('committed_steps')}, discarded {ff.get('discarded')}, "
            f"all {c['replicas']} every step {ff.get('participants_always_' + str(c['replicas']))}, "
            f"replicas identical {ff.get('replicas_identical')}, wall {ff.get('run_wall_s')} s"
        )
    for f in s.get("faults", []):
        if f.get("error"):
            print(f"  {f['kind']}@{f['step']} {f['target']}: ERROR {f['error']}")
            continue
        extra = ""
        if f["kind"] == "hang":
            extra = f", SIGKILLed after {f.get('hung_replica_killed_after_s')} s"
        if f["kind"] == "crash":
            extra = f", exit {f.get('crash_exit_code')} seen after {f.get('crash_exit_seen_after_s')} s"
        print(
            f"  {f['kind']}@{f['step']} {f['target']}{extra}: "
            f"survivors' next commit {f.get('survivors_next_commit_s')} s"
            f" (step {f.get('survivors_next_commit_step')}, {f.get('survivors_next_commit_participants')} "
            f"participant(s)); replacement(s) caught up {f.get('replacement_caught_up_s')} s; "
            f"steps lost {f.get('steps_lost')}; survivors' steps without all: "
            f"{len(f.get('survivors_steps_with_fewer_than_all', []))}"
        )
        for rk, v in f.get("replacements", {}).items():
            if v.get("started_without_a_trained_peer"):
                why = "the survivors had finished" if v.get("survivors_had_finished_before_it_was_ready") else "none"
                print(
                    f"    {rk}'s relaunch found no trained peer ({why}): its first quorum was at step "
                    f"{v.get('first_quorum_max_step')} with {v.get('first_quorum_size')} member(s)"
                )
        if f.get("still_recovering_from_earlier_fault"):
            print(
                f"    still recovering from an earlier fault when it fired: {f['still_recovering_from_earlier_fault']}"
            )
    print(
        f"every replica committed every step 1..{c['steps']}: {s.get('every_replica_committed_every_step')}; "
        f"bit-exact vs fault-free: {s.get('bit_exact')} (max abs param diff {s.get('max_abs_param_diff')})"
    )
    if s.get("error"):
        print("ERROR:", s["error"])
    print(f"wall {r.get('wall_s')} s")


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
