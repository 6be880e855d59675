//! Peer replicas over the in-process transport: 2 nodes × 2 ranks, each
//! node with its own shared-memory directory. Losing node B (its engines
//! gone, its directory deleted) and starting it again empty, B's ranks
//! restore from A's replicas, bit-exact, whether or not the step is in
//! storage; a replica that fails verification is skipped for the next
//! source.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

use std::collections::BTreeMap;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use acp_core::replica::Loopback;
use acp_core::staging::{peek_slot, user_dir};
use acp_core::{
    Dtype, Engine, EngineConfig, ErrorKind, HostTensor, LoadRequest, SaveOptions, Source,
};
use serde_json::json;

const WORLD: u32 = 4;

/// Ranks 0 and 1 on node A, 2 and 3 on node B; rank r's replica goes to
/// the same local rank on the other node.
fn placement() -> BTreeMap<u32, Vec<u32>> {
    (0..WORLD).map(|r| (r, vec![(r + 2) % WORLD])).collect()
}

struct Cluster {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    shm: [PathBuf; 2],
    transport: Arc<Loopback>,
    engines: Vec<Option<Engine>>,
    release_on_close: bool,
    commit_timeout: Duration,
}

fn node_of(rank: u32) -> usize {
    (rank / 2) as usize
}

impl Cluster {
    fn new() -> Cluster {
        Cluster::build(false)
    }

    fn build(release_on_close: bool) -> Cluster {
        Cluster::build_with(release_on_close, Duration::from_secs(20))
    }

    fn build_with(release_on_close: bool, commit_timeout: Duration) -> Cluster {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("ckpt");
        let shm = [tmp.path().join("shm-a"), tmp.path().join("shm-b")];
        for d in &shm {
            std::fs::create_dir(d).unwrap();
        }
        let mut c = Cluster {
            _tmp: tmp,
            root,
            shm,
            transport: Arc::new(Loopback::new(placement())),
            engines: Vec::new(),
            release_on_close,
            commit_timeout,
        };
        c.engines = (0..WORLD).map(|r| Some(c.open(r))).collect();
        c
    }

    fn open(&self, rank: u32) -> Engine {
        let e = Engine::open(
            EngineConfig::new(&self.root)
                .with_shm_dir(&self.shm[node_of(rank)])
                .with_job("replicas")
                .with_rank(rank)
                .with_world_size(WORLD)
                .with_ring_bytes(16 << 20)
                .with_replicas_held(1)
                .with_transport(Arc::clone(&self.transport) as Arc<dyn acp_core::Transport>)
                .with_commit_timeout(self.commit_timeout)
                .with_release_on_close(self.release_on_close),
        )
        .unwrap();
        self.transport.register(&e);
        e
    }

    fn engine(&self, rank: u32) -> &Engine {
        self.engines[rank as usize].as_ref().unwrap()
    }

    /// Every rank saves `step` (committed) and replicates it.
    fn save_and_replicate(&self, step: u64) {
        let handles: Vec<_> = (0..WORLD).map(|r| save(self.engine(r), r, step)).collect();
        for h in handles {
            h.wait().unwrap();
        }
        let reps: Vec<_> = (0..WORLD)
            .map(|r| self.engine(r).replicate(step).unwrap())
            .collect();
        for (r, h) in reps.iter().enumerate() {
            assert_eq!(h.wait(None).unwrap(), vec![(r as u32 + 2) % WORLD]);
        }
    }

    /// Node B is lost (its processes and its shared memory) and replaced
    /// by an empty one.
    fn lose_node_b(&mut self) {
        for r in [2, 3] {
            self.engines[r as usize].take().unwrap().close().unwrap();
            self.transport.unregister(r);
        }
        self.replace_node_b();
    }

    /// Node B is lost without a close (its processes are killed: what is
    /// only resident there is gone) and replaced by an empty one.
    fn crash_node_b(&mut self) {
        for r in [2, 3] {
            drop(self.engines[r as usize].take());
            self.transport.unregister(r);
        }
        self.replace_node_b();
    }

    fn replace_node_b(&mut self) {
        std::fs::remove_dir_all(&self.shm[1]).unwrap();
        std::fs::create_dir(&self.shm[1]).unwrap();
        for r in [2, 3] {
            self.engines[r as usize] = Some(self.open(r));
        }
    }
}

fn shard(rank: u32, step: u64) -> Vec<u8> {
    (0..300_000u32)
        .map(|i| (i as u8) ^ (rank as u8 * 17) ^ (step as u8).wrapping_mul(3))
        .collect()
}

fn save(e: &Engine, rank: u32, step: u64) -> acp_core::SaveHandle {
    save_with(e, rank, step, &SaveOptions::default())
}

fn save_with(e: &Engine, rank: u32, step: u64, opts: &SaveOptions) -> acp_core::SaveHandle {
    let data = shard(rank, step);
    let name = format!("layer.{rank}.w");
    e.save(
        step,
        &[HostTensor {
            name: &name,
            dtype: Dtype::U8,
            shape: &[data.len() as u64],
            data: &data,
        }],
        &json!({"rank": rank, "step": step}),
        opts,
    )
    .unwrap()
}

fn load(e: &Engine, rank: u32, step: u64) -> (Source, bool) {
    let ck = e
        .load(&LoadRequest {
            step: Some(step),
            ..LoadRequest::default()
        })
        .unwrap();
    let name = format!("layer.{rank}.w");
    let exact = ck.tensor(&name).unwrap().data == shard(rank, step).as_slice()
        && ck.values()["step"] == json!(step);
    (ck.report().source, exact)
}

#[test]
fn a_replaced_node_restores_from_peer_replicas() {
    let mut c = Cluster::new();
    c.save_and_replicate(10);
    c.save_and_replicate(20);
    // Each rank of A holds its peer on B's newest two steps.
    assert_eq!(
        c.engine(0)
            .replicas()
            .iter()
            .map(|m| (m.rank, m.step))
            .collect::<Vec<_>>(),
        vec![(2, 20), (2, 10)]
    );
    c.lose_node_b();
    for r in [2, 3] {
        assert_eq!(load(c.engine(r), r, 20), (Source::Peer, true), "rank {r}");
    }
    for r in [0, 1] {
        assert_eq!(load(c.engine(r), r, 20), (Source::Ram, true), "rank {r}");
    }
}

