//! The compressed data file: round trips, and hostile heads, tables and
//! frames.

use std::path::Path;

use proptest::prelude::*;

use super::*;
use crate::codec;
use crate::error::{Error, Result};
use crate::ErrorKind;

const PATH: &str = "/c/step-000000000001/rank-00000.safetensors";
const CHUNK: usize = 4096;

/// A plain image of `specs`, each tensor's bytes from `fill(tensor, i)`.
fn image(specs: &[TensorSpec], fill: impl Fn(usize, usize) -> u8) -> Vec<u8> {
    let meta = ImageMeta {
        step: 1,
        world_size: 1,
        ..ImageMeta::default()
    };
    let layout = Layout::plan(specs, &meta).unwrap();
    let mut img = vec![0u8; usize::try_from(layout.total_len).unwrap()];
    img[..layout.header_bytes().len()].copy_from_slice(layout.header_bytes());
    for (t, e) in layout.entries.iter().enumerate() {
        let at = usize::try_from(e.offset).unwrap();
        for i in 0..usize::try_from(e.len).unwrap() {
            img[at + i] = fill(t, i);
        }
    }
    img
}

fn spec(name: &str, dtype: Dtype, n: u64) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape: vec![n],
    }
}

/// A model-like image: fp32 state, bf16 weights, a u8 mask.
fn sample() -> Vec<u8> {
    let specs = [
        spec("w.bf16", Dtype::BF16, 6000),
        spec("adam.f32", Dtype::F32, 3000),
        spec("mask", Dtype::U8, 1000),
    ];
    image(&specs, |t, i| match t {
        // Low bytes vary, high bytes (sign/exponent) take few values.
        0 | 1 if i % 2 == 1 || i % 4 == 3 => 0x3C,
        _ => (i.wrapping_mul(2_654_435_761) >> 7) as u8,
    })
}

/// Reads `file`'s table as an index of `image` would describe it.
fn table(file: &[u8], image: &[u8]) -> Result<PackedTable> {
    read_packed_table(
        Path::new(PATH),
        file.len() as u64,
        image.len() as u64,
        CHUNK as u64,
        &mut |buf, off| {
            let s = usize::try_from(off).unwrap();
            buf.copy_from_slice(
                file.get(s..s + buf.len())
                    .ok_or_else(|| Error::invalid("test", "read past the end"))?,
            );
            Ok(())
        },
    )
}

/// Decodes every frame of `file` into the plain image.
fn unpack(file: &[u8], image_len: usize, t: &PackedTable) -> Result<Vec<u8>> {
    let mut out = vec![0u8; image_len];
    for (i, f) in t.frames.iter().enumerate() {
        let s = i * CHUNK;
        let bytes =
            &file[usize::try_from(f.offset).unwrap()..][..usize::try_from(f.stored).unwrap()];
        let dst = &mut out[s..s + usize::try_from(f.raw).unwrap()];
        decode_frame(Path::new(PATH), i as u64, f, bytes, dst, &|| {
            vec!["t".to_owned()]
        })?;
    }
    Ok(out)
}

#[test]
fn a_packed_image_round_trips_and_shrinks() {
    let img = sample();
    let file = pack_image(Path::new(PATH), &img, CHUNK, 3).unwrap();
    assert!(is_packed(&file));
    assert!(file.len() < img.len(), "{} of {}", file.len(), img.len());
    let t = table(&file, &img).unwrap();
    assert_eq!(t.frames.len(), img.len().div_ceil(CHUNK));
    assert_eq!(t.file_len(), file.len() as u64);
    assert!(t.frames.iter().any(|f| f.codec == FrameCodec::GroupedZstd));
    assert_eq!(unpack(&file, img.len(), &t).unwrap(), img);
    // The digests the index records are the plain image's.
    assert_eq!(chunk_digests(&img, CHUNK).len(), t.frames.len());
}

#[test]
fn runs_follow_the_tensors_dtypes() {
    let img = sample();
    let h = parse_header(Path::new(PATH), &img, img.len() as u64).unwrap();
    let runs = chunk_runs(&h, 0, h.data_start + 4096);
    // Header bytes (width 1), then the widest tensor first: fp32.
    assert_eq!(runs[0].width, 1);
    assert_eq!(u64::from(runs[0].len), h.data_start);
    assert_eq!(runs[1].width, 4);
    let end = img.len() as u64;
    let last = chunk_runs(&h, end - 100, end);
    assert_eq!(last, vec![codec::Run { width: 1, len: 100 }]);
}

