//! Digest: blake3 throughput over 4 MiB chunks (acp's default chunk), the
//! hashing every flush and every verified load does.
//!
//! Rows: `blake3_1t` (`blake3::hash` per chunk on one thread, the
//! baseline), `acp_chunk_digests` (acp's `format::chunk_digests`, one
//! thread), `blake3_nt` (chunks split over N scoped threads, as a verified
//! load hashes); `sum_then_digest_1t` (each chunk's xxh3 sum, then its
//! blake3 digest: two reads of a chunk that does not fit in a core's
//! cache) and `sum_and_digest_blocks_1t` (both fed from each 128 KiB block
//! in turn, the sum first: one read), the two ways a flush can take a
//! chunk's sum and digest.

use std::hint::black_box;

use acp_bench::{
    bench_bytes, human_bytes, measurement_time, threads, warm_up_time, AlignedBuf, Notes, BLOCK,
    SAMPLES,
};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn hash_chunks(data: &[u8], out: &mut [[u8; 32]]) {
    for (d, piece) in out.iter_mut().zip(data.chunks(BLOCK)) {
        *d = *blake3::hash(piece).as_bytes();
    }
}

/// Each chunk's xxh3 sum, then its blake3 digest.
fn sum_then_digest(data: &[u8], out: &mut [(u64, [u8; 32])]) {
    for (d, piece) in out.iter_mut().zip(data.chunks(BLOCK)) {
        let sum = twox_hash::XxHash3_64::oneshot(piece);
        *d = (sum, *blake3::hash(piece).as_bytes());
    }
}

/// Each chunk's sum and digest fed from each 128 KiB block in turn.
fn sum_and_digest_blocks(data: &[u8], out: &mut [(u64, [u8; 32])]) {
    use std::hash::Hasher;
    for (d, piece) in out.iter_mut().zip(data.chunks(BLOCK)) {
        let mut sum = twox_hash::XxHash3_64::new();
        let mut hasher = blake3::Hasher::new();
        for block in piece.chunks(128 << 10) {
            sum.write(block);
            hasher.update(block);
        }
        *d = (sum.finish(), *hasher.finalize().as_bytes());
    }
}

fn digest(c: &mut Criterion) {
    let bytes = bench_bytes();
    let n = threads();
    let data = AlignedBuf::random(bytes, 3);
    let chunks = bytes.div_ceil(BLOCK);
    let mut out = vec![[0u8; 32]; chunks];

    let mut g = c.benchmark_group("digest");
    g.sample_size(SAMPLES)
        .warm_up_time(warm_up_time())
        .measurement_time(measurement_time())
        .throughput(Throughput::Bytes(bytes as u64));
    g.bench_function("blake3_1t", |b| {
        b.iter(|| {
            hash_chunks(&data, &mut out);
            black_box(&mut out);
        });
    });
    g.bench_function("acp_chunk_digests", |b| {
        b.iter(|| black_box(acp_core::format::chunk_digests(&data, BLOCK)));
    });
    let per = chunks.div_ceil(n);
    g.bench_function("blake3_nt", |b| {
        b.iter(|| {
            std::thread::scope(|s| {
                for (o, d) in out.chunks_mut(per).zip(data.chunks(per * BLOCK)) {
                    std::thread::Builder::new()
                        .name("bench-hash".into())
                        .spawn_scoped(s, move || hash_chunks(d, o))
                        .expect("a benchmark thread starts");
                }
            });
            black_box(&mut out);
        });
    });
    let mut both = vec![(0u64, [0u8; 32]); chunks];
    g.bench_function("sum_then_digest_1t", |b| {
        b.iter(|| {
            sum_then_digest(&data, &mut both);
            black_box(&mut both);
        });
    });
    g.bench_function("sum_and_digest_blocks_1t", |b| {
        b.iter(|| {
            sum_and_digest_blocks(&data, &mut both);
            black_box(&mut both);
        });
    });
    g.finish();

    // Both ways give the same sums and digests.
    let mut blocks = vec![(0u64, [0u8; 32]); chunks];
    sum_then_digest(&data, &mut both);
    sum_and_digest_blocks(&data, &mut blocks);
    assert!(
        both == blocks,
        "a chunk's sum or digest depends on how it is fed"
    );

    // The reference: blake3 of the whole 4 MiB chunks must match acp's.
    hash_chunks(&data, &mut out);
    let ours = acp_core::format::chunk_digests(&data, BLOCK);
    assert!(ours == out, "acp's chunk digests differ from blake3's");

    let mut notes = Notes::new("digest");
    notes.set("bytes", human_bytes(bytes as u64));
    notes.set("chunk", human_bytes(BLOCK as u64));
    notes.set("blake3_nt threads", n);
    notes.save();
}

criterion_group!(benches, digest);
criterion_main!(benches);