#[test]
fn replicas_alone_restore_a_step_missing_from_storage() {
    let mut c = Cluster::new();
    c.save_and_replicate(10);
    c.save_and_replicate(20);
    std::fs::remove_dir_all(c.root.join("step-000000000020")).unwrap();
    c.lose_node_b();
    for r in [2, 3] {
        assert_eq!(load(c.engine(r), r, 20), (Source::Peer, true), "rank {r}");
    }
    // A's ranks restore their own images, verified against the digests
    // their slots recorded.
    for r in [0, 1] {
        assert_eq!(load(c.engine(r), r, 20), (Source::Ram, true), "rank {r}");
    }
}

/// Flips one byte of the image in `holder`'s replica slot of `rank`'s `step`.
fn corrupt_replica(shm: &Path, rank: u32, holder: u32, step: u64) {
    let tag = format!("-replica-r{rank:05}-on-r{holder:05}-s");
    let dir = user_dir(shm);
    for ent in std::fs::read_dir(&dir).unwrap() {
        let path = ent.unwrap().path();
        if !path.file_name().unwrap().to_str().unwrap().contains(&tag) {
            continue;
        }
        let Some(p) = peek_slot(&path).unwrap() else {
            continue;
        };
        if p.is_complete() && p.step == step {
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&path)
                .unwrap();
            let at = p.image_offset + p.image_len - 100;
            let mut b = [0u8];
            f.read_exact_at(&mut b, at).unwrap();
            f.write_all_at(&[b[0] ^ 0x5a], at).unwrap();
            return;
        }
    }
    panic!(
        "no replica of rank {rank}'s step {step} held by rank {holder} in {}",
        dir.display()
    );
}

#[test]
fn a_replica_failing_verification_is_skipped_for_the_next_source() {
    let mut c = Cluster::new();
    c.save_and_replicate(10);
    corrupt_replica(&c.shm[0], 2, 0, 10);
    c.lose_node_b();
    // Rank 2's replica is bad: storage restores it; rank 3's is good.
    assert_eq!(load(c.engine(2), 2, 10), (Source::Storage, true));
    assert_eq!(load(c.engine(3), 3, 10), (Source::Peer, true));
}

#[test]
fn a_bad_replica_of_an_uncommitted_step_is_never_returned() {
    let mut c = Cluster::new();
    c.save_and_replicate(10);
    std::fs::remove_dir_all(c.root.join("step-000000000010")).unwrap();
    corrupt_replica(&c.shm[0], 2, 0, 10);
    c.lose_node_b();
    let err = c
        .engine(2)
        .load(&LoadRequest {
            step: Some(10),
            ..LoadRequest::default()
        })
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert_eq!(load(c.engine(3), 3, 10), (Source::Peer, true));
}

#[test]
fn replica_rings_are_listed_apart_from_own_rings() {
    let c = Cluster::new();
    c.save_and_replicate(10);
    let report = acp_core::ops::shm_list(&c.shm[0]).unwrap();
    let mut rows: Vec<(u32, Option<u32>, Vec<u64>)> = report
        .rings
        .iter()
        .map(|g| (g.rank, g.replica_held_by, g.resident_steps.clone()))
        .collect();
    rows.sort();
    assert_eq!(
        rows,
        vec![
            (0, None, vec![10]),
            (1, None, vec![10]),
            (2, Some(0), vec![10]),
            (3, Some(1), vec![10]),
        ]
    );
    let text = acp_core::ops::shm_list_text(&report);
    assert!(text.contains("2@0"), "{text}");
}

/// A ring left in shared memory: its rank, the rank holding it (a replica
/// ring) and the steps of which it holds the only copy.
type Left = (u32, Option<u32>, Vec<u64>);

/// Closes every engine; returns, per node, the rings left.
fn close_all(c: &mut Cluster) -> [Vec<Left>; 2] {
    for e in &mut c.engines {
        e.take().unwrap().close().unwrap();
    }
    c.shm.clone().map(|dir| {
        let mut rows: Vec<_> = acp_core::ops::shm_list(&dir)
            .unwrap()
            .rings
            .into_iter()
            .map(|g| (g.rank, g.replica_held_by, g.only_copy_steps))
            .collect();
        rows.sort();
        rows
    })
}

#[test]
fn release_on_close_removes_replica_rings_of_committed_steps() {
    let mut c = Cluster::build(true);
    c.save_and_replicate(10);
    assert_eq!(close_all(&mut c), [vec![], vec![]]);
}

#[test]
fn release_on_close_keeps_a_replica_ring_holding_the_only_copy() {
    let mut c = Cluster::build(true);
    c.save_and_replicate(10);
    // Step 10 is then only in RAM: every ring holding it stays, the
    // replica rings included.
    std::fs::remove_dir_all(c.root.join("step-000000000010")).unwrap();
    let left = close_all(&mut c);
    assert_eq!(
        left[0],
        vec![
            (0, None, vec![10]),
            (1, None, vec![10]),
            (2, Some(0), vec![10]),
            (3, Some(1), vec![10]),
        ]
    );
    // `acp gc --shm` applies the same rule: nothing goes without --force.
    let gc = acp_core::ops::shm_gc(&c.shm[0], &acp_core::ops::ShmGcOptions::default()).unwrap();
    assert_eq!(gc.rings.len(), 4, "{gc:?}");
    assert!(gc.rings.iter().all(|g| !g.removed), "{gc:?}");
    let forced = acp_core::ops::ShmGcOptions {
        force: true,
        ..acp_core::ops::ShmGcOptions::default()
    };
    acp_core::ops::shm_gc(&c.shm[0], &forced).unwrap();
    acp_core::ops::shm_gc(&c.shm[1], &forced).unwrap();
    assert!(acp_core::ops::shm_list(&c.shm[0]).unwrap().rings.is_empty());
}

