//! Digest: blake3 throughput over 4 MiB chunks (acp's default chunk), the
//! hashing every flush and every verified load does.
//!
//! Rows: `blake3_1t` (`blake3::hash` per chunk on one thread, the
//! baseline), `acp_chunk_digests` (acp's `format::chunk_digests`, one
//! thread), `blake3_nt` (chunks split over N scoped threads, as a verified
//! load hashes).

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
    g.finish();

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
