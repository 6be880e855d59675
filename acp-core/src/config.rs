//! Engine configuration: a plain struct with defaults, `with_*` setters and
//! [`EngineConfig::validate`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
#[cfg(feature = "test-util")]
use crate::storage::faults::FaultInjector;
use crate::storage::Probe;

/// Which I/O engine flushes and reads checkpoint files.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoChoice {
    /// io_uring when the kernel allows it, else the pwrite/pread thread pool.
    #[default]
    Auto,
    /// io_uring only; opening the engine fails where it is refused.
    Uring,
    /// The pwrite/pread thread pool.
    Psync,
}

/// Whether data files are written and read with `O_DIRECT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirectIo {
    /// `O_DIRECT` where the file system accepts it, buffered I/O elsewhere.
    #[default]
    Auto,
    /// Always `O_DIRECT`; a file system that refuses it is an error.
    On,
    /// Buffered I/O (still fsynced before commit).
    Off,
}

/// What `save` does when every ring slot is busy (staging, or holding a
/// checkpoint not yet flushed).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenFull {
    /// Wait for a slot to be freed by the flush, at most this long, then fail
    /// with [`Error::Timeout`].
    Wait(Duration),
    /// Return at once with a handle that reports the save as skipped.
    Skip,
}

impl Default for WhenFull {
    fn default() -> Self {
        WhenFull::Wait(Duration::from_secs(600))
    }
}

/// Which saves the engine persists (flushes to storage and commits) when
/// the save leaves it to the policy ([`Persist::Policy`](crate::Persist)).
/// A save that is not persisted stays resident: a RAM snapshot in its ring
/// slot, restorable on this node, lost with the node.
///
/// Every policy decides the same on every rank only when it depends on the
/// step alone: with several ranks, only [`PersistPolicy::Every`] is valid
/// (rank 0 commits a step once every rank has written it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PersistPolicy {
    /// Persist the saves whose step is a multiple of `n`; `Every(1)`
    /// persists every save.
    Every(u64),
    /// Persist a save when at least this long has passed since the last
    /// persist was queued (the first save is persisted).
    Interval(Duration),
    /// Persist the newest snapshot whenever the previous persist has
    /// finished: at most one persist in flight; a newer snapshot supersedes
    /// an older one still waiting, which is then never written.
    Coalesce,
}

impl Default for PersistPolicy {
    /// `Every(1)`: every save is persisted.
    fn default() -> Self {
        PersistPolicy::Every(1)
    }
}

/// How much of a checkpoint is re-hashed when it is loaded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verify {
    /// Verify every chunk: from storage against the manifest's blake3
    /// digests; from a resident slot whose recorded digests are the
    /// manifest's, against the xxh3 sum recorded beside each digest (the
    /// blake3 digest when it has none, or when a sum differs; `read/fast.rs`
    /// says what the sums prove).
    #[default]
    Always,
    /// Verify what is read from storage; trust resident slots written by
    /// this process or a previous one on this node (their recorded digests
    /// must still be the manifest's; their bytes are not hashed).
    StorageOnly,
}

/// Whether persisted data files are compressed on storage (the RAM image
/// is always plain).
///
/// A compressed file is the plain image cut into the digest chunks, each
/// chunk's bytes grouped into planes by element width and zstd-compressed
/// (see [`format`](crate::format), "Compressed data file"). It is encoded
/// by the flush, chunks in parallel on up to `copy_threads` threads, never
/// by the save's stall.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compress {
    /// Plain safetensors files.
    #[default]
    None,
    /// Every persisted file is compressed.
    Zstd,
    /// Compressed when that makes the flush finish sooner, by this
    /// engine's measurements: the first flush is written plain (measuring
    /// the storage's write rate), the next compressed (measuring the
    /// compression rate and ratio); from then on a flush is compressed
    /// when `1 / compress_rate + ratio / write_rate < 1 / write_rate`
    /// (seconds per plain byte: the file is compressed, then written),
    /// each rate the newest measurement of its kind. A flush written plain
    /// refreshes the write rate; one compressed refreshes the compression
    /// rate and ratio, and the write rate of its smaller file.
    Auto,
}

