"""Multi-process gloo harness for tests: pools of ranks shared by the test modules (STYLE.md item 13).

Modelled on PyTorch's ``MultiProcContinuousTest``. ``RankPool(world_size)`` spawns its ranks at the first
``run`` and keeps them for every later one, since a gloo group costs 3 to 4 s to start on 2 cores.
``spawn``, never ``fork`` (forking a process that already runs torch's threads is unsafe). Each rank runs
one thread and joins the group through a ``FileStore`` in a fresh temporary directory (no port to collide
on), with a process-group timeout so that a stuck collective raises.

``pool.run(fn, *args, **kwargs)`` sends a scenario to every rank and returns the results in rank order.
``fn`` travels by reference (module and qualified name): it must be a module-level function, e.g. of
``tests/test_foo.py``, which each rank then imports. Between scenarios ranks run no hidden collective;
they only call ``torch.manual_seed(0)``. Messages are ``pickle`` bytes over one ``Pipe`` per rank, not
``Connection.send``, whose pickler carries torch's shared-memory tensor reducers (they break when a rank
is killed). Workers import torch only after setting ``OMP_NUM_THREADS``, hence the local imports.

The parent waits on the pipes and the process sentinels together, so a crash (segfault, ``os._exit``, OOM
kill) is seen at once, not at the timeout. At the first error, crash or deadline it kills every rank and
raises ``RankFailure`` with the failing rank's traceback; the next ``run`` starts fresh ranks, so one
failing test does not break the rest of its module.

Glossary: *rank*, one worker process; *scenario*, the function a test runs on every rank; *deadline*, the
parent's own limit on one ``run`` (``run_timeout_s``), a backstop behind the gloo timeout.
Import this module as ``tests.harness`` (``tests/conftest.py`` puts the repository root on ``sys.path``).
"""
from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path

_STOP = b"stop"  # close() sentinel; scenario payloads are pickles, which never equal it
_KILL_GRACE_S = 2.0  # between SIGTERM and SIGKILL
_CLOSE_GRACE_S = 10.0  # for ranks to leave their process group after the stop sentinel
_SWEEP_S = 0.2  # after a first failure, how long to wait for other ranks failing at the same moment


class RankFailure(RuntimeError):
    """A scenario failed on some rank. ``rank`` is the first to fail; ``failures`` maps rank -> report."""

    def __init__(self, message: str, rank: int, failures: dict[int, str]):
        super().__init__(message)
        self.rank = rank
        self.failures = failures


def rank() -> int:
    """This rank's index in the default process group (call inside a scenario)."""
    import torch.distributed as dist

    return dist.get_rank()


def world_size() -> int:
    """Number of ranks in the default process group (call inside a scenario)."""
    import torch.distributed as dist

    return dist.get_world_size()


SHARED_SIZES = (1, 2, 4)  # the world sizes whose pools every test module shares (shared_pool)
SHARED_TIMEOUT_S = 240.0  # their process-group timeout: the longest any module asks for
_SHARED: dict[int, RankPool] = {}


def module_pool(world_size: int, **pool_kwargs):
    """Return a module-scoped pytest fixture holding a ``RankPool``; in a test file: ``pool2 = module_pool(2)``.
    For 1, 2 and 4 ranks it is the session's shared pool (shared_pool), so ranks are started, and torch, the model
    libraries and the compiler warmed up, once per suite instead of once per module; other sizes get a pool of their
    own, closed after the module."""
    import pytest

    @pytest.fixture(scope="module")
    def pool():
        if world_size in SHARED_SIZES:
            yield shared_pool(world_size)
            return
        with RankPool(world_size, **pool_kwargs) as p:
            yield p

    return pool


def shared_pool(world_size: int) -> RankPool:
    """The session's pool of `world_size` ranks (started at its first run; after a failure its next run starts
    fresh ranks). Scenarios leave no state behind them (between scenarios a rank only reseeds), which is what
    makes sharing ranks across modules sound; close_shared_pools() ends them (tests/conftest.py, at the end)."""
    pool = _SHARED.get(world_size)
    if pool is None or pool._closed:
        pool = _SHARED[world_size] = RankPool(world_size, timeout_s=SHARED_TIMEOUT_S)
    return pool


def shared_pids() -> set[int]:
    """The process ids of the shared pools' live ranks (which outlive each module by design)."""
    return {pid for pool in _SHARED.values() for pid in pool.pids}


def leftover_children() -> list:
    """This process's live children, less the session's shared pools' ranks."""
    shared = shared_pids()
    return [p for p in multiprocessing.active_children() if p.pid not in shared]


