"""The RAM tier: snapshots in the node's shared memory, ``<root>/<run>/<node>/step-.../``,
so a restarted worker on a healthy node restores at memory speed.

The root (``$FTKIT_RAM_DIR``, else ``/dev/shm/ftkit-<uid>``) is per user, so nobody can plant a
step in another's run; every directory is checked before use (_check_private), never followed.
A run's directory is bound to its identity (:func:`run_identity`; docs/operations.md says why).
Every process using a run's directory holds a shared flock on its ``.live`` file (:func:`hold_run`),
which the kernel drops when the process ends however it ends; :func:`remove_job` refuses a run so held.
A removed step's data files are kept in ``<node>/.spare/`` (:class:`SparePool`): writing over a
file's tmpfs pages costs less than fresh ones, which the kernel allocates and zeroes.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import stat
import time
import uuid
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ftkit.errors import FtkitError, InvalidJobIdError, RamTierInUseError, RunIdentityError, UnsafeRamDirError
from ftkit.tiers.redact import redact_url
from ftkit.tiers.storage import Storage

if TYPE_CHECKING:
    from ftkit.config import Tier

log = logging.getLogger("ftkit")

IDENTITY_FILE = "identity.json"
LIVE_FILE = ".live"  # in a run's directory: each process using it holds a shared flock (hold_run)
TOKEN_FILE = ".ftkit-run-token"  # at a durable tier's root (durable_token)
_TOKEN_RE = re.compile(r"[0-9a-f]{32}")
TOKEN_WAIT_S = 300.0  # how long run_tokens(make=False) waits for the process that makes them
_SAFE = re.compile(r"[^A-Za-z0-9._-]")
_VALID_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


def validate_job_id(job: str) -> str:
    """`job` if it is a plain directory name (not a path, hidden or a flag); else InvalidJobIdError."""
    if not isinstance(job, str) or not _VALID_NAME.fullmatch(job):
        shown = job if isinstance(job, str) and len(job) <= 80 else f"{str(job)[:80]}..."
        raise InvalidJobIdError(
            f"invalid job id {shown!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "not starting with '.' or '-' (a directory name under the RAM root)"
        )
    return job


def _name_from(raw: str, what: str) -> str:
    """A directory name for a user-given id: unsafe characters become "_", then it must validate."""
    try:
        return validate_job_id(_SAFE.sub("_", raw.strip()))
    except InvalidJobIdError:
        raise RunIdentityError(
            f"{what} {raw[:80]!r} cannot name a RAM-tier directory: use 1-128 letters, "
            "digits, '.', '_' or '-', not starting with '.' or '-'"
        ) from None


def ram_root() -> str:
    return os.environ.get("FTKIT_RAM_DIR") or f"/dev/shm/ftkit-{os.geteuid()}"


def named_run() -> tuple[str, str] | None:
    """(variable, value) of the first run name set in the environment, or None."""
    return next(((v, os.environ[v]) for v in ("FTKIT_RUN_ID", "FTKIT_JOB_ID") if os.environ.get(v, "").strip()), None)


def job_dir(job: str | None = None) -> str:
    """The path of `job`'s RAM tier (default: the run named by $FTKIT_RUN_ID, else $FTKIT_JOB_ID;
    RunIdentityError when neither is set). Validates the name; creates and checks nothing."""
    if job is not None:
        return os.path.join(ram_root(), validate_job_id(job))
    named = named_run()
    if named is None:
        raise RunIdentityError(
            f"no job id given and $FTKIT_RUN_ID / $FTKIT_JOB_ID are unset: name the "
            f"job (its directory under {ram_root()})"
        )
    return os.path.join(ram_root(), _name_from(named[1], f"${named[0]}"))


@dataclass(frozen=True)
class RunIdentity:
    """Which run a RAM-tier directory belongs to: its directory name and the record kept in it."""

    name: str
    record: dict[str, Any] = field(compare=False)
    source: str = ""  # where it came from, for messages: "run_id", "$FTKIT_RUN_ID", "durable tiers", ...


def _location(url: str) -> str:
    """A durable tier's location, credentials removed: the same on every restart of the run."""
    if url.startswith("file://"):
        url = url[len("file://") :]
    if "://" not in url:
        return os.path.normpath(os.path.abspath(url))
    return redact_url(url).rstrip("/")