#[test]
fn close_finishes_the_queued_replica_sends() {
    let mut c = Cluster::new();
    let saves: Vec<_> = (0..WORLD).map(|r| save(c.engine(r), r, 10)).collect();
    for h in saves {
        h.wait().unwrap();
    }
    // Queued without waiting: rank 0's one replica thread sends them in
    // order, and its close waits for both.
    let queued: Vec<_> = (0..3).map(|_| c.engine(0).replicate(10).unwrap()).collect();
    c.engines[0].take().unwrap().close().unwrap();
    for h in &queued {
        assert!(h.is_done());
        assert_eq!(h.wait(None).unwrap(), vec![2]);
    }
    assert_eq!(
        c.engine(2)
            .replicas()
            .iter()
            .map(|m| (m.rank, m.step))
            .collect::<Vec<_>>(),
        vec![(0, 10)]
    );
}

/// Step 10 committed; step 20 a RAM snapshot on every rank, replicated to
/// the other node; then the job dies: node B with its shared memory, node
/// A's ranks with step 20 still only resident (their close could not
/// commit it without B). Returns the cluster, A's engines closed.
fn a_job_dies_with_a_replicated_snapshot() -> Cluster {
    a_job_dies_with_a_snapshot_replicated(false)
}

/// [`a_job_dies_with_a_replicated_snapshot`]; with `sums_alone`, step 20's
/// replicas are sealed with their quick sums alone, as an exchange seals
/// them before the sender has digests.
fn a_job_dies_with_a_snapshot_replicated(sums_alone: bool) -> Cluster {
    // Long enough for step 10's ranks to report on a loaded machine, short
    // enough for the closes below, which wait that long for node B.
    let mut c = Cluster::build_with(false, Duration::from_secs(2));
    c.save_and_replicate(10);
    let never = SaveOptions {
        persist: acp_core::Persist::Never,
        ..SaveOptions::default()
    };
    let saves: Vec<_> = (0..WORLD)
        .map(|r| save_with(c.engine(r), r, 20, &never))
        .collect();
    for h in saves {
        h.wait().unwrap();
    }
    if sums_alone {
        for r in 0..WORLD {
            let pin = c.engine(r).pin_resident(20).unwrap();
            let meta = c.engine(r).resident_meta(&pin);
            let sums = c.engine(r).resident_sums(&pin);
            let holder = c.engine((r + 2) % WORLD);
            let mut w = holder
                .begin_replica(r, 20, meta.len, meta.chunk_bytes)
                .unwrap();
            w.image_mut().copy_from_slice(pin.image());
            w.finish_with_sums(Vec::new(), sums).unwrap();
            assert!(c.engine(r).protect(20));
        }
    } else {
        let reps: Vec<_> = (0..WORLD)
            .map(|r| c.engine(r).replicate(20).unwrap())
            .collect();
        for h in &reps {
            h.wait(None).unwrap();
        }
    }
    for r in [2, 3] {
        drop(c.engines[r as usize].take());
        c.transport.unregister(r);
    }
    std::fs::remove_dir_all(&c.shm[1]).unwrap();
    std::thread::scope(|s| {
        for r in [0, 1] {
            let e = c.engines[r as usize].take().unwrap();
            s.spawn(move || assert!(e.close().is_err(), "rank {r} committed without B"));
        }
    });
    assert!(!c.root.join("step-000000000020").exists());
    c
}

fn persist_node_a(c: &Cluster) -> acp_core::Result<acp_core::ops::PersistReport> {
    acp_core::ops::persist(&acp_core::ops::PersistOptions {
        root: c.root.clone(),
        job: Some("replicas".into()),
        ranks: None,
        shm_dir: c.shm[0].clone(),
        world_size: None,
        commit_timeout: Duration::from_secs(20),
    })
}

#[test]
fn acp_persist_on_a_survivor_commits_a_dead_nodes_step_from_its_replicas() {
    let c = a_job_dies_with_a_replicated_snapshot();
    let report = persist_node_a(&c).unwrap();
    assert_eq!(report.world_size, WORLD);
    assert_eq!(report.latest, Some(20), "{report:#?}");
    assert!(report.incomplete.is_empty(), "{report:#?}");
    let got: Vec<(u32, Vec<u64>, Vec<u64>)> = report
        .ranks
        .iter()
        .map(|k| (k.rank, k.persisted_steps.clone(), k.from_replica.clone()))
        .collect();
    assert_eq!(
        got,
        vec![
            (0, vec![20], vec![]),
            (1, vec![20], vec![]),
            (2, vec![20], vec![20]),
            (3, vec![20], vec![20]),
        ]
    );
    // Committed, and every rank's file is the bytes it saved.
    every_rank_reads_from_storage(&c, 20);
    // The rings made to stage B's images went once they were committed.
    let left: Vec<(u32, Option<u32>)> = acp_core::ops::shm_list(&c.shm[0])
        .unwrap()
        .rings
        .iter()
        .map(|g| (g.rank, g.replica_held_by))
        .collect();
    assert!(left.iter().all(|(r, h)| *r < 2 || h.is_some()), "{left:?}");
}

#[test]
fn acp_persist_names_the_ranks_it_lacks_and_commits_nothing_partial() {
    let c = a_job_dies_with_a_replicated_snapshot();
    // Rank 3's replica (kept by rank 1) is gone too.
    let dir = user_dir(&c.shm[0]);
    for ent in std::fs::read_dir(&dir).unwrap() {
        let path = ent.unwrap().path();
        if path
            .file_name()
            .unwrap()
            .to_str()
            .unwrap()
            .contains("-replica-r00003-")
        {
            std::fs::remove_file(path).unwrap();
        }
    }
    let err = persist_node_a(&c).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err}");
    assert!(
        err.to_string()
            .contains("step 20 lacks the images of ranks [3]"),
        "{err}"
    );
    assert!(!c.root.join("step-000000000020").exists());
}