def close_shared_pools() -> None:
    for pool in _SHARED.values():
        pool.close()
    _SHARED.clear()


class RankPool:
    """``world_size`` gloo ranks that run scenarios sent by the parent; see the module docstring.

    Args:
        world_size: number of ranks.
        timeout_s: process-group timeout: a collective that waits longer raises on its rank.
        run_timeout_s: the parent's deadline for one ``run`` (default ``timeout_s + 30``); the first run
            after a (re)start includes importing the scenario's module on each rank.
        start_timeout_s: the parent's deadline for spawning the ranks and joining the group.
    """

    def __init__(self, world_size: int, timeout_s: float = 60.0, *, run_timeout_s: float | None = None,
                 start_timeout_s: float = 300.0):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"RankPool world_size must be a positive int, got {world_size!r}")
        limits = {"timeout_s": timeout_s, "run_timeout_s": run_timeout_s, "start_timeout_s": start_timeout_s}
        for name, value in limits.items():
            if value is not None and not value > 0:
                raise ValueError(f"RankPool {name} must be > 0 seconds, got {value!r}")
        self.world_size = world_size
        self.timeout_s = float(timeout_s)
        self.run_timeout_s = float(run_timeout_s) if run_timeout_s is not None else self.timeout_s + 30.0
        self.start_timeout_s = float(start_timeout_s)
        self._ctx = multiprocessing.get_context("spawn")
        self._procs: list = []  # empty while not started, or after a failure (restart on next run)
        self._conns: list = []
        self._dir: str | None = None
        self._closed = False

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the live ranks, in rank order; empty before the first run and after a failure."""
        return [p.pid for p in self._procs]

    def run(self, fn, *args, **kwargs) -> list:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order or raise ``RankFailure``."""
        if self._closed:
            raise RuntimeError("RankPool.run() after close(); create a new RankPool")
        payload = _pickle_scenario(fn, args, kwargs)
        label = f"scenario {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        try:
            if not self._procs:
                self._start()
            self._send_all(payload)
            return self._gather(label, self.run_timeout_s)
        except BaseException:
            self._kill()  # Ctrl-C or a harness bug: leave no rank behind (a no-op after RankFailure)
            raise

    def close(self) -> None:
        """Ask every rank to leave its process group and exit; kill those that do not. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._send_all(_STOP)
        end = time.monotonic() + _CLOSE_GRACE_S
        for proc in self._procs:
            proc.join(max(0.0, end - time.monotonic()))
        self._kill()

    def _send_all(self, payload: bytes) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(payload)
            except OSError:
                pass  # a rank that died while idle: _gather reports it, _kill reaps it

    def _start(self) -> None:
        self._dir = tempfile.mkdtemp(prefix="fxpar-ranks-")
        for r in range(self.world_size):
            parent_end, child_end = self._ctx.Pipe()
            proc = self._ctx.Process(target=_worker, name=f"fxpar-rank{r}", daemon=True, args=(
                r, self.world_size, self._dir, self.timeout_s, self.start_timeout_s, child_end))
            proc.start()
            child_end.close()  # so that the rank's death reads as EOF here
            self._procs.append(proc)
            self._conns.append(parent_end)
        self._gather(f"start-up of {self.world_size} gloo ranks", self.start_timeout_s)

    def _gather(self, label: str, timeout_s: float) -> list:
        """Collect one reply per rank; at the first error, crash or deadline, kill all ranks and raise."""
        results: dict[int, object] = {}
        failures: dict[int, str] = {}
        deadline = time.monotonic() + timeout_s
        while len(results) < self.world_size and not failures:
            pending = [r for r in range(self.world_size) if r not in results]
            left = deadline - time.monotonic()
            if left <= 0:
                stacks = self._dump_stacks(pending)
                for r in pending:
                    failures[r] = f"did not finish within {timeout_s:g} s; its Python stacks then:\n{stacks[r]}"
                break
            wait([self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending], left)
            self._poll(pending, results, failures)
        pending = [r for r in range(self.world_size) if r not in results and r not in failures]
        if failures and pending:  # ranks failing at the same moment report too, for the full picture
            wait([self._conns[r] for r in pending], _SWEEP_S)
            self._poll(pending, results, failures)
        if not failures:
            return [results[r] for r in range(self.world_size)]
        running = [r for r in range(self.world_size) if r not in results and r not in failures]
        self._kill()
        first = next(iter(failures))
        lines = [f"{label} failed on rank {first} of {self.world_size}. Ranks finished ok: {sorted(results)}; "
                 f"failed: {sorted(failures)}; still running when all were killed: {running}"]
        for r in sorted(failures, key=lambda r: r != first):
            lines += [f"---------- rank {r} ----------", failures[r].rstrip()]
        raise RankFailure("\n".join(lines), first, failures)

    def _poll(self, ranks: list[int], results: dict, failures: dict) -> None:
        """Move every reply already sent by ``ranks`` into ``results`` or ``failures``, without blocking.

        Deaths go into ``failures`` before errors: when a rank dies its peers fail too ("Connection reset
        by peer"), and the parent often sees both at once; the dead rank is the one to report first.
        """
        deaths, errors = {}, {}
        for r in ranks:
            conn, proc = self._conns[r], self._procs[r]
            if conn.poll():
                try:
                    reply = conn.recv_bytes()
                except (EOFError, OSError):
                    deaths[r] = self._death_report(r)
                    continue
                try:
                    status, value = pickle.loads(reply)
                except Exception:
                    status, value = "error", f"its reply does not unpickle here:\n{traceback.format_exc()}"
                (results if status == "ok" else errors)[r] = value
            elif not proc.is_alive():
                deaths[r] = self._death_report(r)
        failures.update(deaths)
        failures.update(errors)

    def _death_report(self, r: int) -> str:
        self._procs[r].join(1.0)  # its pipe closes a moment before its exit status is ready
        code = self._procs[r].exitcode
        if code is None:
            how = "closed its pipe but is still alive"
        elif code < 0:
            how = f"died from signal {signal.Signals(-code).name}"
        else:
            how = f"died with exit code {code}"
        return f"rank {r} {how} without reporting a Python error (look for its output on stderr)"

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask ``ranks`` for their Python stacks (faulthandler on SIGUSR1) to show where they hang."""
        for r in ranks:
            os.kill(self._procs[r].pid, signal.SIGUSR1)  # not yet joined, so the pid is still this rank's
        files = {r: Path(self._dir, f"stacks.{r}") for r in ranks}
        end = time.monotonic() + 3.0  # a loaded machine may take a while to schedule them
        while time.monotonic() < end and not all(f.exists() and f.stat().st_size for f in files.values()):
            time.sleep(0.05)
        time.sleep(0.1)  # let the last ones finish writing
        return {r: (f.read_text() if f.exists() else "") or "(none written)" for r, f in files.items()}

    def _kill(self) -> None:
        """SIGTERM every rank, SIGKILL those still alive after a grace period, and forget them."""
        for proc in self._procs:
            if proc.is_alive():
                proc.terminate()
        end = time.monotonic() + _KILL_GRACE_S
        for proc in self._procs:
            proc.join(max(0.0, end - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
            proc.close()
        for conn in self._conns:
            conn.close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._procs, self._conns, self._dir = [], [], None


def _pickle_scenario(fn, args: tuple, kwargs: dict) -> bytes:
    if not callable(fn):
        raise TypeError(f"RankPool.run() needs a function as its first argument, got {type(fn).__name__}")
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as e:
        raise TypeError(
            f"cannot send scenario {fn!r} to the ranks: {e}. Scenarios travel by reference, so define them "
            "at module level of an importable module (a test file, not inside a test, not a lambda); "
            "their args and kwargs must pickle too.") from e


def _worker(rank_: int, world_size_: int, tmp_dir: str, timeout_s: float, start_timeout_s: float, conn) -> None:
    """One rank: join the gloo group, then run scenarios until the stop sentinel or the parent's exit."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it kills the ranks
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # before torch is imported
    stacks = open(os.path.join(tmp_dir, f"stacks.{rank_}"), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.FileStore(os.path.join(tmp_dir, "store"), world_size_)
        store.set_timeout(timedelta(seconds=start_timeout_s))
        store.set(f"booted/{rank_}", "1")  # wait until every rank has imported torch, so that slow
        store.wait([f"booted/{r}" for r in range(world_size_)])  # start-ups don't eat the gloo timeout
        dist.init_process_group("gloo", store=store, rank=rank_, world_size=world_size_,
                                timeout=timedelta(seconds=timeout_s))
        reply = ("ok", None)
    except BaseException:
        reply = ("error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(reply))
    if reply[0] != "ok":
        return
    try:  # EOFError or OSError here: the parent is gone
        while (payload := conn.recv_bytes()) != _STOP:
            try:
                fn, args, kwargs = pickle.loads(payload)
                torch.manual_seed(0)
                reply_bytes = pickle.dumps(("ok", fn(*args, **kwargs)))
            except BaseException:
                reply_bytes = pickle.dumps(("error", traceback.format_exc()))
            conn.send_bytes(reply_bytes)
    except (EOFError, OSError):
        pass
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the interpreter's teardown of torch: 0.7 s of CPU per rank, nothing to save