impl Compress {
    /// Parses `"none"`, `"zstd"` or `"auto"`.
    ///
    /// # Errors
    /// [`Error::Config`] naming `compress` for any other word.
    pub fn parse(word: &str) -> Result<Compress> {
        match word {
            "none" => Ok(Compress::None),
            "zstd" => Ok(Compress::Zstd),
            "auto" => Ok(Compress::Auto),
            other => Err(Error::Config {
                field: "compress",
                reason: format!("{other:?} is not one of \"none\", \"zstd\", \"auto\""),
            }),
        }
    }
}

/// Default zstd level of compressed files: 1. On byte-grouped model
/// weights and optimizer state it was both faster and smaller than zstd's
/// own default (3) in `acp-bench`'s `compress` bench.
pub const DEFAULT_COMPRESS_LEVEL: i32 = 1;

/// Configuration of an [`Engine`](crate::Engine).
///
/// Built with [`EngineConfig::new`] and the `with_*` setters; every setter's
/// doc gives the default and the unit.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub(crate) root: PathBuf,
    pub(crate) job: Option<String>,
    pub(crate) rank: u32,
    pub(crate) world_size: u32,
    pub(crate) ring_bytes: u64,
    /// `ring_bytes` was not given: [`Engine::open`](crate::Engine::open)
    /// sizes it from the room it finds ([`EngineConfig::sized_by`]).
    pub(crate) ring_bytes_auto: bool,
    /// Where a self-sized ring's budget came from, for messages.
    pub(crate) ring_room: Option<String>,
    pub(crate) ring_slots: usize,
    pub(crate) shm_dir: PathBuf,
    pub(crate) mlock: bool,
    pub(crate) copy_threads: usize,
    pub(crate) chunk_bytes: usize,
    pub(crate) queue_depth: usize,
    pub(crate) io: IoChoice,
    pub(crate) direct: DirectIo,
    pub(crate) when_full: WhenFull,
    pub(crate) verify: Verify,
    pub(crate) keep_last: Option<usize>,
    pub(crate) keep_every: Option<u64>,
    pub(crate) persist_on_open: bool,
    pub(crate) release_on_close: bool,
    pub(crate) keep_restored: bool,
    pub(crate) shm_ttl: Duration,
    pub(crate) stall_timeout: Duration,
    pub(crate) commit_timeout: Duration,
    pub(crate) persist_policy: PersistPolicy,
    pub(crate) background_nice: i32,
    pub(crate) replicas_held: u32,
    pub(crate) compress: Compress,
    pub(crate) compress_level: i32,
    pub(crate) incremental: bool,
    pub(crate) transport: Option<Arc<dyn crate::replica::Transport>>,
    #[cfg(feature = "test-util")]
    pub(crate) faults: Option<Arc<FaultInjector>>,
}

/// The ring budget a configuration reports before
/// [`Engine::open`](crate::Engine::open) sizes it: 4 GiB. An opened engine
/// without an explicit [`EngineConfig::with_ring_bytes`] uses
/// [`auto_ring_bytes`] instead.
pub const DEFAULT_RING_BYTES: u64 = 4 << 30;
/// The smallest room per slot a self-sized ring accepts: 4 MiB. Less is a
/// shared-memory directory too small to be of use, refused at open.
pub const MIN_AUTO_SLOT_BYTES: u64 = 4 << 20;

