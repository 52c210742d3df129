"""A faster block scheduler for numba's CUDA simulator, used by the test suite only.

The simulator runs each CUDA thread as a Python thread. Its launching thread finds the threads
waiting at ``syncthreads`` by polling them in a loop that never sleeps. On a two-core machine that
poll and the block threads hand the GIL back and forth across cores, and the block threads barely
run: measured on the CI kind (2 cores), the five residual-kernel tests took 11 s pinned to one
core and over 20 minutes unpinned, which made CI exceed its time limit.

Two changes, same semantics (threads still block at every ``syncthreads`` until all live threads
of the block arrive, and the first exception aborts the block):
- the launching thread waits on a condition that each block thread notifies when it reaches
  ``syncthreads`` or ends, instead of polling;
- block threads run on one CPU, so the GIL passes between them on one core. Torch's threads and
  the main thread keep their affinity.
Measured on the same five tests, unpinned: 13 s with the first change, 4.7 s with both.

:func:`concurrent_grid` runs a launch's blocks at once instead of one after another, each with
shared memory of its own, for kernels whose blocks wait on one another (the residual table kernel's
spread finish); the simulator otherwise shares one shared memory among a launch's blocks.
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings

import numpy as np


def _block_cpu() -> set[int] | None:
    """The one CPU this process's block threads run on. Under pytest-xdist each worker takes its own
    (worker gwN gets the N-th allowed CPU, wrapping): pinned all to the first, two workers ran their
    simulator tests on one core between them, slower than one process."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    n = int(worker[2:]) if worker.startswith("gw") and worker[2:].isdigit() else 0
    return {cpus[n % len(cpus)]}


def install() -> bool:
    """Replace the simulator's scheduler; False (with a warning) where numba-cuda's internals differ."""
    from numba.cuda.simulator import kernel as simk
    from numba.cuda.simulator import kernelapi

    thread_cls, manager_cls = simk.BlockThread, simk.BlockManager
    if (not all(hasattr(thread_cls, a) for a in ("run", "syncthreads")) or not hasattr(manager_cls, "run")
            or not isinstance(getattr(kernelapi.FakeCUDAModule, "shared", None), property)):
        warnings.warn("numba's simulator changed; its block scheduler is left as it is (tests may run slowly)")
        return False
    if getattr(manager_cls, "_trapetum_patched", False):
        return True
    original_thread_run = thread_cls.run
    cpu = _block_cpu()

    def thread_run(self):
        if cpu is not None:
            os.sched_setaffinity(0, cpu)  # pid 0: this thread only
        try:
            original_thread_run(self)
        finally:
            with self._manager._cv:
                self._manager._cv.notify_all()

    def syncthreads(self):
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads call")
        with self._manager._cv:
            self.syncthreads_blocked = True
            self._manager._cv.notify_all()
        self.syncthreads_event.wait()
        self.syncthreads_event.clear()
        if self.abort:
            raise RuntimeError("abort flag set on syncthreads clear")

    def manager_run(self, grid_point, *args):
        if _CONCURRENT["on"] and not getattr(self, "_runner", False):
            # Start this block and return; the launch's last block waits for them all (the simulator's launch
            # loop then copies the arrays back, so nothing may run after it).
            self._runner = True
            t = threading.Thread(target=_catching, args=(manager_run, self, grid_point, args), daemon=True)
            _CONCURRENT["blocks"].append(t)
            t.start()
            if all(g == d - 1 for g, d in zip(grid_point, self._grid_dim)):
                blocks, _CONCURRENT["blocks"] = _CONCURRENT["blocks"], []
                for b in blocks:
                    b.join()
                errors, _CONCURRENT["errors"] = _CONCURRENT["errors"], []
                if errors:
                    raise errors[0]
            return
        self._cv = threading.Condition()

        def target():
            self._f(*args)

        threads = [thread_cls(target, self, grid_point, p, self._debug) for p in np.ndindex(*self._block_dim)]
        for t in threads:
            t.start()
        live = threads
        while live:
            with self._cv:
                while True:
                    failed = [t for t in live if t.exception]
                    live = [t for t in live if t.is_alive()]
                    if failed or not live or all(t.syncthreads_blocked for t in live):
                        break
                    self._cv.wait(0.05)  # the timeout only guards against a missed notify
            if failed:
                for t in threads:
                    t.abort = True
                    t.syncthreads_blocked = False
                    t.syncthreads_event.set()
                raise failed[0].exception[0].with_traceback(failed[0].exception[1])
            for t in live:
                t.syncthreads_blocked = False
                t.syncthreads_event.set()
        for t in threads:
            if t.exception:
                raise t.exception[0].with_traceback(t.exception[1])

    module_cls = kernelapi.FakeCUDAModule
    original_shared = module_cls.shared

    def shared(self):  # cuda.shared: the launch's, or under concurrent_grid the calling block's
        launch = original_shared.fget(self)
        if not _CONCURRENT["on"]:
            return launch
        blocks = self.__dict__.setdefault("_per_block", {})
        with _CONCURRENT["lock"]:
            return blocks.setdefault(tuple(threading.current_thread().blockIdx), kernelapi.FakeCUDAShared(launch._dynshared_size))

    thread_cls.run = thread_run
    thread_cls.syncthreads = syncthreads
    manager_cls.run = manager_run
    module_cls.shared = property(shared)
    manager_cls._trapetum_patched = True
    return True


_CONCURRENT = {"on": False, "blocks": [], "errors": [], "lock": threading.Lock()}


def _catching(run, manager, grid_point, args):
    try:
        run(manager, grid_point, *args)
    except BaseException as e:  # noqa: BLE001 - raised again by the launch's last block
        _CONCURRENT["errors"].append(e)


@contextlib.contextmanager
def concurrent_grid():
    """Within it, every simulated launch runs all its blocks at once (a thread a block, each block its own
    shared memory), as a one-wave grid runs on a GPU: blocks may wait for one another."""
    _CONCURRENT["on"] = True
    try:
        yield
    finally:
        _CONCURRENT["on"] = False