def run_identity(durable_urls: Iterable[str], run_id: str | None = None, tokens: Iterable[str] = ()) -> RunIdentity:
    """The run a "ram" tier belongs to: `run_id`, $FTKIT_RUN_ID / $FTKIT_JOB_ID, else a hash of
    `durable_urls` (the other tiers) and their `tokens` (durable_tokens: a deleted tier's new
    one is another run), or of torchrun's rendezvous id. The same on every rank and restart."""
    from ftkit.coord.dist import rendezvous_id

    if run_id is not None:
        return RunIdentity(_name_from(str(run_id), "run_id"), {"named": str(run_id)}, "run_id")
    named = named_run()
    if named is not None:
        return RunIdentity(_name_from(named[1], f"${named[0]}"), {"named": named[1]}, f"${named[0]}")
    locations = sorted({_location(u) for u in durable_urls})
    if locations:
        record: dict[str, Any] = {"durable_tiers": locations, **({"tokens": sorted(tokens)} if tokens else {})}
        source = "durable tiers " + ", ".join(locations)
    elif rendezvous_id() is not None:
        record = {"rendezvous_id": rendezvous_id()}
        source = f"torchrun rendezvous id {rendezvous_id()}"
    else:
        raise RunIdentityError(
            'the "ram" tier cannot tell which run it belongs to (no run_id, no $FTKIT_RUN_ID or '
            "$FTKIT_JOB_ID, no durable tier, no torchrun --rdzv-id), so it would share its snapshots with "
            'every other run on this host. Name the run: Checkpointer(..., run_id="my-run") or '
            "FTKIT_RUN_ID=my-run (a restarted run must use the same name)"
        )
    digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()
    return RunIdentity(f"run-{digest[:16]}", record, source)


def durable_token(storage: Storage) -> str | None:
    """The token at the root of a durable tier (made if missing): it names this life of the
    tier, so a run started over after the tier was deleted is not the run whose RAM snapshots
    are still on the node. None when it can be neither read nor written (logged)."""
    try:
        token = _read_token(storage)
        if token is None:  # (missing or not ours: a new life)
            token = uuid.uuid4().hex
            storage.write_bytes_atomic(TOKEN_FILE, token.encode())
        return token
    except FtkitError as e:
        log.warning("ftkit: the RAM tier's run is named by %s's location only: %s", storage.display_url, e)
        return None


def _read_token(storage: Storage) -> str | None:
    """The token at the root of a durable tier, or None when there is none (FtkitError when unreadable)."""
    if not storage.exists(TOKEN_FILE):
        return None
    with storage.open_read(TOKEN_FILE) as f:
        token = f.read(64).decode("ascii", "replace")
    return token if _TOKEN_RE.fullmatch(token) else None


def _awaited_token(storage: Storage, deadline: float) -> str | None:
    """The token another process makes (durable_token), once it is there: None when the tier
    cannot be read, or has none by `deadline` (time.monotonic; logged)."""
    delay = 0.02
    try:
        while (token := _read_token(storage)) is None:
            if time.monotonic() >= deadline:
                log.warning(
                    "ftkit: no run token at %s in time (rank 0 makes it); the RAM tier's run is "
                    "named as this node's RAM tier recorded it, if it did",
                    storage.display_url,
                )
                return None
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 1.0)
        return token
    except FtkitError as e:
        log.warning("ftkit: the RAM tier's run is named by %s's location only: %s", storage.display_url, e)
        return None


