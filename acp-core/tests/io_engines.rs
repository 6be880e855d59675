//! One conformance suite for both I/O engines (`io_uring` and psync), with
//! `O_DIRECT` on and off: byte-identical files, exact lengths, mode 0600,
//! `on_chunk` order on writes, each chunk handed over once, as it lands, on
//! reads, `O_EXCL`, `O_NOFOLLOW`, size checks, and clean failure (no
//! partial file) at every injected fault.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use acp_core::io::{open_engine, IoEngine, IoKind, IoOpts};
use acp_core::storage::faults::FaultInjector;
use acp_core::{DirectIo, Error, ErrorKind, IoChoice};
use memmap2::MmapMut;

const CHUNK: usize = 64 << 10;

const SIZES: [usize; 9] = [
    0,
    1,
    4095,
    4096,
    4097,
    CHUNK - 1,
    CHUNK,
    CHUNK + 1,
    3 * CHUNK + 123,
];

/// Both engines; `io_uring` must work where these tests run (a silent
/// fallback would leave it untested).
fn engines() -> Vec<Arc<dyn IoEngine>> {
    let uring = open_engine(IoChoice::Uring).expect("io_uring is available on test machines");
    let psync = open_engine(IoChoice::Psync).expect("psync always opens");
    assert_eq!(uring.kind(), IoKind::Uring);
    assert_eq!(psync.kind(), IoKind::Psync);
    vec![psync, uring]
}

fn opts(direct: DirectIo, queue_depth: usize) -> IoOpts {
    IoOpts {
        chunk_bytes: CHUNK,
        queue_depth,
        direct,
        faults: None,
    }
}

fn round_up(n: usize) -> usize {
    n.next_multiple_of(4096)
}

/// A page-aligned buffer of at least `len` bytes, filled with a pattern
/// that differs per `seed` (and from the zeros of a sparse file).
fn aligned(len: usize, seed: u64) -> MmapMut {
    let mut m = MmapMut::map_anon(len.max(4096)).expect("anonymous map");
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for b in m.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x.to_le_bytes()[3];
    }
    m
}

type Calls = Vec<(usize, Vec<u8>)>;

/// Writes `src[..len]` to `path`, recording the `on_chunk` calls.
fn write(
    engine: &dyn IoEngine,
    path: &Path,
    src: &[u8],
    len: usize,
    opts: &IoOpts,
) -> (Result<acp_core::io::IoStats, Error>, Calls) {
    let mut calls = Vec::new();
    let r = engine.write_file(path, src, len as u64, opts, &mut |i, b| {
        calls.push((i, b.to_vec()));
        Ok(())
    });
    (r, calls)
}

/// Reads `path` into `dst`, recording the `on_chunk` calls (sorted by
/// chunk index) and checking that each runs on the calling thread.
fn read(
    engine: &dyn IoEngine,
    path: &Path,
    dst: &mut [u8],
    opts: &IoOpts,
) -> (Result<u64, Error>, Calls) {
    let caller = std::thread::current().id();
    let mut calls = Vec::new();
    let r = engine.read_file(path, dst, opts, &mut |i, b| {
        assert_eq!(std::thread::current().id(), caller, "on the calling thread");
        calls.push((i, b.to_vec()));
        Ok(())
    });
    calls.sort_by_key(|c| c.0);
    (r, calls)
}

/// Checks one call per chunk, chunk `k` the `k`-th (after sorting, for
/// reads), each with its unpadded bytes of `src`.
fn check_calls(calls: &Calls, src: &[u8], len: usize) {
    assert_eq!(calls.len(), len.div_ceil(CHUNK), "one call per chunk");
    for (k, (i, bytes)) in calls.iter().enumerate() {
        assert_eq!(*i, k, "in order");
        let end = ((k + 1) * CHUNK).min(len);
        assert!(
            bytes[..] == src[k * CHUNK..end],
            "chunk {k}: unpadded source bytes"
        );
    }
}