#[test]
fn complex_tensors_group_their_bytes_as_f32_and_round_trip() {
    let specs = [
        spec("freqs_cis", Dtype::C64, 2000),
        spec("w", Dtype::F32, 500),
    ];
    // Real and imaginary parts alike: the high byte of each f32 takes few
    // values.
    let img = image(&specs, |_, i| {
        if i % 4 == 3 {
            0x3F
        } else {
            (i.wrapping_mul(2_654_435_761) >> 9) as u8
        }
    });
    let h = parse_header(Path::new(PATH), &img, img.len() as u64).unwrap();
    let runs = chunk_runs(&h, h.data_start, h.data_start + 4096);
    assert_eq!(
        runs,
        vec![codec::Run {
            width: 4,
            len: 4096
        }]
    );
    let file = pack_image(Path::new(PATH), &img, CHUNK, 1).unwrap();
    assert!(file.len() < img.len(), "{} of {}", file.len(), img.len());
    let t = table(&file, &img).unwrap();
    assert_eq!(unpack(&file, img.len(), &t).unwrap(), img);
}

#[test]
fn an_empty_image_packs_to_a_head() {
    let file = packed_head(0, CHUNK as u64, &[]);
    let t = table(&file, &[]).unwrap();
    assert!(t.frames.is_empty());
}

#[test]
fn a_changed_frame_is_detected_before_decoding_and_named() {
    let img = sample();
    let file = pack_image(Path::new(PATH), &img, CHUNK, 3).unwrap();
    let t = table(&file, &img).unwrap();
    // Every frame: one flipped byte is caught by its check.
    for (i, f) in t.frames.iter().enumerate() {
        let mut bad = file.clone();
        bad[usize::try_from(f.offset + f.stored / 2).unwrap()] ^= 1;
        let err = unpack(&bad, img.len(), &t).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "frame {i}: {err}");
        let msg = err.to_string();
        assert!(msg.contains(PATH), "{msg}");
        assert!(msg.contains(&format!("compressed frame {i}")), "{msg}");
        assert!(msg.contains("check mismatch"), "{msg}");
    }
}

#[test]
fn a_table_that_is_not_the_index_is_refused() {
    let img = sample();
    let file = pack_image(Path::new(PATH), &img, CHUNK, 3).unwrap();
    let read = |len: u64, chunk: u64| {
        read_packed_table(
            Path::new(PATH),
            file.len() as u64,
            len,
            chunk,
            &mut |b, o| {
                let s = usize::try_from(o).unwrap();
                b.copy_from_slice(&file[s..s + b.len()]);
                Ok(())
            },
        )
    };
    for (len, chunk) in [
        (img.len() as u64 + 1, CHUNK as u64),
        (img.len() as u64, 8192),
    ] {
        let err = read(len, chunk).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        assert!(err.to_string().contains("the index"), "{err}");
    }
}

/// Rewrites table entry `i` with `edit` and reseals the table digest, as a
/// hostile writer would (a random change is caught by the digest).
fn forge(file: &[u8], i: usize, edit: impl Fn(&mut [u8])) -> Vec<u8> {
    let mut f = file.to_vec();
    let (h, e) = (PACKED_HEAD_BYTES as usize, FRAME_ENTRY_BYTES as usize);
    edit(&mut f[h + i * e..h + (i + 1) * e]);
    reseal(&mut f);
    f
}

/// Writes the digest of `f`'s frame table into its head again.
fn reseal(f: &mut [u8]) {
    let n = usize::try_from(u32::from_le_bytes(f[12..16].try_into().unwrap())).unwrap();
    let (h, e) = (PACKED_HEAD_BYTES as usize, FRAME_ENTRY_BYTES as usize);
    let d = digest(&f[h..h + n * e]);
    f[32..64].copy_from_slice(&d);
}

#[test]
fn hostile_frame_tables_are_clear_errors() {
    let img = sample();
    let file = pack_image(Path::new(PATH), &img, CHUNK, 3).unwrap();
    let put = |e: &mut [u8], at: usize, v: u64| e[at..at + 8].copy_from_slice(&v.to_le_bytes());
    let t = table(&file, &img).unwrap();
    let f1 = t.frames[1];
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (
            forge(&file, 1, |e| put(e, 8, u64::MAX - 8)),
            "past the file",
        ),
        (
            forge(&file, 1, |e| put(e, 8, f1.stored + (1 << 40))),
            "past the file",
        ),
        (forge(&file, 1, |e| put(e, 0, f1.offset - 1)), "overlap"),
        (forge(&file, 1, |e| put(e, 0, 0)), "overlap"),
        (forge(&file, 1, |e| put(e, 16, 1 << 40)), "decodes to"),
        (forge(&file, 0, |e| e[24] = 0), "stored frame 0"),
        (forge(&file, 1, |e| e[24] = 9), "unknown codec"),
        (forge(&file, 1, |e| e[0] ^= 1), "gaps"),
    ];
    for (bad, want) in cases {
        let err = table(&bad, &img).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
        let msg = err.to_string();
        assert!(
            msg.contains(PATH) && msg.contains(want),
            "want {want:?}: {msg}"
        );
    }
    // A table entry changed without resealing: the table digest.
    let mut bad = file.clone();
    bad[PACKED_HEAD_BYTES as usize + 3] ^= 1;
    assert!(table(&bad, &img)
        .unwrap_err()
        .to_string()
        .contains("digest differs"));
    // A frame count past the file, and one that is not the chunks'.
    for n in [u32::MAX, 1] {
        let mut bad = file.clone();
        bad[12..16].copy_from_slice(&n.to_le_bytes());
        let err = table(&bad, &img).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    }
    // Truncated files, and trailing bytes.
    for cut in [0, 10, 63, 64, file.len() - 1] {
        assert!(table(&file[..cut], &img).is_err(), "cut at {cut}");
    }
    let mut long = file.clone();
    long.push(0);
    assert!(table(&long, &img)
        .unwrap_err()
        .to_string()
        .contains("frames end at"));
}