/// The budget of a ring whose `ring_bytes` is not given: 7/8 of the room
/// left by the shared-memory directory's free space and by
/// `MemAvailable`, whichever is less, each counting the ring's own files
/// as room (they are reused). Slots take memory only as images need it
/// (two slots of the checkpoint's size, in 2 MiB steps), so this is a cap,
/// not an allocation; the 1/8 left over is for the rest of the node.
#[must_use]
pub fn auto_ring_bytes(room: &crate::staging::ShmRoom) -> u64 {
    let shm = room.free.saturating_add(room.held);
    let mem = room
        .mem_available
        .map_or(u64::MAX, |m| m.saturating_add(room.held));
    shm.min(mem) / 8 * 7
}
/// Default age after which [`Engine::open`](crate::Engine::open) removes
/// another job's dead, fully committed ring: 24 h.
pub const DEFAULT_SHM_TTL: Duration = Duration::from_secs(24 * 3600);
/// Default niceness of the flush thread (and the I/O threads it starts): 10.
pub const DEFAULT_BACKGROUND_NICE: i32 = 10;
/// Default flush chunk: 4 MiB.
pub const DEFAULT_CHUNK_BYTES: usize = 4 << 20;

impl EngineConfig {
    /// A configuration for checkpoints under `root`, with every other field
    /// at its default.
    #[must_use]
    pub fn new(root: impl Into<PathBuf>) -> Self {
        let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
        EngineConfig {
            root: root.into(),
            job: None,
            rank: 0,
            world_size: 1,
            ring_bytes: DEFAULT_RING_BYTES,
            ring_bytes_auto: true,
            ring_room: None,
            ring_slots: 2,
            shm_dir: PathBuf::from("/dev/shm"),
            mlock: true,
            copy_threads: cores.min(8),
            chunk_bytes: DEFAULT_CHUNK_BYTES,
            queue_depth: 8,
            io: IoChoice::Auto,
            direct: DirectIo::Auto,
            when_full: WhenFull::default(),
            verify: Verify::Always,
            keep_last: None,
            keep_every: None,
            persist_on_open: true,
            release_on_close: false,
            keep_restored: true,
            shm_ttl: DEFAULT_SHM_TTL,
            stall_timeout: Duration::from_secs(300),
            commit_timeout: Duration::from_secs(600),
            persist_policy: PersistPolicy::default(),
            background_nice: DEFAULT_BACKGROUND_NICE,
            replicas_held: 0,
            compress: Compress::None,
            compress_level: DEFAULT_COMPRESS_LEVEL,
            incremental: true,
            transport: None,
            #[cfg(feature = "test-util")]
            faults: None,
        }
    }

    /// Whether persisted data files are compressed ([`Compress`]). Default:
    /// [`Compress::None`], plain safetensors files.
    #[must_use]
    pub fn with_compress(mut self, compress: Compress) -> Self {
        self.compress = compress;
        self
    }

    /// The zstd level of compressed files, 1 (fastest) to 19. Default:
    /// [`DEFAULT_COMPRESS_LEVEL`] (1). Level 1 is a literal-first profile
    /// (little match finding, Huffman-coded bytes: what float planes
    /// need); 2 to 19 are zstd's own levels ([`crate::codec`], "Levels").
    #[must_use]
    pub fn with_compress_level(mut self, level: i32) -> Self {
        self.compress_level = level;
        self
    }

    /// Whether a persisted step references the chunks that the newest
    /// committed step of the root already holds with the same digest
    /// instead of writing them again (an incremental step; the layout is
    /// in [`format`](crate::format), "Incremental steps"). Default: `true`:
    /// a chunk that did not change costs a digest, not a write, and a step
    /// with nothing to reuse is written exactly as without it. `false`
    /// writes every step whole (plain safetensors files unless
    /// compressed), for readers that predate format version 3 or storage
    /// that must hold each step on its own.
    #[must_use]
    pub fn with_incremental(mut self, incremental: bool) -> Self {
        self.incremental = incremental;
        self
    }

    /// The job id that names this job's shared-memory slots. Default: derived
    /// from the canonical root path, so two engines on the same root share it.
    #[must_use]
    pub fn with_job(mut self, job: impl Into<String>) -> Self {
        self.job = Some(job.into());
        self
    }