/// The tests sit in `io` so that `cargo test io` selects them.
mod io {
    use super::*;

    #[test]
    fn round_trip_every_size_engine_and_mode() {
        let dir = tempfile::tempdir().unwrap();
        for engine in engines() {
            for direct in [DirectIo::On, DirectIo::Off] {
                for qd in [1, 4] {
                    let o = opts(direct, qd);
                    for (k, &len) in SIZES.iter().enumerate() {
                        let case = format!("{:?} {direct:?} qd{qd} len {len}", engine.kind());
                        let path = dir
                            .path()
                            .join(format!("{:?}-{direct:?}-{qd}-{k}", engine.kind()));
                        let src = aligned(round_up(len), k as u64 + 1);
                        // The source is exactly as long as the contract asks.
                        let src = &src[..round_up(len)];
                        let (r, calls) = write(&*engine, &path, src, len, &o);
                        let stats = r.unwrap_or_else(|e| panic!("{case}: {e}"));
                        assert_eq!(stats.bytes, len as u64, "{case}");
                        assert_eq!(stats.kind, engine.kind(), "{case}");
                        assert_eq!(stats.direct, direct == DirectIo::On, "{case}");
                        check_calls(&calls, src, len);

                        let meta = fs::metadata(&path).unwrap();
                        assert_eq!(meta.len(), len as u64, "{case}: exact length");
                        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "{case}");
                        assert!(fs::read(&path).unwrap() == src[..len], "{case}: bytes");

                        for read_direct in [DirectIo::On, DirectIo::Off] {
                            let mut dst = aligned(round_up(len), 99);
                            let dst = &mut dst[..round_up(len)];
                            let (r, calls) = read(&*engine, &path, dst, &opts(read_direct, qd));
                            let n =
                                r.unwrap_or_else(|e| panic!("{case}: read {read_direct:?}: {e}"));
                            assert_eq!(n, len as u64, "{case}");
                            assert!(dst[..len] == src[..len], "{case}: read {read_direct:?}");
                            check_calls(&calls, src, len);
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn shm_with_auto_direct_round_trips() {
        let shm = Path::new("/dev/shm");
        if !shm.is_dir() {
            return;
        }
        let dir = tempfile::tempdir_in(shm).unwrap();
        for engine in engines() {
            for &len in &[0, 4097, 3 * CHUNK + 123] {
                let path = dir.path().join(format!("{:?}-{len}", engine.kind()));
                let src = aligned(round_up(len), 7);
                let o = opts(DirectIo::Auto, 4);
                let (r, calls) = write(&*engine, &path, &src, len, &o);
                r.unwrap();
                check_calls(&calls, &src, len);
                assert!(fs::read(&path).unwrap() == src[..len]);
                let mut dst = aligned(round_up(len), 8);
                let (r, calls) = read(&*engine, &path, &mut dst, &o);
                assert_eq!(r.unwrap(), len as u64);
                assert!(dst[..len] == src[..len]);
                check_calls(&calls, &src, len);
            }
        }
    }

    #[test]
    fn existing_file_is_refused_and_untouched() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        fs::write(&path, b"keep me").unwrap();
        let src = aligned(CHUNK, 1);
        for engine in engines() {
            for direct in [DirectIo::On, DirectIo::Off, DirectIo::Auto] {
                let (r, calls) = write(&*engine, &path, &src, 100, &opts(direct, 4));
                let e = r.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Io, "{e}");
                assert!(e.to_string().contains("create"), "{e}");
                assert!(calls.is_empty());
                assert_eq!(fs::read(&path).unwrap(), b"keep me");
            }
        }
    }

    #[test]
    fn read_that_does_not_fit_is_invalid_and_reads_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let len = 3 * CHUNK + 123;
        fs::write(&path, &aligned(len, 3)[..len]).unwrap();
        for engine in engines() {
            // Room for the bytes but not for the padded tail, and less.
            for room in [len, round_up(len) - 4096, 0] {
                let faults = Arc::new(FaultInjector::counting());
                let mut o = opts(DirectIo::Auto, 4);
                o.faults = Some(faults.clone());
                let mut dst = aligned(room, 4);
                let (r, calls) = read(&*engine, &path, &mut dst[..room], &o);
                let e = r.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
                assert_eq!(faults.ops(), 0, "nothing read");
                assert!(calls.is_empty());
            }
        }
    }

    #[test]
    fn read_refuses_symlinks_and_non_regular_files() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        fs::write(&target, b"data").unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let fifo = dir.path().join("fifo");
        let have_fifo = std::process::Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .is_ok_and(|s| s.success());
        for engine in engines() {
            let o = opts(DirectIo::Auto, 4);
            let mut dst = aligned(CHUNK, 5);
            let e = read(&*engine, &link, &mut dst, &o).0.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
            assert!(e.to_string().contains("symlink"), "{e}");
            let e = read(&*engine, dir.path(), &mut dst, &o).0.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
            if have_fifo {
                // Refused at once, not a hang waiting for a writer.
                let e = read(&*engine, &fifo, &mut dst, &o).0.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Corrupt, "{e}");
                assert!(e.to_string().contains("FIFO"), "{e}");
            }
            let e = read(&*engine, &dir.path().join("missing"), &mut dst, &o)
                .0
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Io, "{e}");
        }
    }

    /// Ops of one write of `len` bytes: a "write" per chunk and the "fsync".
    fn count_ops(engine: &dyn IoEngine, dir: &Path, len: usize, direct: DirectIo) -> u64 {
        let faults = Arc::new(FaultInjector::counting());
        let mut o = opts(direct, 4);
        o.faults = Some(faults.clone());
        let path = dir.join("count");
        let src = aligned(round_up(len), 6);
        write(engine, &path, &src, len, &o)
            .0
            .expect("write without faults");
        fs::remove_file(&path).expect("remove the counted file");
        let log = faults.log();
        assert_eq!(log.len() as u64, faults.ops());
        assert!(
            log.last().is_some_and(|l| l.starts_with("fsync ")),
            "{log:?}"
        );
        faults.ops()
    }

    #[test]
    fn every_injected_write_fault_fails_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let len = 3 * CHUNK + 123;
        let src = aligned(round_up(len), 9);
        for engine in engines() {
            for direct in [DirectIo::On, DirectIo::Off] {
                let ops = count_ops(&*engine, dir.path(), len, direct);
                assert_eq!(ops, len.div_ceil(CHUNK) as u64 + 1);
                for sticky in [false, true] {
                    for n in 0..ops {
                        let case = format!(
                            "{:?} {direct:?} fault at {n} sticky {sticky}",
                            engine.kind()
                        );
                        let mut o = opts(direct, 4);
                        o.faults = Some(Arc::new(FaultInjector::fail_at(n, libc::EIO, sticky)));
                        let path = dir.path().join("f");
                        let e = write(&*engine, &path, &src, len, &o).0.unwrap_err();
                        assert_eq!(e.kind(), ErrorKind::Io, "{case}: {e}");
                        assert!(!path.exists(), "{case}: partial file left");
                    }
                }
            }
        }
    }

    #[test]
    fn enospc_is_no_space_and_leaves_no_file() {
        let dir = tempfile::tempdir().unwrap();
        let len = 3 * CHUNK + 123;
        let src = aligned(round_up(len), 10);
        for engine in engines() {
            // A chunk write, and the fsync.
            for n in [1, 4] {
                let mut o = opts(DirectIo::On, 4);
                o.faults = Some(Arc::new(FaultInjector::fail_at(n, libc::ENOSPC, false)));
                let path = dir.path().join("f");
                let e = write(&*engine, &path, &src, len, &o).0.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::NoSpace, "{e}");
                assert!(e.to_string().contains(&*path.to_string_lossy()), "{e}");
                assert!(!path.exists());
            }
        }
    }

    #[test]
    fn on_chunk_error_stops_the_write_and_removes_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let len = 8 * CHUNK;
        let src = aligned(len, 11);
        for engine in engines() {
            for qd in [1, 4] {
                let path = dir.path().join("f");
                let mut seen = Vec::new();
                let r = engine.write_file(
                    &path,
                    &src,
                    len as u64,
                    &opts(DirectIo::On, qd),
                    &mut |i, _| {
                        seen.push(i);
                        if i == 2 {
                            return Err(Error::invalid("chunk 2", "hash refused"));
                        }
                        Ok(())
                    },
                );
                let e = r.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
                assert!(e.to_string().contains("hash refused"), "{e}");
                assert_eq!(seen, vec![0, 1, 2], "no chunk after the failing one");
                assert!(!path.exists());
            }
        }
    }

    #[test]
    fn on_chunk_runs_on_the_caller_before_its_chunk_is_written() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let len = 6 * CHUNK + 9;
        let src = aligned(round_up(len), 15);
        let caller = std::thread::current().id();
        for engine in engines() {
            for (qd, direct) in [(1, DirectIo::On), (4, DirectIo::Off)] {
                let path = dir.path().join(format!("{:?}-{qd}", engine.kind()));
                let mut seen = 0;
                engine
                    .write_file(&path, &src, len as u64, &opts(direct, qd), &mut |i, b| {
                        assert_eq!(std::thread::current().id(), caller);
                        // The file exists (fallocated, zeros) but chunk `i`
                        // is not in it yet.
                        let mut now = vec![1u8; b.len()];
                        let f = fs::File::open(&path).unwrap();
                        f.read_exact_at(&mut now, (i * CHUNK) as u64).unwrap();
                        assert!(
                            now.iter().all(|&x| x == 0),
                            "chunk {i} written before on_chunk"
                        );
                        seen += 1;
                        Ok(())
                    })
                    .unwrap();
                assert_eq!(seen, 7);
                assert!(fs::read(&path).unwrap() == src[..len]);
            }
        }
    }

    #[test]
    fn every_injected_read_fault_fails() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let len = 3 * CHUNK + 123;
        let src = aligned(len, 12);
        fs::write(&path, &src[..len]).unwrap();
        for engine in engines() {
            for direct in [DirectIo::On, DirectIo::Off] {
                let mut dst = aligned(round_up(len), 13);
                let faults = Arc::new(FaultInjector::counting());
                let mut o = opts(direct, 4);
                o.faults = Some(faults.clone());
                read(&*engine, &path, &mut dst, &o).0.unwrap();
                assert_eq!(faults.ops(), len.div_ceil(CHUNK) as u64);
                for n in 0..faults.ops() {
                    o.faults = Some(Arc::new(FaultInjector::fail_at(n, libc::EIO, false)));
                    let (r, calls) = read(&*engine, &path, &mut dst, &o);
                    let e = r.unwrap_err();
                    assert_eq!(e.kind(), ErrorKind::Io, "{e}");
                    // The failed chunk is not handed over; what was, before
                    // the fault, is the file's.
                    assert!(calls.len() < len.div_ceil(CHUNK), "{e}");
                    for (i, bytes) in &calls {
                        let end = ((i + 1) * CHUNK).min(len);
                        assert!(bytes[..] == src[i * CHUNK..end], "chunk {i}");
                    }
                }
            }
        }
    }

    #[test]
    fn read_chunks_handed_over_stay_valid_while_dst_is_borrowed() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let len = 5 * CHUNK + 7;
        let src = aligned(len, 16);
        fs::write(&path, &src[..len]).unwrap();
        for engine in engines() {
            for (qd, direct) in [(1, DirectIo::On), (4, DirectIo::Off), (4, DirectIo::On)] {
                let case = format!("{:?} qd{qd} {direct:?}", engine.kind());
                let mut dst = aligned(round_up(len), 17);
                let base = dst.as_ptr() as usize;
                // The slices outlive their `on_chunk` call, as a hashing
                // thread would keep them.
                let mut kept: Vec<(usize, &[u8])> = Vec::new();
                let n = engine
                    .read_file(&path, &mut dst, &opts(direct, qd), &mut |i, b| {
                        kept.push((i, b));
                        Ok(())
                    })
                    .unwrap_or_else(|e| panic!("{case}: {e}"));
                assert_eq!(n, len as u64, "{case}");
                kept.sort_by_key(|k| k.0);
                assert_eq!(kept.len(), len.div_ceil(CHUNK), "{case}: once each");
                for (k, (i, b)) in kept.iter().enumerate() {
                    assert_eq!(*i, k, "{case}");
                    assert_eq!(b.as_ptr() as usize, base + k * CHUNK, "{case}: in dst");
                    let end = ((k + 1) * CHUNK).min(len);
                    assert!(b[..] == src[k * CHUNK..end], "{case}: chunk {k}");
                }
            }
        }
    }

    #[test]
    fn read_hands_over_chunks_before_the_last_read_starts() {
        use std::sync::atomic::{AtomicBool, Ordering};
        use std::time::Duration;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let n = 8;
        let len = n * CHUNK;
        fs::write(&path, &aligned(len, 18)[..len]).unwrap();
        for engine in engines() {
            let handed = Arc::new(AtomicBool::new(false));
            let waited_out = Arc::new(AtomicBool::new(false));
            let faults = Arc::new(FaultInjector::counting());
            let (h, w) = (Arc::clone(&handed), Arc::clone(&waited_out));
            // The last read does not start before a chunk was handed over
            // (or 10 s passed: an engine that hands over only at the end).
            faults.set_hook(move |op, _, _| {
                if op + 1 == n as u64 {
                    let t = Instant::now();
                    while !h.load(Ordering::SeqCst) {
                        if t.elapsed() > Duration::from_secs(10) {
                            w.store(true, Ordering::SeqCst);
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            });
            let mut o = opts(DirectIo::On, 2);
            o.faults = Some(faults);
            let mut dst = aligned(len, 19);
            engine
                .read_file(&path, &mut dst, &o, &mut |_, _| {
                    handed.store(true, Ordering::SeqCst);
                    Ok(())
                })
                .unwrap();
            assert!(
                !waited_out.load(Ordering::SeqCst),
                "{:?}: no chunk handed over before the last read",
                engine.kind()
            );
        }
    }

    #[test]
    fn on_chunk_error_stops_the_read() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let len = 8 * CHUNK;
        fs::write(&path, &aligned(len, 21)[..len]).unwrap();
        for engine in engines() {
            for qd in [1, 4] {
                let mut dst = aligned(len, 22);
                let mut calls = 0;
                let e = engine
                    .read_file(&path, &mut dst, &opts(DirectIo::On, qd), &mut |_, _| {
                        calls += 1;
                        if calls == 2 {
                            return Err(Error::invalid("chunk", "digest refused"));
                        }
                        Ok(())
                    })
                    .unwrap_err();
                assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
                assert!(e.to_string().contains("digest refused"), "{e}");
                assert_eq!(
                    calls,
                    2,
                    "{:?} qd{qd}: no call after the error",
                    engine.kind()
                );
            }
        }
    }

    #[test]
    fn bad_arguments_are_invalid_and_create_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let src = aligned(2 * CHUNK, 14);
        for engine in engines() {
            let mut o = opts(DirectIo::Off, 4);
            o.chunk_bytes = 1000;
            let e = write(&*engine, &path, &src, 10, &o).0.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
            let mut o = opts(DirectIo::Off, 0);
            o.queue_depth = 0;
            let e = write(&*engine, &path, &src, 10, &o).0.unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
            // Longer than the source.
            let e = write(
                &*engine,
                &path,
                &src,
                2 * CHUNK + 1,
                &opts(DirectIo::Off, 4),
            )
            .0
            .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
            // O_DIRECT forced over an unaligned source, or one without room
            // for the padded tail.
            let e = write(&*engine, &path, &src[1..], 4096, &opts(DirectIo::On, 4))
                .0
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
            let e = write(&*engine, &path, &src[..4097], 4097, &opts(DirectIo::On, 4))
                .0
                .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::Invalid, "{e}");
            assert!(!path.exists());
            // With `Auto` the same buffers are written buffered.
            let (r, _) = write(&*engine, &path, &src[1..], 4096, &opts(DirectIo::Auto, 4));
            assert!(!r.unwrap().direct);
            assert!(fs::read(&path).unwrap() == src[1..4097]);
            fs::remove_file(&path).unwrap();
        }
    }

    #[test]
    fn one_engine_serves_concurrent_writers() {
        let dir = tempfile::tempdir().unwrap();
        let len = 5 * CHUNK + 17;
        for engine in engines() {
            std::thread::scope(|s| {
                for t in 0..4u64 {
                    let engine = &engine;
                    let dir = dir.path();
                    s.spawn(move || {
                        let path = dir.join(format!("{:?}-{t}", engine.kind()));
                        let src = aligned(round_up(len), 20 + t);
                        write(&**engine, &path, &src, len, &opts(DirectIo::On, 4))
                            .0
                            .unwrap();
                        let mut dst = aligned(round_up(len), 30 + t);
                        read(&**engine, &path, &mut dst, &opts(DirectIo::On, 4))
                            .0
                            .unwrap();
                        assert!(dst[..len] == src[..len]);
                    });
                }
            });
        }
    }

    /// Write throughput of a 256 MiB file per engine, `O_DIRECT` where the
    /// file system allows, fsync included. Run with `cargo test --release
    /// --test io_engines -- --ignored --nocapture`. Environment:
    /// `ACP_IO_BENCH_DIR` (default: the temporary directory),
    /// `ACP_IO_BENCH_CHUNK_MIB` (4), `ACP_IO_BENCH_QD` (8), and
    /// `ACP_IO_BENCH_HASH=1` to blake3 each chunk in `on_chunk` as the flush
    /// does.
    #[test]
    #[ignore = "a 256 MiB write per engine; run by hand"]
    fn write_throughput_256mib() {
        let env = |k: &str, d: usize| {
            std::env::var(k)
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(d)
        };
        let base = std::env::var_os("ACP_IO_BENCH_DIR").map_or_else(std::env::temp_dir, Into::into);
        let hash = env("ACP_IO_BENCH_HASH", 0) == 1;
        let dir = tempfile::tempdir_in(base).unwrap();
        let len = 256 << 20;
        let src = aligned(len, 42);
        let o = IoOpts {
            chunk_bytes: env("ACP_IO_BENCH_CHUNK_MIB", 4) << 20,
            queue_depth: env("ACP_IO_BENCH_QD", 8),
            direct: DirectIo::Auto,
            faults: None,
        };
        for engine in engines() {
            let mut secs = Vec::new();
            let mut direct = false;
            for r in 0..5 {
                let path = dir.path().join(format!("{:?}-{r}", engine.kind()));
                let mut digests = Vec::new();
                let t = Instant::now();
                let stats = engine
                    .write_file(&path, &src, len as u64, &o, &mut |_, b| {
                        if hash {
                            digests.push(blake3::hash(b));
                        }
                        Ok(())
                    })
                    .unwrap();
                secs.push(t.elapsed().as_secs_f64());
                direct = stats.direct;
                fs::remove_file(&path).unwrap();
            }
            secs.sort_by(f64::total_cmp);
            eprintln!(
                "{:?}: 256 MiB, chunk {} MiB, qd {}, direct {direct}, hash {hash}: median {:.3} s = {:.2} GB/s (runs {secs:.3?})",
                engine.kind(),
                o.chunk_bytes >> 20,
                o.queue_depth,
                secs[2],
                f64::from(u32::try_from(len).expect("256 MiB fits a u32")) / secs[2] / 1e9
            );
        }
    }
}
