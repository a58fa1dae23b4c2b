"""The shared-memory all-reduce (worker/cpu/shm_allreduce.py, csrc/shm_allreduce.cpp)
between real processes (spawned, 2 and 3 ranks on this machine's cores).

Every rank's input is a pure function of (seed, call, rank), so the parent (and each
rank, for the long runs) rebuilds all ranks' inputs and checks each result against
- the exact sum in float64 of those inputs, within the float tolerance of a float32
  accumulation (and one bfloat16 rounding), and
- torch's own adds in rank order 0, 1, ..., bit for bit (the kernel's documented
  order), and the ranks' results against one another, bit for bit.
Small chunks (a few hundred bytes) make multi-chunk messages and buffer reuse cheap.
"""

from __future__ import annotations

import hashlib
import io
import multiprocessing as mp
import os
import time
import traceback

import pytest
import torch

from worker.cpu.shm_allreduce import ShmAllReduce, ShmAllReduceTimeout

needs_kernels = pytest.mark.skipif(not ShmAllReduce.available(), reason="the CPU kernels cannot be built here")
pytestmark = needs_kernels

CHUNK = 512  # bytes: 128 float32 / 256 bfloat16 elements per exchange


def rank_input(seed: int, call: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + call * 101 + rank)
    scale = 10.0 ** torch.randint(-3, 4, (numel,), generator=g)  # mixed magnitudes: order matters in float32
    return (torch.randn(numel, generator=g, dtype=torch.float64) * scale).to(dtype)


def reference(seed: int, call: int, world: int, numel: int, dtype: torch.dtype):
    """(exact float64 sum, float tolerance per element, torch's float32 sum in rank order
    rounded to dtype)."""
    xs = [rank_input(seed, call, r, numel, dtype) for r in range(world)]
    exact = torch.stack([x.double() for x in xs]).sum(0)
    magnitude = torch.stack([x.double().abs() for x in xs]).sum(0)
    tol = world * 2.0**-23 * magnitude + (2.0**-8 * exact.abs() if dtype == torch.bfloat16 else 0)
    ordered = xs[0].float()
    for x in xs[1:]:
        ordered = ordered + x.float()
    return exact, tol, ordered.to(dtype)