    /// This process's rank. Default 0.
    #[must_use]
    pub fn with_rank(mut self, rank: u32) -> Self {
        self.rank = rank;
        self
    }

    /// The number of ranks. Default 1.
    #[must_use]
    pub fn with_world_size(mut self, world_size: u32) -> Self {
        self.world_size = world_size;
        self
    }

    /// The memory budget of the shared-memory ring, in bytes, over all its
    /// slots. Default: sized when the engine opens from the shared-memory
    /// directory's free space and `MemAvailable` ([`auto_ring_bytes`]); a
    /// directory with less than [`MIN_AUTO_SLOT_BYTES`] per slot is refused
    /// there with an error that names its size and the fix. A value given
    /// here always wins. A save larger than one slot's share fails with
    /// [`Error::Invalid`], naming the size needed.
    #[must_use]
    pub fn with_ring_bytes(mut self, bytes: u64) -> Self {
        self.ring_bytes = bytes;
        self.ring_bytes_auto = false;
        self
    }

    /// Sizes the ring from `room` (measured by
    /// [`shm_room`](crate::staging::shm_room) on this configuration's
    /// `shm_dir`) when `ring_bytes` was not given: the budget is then set,
    /// as if given. An explicit budget is kept as it is (with a warning
    /// when `room` cannot hold it). [`Engine::open`](crate::Engine::open)
    /// calls it with the room it measures.
    ///
    /// # Errors
    /// [`Error::Config`] for `ring_bytes` when it was not given and the
    /// room leaves less than [`MIN_AUTO_SLOT_BYTES`] per slot, or could not
    /// be measured (the directory is missing).
    pub fn sized_by(mut self, room: Result<crate::staging::ShmRoom>) -> Result<Self> {
        let fix = "give the container a larger /dev/shm (`docker run --shm-size=16g`; \
                   Kubernetes: an emptyDir with `medium: Memory`), point shm_dir \
                   (ACP_SHM_DIR) at a larger tmpfs, or set ring_bytes";
        if !self.ring_bytes_auto {
            if let Ok(room) = &room {
                let have = room.free.saturating_add(room.held);
                if have < self.ring_bytes {
                    tracing::warn!(
                        "acp: ring_bytes {} is more than the room in {}; saves that need \
                         it will fail with no space left; {fix}",
                        crate::error::human_bytes(self.ring_bytes),
                        room.describe()
                    );
                }
            }
            return Ok(self);
        }
        let room = room.map_err(|e| Error::Config {
            field: "ring_bytes",
            reason: format!("not given, and the shared-memory directory cannot be measured ({e}); create it, or {fix}"),
        })?;
        let budget = auto_ring_bytes(&room);
        let need = MIN_AUTO_SLOT_BYTES.saturating_mul(self.ring_slots as u64);
        if budget < need {
            return Err(Error::Config {
                field: "ring_bytes",
                reason: format!(
                    "not given, and the shared-memory directory is too small for a ring: \
                     {} leaves {} for it, {} needed at the least ({} slots of {}), and \
                     a ring needs two slots the size of the checkpoint; {fix}",
                    room.describe(),
                    crate::error::human_bytes(budget),
                    crate::error::human_bytes(need),
                    self.ring_slots,
                    crate::error::human_bytes(MIN_AUTO_SLOT_BYTES)
                ),
            });
        }
        self.ring_bytes = budget;
        self.ring_bytes_auto = false;
        self.ring_room = Some(room.describe());
        Ok(self)
    }

    /// The number of ring slots. Default 2: one holds the newest resident
    /// checkpoint while the next is staged into the other.
    #[must_use]
    pub fn with_ring_slots(mut self, slots: usize) -> Self {
        self.ring_slots = slots;
        self
    }