/// Reads the table of `file` as an index of an image of `len` bytes in
/// one chunk would describe it.
fn one_chunk_table(file: &[u8], len: u64) -> Result<PackedTable> {
    read_packed_table(
        Path::new(PATH),
        file.len() as u64,
        len,
        len,
        &mut |buf, off| {
            let s = usize::try_from(off).unwrap();
            buf.copy_from_slice(&file[s..s + buf.len()]);
            Ok(())
        },
    )
}

#[test]
fn a_frame_claiming_more_than_zstd_can_expand_to_is_refused() {
    use super::packed::MAX_FRAME_EXPANSION;
    // A 16-byte compressed frame can claim at most 16 * 32,768 bytes.
    let frame = [7u8; 16];
    let with = |len: u64| {
        let head = packed_head(len, len, &[(&frame[..], FrameCodec::GroupedZstd)]);
        [head, frame.to_vec()].concat()
    };
    let most = 16 * MAX_FRAME_EXPANSION;
    assert!(one_chunk_table(&with(most), most).is_ok());
    let err = one_chunk_table(&with(most + 1), most + 1).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("times its length"), "{err}");
    // The most compressible chunk (zeros, one plane, the fastest and the
    // strongest level) stays within the limit: no frame this build writes
    // is refused by it.
    let zeros = image(&[spec("z", Dtype::U8, 8 << 20)], |_, _| 0);
    for level in [codec::LITERAL_FIRST, 19] {
        let file = pack_image(Path::new(PATH), &zeros, zeros.len(), level).unwrap();
        let t = one_chunk_table(&file, zeros.len() as u64).unwrap();
        let f = t.frames[0];
        assert_eq!(f.codec, FrameCodec::GroupedZstd);
        assert!(f.raw > f.stored * (MAX_FRAME_EXPANSION / 2), "{f:?}");
        assert_eq!(unpack_one(&file, &f, zeros.len()), zeros);
    }
}

/// Decodes the one frame `f` of `file` into an image of `len` bytes.
fn unpack_one(file: &[u8], f: &Frame, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    let bytes = &file[usize::try_from(f.offset).unwrap()..][..usize::try_from(f.stored).unwrap()];
    decode_frame(Path::new(PATH), 0, f, bytes, &mut out, &Vec::new).unwrap();
    out
}

/// `file` (written by this build) relabelled as container `version`,
/// each frame's check rewritten by `check` and the table resealed.
fn relabelled(file: &[u8], version: u32, check: impl Fn(&[u8]) -> Digest) -> Vec<u8> {
    let mut f = file.to_vec();
    f[8..12].copy_from_slice(&version.to_le_bytes());
    let n = usize::try_from(u32::from_le_bytes(f[12..16].try_into().unwrap())).unwrap();
    let (h, e) = (PACKED_HEAD_BYTES as usize, FRAME_ENTRY_BYTES as usize);
    for i in 0..n {
        let at = h + i * e;
        let off = usize::try_from(u64::from_le_bytes(f[at..at + 8].try_into().unwrap())).unwrap();
        let len =
            usize::try_from(u64::from_le_bytes(f[at + 8..at + 16].try_into().unwrap())).unwrap();
        let c = check(&file[off..off + len]);
        f[at + 32..at + 64].copy_from_slice(&c);
    }
    reseal(&mut f);
    f
}

