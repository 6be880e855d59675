#!/usr/bin/env python3
"""The physical baselines of this machine: what a save could cost at best.

    python acp-bench/peers/baselines.py                      # 1 GiB, 3 repeats, under /tmp
    python acp-bench/peers/baselines.py --size-gib 4 --dir /data --repeats 5

- memcpy: libc ``memcpy`` (``ctypes.memmove``, which releases the GIL) from one buffer into
  another that is preallocated and prefaulted, on one thread and on every CPU (the bytes split
  evenly between the threads);
- disk: a sequential O_DIRECT write of a fresh, fallocated file of exactly the given size with
  fio (``--ioengine=io_uring --direct=1``, fsync at the end included), and an O_DIRECT read of
  it after dropping the page cache. Without fio, a Python O_DIRECT pwrite/pread loop stands in,
  and the result's ``tool`` says so.

Other scripts in this folder import it (``sys.path`` holds the script's own directory).
Times are seconds; GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

MiB = 1 << 20
GiB = 1 << 30
PAGE = 4096
DIRECT_ALIGN = 4096
"""O_DIRECT offsets and lengths are kept to multiples of this (the logical block size of
any common device divides it)."""

FIO_BS = "1M"
FIO_IODEPTH = 32
"""The fio settings with the best O_DIRECT io_uring write on this machine (shared notes,
``peers/RESULTS.md``, 8 GiB: 1M at depth 32 gave 1.89 GB/s, 4M at depth 32 1.82 GB/s, depth
1 about 1.5). Differences below 10% are within this VM's run-to-run noise."""

Range = tuple[int, int, int]
"""``(dst_ptr, src_ptr, nbytes)``."""


# ----------------------------------------------------------------------------- machine


def cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def meminfo() -> dict[str, int]:
    """``/proc/meminfo`` in bytes (empty where there is none)."""
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def mem_available() -> int:
    """MemAvailable in bytes: what can be allocated without swapping or the OOM killer."""
    info = meminfo()
    return info.get("MemAvailable", info.get("MemFree", 0))


def mount_of(path: str) -> dict[str, str]:
    """The mount holding ``path``: its device, mount point and file system type."""
    real = os.path.realpath(path)
    best = {"device": "?", "mount": "/", "fs": "?"}
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fs = line.split()[:3]
                mnt = mnt.replace("\\040", " ")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best["mount"]):
                    best = {"device": dev, "mount": mnt, "fs": fs}
    except OSError:
        pass
    return best


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def fio_version(fio: str = "fio") -> str | None:
    """``fio-3.33``, or None when fio is not installed."""
    exe = shutil.which(fio)
    if exe is None:
        return None
    p = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
    return p.stdout.strip() or None


def machine(path: str) -> dict[str, object]:
    """What the figures depend on: CPUs, memory, kernel, fio, and the file system of ``path``."""
    info = meminfo()
    return {
        "cpus": cpus(),
        "cpu_model": cpu_model(),
        "kernel": platform.release(),
        "mem_total": info.get("MemTotal"),
        "mem_available": info.get("MemAvailable"),
        "load_average": list(os.getloadavg()),
        "python": sys.version.split()[0],
        "fio": fio_version(),
        "dir": path,
        "dir_mount": mount_of(path),
        "shm_mount": mount_of("/dev/shm") if os.path.isdir("/dev/shm") else None,
    }


# ----------------------------------------------------------------------------- caches, files


def files_under(paths: Iterable[str]) -> list[str]:
    """Every regular file in ``paths`` (files, or directories walked)."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            out += [os.path.join(r, n) for r, _, ns in os.walk(p) for n in ns]
        elif os.path.exists(p):
            out.append(p)
    return out


def drop_caches(paths: Iterable[str]) -> str:
    """Empties the page cache: all of it (``echo 3 > /proc/sys/vm/drop_caches``, which needs
    root), else the pages of the files under ``paths`` (``posix_fadvise(DONTNEED)``). Returns
    the mode: ``"cold"``, ``"cold (fadvise)"`` or ``"warm (could not drop caches)"``."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "cold"
    except OSError:
        pass
    try:
        for p in files_under(paths):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except (OSError, AttributeError):
        return "warm (could not drop caches)"
    return "cold (fadvise)"