    /// The directory that holds the slots' files. Default `/dev/shm`.
    #[must_use]
    pub fn with_shm_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.shm_dir = dir.into();
        self
    }

    /// Whether to try to `mlock` the ring. Default true; a refusal is
    /// reported in [`OpenReport`](crate::OpenReport), never fatal.
    #[must_use]
    pub fn with_mlock(mut self, mlock: bool) -> Self {
        self.mlock = mlock;
        self
    }

    /// Threads that copy host tensors into a slot. Default: the number of
    /// cores, at most 8.
    #[must_use]
    pub fn with_copy_threads(mut self, threads: usize) -> Self {
        self.copy_threads = threads;
        self
    }

    /// The flush and hash chunk, in bytes. Default 4 MiB; a multiple of 4096.
    #[must_use]
    pub fn with_chunk_bytes(mut self, bytes: usize) -> Self {
        self.chunk_bytes = bytes;
        self
    }

    /// Writes (or reads) in flight at once. Default 8.
    #[must_use]
    pub fn with_queue_depth(mut self, depth: usize) -> Self {
        self.queue_depth = depth;
        self
    }

    /// The I/O engine. Default [`IoChoice::Auto`].
    #[must_use]
    pub fn with_io(mut self, io: IoChoice) -> Self {
        self.io = io;
        self
    }

    /// `O_DIRECT` use. Default [`DirectIo::Auto`].
    #[must_use]
    pub fn with_direct_io(mut self, direct: DirectIo) -> Self {
        self.direct = direct;
        self
    }

    /// What a save does when no slot is free. Default: wait up to 600 s.
    #[must_use]
    pub fn with_when_full(mut self, policy: WhenFull) -> Self {
        self.when_full = policy;
        self
    }

    /// What a load re-hashes. Default [`Verify::Always`].
    #[must_use]
    pub fn with_verify(mut self, verify: Verify) -> Self {
        self.verify = verify;
        self
    }

    /// Retention: keep the newest `k` committed steps. Default: keep all.
    #[must_use]
    pub fn with_keep_last(mut self, k: usize) -> Self {
        self.keep_last = Some(k);
        self
    }

    /// Retention: also keep every step that is a multiple of `m`. Default:
    /// none beyond `keep_last`.
    #[must_use]
    pub fn with_keep_every(mut self, m: u64) -> Self {
        self.keep_every = Some(m);
        self
    }

    /// Whether opening the engine flushes and commits complete resident
    /// checkpoints left by a dead process that are newer than the newest
    /// committed step. Default true.
    #[must_use]
    pub fn with_persist_on_open(mut self, persist: bool) -> Self {
        self.persist_on_open = persist;
        self
    }

    /// Whether [`Engine::close`](crate::Engine::close) removes this job
    /// and rank's ring files (after the flush queue drains), freeing their
    /// shared memory. A ring whose resident steps are not all committed
    /// (or superseded by a newer committed step) is kept, with a warning:
    /// it holds the only copy. Default false: the newest resident step
    /// stays in RAM for a fast restart and for `acp persist`.
    #[must_use]
    pub fn with_release_on_close(mut self, release: bool) -> Self {
        self.release_on_close = release;
        self
    }

    /// Whether a step this rank restored from storage without a ring slot
    /// ready for it (a new node's ring: the file was streamed into the
    /// caller's tensors, or read into private memory) is read again into a
    /// ring slot in the background, on the flush thread, so that it is
    /// resident until the next save and a crash before then restores it
    /// from RAM. Skipped when a newer image is sealed first. Default true;
    /// false saves that second read of the file.
    #[must_use]
    pub fn with_keep_restored(mut self, keep: bool) -> Self {
        self.keep_restored = keep;
        self
    }

    /// At open, rings of other jobs of this user in `shm_dir` whose files
    /// have not changed for this long, that no live process holds and
    /// whose resident steps are all committed, are removed (as `acp gc
    /// --shm --ttl` does). Default 24 h ([`DEFAULT_SHM_TTL`]); zero turns
    /// it off.
    #[must_use]
    pub fn with_shm_ttl(mut self, ttl: Duration) -> Self {
        self.shm_ttl = ttl;
        self
    }

    /// How long a flush may make no progress before its handle fails with
    /// [`Error::Timeout`] (the watchdog). Default 300 s.
    #[must_use]
    pub fn with_stall_timeout(mut self, timeout: Duration) -> Self {
        self.stall_timeout = timeout;
        self
    }

    /// With several ranks: how long rank 0 waits for every rank's file to be
    /// durable, and how long the other ranks wait for rank 0's commit, before
    /// the save fails with [`Error::Timeout`] naming the ranks that did not
    /// answer. Default 600 s.
    #[must_use]
    pub fn with_commit_timeout(mut self, timeout: Duration) -> Self {
        self.commit_timeout = timeout;
        self
    }

    /// Which saves are persisted when the save leaves it to the policy.
    /// Default [`PersistPolicy::Every`]`(1)`: every save, so code written
    /// before the policy existed keeps its meaning.
    #[must_use]
    pub fn with_persist_policy(mut self, policy: PersistPolicy) -> Self {
        self.persist_policy = policy;
        self
    }

    /// The niceness (0 to 19) the flush thread sets on itself, and so on
    /// the hashing and I/O threads it starts (they inherit it); with a
    /// positive value it also asks for the lowest best-effort I/O priority
    /// (`ioprio_set`). Training threads then win the cores and the disk
    /// when they compete with the background flush. Best effort: a refusal
    /// is logged once, never an error. The share of threads the flush uses
    /// is [`EngineConfig::with_queue_depth`]'s (at most that many pwrite
    /// threads). Default 10 ([`DEFAULT_BACKGROUND_NICE`]); 0 leaves the
    /// priorities alone.
    #[must_use]
    pub fn with_background_nice(mut self, nice: i32) -> Self {
        self.background_nice = nice;
        self
    }

    /// Injects I/O failures (tests and fault drills): `faults` sees every
    /// storage operation of the engine. Only with the `test-util` feature.
    #[cfg(feature = "test-util")]
    #[must_use]
    pub fn with_faults(mut self, faults: Arc<FaultInjector>) -> Self {
        self.faults = Some(faults);
        self
    }

    /// What sees every storage operation: the fault injector, when the
    /// `test-util` feature is on and one is set.
    pub(crate) fn probe(&self) -> Option<Arc<dyn Probe>> {
        #[cfg(feature = "test-util")]
        if let Some(f) = &self.faults {
            return Some(Arc::clone(f) as Arc<dyn Probe>);
        }
        None
    }

    /// This process's rank.
    #[must_use]
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The number of ranks.
    #[must_use]
    pub fn world_size(&self) -> u32 {
        self.world_size
    }

    /// The ring budget in bytes: the one given, or once the engine has
    /// opened ([`Engine::config`](crate::Engine::config)) the one it sized
    /// from the room; before that, [`DEFAULT_RING_BYTES`] for a budget not
    /// given.
    #[must_use]
    pub fn ring_bytes(&self) -> u64 {
        self.ring_bytes
    }

    /// The checkpoint root.
    #[must_use]
    pub fn root(&self) -> &std::path::Path {
        &self.root
    }

    /// How many other ranks' images this rank keeps replicas of (peer
    /// replicas, [`crate::replica`]), each in 2 slots. Default 0. Those
    /// slots share the ring budget with this rank's own: each of the
    /// `ring_slots + 2 × n` slots may use `ring_bytes / (ring_slots + 2 × n)`.
    #[must_use]
    pub fn with_replicas_held(mut self, n: u32) -> Self {
        self.replicas_held = n;
        self
    }

    /// The transport that sends this rank's images to their holders and
    /// fetches them back for a restore ([`crate::replica::Transport`]).
    /// Default none: no replicas are sent, and a restore never asks a peer.
    #[must_use]
    pub fn with_transport(mut self, transport: Arc<dyn crate::replica::Transport>) -> Self {
        self.transport = Some(transport);
        self
    }

    /// The share of the ring budget of one slot, own or replica.
    pub(crate) fn slot_share(&self) -> u64 {
        let slots = self.ring_slots as u64
            + crate::replica::SLOTS_PER_SOURCE as u64 * u64::from(self.replicas_held);
        self.ring_bytes / slots.max(1)
    }

    /// The budget of this rank's own ring: its slots' share.
    pub(crate) fn own_ring_bytes(&self) -> u64 {
        if self.replicas_held == 0 {
            self.ring_bytes
        } else {
            self.slot_share() * self.ring_slots as u64
        }
    }

    /// Rejects impossible combinations.
    ///
    /// # Errors
    /// [`Error::Config`] naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |field, reason: &str| {
            Err(Error::Config {
                field,
                reason: reason.to_owned(),
            })
        };
        if self.root.as_os_str().is_empty() {
            return bad("root", "must not be empty");
        }
        if self.world_size == 0 {
            return bad("world_size", "must be at least 1");
        }
        if self.rank >= self.world_size {
            return Err(Error::Config {
                field: "rank",
                reason: format!("{} is not below world_size {}", self.rank, self.world_size),
            });
        }
        if self.ring_slots == 0 {
            return bad("ring_slots", "must be at least 1");
        }
        if self.ring_bytes < 1 << 20 {
            return bad("ring_bytes", "must be at least 1 MiB");
        }
        if self.chunk_bytes == 0 || self.chunk_bytes % 4096 != 0 {
            return bad("chunk_bytes", "must be a positive multiple of 4096");
        }
        if self.chunk_bytes > 1 << 30 {
            return bad("chunk_bytes", "must be at most 1 GiB");
        }
        if self.queue_depth == 0 || self.queue_depth > 1024 {
            return bad("queue_depth", "must be between 1 and 1024");
        }
        if self.copy_threads == 0 || self.copy_threads > 256 {
            return bad("copy_threads", "must be between 1 and 256");
        }
        if self.keep_last == Some(0) {
            return bad(
                "keep_last",
                "must be at least 1 (0 would delete every checkpoint)",
            );
        }
        if self.keep_every == Some(0) {
            return bad("keep_every", "must be at least 1");
        }
        if !(1..=19).contains(&self.compress_level) {
            return bad("compress_level", "must be between 1 and 19");
        }
        if !(0..=19).contains(&self.background_nice) {
            return bad("background_nice", "must be between 0 and 19");
        }
        match self.persist_policy {
            PersistPolicy::Every(0) => {
                return bad(
                    "persist_policy",
                    "persist every 0 steps: must be at least 1",
                );
            }
            PersistPolicy::Interval(d) if d.is_zero() => {
                return bad("persist_policy", "a persist interval must be positive");
            }
            PersistPolicy::Interval(_) | PersistPolicy::Coalesce if self.world_size > 1 => {
                return bad(
                    "persist_policy",
                    "with several ranks every rank must persist the same steps: use Every(n) or explicit persist per save",
                );
            }
            _ => {}
        }
        if let Some(job) = &self.job {
            if job.is_empty() || job.len() > 128 {
                return bad("job", "must be 1 to 128 bytes");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_validate() {
        EngineConfig::new("/tmp/x").validate().unwrap();
    }

    #[test]
    fn impossible_values_name_the_field() {
        let e = EngineConfig::new("/tmp/x")
            .with_rank(2)
            .validate()
            .unwrap_err();
        assert!(matches!(e, Error::Config { field: "rank", .. }), "{e}");
        let e = EngineConfig::new("/tmp/x")
            .with_chunk_bytes(1000)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("chunk_bytes"), "{e}");
        let e = EngineConfig::new("/tmp/x")
            .with_keep_last(0)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("keep_last"), "{e}");
        let e = EngineConfig::new("/tmp/x")
            .with_persist_policy(PersistPolicy::Every(0))
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("persist_policy"), "{e}");
        let e = EngineConfig::new("/tmp/x")
            .with_world_size(2)
            .with_persist_policy(PersistPolicy::Coalesce)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("persist_policy"), "{e}");
        let e = EngineConfig::new("/tmp/x")
            .with_background_nice(20)
            .validate()
            .unwrap_err();
        assert!(e.to_string().contains("background_nice"), "{e}");
    }

    fn room(free: u64, held: u64, mem: Option<u64>) -> crate::staging::ShmRoom {
        crate::staging::ShmRoom {
            dir: PathBuf::from("/dev/shm"),
            free,
            size: free + held,
            held,
            mem_available: mem,
        }
    }

    #[test]
    fn a_ring_without_a_budget_takes_seven_eighths_of_the_smaller_room() {
        const GIB: u64 = 1 << 30;
        // This machine's kind: 24 GiB, /dev/shm half of it.
        assert_eq!(
            auto_ring_bytes(&room(12 * GIB, 0, Some(22 * GIB))),
            12 * GIB / 8 * 7
        );
        // Memory is the smaller room.
        assert_eq!(auto_ring_bytes(&room(12 * GIB, 0, Some(8 * GIB))), 7 * GIB);
        // The ring's own files are room: they are reused.
        assert_eq!(auto_ring_bytes(&room(4 * GIB, 4 * GIB, None)), 7 * GIB);
        // Two slots of a 2 GiB state fit the budget of a default /dev/shm.
        let c = EngineConfig::new("/r")
            .sized_by(Ok(room(12 * GIB, 0, Some(22 * GIB))))
            .unwrap();
        assert!(
            c.own_ring_bytes() / 2 > 2 * GIB + (64 << 20),
            "{}",
            c.ring_bytes
        );
        assert!(c
            .ring_room
            .as_deref()
            .unwrap()
            .contains("/dev/shm: 12.0 GiB free"));
    }

    #[test]
    fn a_given_budget_wins_over_the_room() {
        let c = EngineConfig::new("/r")
            .with_ring_bytes(16 << 20)
            .sized_by(Ok(room(1 << 40, 0, Some(1 << 40))))
            .unwrap();
        assert_eq!(c.ring_bytes, 16 << 20);
        assert!(c.ring_room.is_none());
        // Even past the room, and when the room cannot be measured.
        let tiny = EngineConfig::new("/r").with_ring_bytes(1 << 30);
        assert_eq!(
            tiny.clone()
                .sized_by(Ok(room(1 << 20, 0, None)))
                .unwrap()
                .ring_bytes,
            1 << 30
        );
        let gone = Err(Error::invalid("x", "gone"));
        assert_eq!(tiny.sized_by(gone).unwrap().ring_bytes, 1 << 30);
    }

    #[test]
    fn a_container_sized_shm_is_refused_at_open_naming_the_sizes_and_the_fix() {
        // 64 MiB is room for a small ring, so only a smaller one is refused.
        let ok = EngineConfig::new("/r").sized_by(Ok(room(64 << 20, 0, Some(1 << 34))));
        assert_eq!(ok.unwrap().ring_bytes, 56 << 20);
        let e = EngineConfig::new("/r")
            .sized_by(Ok(room(6 << 20, 0, Some(1 << 34))))
            .unwrap_err();
        let text = e.to_string();
        for want in [
            "ring_bytes",
            "/dev/shm: 6.0 MiB free",
            "5.2 MiB for it",
            "8.0 MiB needed",
            "--shm-size",
            "ACP_SHM_DIR",
        ] {
            assert!(text.contains(want), "`{want}` missing: {text}");
        }
        let gone = Err(Error::invalid("/nowhere", "no such directory"));
        let e = EngineConfig::new("/r").sized_by(gone).unwrap_err();
        assert!(e.to_string().contains("/nowhere"), "{e}");
    }
}