#[test]
fn compressed_frames_are_checked_with_xxh3_since_version_4() {
    let img = sample();
    let file = pack_image(Path::new(PATH), &img, CHUNK, 3).unwrap();
    assert_eq!(
        u32::from_le_bytes(file[8..12].try_into().unwrap()),
        QUICK_FRAME_VERSION
    );
    let t = table(&file, &img).unwrap();
    let bytes = |f: &Frame| {
        &file[usize::try_from(f.offset).unwrap()..][..usize::try_from(f.stored).unwrap()]
    };
    assert!(t.frames.iter().any(|f| f.codec == FrameCodec::GroupedZstd));
    for f in &t.frames {
        assert_eq!(f.quick, f.codec == FrameCodec::GroupedZstd, "{f:?}");
        let want = if f.quick {
            quick_frame_check(bytes(f))
        } else {
            digest(bytes(f))
        };
        assert_eq!(f.check, want, "{f:?}");
    }
    // A quick check is 16 bytes: a table with more is refused.
    let i = t
        .frames
        .iter()
        .position(|f| f.codec == FrameCodec::GroupedZstd)
        .unwrap();
    let err = table(&forge(&file, i, |e| e[63] = 1), &img).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("past its 16"), "{err}");
}

#[test]
fn containers_of_versions_2_and_3_are_read_with_blake3_frame_checks() {
    let img = sample();
    let file = pack_image(Path::new(PATH), &img, CHUNK, 3).unwrap();
    for version in [COMPRESSED_VERSION, INCREMENTAL_VERSION] {
        let old = relabelled(&file, version, digest);
        let t = table(&old, &img).unwrap();
        assert!(t.frames.iter().all(|f| !f.quick), "version {version}");
        assert_eq!(
            unpack(&old, img.len(), &t).unwrap(),
            img,
            "version {version}"
        );
        // A changed frame is caught by its blake3.
        let f = t
            .frames
            .iter()
            .find(|f| f.codec == FrameCodec::GroupedZstd)
            .unwrap();
        let mut bad = old.clone();
        bad[usize::try_from(f.offset + f.stored / 2).unwrap()] ^= 1;
        let err = unpack(&bad, img.len(), &t).unwrap_err();
        assert!(err.to_string().contains("check mismatch"), "{err}");
        // The version decides the hash: xxh3 checks under an old version
        // are not taken.
        let mixed = relabelled(&file, version, quick_frame_check);
        let t = table(&mixed, &img).unwrap();
        let err = unpack(&mixed, img.len(), &t).unwrap_err();
        assert!(err.to_string().contains("check mismatch"), "{err}");
    }
}

#[test]
fn a_newer_container_is_unsupported_not_corrupt() {
    let img = sample();
    let mut file = pack_image(Path::new(PATH), &img, CHUNK, 3).unwrap();
    file[8..12].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
    assert_eq!(
        table(&file, &img).unwrap_err().kind(),
        ErrorKind::Unsupported
    );
    file[..8].copy_from_slice(b"{\"a\":1} ");
    assert_eq!(table(&file, &img).unwrap_err().kind(), ErrorKind::Corrupt);
}

#[test]
fn an_index_of_version_1_with_a_compressed_file_is_corrupt_and_version_2_is_read() {
    let img = sample();
    let d = chunk_digests(&img, CHUNK);
    let mut files = std::collections::BTreeMap::new();
    files.insert(
        data_file_name(0),
        FileEntry {
            stored_size: Some(100),
            ..FileEntry::plain(0, img.len() as u64, CHUNK as u64, &d)
        },
    );
    let mut idx = Index {
        step: 1,
        world_size: 1,
        format_version: PLAIN_VERSION,
        files,
        weight_map: std::collections::BTreeMap::new(),
    };
    let p = Path::new("/c/step-000000000001/model.safetensors.index.json");
    let err = Index::parse(p, &idx.to_json()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("compressed"), "{err}");
    idx.format_version = COMPRESSED_VERSION;
    let back = Index::parse(p, &idx.to_json()).unwrap();
    assert_eq!(back, idx);
    assert_eq!(back.files[&data_file_name(0)].file_len(), 100);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Every dtype, any bytes: the compressed file decodes to the image.
    #[test]
    fn every_dtype_round_trips_through_a_packed_file(
        tensors in prop::collection::vec((prop::sample::select(Dtype::ALL.to_vec()), 0u64..3000, any::<u8>()), 1..5),
        seed in any::<u64>(),
    ) {
        let specs: Vec<TensorSpec> = tensors
            .iter()
            .enumerate()
            .map(|(i, (d, n, _))| spec(&format!("t{i}"), *d, *n))
            .collect();
        let img = image(&specs, |t, i| {
            let mask = tensors[t].2;
            ((i as u64).wrapping_mul(seed | 1) >> 11) as u8 & mask
        });
        let file = pack_image(Path::new(PATH), &img, CHUNK, 1).unwrap();
        let t = table(&file, &img).unwrap();
        prop_assert_eq!(unpack(&file, img.len(), &t).unwrap(), img);
    }
}