def check(result: torch.Tensor, seed: int, call: int, world: int) -> str | None:
    """None, or what is wrong with this result."""
    exact, tol, ordered = reference(seed, call, world, result.numel(), result.dtype)
    err = (result.double() - exact).abs()
    if not bool((err <= tol).all()):
        i = int((err - tol).argmax())
        return f"call {call}: element {i} is {result[i].item()}, the exact sum {exact[i].item()}"
    if not torch.equal(result.view(torch.int16 if result.dtype == torch.bfloat16 else torch.int32),
                       ordered.view(torch.int16 if result.dtype == torch.bfloat16 else torch.int32)):
        return f"call {call}: not the rank-order float32 sum bit for bit"
    return None


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _rank_main(fn, path, rank, world, out, kwargs):
    torch.set_num_threads(1)
    try:
        shm = ShmAllReduce(path, rank, world, chunk_bytes=kwargs.pop("chunk_bytes", CHUNK),
                           timeout_s=kwargs.pop("timeout_s", 20.0))
        value = io.BytesIO()  # torch.save's bytes: a queue would share tensors by fd, gone with this process
        torch.save(fn(shm, rank, world, **kwargs), value)
        out.put((rank, "ok", value.getvalue()))
    except BaseException as exc:  # noqa: BLE001  (reported to the parent)
        out.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def run_ranks(fn, world: int, tmp_path, limit_s: float = 60.0, **kwargs) -> dict[int, object]:
    """fn(shm, rank, world, **kwargs) in `world` spawned processes; {rank: its return};
    any rank's exception fails the test, and so does a rank still running after limit_s
    (killed: no test hangs)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    path = str(tmp_path / "segment")
    procs = [ctx.Process(target=_rank_main, args=(fn, path, r, world, out, dict(kwargs)), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results, errors, deadline = {}, [], time.monotonic() + limit_s
    try:
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"ranks still running after {limit_s} s (hung?): got {sorted(results)}")
            try:
                rank, status, value = out.get(timeout=min(left, 1.0))
            except Exception:  # queue.Empty
                if any(p.exitcode not in (None, 0) for p in procs):
                    pytest.fail(f"a rank died: exit codes {[p.exitcode for p in procs]}")
                continue
            if status == "ok":
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}: {value}")
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(errors)
    return results


# --- what the ranks run -------------------------------------------------------------

def _cases(shm, rank, world, seed, cases):
    """One all-reduce per (numel, dtype); the results, to be checked by the parent."""
    results = []
    for call, (numel, dtype) in enumerate(cases):
        t = rank_input(seed, call, rank, numel, dtype)
        assert shm.all_reduce(t) is t
        results.append(t)
    return results


def _many_calls(shm, rank, world, seed, calls):
    """`calls` back-to-back all-reduces of sizes and dtypes drawn alike on every rank,
    each checked here; (problems, digest of every result)."""
    g = torch.Generator().manual_seed(seed)
    problems, h = [], hashlib.sha256()
    for call in range(calls):
        numel = int(torch.randint(1, 1500, (1,), generator=g))
        dtype = torch.bfloat16 if torch.rand(1, generator=g).item() < 0.4 else torch.float32
        t = rank_input(seed, call, rank, numel, dtype)
        shm.all_reduce(t)
        problem = check(t, seed, call, world)
        if problem:
            problems.append(problem)
        h.update(digest(t).encode())
    return problems, h.hexdigest()


def _absent_peer(shm, rank, world, absent, timeout):
    """Ranks other than `absent` all-reduce once and report how long until they raised;
    `absent` attached and never calls."""
    shm.timeout_s = timeout  # attaching had longer (the ranks start at different times)
    if rank == absent:
        time.sleep(0.2)
        return None
    t = torch.ones(1000)
    start = time.monotonic()
    try:
        shm.all_reduce(t)
    except ShmAllReduceTimeout as exc:
        waited, message = time.monotonic() - start, str(exc)
    else:
        return "returned without the absent peer"
    try:  # out of step now: refuses at once
        shm.all_reduce(t)
        again = "a second call went through"
    except RuntimeError as exc:
        again = str(exc)
    return waited, message, again


def _pinned(shm, rank, world, seed, calls):
    os.sched_setaffinity(0, {0})  # every rank on one core: waits must sleep, and be woken
    start = time.monotonic()
    problems, h = _many_calls(shm, rank, world, seed, calls)
    return problems, h, time.monotonic() - start


# --- tests ----------------------------------------------------------------------------

F32_PER_CHUNK = CHUNK // 4


@pytest.mark.parametrize("world", [2, 3])
def test_sums_match_reference_and_agree_across_ranks(world, tmp_path):
    sizes = [1, 7, F32_PER_CHUNK - 1, F32_PER_CHUNK, F32_PER_CHUNK + 1, 2 * F32_PER_CHUNK, 5 * F32_PER_CHUNK + 33,
             4 * 576 + 3]  # one chunk, several, odd tails (bf16: half as many chunks)
    cases = [(n, dtype) for dtype in (torch.float32, torch.bfloat16) for n in sizes]
    results = run_ranks(_cases, world, tmp_path, seed=world, cases=cases)
    for call, (numel, dtype) in enumerate(cases):
        for rank in range(world):
            got = results[rank][call]
            assert got.dtype == dtype and got.numel() == numel
            problem = check(got, world, call, world)
            assert problem is None, f"rank {rank}, {numel} x {dtype}: {problem}"
        assert len({digest(results[r][call]) for r in range(world)}) == 1, f"ranks differ on call {call}"


@pytest.mark.parametrize("world", [2, 3])
def test_many_consecutive_calls_reuse_the_buffers_correctly(world, tmp_path):
    results = run_ranks(_many_calls, world, tmp_path, seed=7 + world, calls=200)
    for rank in range(world):
        problems, _ = results[rank]
        assert not problems, f"rank {rank}: {problems[:3]}"
    assert len({results[r][1] for r in range(world)}) == 1, "the ranks' results differ"


def test_large_message_with_the_default_chunk(tmp_path):
    """A prefill-sized message (4 MB, one default chunk) and one just over it."""
    numel = (4 << 20) // 4
    results = run_ranks(_cases, 2, tmp_path, seed=3, cases=[(numel, torch.float32), (numel + 5, torch.float32)],
                        chunk_bytes=4 << 20)
    for call in range(2):
        assert check(results[0][call], 3, call, 2) is None
        assert torch.equal(results[0][call], results[1][call])


def test_three_ranks_on_one_core(tmp_path):
    """More ranks than cores (here all on core 0): waits must give the core away and
    be woken when the peer publishes, or the ranks never finish (run_ranks' time limit
    fails the test); how fast is tests/bench/allreduce.py's business."""
    results = run_ranks(_pinned, 3, tmp_path, seed=11, calls=60)
    for rank in range(3):
        problems, _, _seconds = results[rank]
        assert not problems, f"rank {rank}: {problems[:3]}"
    assert len({results[r][1] for r in range(3)}) == 1