def fsync_path(path: str) -> None:
    """fsyncs every file under ``path``."""
    for fp in files_under([path]):
        fd = os.open(fp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ----------------------------------------------------------------------------- memory


class Buffer:
    """Anonymous, page-aligned memory, every page touched before use (prefaulted).

    ``random=True`` fills it with a pseudo-random pattern (a 1 MiB block repeated), so a copy
    reads real data; else every byte is 0x5A. ``addr`` is its address; ``close()`` unmaps it.
    """

    def __init__(self, nbytes: int, *, random: bool = False) -> None:
        self.size = nbytes
        self._mm = mmap.mmap(-1, max(nbytes, PAGE))
        self._view = ctypes.c_char.from_buffer(self._mm)
        self.addr = ctypes.addressof(self._view)
        if random and nbytes:
            head = min(nbytes, MiB)
            ctypes.memmove(self.addr, os.urandom(head), head)
            done = head
            while done < nbytes:  # doubling copies of what is already there
                n = min(done, nbytes - done)
                ctypes.memmove(self.addr + done, self.addr, n)
                done += n
        else:
            ctypes.memset(self.addr, 0x5A, nbytes)

    def close(self) -> None:
        if self._mm.closed:
            return
        del self._view  # the exported buffer must go before the mapping can close
        self._mm.close()

    def __enter__(self) -> Buffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def split_ranges(ranges: Sequence[Range], parts: int, align: int = 64) -> list[list[Range]]:
    """Splits ``ranges`` into ``parts`` lists holding the same number of bytes (to ``align``),
    cutting a range where a share ends: one large tensor is shared out like many small ones."""
    total = sum(n for _, _, n in ranges)
    share = -(-total // parts)
    share += -share % align
    out: list[list[Range]] = [[] for _ in range(parts)]
    i, room = 0, share
    for dst, src, n in ranges:
        off = 0
        while off < n:
            take = n - off if i == parts - 1 else min(n - off, room)
            if take:
                out[i].append((dst + off, src + off, take))
            off += take
            room -= take
            if room <= 0 and i < parts - 1:
                i, room = i + 1, share
    return out


def _copy(part: Sequence[Range]) -> None:
    memmove = ctypes.memmove  # a C call that releases the GIL
    for d, s, n in part:
        memmove(d, s, n)


def copy_ranges(ranges: Sequence[Range], threads: int = 1) -> float:
    """Copies every ``(dst, src, n)`` with libc memcpy on ``threads`` threads, the bytes split
    evenly; returns the seconds from the start of the copy until every thread is done (thread
    start-up is outside the timing). The caller owns the memory; dst must not overlap src."""
    if threads <= 1:
        t0 = time.perf_counter()
        _copy(ranges)
        return time.perf_counter() - t0
    parts = split_ranges(ranges, threads)
    start = threading.Barrier(threads)

    def work(part: list[Range]) -> None:
        start.wait()
        _copy(part)

    workers = [
        threading.Thread(target=work, args=(p,), name=f"memcpy-{i}", daemon=True)
        for i, p in enumerate(parts[1:], 1)
    ]
    for w in workers:
        w.start()
    start.wait()
    t0 = time.perf_counter()
    _copy(parts[0])
    for w in workers:
        w.join()
    return time.perf_counter() - t0


def memcpy(nbytes: int, threads: int = 1, repeats: int = 1) -> list[float]:
    """Seconds of each of ``repeats`` copies of ``nbytes`` from a filled buffer into a
    preallocated, prefaulted one (allocation and filling are outside the timing)."""
    with Buffer(nbytes, random=True) as src, Buffer(nbytes) as dst:
        ranges = [(dst.addr, src.addr, nbytes)]
        return [copy_ranges(ranges, threads) for _ in range(repeats)]


# ----------------------------------------------------------------------------- disk


@dataclass
class DiskResult:
    """One sequential O_DIRECT pass over a file."""

    op: str
    """``"write"`` (fresh fallocated file, fsync at the end included) or ``"read"``."""
    bytes: int
    secs: float
    gb_per_sec: float
    tool: str
    """What did the I/O, with its settings; says when fio was missing."""
    cache: str = ""
    """Reads: how the page cache was emptied (``drop_caches``)."""
    wall_secs: float = 0.0
    """The whole call, tool start-up and file set-up included."""

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // DIRECT_ALIGN) * DIRECT_ALIGN


def _bs_bytes(bs: str) -> int:
    units = {"k": 1 << 10, "m": MiB, "g": GiB}
    s = bs.strip().lower().rstrip("b")
    return int(s[:-1]) * units[s[-1]] if s[-1:] in units else int(s)


def _fio(
    fio: str, path: str, rw: str, nbytes: int, *, bs: str, iodepth: int
) -> tuple[float, int, str]:
    """Runs fio over ``path[0:nbytes]``: one job in ``bs`` blocks, then (when ``nbytes`` is
    not a multiple of ``bs``) one more for the tail, after it. Returns (seconds, bytes, tool).
    fio's runtime of a write job includes its ``end_fsync``."""
    block = _bs_bytes(bs)
    bulk = nbytes - nbytes % block
    tail = nbytes - bulk
    cmd = [
        fio,
        "--output-format=json",
        f"--filename={path}",
        f"--rw={rw}",
        "--ioengine=io_uring",
        "--direct=1",
        "--fallocate=none",  # the caller fallocated the file, outside the timing
        "--invalidate=1",
    ]
    fsync = ["--end_fsync=1"] if rw == "write" else []
    if bulk:
        cmd += ["--name=bulk", "--offset=0", f"--size={bulk}", f"--bs={block}"]
        cmd += [f"--iodepth={iodepth}"] + (fsync if not tail else [])
    if tail:
        cmd += ["--name=tail", "--stonewall", f"--offset={bulk}", f"--size={tail}"]
        cmd += [f"--bs={tail}", "--iodepth=1", *fsync]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode != 0 or "{" not in p.stdout:
        lines = (p.stderr or p.stdout).strip().splitlines()
        raise RuntimeError(f"fio {rw} of {path}: {lines[-1] if lines else p.returncode}")
    jobs = json.loads(p.stdout[p.stdout.index("{") :])["jobs"]
    errors = [j["error"] for j in jobs if j.get("error")]
    if errors:
        raise RuntimeError(f"fio {rw} of {path}: error {os.strerror(errors[0])}")
    secs = sum(j[rw]["runtime"] for j in jobs) / 1e3  # milliseconds
    done = sum(j[rw]["io_bytes"] for j in jobs)
    version = fio_version(fio) or "fio"
    tool = f"{version} io_uring O_DIRECT bs={bs} iodepth={iodepth}"
    return secs, done, tool


def _py_direct(path: str, rw: str, nbytes: int, block: int) -> tuple[float, int, str]:
    """The stand-in for fio: pwrite/pread loop on one thread, O_DIRECT, one aligned buffer."""
    flags = (os.O_WRONLY if rw == "write" else os.O_RDONLY) | os.O_DIRECT
    fd = os.open(path, flags)
    buf = Buffer(min(block, nbytes), random=True)
    view = memoryview(buf._mm)
    try:
        t0 = time.perf_counter()
        off = 0
        while off < nbytes:
            n = min(block, nbytes - off)
            write = rw == "write"
            done = os.pwrite(fd, view[:n], off) if write else os.preadv(fd, [view[:n]], off)
            if done <= 0:
                raise OSError(f"short {rw} at offset {off} of {path}")
            off += done
        if rw == "write":
            os.fsync(fd)
        secs = time.perf_counter() - t0
    finally:
        view.release()
        buf.close()
        os.close(fd)
    tool = f"python O_DIRECT p{rw} loop, 1 thread, {block // MiB} MiB blocks (fio not found)"
    return secs, off, tool


def direct_write(
    path: str,
    nbytes: int,
    *,
    bs: str = FIO_BS,
    iodepth: int = FIO_IODEPTH,
    fio: str = "fio",
) -> DiskResult:
    """Writes a fresh file of ``nbytes`` (rounded up to 4 KiB for O_DIRECT) at ``path``,
    sequentially with O_DIRECT, fsync included. The file is deleted and fallocated first,
    outside the timing; it is left in place (for ``direct_read``)."""
    t0 = time.perf_counter()
    size = _aligned(nbytes)
    if os.path.exists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        os.fsync(fd)
    finally:
        os.close(fd)
    exe = shutil.which(fio)
    if exe:
        secs, done, tool = _fio(exe, path, "write", size, bs=bs, iodepth=iodepth)
    else:
        secs, done, tool = _py_direct(path, "write", size, 4 * MiB)
    if done != size:
        raise RuntimeError(f"{tool}: wrote {done} bytes of {size} to {path}")
    return DiskResult("write", size, secs, size / secs / 1e9, tool, "", time.perf_counter() - t0)


def direct_read(
    path: str,
    nbytes: int | None = None,
    *,
    bs: str = FIO_BS,
    iodepth: int = FIO_IODEPTH,
    fio: str = "fio",
) -> DiskResult:
    """Reads ``path`` (its first ``nbytes``, rounded down to 4 KiB; all of it by default)
    sequentially with O_DIRECT, after dropping the page cache."""
    t0 = time.perf_counter()
    size = os.path.getsize(path) if nbytes is None else nbytes
    size -= size % DIRECT_ALIGN
    cache = drop_caches([path])
    exe = shutil.which(fio)
    if exe:
        secs, done, tool = _fio(exe, path, "read", size, bs=bs, iodepth=iodepth)
    else:
        secs, done, tool = _py_direct(path, "read", size, 4 * MiB)
    if done != size:
        raise RuntimeError(f"{tool}: read {done} bytes of {size} from {path}")
    return DiskResult("read", size, secs, size / secs / 1e9, tool, cache, time.perf_counter() - t0)


# ----------------------------------------------------------------------------- summaries


def summary(runs: Sequence[float]) -> dict[str, object]:
    """Median, min and max of ``runs`` (and the runs)."""
    return {
        "median": statistics.median(runs),
        "min": min(runs),
        "max": max(runs),
        "runs": list(runs),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size-gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="scratch directory (default: a new one in /tmp)")
    ap.add_argument("--bs", default=FIO_BS)
    ap.add_argument("--iodepth", type=int, default=FIO_IODEPTH)
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args()
    nbytes = int(a.size_gib * GiB)
    work = tempfile.mkdtemp(prefix="acp-baselines-", dir=a.dir)
    env = machine(work)
    print("# baselines", json.dumps(env), flush=True)
    out: dict[str, object] = {"machine": env, "bytes": nbytes}
    try:
        for threads in sorted({1, cpus()}):
            runs = memcpy(nbytes, threads, a.repeats)
            out[f"memcpy_{threads}"] = summary(runs)
            med = statistics.median(runs)
            print(f"memcpy, {threads} thread(s): {med:.4f} s  {nbytes / med / 1e9:.2f} GB/s")
        path = os.path.join(work, "direct.bin")
        for op in ("write", "read"):
            results = []
            for _ in range(a.repeats):
                if op == "write":
                    results.append(direct_write(path, nbytes, bs=a.bs, iodepth=a.iodepth))
                else:
                    results.append(direct_read(path, bs=a.bs, iodepth=a.iodepth))
            med = statistics.median(r.secs for r in results)
            out[f"direct_{op}"] = {**summary([r.secs for r in results]), "tool": results[0].tool}
            print(
                f"O_DIRECT {op}: {med:.4f} s  {nbytes / med / 1e9:.2f} GB/s  ({results[0].tool}"
                f"{', ' + results[0].cache if results[0].cache else ''})"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
