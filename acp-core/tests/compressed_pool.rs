//! A compressed file large enough to be decoded on the copy threads (the
//! pool takes files of 8 MiB and more): every dtype round trips bit-exact
//! through `load` and `load_into`, with stored frames, compressed frames and
//! frames that mix raw and zstd planes in one file; a changed frame in the
//! middle of the file, compressed or stored, is an error naming the file,
//! the frame and its tensor.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::path::{Path, PathBuf};

use acp_core::format::{FRAME_ENTRY_BYTES, PACKED_HEAD_BYTES};
use acp_core::{
    Compress, Dtype, Engine, EngineConfig, Error, HostTensor, LoadRequest, SaveOptions, Source,
};

/// Digest chunks (and reads) of 64 KiB: a file of about 10 MiB is some
/// 160 reads, taken by the pool's threads in turn.
const CHUNK: usize = 64 << 10;
const FILE: &str = "step-000000000003/rank-00000.safetensors";

struct Xorshift(u64);

impl Xorshift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// About normal(0, sigma): a sum of four uniforms.
    fn normal(&mut self, sigma: f64) -> f64 {
        let u: f64 = (0..4)
            .map(|_| (self.next() >> 11) as f64 / (1u64 << 53) as f64)
            .sum::<f64>()
            - 2.0;
        u * sigma * 1.7
    }
}

/// `n` elements of `dtype`: floats drawn like trained weights (their
/// exponent planes shrink, their low mantissa planes do not), other
/// dtypes random bytes (their frames are stored as they are).
fn values(dtype: Dtype, n: usize, rng: &mut Xorshift) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * dtype.size());
    for _ in 0..n {
        let v = rng.normal(0.02);
        match dtype {
            Dtype::F64 => out.extend_from_slice(&v.to_le_bytes()),
            Dtype::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            Dtype::BF16 => out.extend_from_slice(&(v as f32).to_bits().to_le_bytes()[2..]),
            Dtype::F16 => {
                // Sign, a small exponent, a random mantissa.
                let h = (rng.next() as u16 & 0x83FF) | 0x2000;
                out.extend_from_slice(&h.to_le_bytes());
            }
            _ => out.extend_from_slice(&rng.next().to_le_bytes()[..dtype.size()]),
        }
    }
    out
}

type Tensors = Vec<(String, Dtype, Vec<u64>, Vec<u8>)>;

/// About 10 MiB: large tensors of fp32, bf16 and fp64 weights and of
/// random bytes, and a small tensor of every dtype, of odd lengths.
fn tensors() -> Tensors {
    let mut rng = Xorshift(0x51_7CC1_B727_220A);
    let mut out = Vec::new();
    for (name, dtype, n) in [
        ("w.f32", Dtype::F32, 1 << 20),
        ("w.bf16", Dtype::BF16, 1 << 20),
        ("w.f64", Dtype::F64, 1 << 18),
        ("random.u8", Dtype::U8, (2 << 20) + 13),
    ] {
        let data = values(dtype, n, &mut rng);
        out.push((name.to_owned(), dtype, vec![n as u64], data));
    }
    for d in Dtype::ALL {
        let data = values(d, 37, &mut rng);
        out.push((format!("all.{}", d.name()), d, vec![37], data));
    }
    out
}

fn host(ts: &Tensors) -> Vec<HostTensor<'_>> {
    ts.iter()
        .map(|(name, dtype, shape, data)| HostTensor {
            name,
            dtype: *dtype,
            shape,
            data,
        })
        .collect()
}

fn engine(dir: &Path) -> (Engine, PathBuf) {
    let (root, shm) = (dir.join("ckpt"), dir.join("shm"));
    std::fs::create_dir_all(&shm).unwrap();
    let e = Engine::open(
        EngineConfig::new(&root)
            .with_shm_dir(&shm)
            .with_job("compressed-pool")
            .with_ring_bytes(64 << 20)
            .with_chunk_bytes(CHUNK)
            .with_copy_threads(3)
            .with_compress(Compress::Zstd)
            .with_incremental(false)
            .with_mlock(false)
            .with_release_on_close(true),
    )
    .unwrap();
    (e, root)
}

fn save(e: &Engine, ts: &Tensors) {
    e.save(
        3,
        &host(ts),
        &serde_json::json!(null),
        &SaveOptions::default(),
    )
    .unwrap()
    .wait()
    .unwrap();
}

fn storage() -> LoadRequest {
    LoadRequest {
        step: Some(3),
        storage_only: true,
        ..LoadRequest::default()
    }
}

/// Frame `i`'s table entry: (offset, stored length, codec).
fn frame(file: &[u8], i: usize) -> (usize, usize, u8) {
    let at = PACKED_HEAD_BYTES as usize + i * FRAME_ENTRY_BYTES as usize;
    let u = |o: usize| u64::from_le_bytes(file[at + o..at + o + 8].try_into().unwrap()) as usize;
    (u(0), u(8), file[at + 24])
}