@pytest.mark.parametrize("world", [2, 3])
def test_absent_peer_makes_the_others_raise(world, tmp_path):
    timeout = 1.5
    results = run_ranks(_absent_peer, world, tmp_path, limit_s=30, absent=world - 1, timeout=timeout)
    for rank in range(world - 1):
        assert isinstance(results[rank], tuple), f"rank {rank}: {results[rank]}"
        waited, message, again = results[rank]
        assert timeout <= waited < timeout + 1.5, f"rank {rank} raised after {waited:.2f} s"
        assert "timed out" in message and f"rank {world - 1}" in message
        assert "out of step" in again


def test_attach_gives_up_when_rank_0_never_creates(tmp_path):
    start = time.monotonic()
    with pytest.raises(ShmAllReduceTimeout, match="did not appear"):
        ShmAllReduce(str(tmp_path / "never"), 1, 2, timeout_s=0.5)
    assert time.monotonic() - start < 2


def test_file_is_unlinked_and_tensors_are_checked(tmp_path):
    path = str(tmp_path / "single")
    shm = ShmAllReduce(path, 0, 1)
    assert os.path.exists(path) and not any(".tmp" in name for name in os.listdir(tmp_path))
    shm.unlink()
    assert not os.path.exists(path)
    t = torch.arange(5.0)
    assert torch.equal(shm.all_reduce(t), torch.arange(5.0))  # one rank: the sum is itself
    for bad, why in [(torch.ones(4, dtype=torch.float64), "float32 or bfloat16"),
                     (torch.ones(4, 4).t(), "contiguous"),
                     (torch.ones(4, dtype=torch.int32), "float32 or bfloat16"),
                     ([1.0, 2.0], "a tensor")]:
        with pytest.raises(ValueError, match=why):
            shm.all_reduce(bad)
    shm.close()
    with pytest.raises(ValueError, match="closed"):
        shm.all_reduce(t)


def test_mismatched_calls_raise_instead_of_summing(tmp_path):
    results = run_ranks(_mismatch, 2, tmp_path, limit_s=30, timeout_s=5.0)
    for rank in range(2):
        assert "the ranks' calls differ" in results[rank], results[rank]


def _mismatch(shm, rank, world):
    t = torch.ones(100 + rank)  # 400 vs 404 bytes: one chunk each, different calls
    try:
        shm.all_reduce(t)
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_for_group_over_gloo(tmp_path):
    results = run_ranks(_for_group, 2, tmp_path, port=_free_port())
    for rank in range(2):
        leftover, value = results[rank]
        assert not leftover, f"left in /dev/shm: {leftover}"
        assert value == 3.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _for_group(_shm, rank, world, port):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        shm = ShmAllReduce.for_group(timeout_s=20)
        dist.barrier()  # rank 0 has unlinked by now
        leftover = [n for n in os.listdir("/dev/shm") if os.path.basename(shm.path) in n]
        t = torch.full((10,), float(rank + 1))
        shm.all_reduce(t)
        shm.close()
        return leftover, t[0].item()
    finally:
        dist.destroy_process_group()