/// Rank 2's image of step 20 reached its holder, rank 3's did not (node B
/// was lost during the exchange): step 20 is complete nowhere, so every
/// rank restores step 10, and rank 2's holder must still have its replica
/// of step 10 beside the newer one, also after the holder's restart.
#[test]
fn a_holder_keeps_the_previous_replica_while_the_newest_is_not_everywhere() {
    let mut c = Cluster::new();
    c.save_and_replicate(10);
    let saves: Vec<_> = (0..WORLD).map(|r| save(c.engine(r), r, 20)).collect();
    for h in saves {
        h.wait().unwrap();
    }
    assert_eq!(c.engine(2).replicate(20).unwrap().wait(None).unwrap(), [0]);
    // Only RAM holds either step now.
    for step in [10, 20] {
        std::fs::remove_dir_all(c.root.join(format!("step-{step:012}"))).unwrap();
    }
    c.lose_node_b();
    let held = |c: &Cluster| -> Vec<(u32, u64)> {
        c.engine(0)
            .replicas()
            .iter()
            .map(|m| (m.rank, m.step))
            .collect()
    };
    assert_eq!(held(&c), [(2, 20), (2, 10)]);
    assert_eq!(load(c.engine(2), 2, 10), (Source::Peer, true));
    assert_eq!(load(c.engine(3), 3, 10), (Source::Peer, true));
    // The holder restarts on its node: it keeps both.
    c.engines[0].take().unwrap().close().unwrap();
    c.transport.unregister(0);
    c.engines[0] = Some(c.open(0));
    assert_eq!(held(&c), [(2, 20), (2, 10)]);
}

/// With `--rank`, node A commits B's ranks from the replicas it keeps
/// while A's own ranks are persisted by another run at the same time (as
/// when they sit on a third node).
#[test]
fn acp_persist_with_named_ranks_takes_their_replicas() {
    let c = a_job_dies_with_a_replicated_snapshot();
    let run = |ranks: Vec<u32>| {
        let opts = acp_core::ops::PersistOptions {
            root: c.root.clone(),
            job: Some("replicas".into()),
            ranks: Some(ranks),
            shm_dir: c.shm[0].clone(),
            world_size: Some(WORLD),
            commit_timeout: Duration::from_secs(20),
        };
        acp_core::ops::persist(&opts).unwrap()
    };
    let (own, replicas) = std::thread::scope(|s| {
        let own = s.spawn(|| run(vec![0, 1]));
        let replicas = s.spawn(|| run(vec![2, 3]));
        (own.join().unwrap(), replicas.join().unwrap())
    });
    assert!(
        own.ranks.iter().all(|k| k.persisted_steps == [20]),
        "{own:#?}"
    );
    assert!(
        replicas.ranks.iter().all(|k| k.from_replica == [20]),
        "{replicas:#?}"
    );
    assert!(c.root.join("step-000000000020").exists());
}

/// Every rank saves `step` (committed); each rank's image then reaches its
/// holder through [`Engine::begin_replica`]: the bytes written straight
/// into the replica slot, `tamper` applied to them (by source rank), then
/// sealed with the digests the sender took.
fn save_and_receive_into_slots(c: &Cluster, step: u64, tamper: impl Fn(u32, &mut [u8])) {
    save_and_receive_with_sums(c, step, tamper, |_, _| {});
}

/// Every rank saves `step` and its holder receives its image into a
/// replica slot as a transport does, sealed with the digests and quick
/// sums sent after it; `tamper` changes the bytes and `tamper_sums` the
/// sums on their way.
fn save_and_receive_with_sums(
    c: &Cluster,
    step: u64,
    tamper: impl Fn(u32, &mut [u8]),
    tamper_sums: impl Fn(u32, &mut [u64]),
) {
    let handles: Vec<_> = (0..WORLD).map(|r| save(c.engine(r), r, step)).collect();
    for h in handles {
        h.wait().unwrap();
    }
    for r in 0..WORLD {
        let (meta, pin) = c.engine(r).resident_replica(step).unwrap();
        assert_eq!(meta.sums.len(), meta.digests.len(), "rank {r}'s quick sums");
        let holder = c.engine((r + 2) % WORLD);
        let mut w = holder
            .begin_replica(r, step, meta.len, meta.chunk_bytes)
            .unwrap();
        w.image_mut().copy_from_slice(pin.image());
        tamper(r, w.image_mut());
        let mut sums = meta.sums.clone();
        tamper_sums(r, &mut sums);
        w.finish_with_sums(meta.digests.clone(), sums).unwrap();
    }
}

#[test]
fn a_replica_received_straight_into_its_slot_restores_bit_exact() {
    let mut c = Cluster::new();
    save_and_receive_into_slots(&c, 10, |_, _| {});
    let held: Vec<_> = c.engine(0).replicas();
    assert_eq!(held.len(), 1);
    let (meta, _) = c.engine(2).resident_replica(10).unwrap();
    assert_eq!(held[0], meta, "the holder records the sender's digests");
    c.lose_node_b();
    for r in [2, 3] {
        assert_eq!(load(c.engine(r), r, 10), (Source::Peer, true), "rank {r}");
    }
}

#[test]
fn a_replica_corrupted_on_its_way_into_the_slot_is_rejected_by_name() {
    let mut c = Cluster::new();
    save_and_receive_into_slots(&c, 10, |r, image| {
        if r == 2 {
            image[1000] ^= 0x5a;
        }
    });
    c.lose_node_b();
    let ck = c
        .engine(2)
        .load(&LoadRequest {
            step: Some(10),
            ..LoadRequest::default()
        })
        .unwrap();
    assert_eq!(ck.report().source, Source::Storage);
    let why = ck.report().rejected.clone().unwrap();
    assert!(
        why.contains("rank 2's image of step 10") && why.contains("replica"),
        "{why}"
    );
    assert_eq!(load(c.engine(3), 3, 10), (Source::Peer, true));
}

#[test]
fn a_replica_whose_quick_sums_were_damaged_is_checked_by_its_digests() {
    let mut c = Cluster::new();
    save_and_receive_with_sums(
        &c,
        10,
        |_, _| {},
        |r, sums| {
            if r == 2 {
                sums[0] ^= 1;
            }
        },
    );
    c.lose_node_b();
    // Rank 2's bytes are intact, only a sum is wrong: its digests pass it.
    for r in [2, 3] {
        let ck = c
            .engine(r)
            .load(&LoadRequest {
                step: Some(10),
                ..LoadRequest::default()
            })
            .unwrap();
        assert_eq!(ck.report().source, Source::Peer, "rank {r}");
        assert!(ck.report().rejected.is_none(), "rank {r}");
        let name = format!("layer.{r}.w");
        assert_eq!(ck.tensor(&name).unwrap().data, shard(r, 10).as_slice());
    }
}