def run_tokens(
    durable: Sequence[Tier], run_id: str | None = None, make: bool = True, wait_s: float = TOKEN_WAIT_S
) -> list[str]:
    """The durable tiers' tokens that name the RAM tier's run (run_identity's `tokens`), sorted:
    none for a named run (`run_id`, $FTKIT_RUN_ID / $FTKIT_JOB_ID); each read, or made where
    missing (`make`: the one process of the job that does, so no two make different ones), or
    else waited for, at most `wait_s` in all. When one cannot be had (a tier that cannot be read), the
    tokens this node's RAM tier of the run recorded (known_tokens), or none."""
    if run_id is not None or named_run() is not None or not durable:
        return []
    storages = [t.open() for t in durable]
    deadline = time.monotonic() + wait_s
    tokens = [durable_token(s) if make else _awaited_token(s, deadline) for s in storages]
    if None in tokens:  # one cannot be read: as this node's RAM tier recorded them, if it did
        return sorted(known_tokens(t.url for t in durable) or [])
    return sorted(t for t in tokens if t is not None)


def _runs_on(locations: list[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(directory name, record) of this node's RAM tiers of unnamed runs on the durable tiers at
    `locations`; one whose record cannot be read is left alone."""
    root = ram_root()
    for name in os.listdir(root) if os.path.isdir(root) else ():
        path = os.path.join(root, name, IDENTITY_FILE)
        if not name.startswith("run-") or not os.path.isfile(path):
            continue
        try:
            run = _read_identity(path).get("run")
        except (OSError, AttributeError, FtkitError) as e:  # (not ours to judge)
            log.info("ftkit: left %s alone: %s", name, e)
            continue
        if isinstance(run, dict) and run.get("durable_tiers") == locations:
            yield name, run


def known_tokens(durable_urls: Iterable[str]) -> list[str] | None:
    """The tokens recorded by this node's one RAM tier of a run on these durable tiers: what
    names the run while a durable tier cannot be read (an S3 outage at a restart)."""
    found = [run["tokens"] for _, run in _runs_on(sorted({_location(u) for u in durable_urls})) if "tokens" in run]
    return found[0] if len(found) == 1 and isinstance(found[0], list) else None


def retire_earlier_lives(identity: RunIdentity) -> None:
    """Remove this node's RAM tiers of runs on the same durable tiers under other tokens: runs
    whose durable tiers were deleted since (they are never restored; they would fill the node).
    Only when the tokens were read: without them, this run cannot tell which life is the live one."""
    if "tokens" not in identity.record:
        return
    for name, run in _runs_on(identity.record["durable_tiers"]):
        if name != identity.name and run != identity.record:
            try:
                remove_job(name)
            except (OSError, FtkitError) as e:
                log.info("ftkit: left %s alone: %s", name, e)
            else:
                log.warning("ftkit: removed the RAM tier %s of an earlier run on the same durable tiers", name)


def _check_private(path: str, what: str) -> None:
    """Refuse `path` unless it is a real directory owned by us and writable by nobody else."""
    try:
        st = os.lstat(path)
    except OSError as e:
        raise UnsafeRamDirError(f"RAM tier {what} {path}: cannot stat it ({e.strerror})") from None
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeRamDirError(
            f"RAM tier {what} {path} is a symlink; refusing to follow it "
            f"(remove it, or set FTKIT_RAM_DIR to a directory of your own)"
        )
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeRamDirError(f"RAM tier {what} {path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeRamDirError(
            f"RAM tier {what} {path} is owned by uid {st.st_uid}, not by this process "
            f"(uid {os.geteuid()}); refusing to use it (set FTKIT_RAM_DIR to a directory "
            "of your own)"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode & 0o022:
        raise UnsafeRamDirError(
            f"RAM tier {what} {path} has mode {mode:04o}: others can write into it "
            f"(plant or replace snapshots); refusing to use it (chmod 700 it, or set "
            "FTKIT_RAM_DIR to a private directory)"
        )
    if mode & 0o077:  # readable by others, but nothing can have been planted: make it private
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fst = os.fstat(fd)
            if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
                raise UnsafeRamDirError(f"RAM tier {what} {path} changed while being checked")
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
        log.warning("ftkit: RAM tier %s %s had mode %04o (readable by others); made it 0700", what, path, mode)


def _private_dir(path: str, what: str) -> str:
    """Create `path` 0700 if missing, then check it (see _check_private)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise UnsafeRamDirError(f"cannot create the RAM tier {what} {path}: {e.strerror}") from None
    _check_private(path, what)
    return path


def private_subdir(*parts: str) -> str:
    """``<root>/<parts...>``, each level created 0700 and checked (coord/nodelocal.py's heartbeats)."""
    path = _root()
    for part in parts:
        path = _private_dir(os.path.join(path, part), "directory")
    return path


def _root() -> str:
    root = os.path.abspath(ram_root())
    # e.g. FTKIT_RAM_DIR=/scratch/me/ftkit/ram: its parents are the user's
    os.makedirs(os.path.dirname(root), exist_ok=True)
    return _private_dir(root, "root")


def _read_identity(path: str) -> Any:
    """The JSON in `path`, opened without following links and only if it is a small regular file of ours."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK), "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size > 65536:
            raise UnsafeRamDirError(f"{path} is not a small regular file of this user's")
        data = f.read(65537)
    try:
        return json.loads(data)
    except ValueError:
        return None  # torn or foreign: treated as another run's (refused below)


def _bind(job_path: str, identity: RunIdentity) -> None:
    """Record `identity` in the job directory, or check the one recorded there. Hard-linked
    into place from a temporary file: several node leaders may race, and none reads half a record."""
    record = {"version": 1, "run": identity.record}
    path = os.path.join(job_path, IDENTITY_FILE)
    if not os.path.lexists(path):
        tmp = os.path.join(job_path, f".identity-{uuid.uuid4().hex[:12]}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(record, f, sort_keys=True)
            with contextlib.suppress(FileExistsError):  # another process recorded first: checked below
                os.link(tmp, path)
        finally:
            os.unlink(tmp)
    try:
        found = _read_identity(path)
    except OSError as e:
        reason = "it is a symlink" if e.errno == errno.ELOOP else e.strerror
        raise UnsafeRamDirError(f"cannot read the RAM tier's run record {path}: {reason}") from None
    if not isinstance(found, dict) or found.get("run") != identity.record:
        recorded = found.get("run") if isinstance(found, dict) else found
        raise RunIdentityError(
            f"RAM tier directory {job_path} belongs to another run (recorded {json.dumps(recorded)[:200]}; "
            f"this run is {json.dumps(identity.record)[:200]}); refusing to reuse it. Give this run another "
            f"name (run_id / $FTKIT_RUN_ID), or remove that one: ftkit gc ram --job {os.path.basename(job_path)}"
        )


def open_node_dir(identity: RunIdentity, node: str) -> str:
    """The RAM tier directory of `node` in `identity`'s run: created 0700, checked, bound to the run."""
    root = _root()
    job_path = _private_dir(os.path.join(root, validate_job_id(identity.name)), "job directory")
    _bind(job_path, identity)
    return _private_dir(os.path.join(job_path, _name_from(node, "node id")), "node directory")


def existing_job_dir(job: str | None = None) -> str | None:
    """`job`'s RAM tier directory if it exists, checked as for use (UnsafeRamDirError); else None."""
    path = job_dir(job)
    if not os.path.lexists(path):
        return None
    _check_private(os.path.dirname(path), "root")
    _check_private(path, "job directory")
    return path


def remove_job(job: str | None = None, force: bool = False) -> str:
    """Delete a finished job's RAM tier here, checked as for use (never a link); the directory removed.
    RamTierInUseError while a live process on this node holds it (hold_run), unless `force`."""
    import shutil

    path = existing_job_dir(job)
    if path is not None:
        with _unused(path, force):
            shutil.rmtree(path)
    return job_dir(job)


def check_unused(job: str | None = None) -> None:
    """RamTierInUseError if a live process on this node holds `job`'s RAM tier (hold_run); changes nothing."""
    path = existing_job_dir(job)
    if path is not None:
        with _unused(path, False, create=False):
            pass


class RunHold:
    """A process's shared flock on its run's LIVE_FILE: the run's RAM tier is in use while one is
    held. The kernel drops it when the process ends, however it ends (SIGKILL, OOM killer)."""

    def __init__(self, fd: int):
        self._close = weakref.finalize(self, os.close, fd)

    def close(self) -> None:
        self._close()


def hold_run(identity: RunIdentity) -> RunHold:
    """Hold `identity`'s RAM tier directory on this node (created 0700 and checked if missing)
    until closed or the process ends: `ftkit gc ram` refuses to remove it meanwhile. Waits while
    a removal is under way, then makes the directory again."""
    root = _root()
    for _ in range(100):
        job_path = _private_dir(os.path.join(root, validate_job_id(identity.name)), "job directory")
        fd = _open_live(job_path, create=True)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # (waits while remove_job holds it exclusively)
            held = os.fstat(fd)
            try:
                now = os.lstat(os.path.join(job_path, LIVE_FILE))
            except FileNotFoundError:  # removed while this process waited: made again
                now = None
            if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
                hold, fd = RunHold(fd), -1
                return hold
        finally:
            if fd >= 0:
                os.close(fd)
    raise UnsafeRamDirError(f"RAM tier job directory {job_path}: its {LIVE_FILE} keeps being replaced")


def _open_live(job_path: str, create: bool) -> int:
    """An fd of `job_path`'s LIVE_FILE, a regular file of ours (UnsafeRamDirError otherwise); -1 when
    it is missing and not `create`."""
    path = os.path.join(job_path, LIVE_FILE)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        if create:
            raise
        return -1
    except OSError as e:
        reason = "it is a symlink" if e.errno == errno.ELOOP else e.strerror
        raise UnsafeRamDirError(f"cannot open the RAM tier's {path}: {reason}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafeRamDirError(f"{path} is not a regular file of this user's")
    return fd


@contextlib.contextmanager
def _unused(job_path: str, force: bool, create: bool = True) -> Iterator[None]:
    """Within: no process holds `job_path` (hold_run), nor can take it (unless `force`: unchecked)."""
    if force:
        yield
        return
    fd = _open_live(job_path, create)  # (made if missing: a process starting now waits for this one)
    if fd < 0:  # no process ever held it
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RamTierInUseError(f"the RAM tier {job_path} is in use by a running process on this node") from None
        yield
    finally:
        os.close(fd)


SPARE_DIR = ".spare"


class SparePool:
    """Data files of removed steps, kept (`limit` of them) so the next writes reuse their pages.
    Shared by the node's ranks: a file is claimed by an atomic rename, so no two get the same."""

    def __init__(self, node_path: str, limit: int):
        self.dir = os.path.join(node_path, SPARE_DIR)
        self.limit = limit

    def give(self, paths: list[str]) -> list[str]:
        """Keep what fits of `paths` (data files of a step being removed); returns those not kept."""
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            room = self.limit - len(os.listdir(self.dir))
        except OSError:
            return list(paths)
        rest = []
        for path in paths:
            if room <= 0:
                rest.append(path)
                continue
            try:
                os.rename(path, os.path.join(self.dir, uuid.uuid4().hex[:12]))
                room -= 1
            except OSError:
                rest.append(path)
        return rest

    def take(self, dest: str) -> bool:
        """Move a spare file to `dest` (which must not exist); False when there is none."""
        try:  # spares only save time: any trouble here means a new file, as without them
            names = os.listdir(self.dir)
        except OSError:
            return False
        for name in names:
            try:
                os.rename(os.path.join(self.dir, name), dest)
                return True
            except FileNotFoundError:  # another rank of this node took it first
                continue
            except OSError:
                return False
        return False
