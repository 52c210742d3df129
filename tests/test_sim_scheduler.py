"""The simulator's replacement block scheduler (sim_scheduler.py) keeps the simulator's semantics."""
import numpy as np
import pytest
from numba import cuda

import sim_scheduler


def test_it_is_installed():
    from numba.cuda.simulator import kernel as simk

    assert getattr(simk.BlockManager, "_trapetum_patched", False)
    assert sim_scheduler.install()  # a second call is a no-op


@cuda.jit
def _reverse_in_shared(out, rounds):
    buf = cuda.shared.array(64, dtype=np.float32)
    t = cuda.threadIdx.x
    n = cuda.blockDim.x
    buf[t] = t + 100 * cuda.blockIdx.x
    for _ in range(rounds):
        cuda.syncthreads()
        v = buf[n - 1 - t]  # another thread's value: wrong without the barrier
        cuda.syncthreads()
        buf[t] = v
    cuda.syncthreads()
    out[cuda.blockIdx.x, t] = buf[t]


@pytest.mark.parametrize("rounds", [1, 3])
def test_syncthreads_orders_shared_memory(rounds):
    out = np.full((3, 64), np.nan, dtype=np.float32)
    _reverse_in_shared[3, 64](out, rounds)
    base = np.arange(64, dtype=np.float32)
    expect = base[::-1] if rounds % 2 else base
    np.testing.assert_array_equal(out, expect[None, :] + 100 * np.arange(3, dtype=np.float32)[:, None])


@cuda.jit
def _fails_in_one_thread(out):
    t = cuda.threadIdx.x
    cuda.syncthreads()
    if t == 5:
        out[1000] = 1.0  # out of bounds: the simulator raises IndexError in this thread
    cuda.syncthreads()
    out[t] = 1.0


def test_an_exception_in_one_thread_aborts_the_launch():
    out = np.zeros(32, dtype=np.float32)
    with pytest.raises(IndexError):
        _fails_in_one_thread[1, 32](out)


@cuda.jit
def _early_exit(out):
    t = cuda.threadIdx.x
    if t >= 16:
        return  # threads that ended no longer count at the barrier
    cuda.syncthreads()
    out[t] = 2.0


def test_threads_that_exit_early_do_not_hang_the_block():
    out = np.zeros(32, dtype=np.float32)
    _early_exit[1, 32](out)
    assert (out[:16] == 2).all() and (out[16:] == 0).all()


@pytest.mark.parametrize("worker, cpu", [(None, 3), ("gw0", 3), ("gw1", 5), ("gw2", 3), ("master", 3)])
def test_each_xdist_worker_runs_its_block_threads_on_a_cpu_of_its_own(monkeypatch, worker, cpu):
    monkeypatch.setattr(sim_scheduler.os, "sched_getaffinity", lambda pid: {5, 3})
    if worker is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
    assert sim_scheduler._block_cpu() == {cpu}


@cuda.jit
def _wait_for_each_other(out, counter):
    buf = cuda.shared.array(1, dtype=np.int32)
    if cuda.threadIdx.x == 0:
        buf[0] = cuda.blockIdx.x  # a block's own shared memory: another block's store would show here
        cuda.atomic.add(counter, 0, 1)
        while counter[0] < cuda.gridDim.x:  # every block must be running for this to end
            pass
    cuda.syncthreads()
    out[cuda.blockIdx.x, cuda.threadIdx.x] = buf[0]


def test_concurrent_grid_runs_blocks_at_once_each_with_its_own_shared_memory():
    out = np.full((3, 4), -1, dtype=np.int32)
    counter = np.zeros(1, dtype=np.int32)
    with sim_scheduler.concurrent_grid():
        _wait_for_each_other[3, 4](out, counter)
    np.testing.assert_array_equal(out, np.repeat(np.arange(3, dtype=np.int32)[:, None], 4, axis=1))
    assert counter[0] == 3


def test_concurrent_grid_raises_a_blocks_error():
    out = np.zeros(32, dtype=np.float32)
    with sim_scheduler.concurrent_grid(), pytest.raises(IndexError):
        _fails_in_one_thread[2, 32](out)