#[test]
fn quick_sums_that_do_not_match_the_digests_in_count_are_refused() {
    let c = Cluster::new();
    // Resident only: rank 2 alone saves step 10.
    let resident = SaveOptions {
        persist: acp_core::Persist::Never,
        ..SaveOptions::default()
    };
    save_with(c.engine(2), 2, 10, &resident).wait().unwrap();
    let (meta, pin) = c.engine(2).resident_replica(10).unwrap();
    let holder = c.engine(0);
    let mut w = holder
        .begin_replica(2, 10, meta.len, meta.chunk_bytes)
        .unwrap();
    w.image_mut().copy_from_slice(pin.image());
    let mut sums = meta.sums.clone();
    sums.push(0);
    let err = w.finish_with_sums(meta.digests.clone(), sums).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
    assert!(err.to_string().contains("quick sums"), "{err}");
    assert!(holder.replicas().is_empty());
}

#[test]
fn an_unfinished_or_misdescribed_replica_slot_holds_nothing() {
    let c = Cluster::new();
    save_and_receive_into_slots(&c, 10, |_, _| {});
    // Resident only: rank 2 alone saves step 20.
    let resident = SaveOptions {
        persist: acp_core::Persist::Never,
        ..SaveOptions::default()
    };
    save_with(c.engine(2), 2, 20, &resident).wait().unwrap();
    let (meta, pin) = c.engine(2).resident_replica(20).unwrap();
    let holder = c.engine(0);
    // Dropped before its digests came: nothing new is held, the older
    // replica stays.
    let mut w = holder
        .begin_replica(2, 20, meta.len, meta.chunk_bytes)
        .unwrap();
    w.image_mut().copy_from_slice(pin.image());
    drop(w);
    let steps = |e: &Engine| e.replicas().iter().map(|m| m.step).collect::<Vec<_>>();
    assert_eq!(steps(holder), vec![10]);
    // Digests that do not describe the image are refused.
    let mut w = holder
        .begin_replica(2, 20, meta.len, meta.chunk_bytes)
        .unwrap();
    w.image_mut().copy_from_slice(pin.image());
    let err = w.finish(meta.digests[1..].to_vec()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
    assert_eq!(steps(holder), vec![10]);
    // Another chunk size is refused before anything is received.
    let err = holder
        .begin_replica(2, 20, meta.len, meta.chunk_bytes * 2)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
}

/// Step 10 is replicated everywhere (protected), step 20 only sealed: each
/// rank keeps its own image of step 10 resident beside step 20, so losing
/// node B then still finds every rank's image of step 10 on node A (its
/// own ranks' slots, B's ranks' replicas). Once step 20 is replicated too,
/// step 10's slot is let go.
#[test]
fn the_newest_replicated_snapshot_stays_until_a_newer_one_is_replicated() {
    let mut c = Cluster::new();
    let never = SaveOptions {
        persist: acp_core::Persist::Never,
        ..SaveOptions::default()
    };
    let snapshot = |c: &Cluster, step: u64| {
        let saves: Vec<_> = (0..WORLD)
            .map(|r| save_with(c.engine(r), r, step, &never))
            .collect();
        for h in saves {
            h.wait().unwrap();
        }
    };
    snapshot(&c, 10);
    for r in 0..WORLD {
        assert_eq!(
            c.engine(r).replicate(10).unwrap().wait(None).unwrap().len(),
            1
        );
    }
    snapshot(&c, 20);
    // Without the protection step 10's slot was released at step 20's seal.
    assert_eq!(c.engine(0).resident_steps(), [20, 10]);
    assert!(!c.engine(0).protect(10), "10 is protected already");
    // Node B is lost (no close: its processes are killed), B's images of
    // step 20 with it.
    c.crash_node_b();
    for r in [0, 1] {
        assert_eq!(load(c.engine(r), r, 10), (Source::Ram, true), "rank {r}");
    }
    for r in [2, 3] {
        assert_eq!(load(c.engine(r), r, 10), (Source::Peer, true), "rank {r}");
    }
    // Rank 0's step 20 replicated (to rank 2, on the new node B): step
    // 10 is no longer the newest protected step, and its slot goes.
    assert_eq!(c.engine(0).replicate(20).unwrap().wait(None).unwrap(), [2]);
    assert_eq!(c.engine(0).resident_steps(), [20]);
}

/// A transport whose sends wait until the test opens the gate: an
/// exchange still in flight while the trainer saves on.
#[derive(Debug)]
struct Gate {
    inner: Arc<Loopback>,
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }
}

impl acp_core::Transport for Gate {
    fn send(&self, to: u32, meta: &acp_core::ReplicaMeta, image: &[u8]) -> acp_core::Result<()> {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
        drop(open);
        self.inner.send(to, meta, image)
    }
    fn list(&self, peer: u32) -> acp_core::Result<Vec<acp_core::ReplicaMeta>> {
        self.inner.list(peer)
    }
    fn fetch(
        &self,
        peer: u32,
        rank: u32,
        step: u64,
    ) -> acp_core::Result<Option<acp_core::replica::Fetched>> {
        self.inner.fetch(peer, rank, step)
    }
    fn holders(&self, rank: u32) -> Vec<u32> {
        self.inner.holders(rank)
    }
}