fn frames(file: &[u8]) -> usize {
    u32::from_le_bytes(file[12..16].try_into().unwrap()) as usize
}

/// The plane modes (0 raw, 1 zstd) of a zstd frame's bytes.
fn plane_modes(f: &[u8]) -> Vec<u8> {
    let runs = u32::from_le_bytes(f[..4].try_into().unwrap()) as usize;
    let mut widths: Vec<u8> = (0..runs).map(|r| f[4 + r * 5]).collect();
    widths.sort_unstable();
    widths.dedup();
    let planes: usize = widths.iter().map(|w| usize::from(*w)).sum();
    let at = 4 + runs * 5;
    (0..planes).map(|p| f[at + p * 5]).collect()
}

#[test]
fn every_dtype_round_trips_through_the_decoding_pool() {
    let dir = tempfile::tempdir().unwrap();
    let ts = tensors();
    let (e, root) = engine(dir.path());
    save(&e, &ts);
    let file = std::fs::read(root.join(FILE)).unwrap();
    assert!(
        file.len() > 8 << 20,
        "the pool takes files of 8 MiB and more"
    );

    // Stored frames, compressed frames, and compressed frames holding a
    // raw plane beside zstd ones: every kind of frame is in the file.
    let n = frames(&file);
    let codecs: Vec<u8> = (0..n).map(|i| frame(&file, i).2).collect();
    assert!(codecs.contains(&0), "a stored frame");
    assert!(codecs.contains(&1), "a compressed frame");
    let mixed = (0..n).filter(|&i| codecs[i] == 1).any(|i| {
        let (off, len, _) = frame(&file, i);
        let modes = plane_modes(&file[off..off + len]);
        modes.contains(&0) && modes.contains(&1)
    });
    assert!(mixed, "a frame with raw and zstd planes");

    let ck = e.load(&storage()).unwrap();
    assert_eq!(ck.report().source, Source::Storage);
    for (name, _, _, data) in &ts {
        assert_eq!(ck.tensor(name).unwrap().data, &data[..], "{name}");
    }
    drop(ck);

    let mut dst: Vec<Vec<u8>> = ts.iter().map(|t| vec![0xA5; t.3.len()]).collect();
    let mut into: Vec<(&str, &mut [u8])> = ts
        .iter()
        .zip(&mut dst)
        .map(|(t, d)| (t.0.as_str(), &mut d[..]))
        .collect();
    let ck = e.load_into(&storage(), &mut into).unwrap();
    assert_eq!(ck.report().source, Source::Storage);
    drop(ck);
    for ((name, _, _, data), got) in ts.iter().zip(&dst) {
        assert_eq!(got, data, "load_into {name}");
    }
    e.close().unwrap();
}

/// Flips a byte in the middle of the first frame of codec `codec` past
/// the first quarter of the file, loads it (through `load_into`, into the
/// tensors' buffers), and returns the error and the frame's index.
fn load_with_changed_frame(codec: u8) -> (Error, usize, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let ts = tensors();
    let (e, root) = engine(dir.path());
    save(&e, &ts);
    let path = root.join(FILE);
    let mut file = std::fs::read(&path).unwrap();
    let n = frames(&file);
    let i = (n / 4..n).find(|&i| frame(&file, i).2 == codec).unwrap();
    let (off, len, _) = frame(&file, i);
    file[off + len / 2] ^= 0x10;
    std::fs::write(&path, &file).unwrap();
    let mut dst: Vec<Vec<u8>> = ts.iter().map(|t| vec![0; t.3.len()]).collect();
    let mut into: Vec<(&str, &mut [u8])> = ts
        .iter()
        .zip(&mut dst)
        .map(|(t, d)| (t.0.as_str(), &mut d[..]))
        .collect();
    let err = e.load_into(&storage(), &mut into).unwrap_err();
    assert!(
        matches!(e.load(&storage()).unwrap_err(), Error::Corrupt { .. }),
        "load"
    );
    e.close().unwrap();
    (err, i, path)
}

#[test]
fn a_changed_compressed_frame_in_the_middle_is_named() {
    let (err, i, path) = load_with_changed_frame(1);
    let Error::Corrupt {
        path: p,
        tensor,
        reason,
    } = &err
    else {
        panic!("not Corrupt: {err}");
    };
    assert_eq!(p, &path, "{err}");
    assert!(tensor.is_some(), "{err}");
    assert!(reason.contains(&format!("compressed frame {i} ")), "{err}");
    assert!(reason.contains("check mismatch"), "{err}");
}

#[test]
fn a_changed_stored_frame_in_the_middle_is_named() {
    let (err, i, path) = load_with_changed_frame(0);
    let Error::Corrupt {
        path: p,
        tensor,
        reason,
    } = &err
    else {
        panic!("not Corrupt: {err}");
    };
    assert_eq!(p, &path, "{err}");
    assert_eq!(tensor.as_deref(), Some("random.u8"), "{err}");
    assert!(reason.contains(&format!("compressed frame {i} ")), "{err}");
    assert!(reason.contains("check mismatch"), "{err}");
}