/// Step 10's exchange is still in flight while steps 20 and 30 are saved
/// (a ring that saves faster than it replicates): step 10 stays resident
/// until its exchange ends and becomes the protected step, so losing the
/// holder's node then still finds rank 0's image of it on rank 0's node.
/// Without the hold, step 10 was released when step 20 sealed, its
/// exchange could protect nothing, and no newer step ever got protected.
#[test]
fn a_snapshot_whose_exchange_is_in_flight_stays_and_is_protected() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ckpt");
    let shm = [tmp.path().join("shm-a"), tmp.path().join("shm-b")];
    let loopback = Arc::new(Loopback::new(
        [(0, vec![1]), (1, vec![0])].into_iter().collect(),
    ));
    let gate = Arc::new(Gate {
        inner: Arc::clone(&loopback),
        open: Mutex::new(false),
        opened: Condvar::new(),
    });
    let engines: Vec<Engine> = (0..2u32)
        .map(|r| {
            std::fs::create_dir(&shm[r as usize]).unwrap();
            let e = Engine::open(
                EngineConfig::new(&root)
                    .with_shm_dir(&shm[r as usize])
                    .with_job("in-flight")
                    .with_rank(r)
                    .with_world_size(2)
                    .with_ring_bytes(16 << 20)
                    .with_ring_slots(4)
                    .with_replicas_held(1)
                    .with_transport(Arc::clone(&gate) as Arc<dyn acp_core::Transport>)
                    .with_commit_timeout(Duration::from_secs(20))
                    .with_release_on_close(true),
            )
            .unwrap();
            loopback.register(&e);
            e
        })
        .collect();
    let e0 = &engines[0];
    let never = SaveOptions {
        persist: acp_core::Persist::Never,
        ..SaveOptions::default()
    };
    save_with(e0, 0, 10, &never).wait().unwrap();
    let sending = e0.replicate(10).unwrap();
    for step in [20, 30] {
        save_with(e0, 0, step, &never).wait().unwrap();
    }
    assert_eq!(e0.resident_steps(), [30, 10], "20 superseded, 10 held");
    gate.open();
    assert_eq!(sending.wait(None).unwrap(), [1]);
    assert!(!e0.protect(10), "the exchange protected step 10 already");
    assert_eq!(
        e0.resident_steps(),
        [30, 10],
        "10 kept as the protected step"
    );
    assert_eq!(engines[1].replicas()[0].step, 10);
    // A hold of a step that is not a kept snapshot marks nothing, and a
    // release without a hold changes nothing.
    assert!(!e0.hold_replicating(20));
    e0.release_replicating(20);
    assert_eq!(e0.resident_steps(), [30, 10]);
    // close commits the newest snapshot: every rank has step 30.
    save_with(&engines[1], 1, 30, &never).wait().unwrap();
    std::thread::scope(|s| {
        for e in &engines {
            s.spawn(|| e.close().unwrap());
        }
    });
}

/// The chunk size of the cluster's engines.
fn chunk_bytes(c: &Cluster) -> u64 {
    let (meta, _) = {
        let resident = SaveOptions {
            persist: acp_core::Persist::Never,
            ..SaveOptions::default()
        };
        save_with(c.engine(1), 1, 1, &resident).wait().unwrap();
        c.engine(1).resident_replica(1).unwrap()
    };
    meta.chunk_bytes
}

/// Receives `image` as `rank`'s image of `step` into a replica slot of
/// `holder`, sealed with its own digests and quick sums.
fn receive(holder: &Engine, rank: u32, step: u64, image: &[u8], chunk: u64) {
    try_receive(holder, rank, step, image, chunk).unwrap();
}

fn try_receive(
    holder: &Engine,
    rank: u32,
    step: u64,
    image: &[u8],
    chunk: u64,
) -> acp_core::Result<()> {
    let meta = acp_core::ReplicaMeta::of_image(rank, step, image, chunk);
    holder.receive_replica(&meta, |dst| {
        dst.copy_from_slice(image);
        Ok(())
    })
}

/// A message claiming a rank outside the job (a stale or buggy peer) is
/// refused before a replica ring is opened for it: it neither takes one
/// of the holder's `replicas_held` sources from the rank it serves nor
/// leaves a ring in shared memory.
#[test]
fn a_replica_of_a_rank_outside_the_world_takes_no_source() {
    let c = Cluster::new();
    let chunk = chunk_bytes(&c);
    let holder = c.engine(0);
    let err = holder
        .begin_replica(WORLD + 5, 10, 4096, chunk)
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Invalid, "{err}");
    assert!(
        err.to_string().contains("rank 9") && err.to_string().contains("world"),
        "{err}"
    );
    let stray = std::fs::read_dir(user_dir(&c.shm[0]))
        .unwrap()
        .filter_map(|e| e.unwrap().file_name().into_string().ok())
        .find(|n| n.contains("-replica-r00009-"));
    assert_eq!(stray, None, "a ring was opened for rank 9");
    // The rank it holds replicas of still gets its slot.
    save_and_receive_into_slots(&c, 10, |_, _| {});
    let held: Vec<_> = holder.replicas().iter().map(|m| (m.rank, m.step)).collect();
    assert_eq!(held, vec![(2, 10)]);
}

/// A step received again (its rank re-ran it after a restart from an
/// earlier step, so its bytes differ) replaces the copy received before,
/// whichever slot each is in: the older copy is never the one a restore
/// is served.
#[test]
fn a_step_received_again_replaces_the_older_copy() {
    let c = Cluster::new();
    let chunk = chunk_bytes(&c);
    let holder = c.engine(0);
    let first = vec![1u8; 10_000];
    let again = vec![2u8; 10_000];
    receive(holder, 2, 10, &first, chunk);
    receive(holder, 2, 10, &again, chunk);
    let held: Vec<_> = holder.replicas().iter().map(|m| (m.rank, m.step)).collect();
    assert_eq!(held, vec![(2, 10)], "one copy of step 10 is kept");
    let (meta, pin, _) = holder.pin_replica(2, 10).unwrap();
    assert!(pin.image() == again.as_slice(), "the older copy was kept");
    assert_eq!(
        meta.digests,
        acp_core::ReplicaMeta::of_image(2, 10, &again, chunk).digests
    );
}

/// A replica served while its holder receives newer ones (a restore's
/// fetch beside a replica exchange) is the step asked for, described by
/// its own length and digests, or nothing: never a newer image of the
/// reused slot under the old step's name (a loopback fetch of one then
/// panicked on the length).
#[test]
fn a_replica_pinned_while_its_slot_is_reused_is_the_step_asked_for() {
    let c = Cluster::new();
    let chunk = chunk_bytes(&c);
    let holder = c.engine(0).clone();
    let image = |step: u64| vec![step as u8; 4096 * (1 + (step % 3) as usize) + step as usize];
    receive(&holder, 2, 1, &image(1), chunk);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let newest = Arc::new(std::sync::atomic::AtomicU64::new(1));
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (holder, stop, newest) = (holder.clone(), Arc::clone(&stop), Arc::clone(&newest));
            std::thread::Builder::new()
                .name("replica-reader".to_owned())
                .spawn(move || {
                    let mut served = 0u64;
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let n = newest.load(std::sync::atomic::Ordering::Relaxed);
                        // The previous step: the slot the next receive reuses.
                        let step = n.saturating_sub(1).max(1);
                        if let Some((meta, pin, _)) = holder.pin_replica(2, step) {
                            assert_eq!(
                                (meta.step, pin.step(), meta.len, pin.image().len() as u64),
                                (
                                    step,
                                    step,
                                    image(step).len() as u64,
                                    image(step).len() as u64
                                ),
                                "replica pinned for step {step}"
                            );
                            served += 1;
                        }
                        // The listing describes each image by its own
                        // length and digests.
                        for m in holder.replicas() {
                            let want =
                                acp_core::ReplicaMeta::of_image(2, m.step, &image(m.step), chunk);
                            assert!(
                                m.len == want.len && m.digests == want.digests,
                                "replica of step {} listed with another image's digests",
                                m.step
                            );
                        }
                    }
                    served
                })
                .unwrap()
        })
        .collect();
    let t0 = std::time::Instant::now();
    let mut step = 1;
    while t0.elapsed() < Duration::from_secs(3) {
        // Both slots may be pinned by the readers for a moment.
        match try_receive(&holder, 2, step + 1, &image(step + 1), chunk) {
            Ok(()) => {
                step += 1;
                newest.store(step, std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => assert_eq!(e.kind(), ErrorKind::Busy, "{e}"),
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let served: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
    assert!(served > 0, "no replica was served");
}

/// A survivor committing a lost rank's step from a replica kept on its
/// node checks that the image is that rank's: a replica slot of rank 3
/// holding rank 2's image (a misdirected send) is refused, naming the
/// slot, rather than committed as rank 3's file, which every load of the
/// step would then refuse.
#[test]
fn a_replica_holding_another_ranks_image_is_not_persisted_as_its_rank() {
    let c = Cluster::new();
    let resident = SaveOptions {
        persist: acp_core::Persist::Never,
        ..SaveOptions::default()
    };
    save_with(c.engine(2), 2, 10, &resident).wait().unwrap();
    let (meta, pin) = c.engine(2).resident_replica(10).unwrap();
    // Rank 1 (node A) keeps rank 3's replicas; rank 2's image arrives
    // under rank 3's name, with its own digests.
    let mut w = c
        .engine(1)
        .begin_replica(3, 10, meta.len, meta.chunk_bytes)
        .unwrap();
    w.image_mut().copy_from_slice(pin.image());
    w.finish_with_sums(meta.digests.clone(), meta.sums.clone())
        .unwrap();
    // Node B is lost: rank 3 is persisted on node A from that replica.
    let survivor = Engine::open(
        EngineConfig::new(&c.root)
            .with_shm_dir(&c.shm[0])
            .with_job("replicas")
            .with_rank(3)
            .with_world_size(WORLD)
            .with_ring_bytes(16 << 20)
            .with_commit_timeout(Duration::from_secs(2))
            .with_release_on_close(true),
    )
    .unwrap();
    let err = survivor
        .persist_replica(10)
        .and_then(|h| h.wait())
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Corrupt, "{err}");
    assert!(err.to_string().contains("acp.rank 2"), "{err}");
    survivor.close().unwrap();
}

/// Another rank's restore reads a replica slot on this node without a
/// lock; a control block rewritten under it (here an image offset of 0,
/// inside the header page) makes the slot hold no digests for it, never a
/// panic on the offset (across FFI, a Python exception).
#[test]
fn a_control_block_changed_under_a_peer_reader_is_no_panic() {
    use acp_core::staging::{job_tag, replica_files, PeerImage, PeerSlot};
    let c = Cluster::new();
    save_and_receive_into_slots(&c, 10, |_, _| {});
    let file = replica_files(&c.shm[0], "replicas", Some(2))
        .unwrap()
        .into_iter()
        .find(|f| {
            peek_slot(&f.path())
                .unwrap()
                .is_some_and(|p| p.is_complete())
        })
        .unwrap();
    let peek = peek_slot(&file.path()).unwrap().unwrap();
    let want = PeerImage {
        job_tag: job_tag("replicas"),
        rank: 2,
        step: 10,
        len: peek.image_len,
    };
    let slot = PeerSlot::open(&file, want).unwrap().unwrap();
    let (chunk, digests) = slot.digests().unwrap().unwrap();
    // The quick sums recorded beside those digests, and only beside them.
    let sums = slot.sums(chunk, &digests).unwrap().unwrap();
    assert_eq!(sums.len(), digests.len());
    assert!(slot.sums(chunk, &digests[1..]).unwrap().is_none());
    assert!(slot.sums(chunk * 2, &digests).unwrap().is_none());
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(file.path())
        .unwrap();
    f.write_all_at(&0u64.to_le_bytes(), 104).unwrap();
    assert!(slot.digests().unwrap().is_none());
    assert!(slot.sums(chunk, &digests).unwrap().is_none());
    assert!(!slot.unchanged().unwrap());
}

/// A replica sealed with its quick sums alone (what an exchange does
/// before the sender has blake3 digests) of a step that is only resident:
/// the sums check it for a restore from the peer, and a survivor persists
/// it; its digests, recorded later, bind it as if it had come with them.
#[test]
fn a_replica_sealed_with_its_sums_alone_restores_persists_and_takes_digests() {
    let mut c = Cluster::new();
    let resident = SaveOptions {
        persist: acp_core::Persist::Never,
        ..SaveOptions::default()
    };
    for r in [2, 3] {
        save_with(c.engine(r), r, 10, &resident).wait().unwrap();
        let pin = c.engine(r).pin_resident(10).unwrap();
        let sums = c.engine(r).resident_sums(&pin);
        let chunk = c.engine(r).resident_meta(&pin).chunk_bytes;
        // A RAM snapshot has no digests to send.
        assert_eq!(
            c.engine(r)
                .digests_to_send(&pin, Duration::from_secs(60))
                .unwrap(),
            None
        );
        let holder = c.engine((r + 2) % WORLD);
        let mut w = holder
            .begin_replica(r, 10, pin.image().len() as u64, chunk)
            .unwrap();
        w.image_mut().copy_from_slice(pin.image());
        if r == 3 {
            w.image_mut()[1000] ^= 0x5a;
        }
        w.finish_with_sums(Vec::new(), sums).unwrap();
        let held = holder.replicas();
        assert_eq!(held.len(), 1);
        assert!(held[0].digests.is_empty() && !held[0].sums.is_empty());
    }
    // Rank 0's replica of rank 2 takes digests; a wrong count is refused.
    let pin = c.engine(2).pin_resident(10).unwrap();
    let (digests, _) = c.engine(2).resident_hashes(&pin).unwrap();
    drop(pin);
    assert!(!c.engine(0).add_replica_digests(2, 10, &digests[1..]));
    assert!(c.engine(0).add_replica_digests(2, 10, &digests));
    assert_eq!(c.engine(0).replicas()[0].digests, digests);
    let chunk = c.engine(0).replicas()[0].chunk_bytes;
    c.engine(0).replicas()[0].check(chunk).unwrap();
    // Node B dies (no close: step 10 is only resident) and is replaced.
    c.crash_node_b();
    assert_eq!(load(c.engine(2), 2, 10), (Source::Peer, true));
    // Rank 3's replica was damaged: refused by name, and no other copy.
    let err = c
        .engine(3)
        .load(&LoadRequest {
            step: Some(10),
            ..LoadRequest::default()
        })
        .unwrap_err();
    assert!(err.to_string().contains("quick sum"), "{err}");
}

/// `acp persist` on a surviving node commits a lost node's step from
/// replicas that have their quick sums alone (sent before any blake3
/// digest existed): the sums check the copies, the persist hashes them as
/// it writes.
#[test]
fn acp_persist_commits_replicas_that_have_their_sums_alone() {
    let c = a_job_dies_with_a_snapshot_replicated(true);
    let report = persist_node_a(&c).unwrap();
    assert_eq!(report.latest, Some(20), "{report:#?}");
    assert!(report.incomplete.is_empty(), "{report:#?}");
    every_rank_reads_from_storage(&c, 20);
}

/// Every rank's file of committed `step` loads from storage, bit-exact
/// (a reader of another job: no RAM of the cluster's).
fn every_rank_reads_from_storage(c: &Cluster, step: u64) {
    for r in 0..WORLD {
        let reader = Engine::open(
            EngineConfig::new(&c.root)
                .with_shm_dir(c._tmp.path())
                .with_job("reader")
                .with_rank(r)
                .with_world_size(WORLD)
                .with_ring_bytes(16 << 20),
        )
        .unwrap();
        assert_eq!(load(&reader, r, step), (Source::Storage, true), "rank {r}");
        reader.close().unwrap();
    }
}

/// While its step's image is being sent to its holders
/// ([`Engine::exchange_started`]), a persist of that step pauses between
/// chunks, and commits once the exchange ends; an exchange of another
/// step holds no persist back; and a persist never waits for its
/// exchange past [`acp_core::FLUSH_YIELD_MAX`].
#[test]
fn a_persist_yields_to_its_own_steps_exchange_for_a_bounded_time() {
    let tmp = tempfile::tempdir().unwrap();
    let shm = tmp.path().join("shm");
    std::fs::create_dir(&shm).unwrap();
    let e = Engine::open(
        EngineConfig::new(tmp.path().join("ckpt"))
            .with_shm_dir(&shm)
            .with_job("yield")
            .with_ring_bytes(16 << 20)
            .with_ring_slots(4)
            .with_release_on_close(true),
    )
    .unwrap();
    e.exchange_started(10);
    let h = save(&e, 0, 10);
    assert!(
        h.wait_timeout(Duration::from_millis(500))
            .unwrap()
            .is_none(),
        "step 10 committed while its exchange ran"
    );
    e.exchange_started(20);
    e.exchange_ended(10);
    let report = h
        .wait_timeout(Duration::from_secs(5))
        .unwrap()
        .expect("step 10 committed once its exchange ended");
    // Its report says how long it waited (at least the 0.5 s above).
    assert!(
        report.replica_wait_secs >= 0.4 && report.replica_wait_secs <= report.flush_secs,
        "{report:?}"
    );
    // Step 20's exchange is still marked: step 30's persist does not wait.
    let report = save(&e, 0, 30)
        .wait_timeout(Duration::from_secs(5))
        .unwrap()
        .expect("step 30 did not wait for step 20's exchange");
    assert_eq!(report.replica_wait_secs, 0.0);
    e.exchange_ended(20);
    // An exchange that never ends (a stalled peer) holds the persist back
    // for FLUSH_YIELD_MAX at most.
    e.exchange_started(40);
    let t = std::time::Instant::now();
    let h = save(&e, 0, 40);
    h.wait_timeout(acp_core::FLUSH_YIELD_MAX + Duration::from_secs(20))
        .unwrap()
        .expect("step 40 committed despite the exchange that never ended");
    assert!(t.elapsed() >= acp_core::FLUSH_YIELD_MAX - Duration::from_secs(1));
    assert_eq!(load(&e, 0, 40), (Source::Ram, true));
    e.exchange_ended(40);
    // The dying checkpoint (`persist_newest`) does not wait for a peer:
    // the persist paused for step 50's exchange goes on at once.
    e.exchange_started(50);
    let h = save(&e, 0, 50);
    assert!(h
        .wait_timeout(Duration::from_millis(300))
        .unwrap()
        .is_none());
    let t = std::time::Instant::now();
    assert!(e.persist_newest().unwrap().is_none(), "step 50 is queued");
    h.wait_timeout(Duration::from_secs(5))
        .unwrap()
        .expect("step 50 committed once the engine hurried");
    assert!(t.elapsed() < Duration::from_secs(5));
    e.close().unwrap();
}

/// Once a replica ring has received an image, its other slot is grown to
/// that image's size in the background, so that the next image received
/// does not wait for its memory.
#[test]
fn a_replica_rings_other_slot_is_readied_in_the_background() {
    let c = Cluster::new();
    c.save_and_replicate(10);
    let len = shard(0, 10).len() as u64;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let files = acp_core::staging::replica_files(&c.shm[1], "replicas", Some(0)).unwrap();
        let sizes: Vec<(usize, u64)> = files
            .iter()
            .map(|f| (f.slot, std::fs::metadata(f.path()).map_or(0, |m| m.len())))
            .collect();
        if sizes.len() == 2 && sizes.iter().all(|(_, n)| *n >= len) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "rank 0's replica slots on node B: {sizes:?}, each should hold {len} bytes"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}
