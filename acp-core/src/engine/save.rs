//! Saving: the options and figures of a save, and the stall (checking the
//! input, laying the image out, waiting for a free ring slot).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::state::Shared;
use super::wait::WATCH_TICK;
use super::{Engine, Persist, SaveHandle, Staging};
use crate::config::WhenFull;
use crate::error::{Error, Result};
use crate::format::{check_values_json, Dtype, Entry, ImageMeta, Layout, TensorSpec};
use crate::io::IoKind;
use crate::staging::StagingSlot;

/// Options of one save.
#[derive(Debug, Clone, Default)]
pub struct SaveOptions {
    /// Replace the step if it is already committed (atomically: the old one
    /// stays loadable until the new one is committed).
    pub overwrite: bool,
    /// Extra string metadata for the safetensors header (e.g. `format: pt`).
    pub extra_metadata: BTreeMap<String, String>,
    /// Called at every tick (100 ms) while the save waits for a free ring
    /// slot, with no lock of the engine held and nothing staged; an error
    /// ends the wait and the save with that error. Bindings run their
    /// signal handlers here (a SIGTERM must not wait for a slot).
    pub on_wait: Option<OnWait>,
    /// Whether this save is persisted (flushed to storage and committed)
    /// or stays a RAM snapshot. Default [`Persist::Policy`].
    pub persist: Persist,
}

/// The callback of [`SaveOptions::on_wait`].
#[derive(Clone)]
pub struct OnWait(pub Arc<dyn Fn() -> Result<()> + Send + Sync>);

impl std::fmt::Debug for OnWait {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OnWait(..)")
    }
}

/// A host tensor handed to [`Engine::save`].
#[derive(Debug, Clone, Copy)]
pub struct HostTensor<'a> {
    /// Name.
    pub name: &'a str,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: &'a [u64],
    /// The bytes, exactly `numel × dtype.size()` of them.
    pub data: &'a [u8],
}

impl HostTensor<'_> {
    /// Its name, dtype and shape, as a layout takes them.
    #[must_use]
    pub fn spec(&self) -> TensorSpec {
        TensorSpec {
            name: self.name.to_owned(),
            dtype: self.dtype,
            shape: self.shape.to_vec(),
        }
    }
}

/// The layout of a save kept for the next saves of the same tensors and
/// values ([`Engine::save_plan`]): a save from it
/// ([`Engine::begin_save_planned`]) writes only its own header, without
/// checking and placing every tensor again. The tensors' names, dtypes,
/// shapes and the values are fixed when the plan is made.
#[derive(Debug)]
pub struct SavePlan {
    /// The image under the header of step 0 with no extra metadata, the
    /// plan's values in it; each save restamps its header
    /// ([`Layout::restamp_header_same_values`], or
    /// [`Layout::restamp_header`] with other values).
    layout: Layout,
    /// `layout`'s entries, shared with the stagings of saves whose data
    /// starts where the plan's does (most: only a header that crosses a
    /// multiple of [`DATA_ALIGN`](crate::format::DATA_ALIGN) moves it).
    entries: Arc<[Entry]>,
}

impl SavePlan {
    /// The laid-out tensors, in the order given to [`Engine::save_plan`]
    /// (their offsets are those of the plan's own header; a save's
    /// [`Staging::entries`] has its own).
    #[must_use]
    pub fn entries(&self) -> &[Entry] {
        &self.entries
    }

    /// The image of a save of this plan with the header fields `meta` and
    /// the values `values` (checked JSON text; the plan's own when None).
    fn image(&self, meta: &ImageMeta, values: Option<&str>) -> Result<Image> {
        let (header, data_start) = match values {
            Some(v) => self.layout.restamp_header(meta, v)?,
            None => self.layout.restamp_header_same_values(meta)?,
        };
        let base = self.layout.data_start;
        let entries = if data_start == base {
            Arc::clone(&self.entries)
        } else {
            self.entries
                .iter()
                .map(|e| Entry {
                    // Entries lie after the plan's data start; the new one
                    // is checked to leave room for the whole data section.
                    offset: e.offset - base + data_start,
                    ..e.clone()
                })
                .collect()
        };
        Ok(Image {
            total_len: self.layout.total_len - base + data_start,
            header,
            entries,
        })
    }
}

/// The image of one save: its header bytes and where its tensors go.
pub(super) struct Image {
    pub(super) header: Vec<u8>,
    pub(super) entries: Arc<[Entry]>,
    pub(super) total_len: u64,
}

impl From<Layout> for Image {
    fn from(layout: Layout) -> Image {
        let total_len = layout.total_len;
        let (entries, header) = layout.into_parts();
        Image {
            header,
            entries: entries.into(),
            total_len,
        }
    }
}

/// The figures of a finished save.
#[derive(Debug, Clone, PartialEq)]
pub struct SaveReport {
    /// The step.
    pub step: u64,
    /// True when the save was skipped because no slot was free
    /// ([`WhenFull::Skip`]); nothing was written.
    pub skipped: bool,
    /// Image bytes (the data file's size).
    pub bytes: u64,
    /// Bytes written to storage for the data file: `bytes` for a plain
    /// file, the container's length for a compressed or incremental one
    /// (the chunks it references take no bytes there), 0 when
    /// nothing was written (skipped, resident, superseded). `stored_bytes
    /// / bytes` is the save's compression ratio.
    pub stored_bytes: u64,
    /// Chunks of the image not written because the root's newest
    /// committed step already held them (an incremental step references
    /// them); 0 for a step written whole.
    pub reused_chunks: u64,
    /// The image bytes of those chunks: bytes not written.
    pub reused_bytes: u64,
    /// The stall: from `begin_save` to `finish`, in seconds.
    pub stall_secs: f64,
    /// Waiting for a free slot (part of the stall), in seconds.
    pub slot_wait_secs: f64,
    /// Queued behind earlier flushes, in seconds.
    pub queue_secs: f64,
    /// Writing, hashing and fsyncing the data file, in seconds.
    pub flush_secs: f64,
    /// The part of `flush_secs` the flush waited for this step's replica
    /// exchange to end ([`Engine::exchange_started`]: replication goes
    /// first), in seconds; 0 without replicas.
    pub replica_wait_secs: f64,
    /// Writing the index, renaming and syncing directories, in seconds.
    pub commit_secs: f64,
    /// From `begin_save` to committed, in seconds.
    pub total_secs: f64,
    /// The I/O engine that wrote it.
    pub io: IoKind,
    /// Whether `O_DIRECT` was used.
    pub direct: bool,
    /// What became of the save: persisted (committed), resident (a RAM
    /// snapshot the policy or the caller did not persist), superseded
    /// (a newer save was persisted or queued first), or skipped. Only
    /// `Persisted` has flush and commit figures.
    pub outcome: super::Outcome,
}

impl Engine {
    /// Starts a save of `step`: checks the input, lays the image out in a
    /// ring slot and returns the [`Staging`] to fill. Returns `Ok(None)`
    /// when no slot is free and the policy is [`WhenFull::Skip`].
    ///
    /// # Errors
    /// [`Error::Invalid`] naming a bad tensor or value key; [`Error::Exists`]
    /// when the step is committed and `overwrite` is off; [`Error::Timeout`]
    /// waiting for a slot; [`Error::Closed`].
    pub fn begin_save(
        &self,
        step: u64,
        tensors: &[TensorSpec],
        values: &serde_json::Value,
        opts: &SaveOptions,
    ) -> Result<Option<Staging>> {
        let values = serde_json::to_string(values)
            .map_err(|e| Error::invalid("values", format!("cannot write them as JSON: {e}")))?;
        self.begin(step, opts, |meta| {
            Layout::plan_with_values(tensors, &meta, &values).map(Image::from)
        })
    }

    /// [`Engine::begin_save`] with the values given as JSON text, stored as
    /// given once checked to be one JSON value (bindings that already hold
    /// the text skip building a [`serde_json::Value`] of it, which costs
    /// microseconds per tensor reference in the stall).
    ///
    /// # Errors
    /// As [`Engine::begin_save`], and [`Error::Invalid`] naming `values`
    /// when the text is not JSON.
    pub fn begin_save_json(
        &self,
        step: u64,
        tensors: &[TensorSpec],
        values_json: &str,
        opts: &SaveOptions,
    ) -> Result<Option<Staging>> {
        check_values_json(values_json)?;
        self.begin(step, opts, |meta| {
            Layout::plan_with_values(tensors, &meta, values_json).map(Image::from)
        })
    }

    /// Checks and lays out `tensors` and `values_json` once, for saves
    /// that repeat them ([`Engine::begin_save_planned`]): a training
    /// loop's state keeps its structure from one save to the next, and
    /// checking and placing its tensors is most of the stall's cost beyond
    /// the copy when they are many and small.
    ///
    /// # Errors
    /// As [`Engine::begin_save_json`] for the input.
    pub fn save_plan(&self, tensors: &[TensorSpec], values_json: &str) -> Result<SavePlan> {
        check_values_json(values_json)?;
        let layout =
            Layout::plan_with_values(tensors, &self.meta(0, BTreeMap::new()), values_json)?;
        Ok(SavePlan {
            entries: layout.entries.clone().into(),
            layout,
        })
    }

    /// [`Engine::begin_save_json`] of the plan's tensors and values: the
    /// same image, its header written for `step` and `opts`.
    ///
    /// # Errors
    /// As [`Engine::begin_save_json`].
    pub fn begin_save_planned(
        &self,
        step: u64,
        plan: &SavePlan,
        opts: &SaveOptions,
    ) -> Result<Option<Staging>> {
        self.begin(step, opts, |meta| plan.image(&meta, None))
    }

    /// [`Engine::begin_save_planned`] with other values than the plan's:
    /// the plan's tensors, their layout kept (only the header is written
    /// anew; a header that crosses a multiple of
    /// [`DATA_ALIGN`](crate::format::DATA_ALIGN) moves the data section
    /// as a longer step number does), and `values_json` in the header. For
    /// a state whose plain values (a step counter, a scheduler's epoch)
    /// change between saves while its tensors keep their structure.
    ///
    /// # Errors
    /// As [`Engine::begin_save_json`], and [`Error::Invalid`] naming
    /// `values` when the text is not JSON.
    pub fn begin_save_planned_values(
        &self,
        step: u64,
        plan: &SavePlan,
        values_json: &str,
        opts: &SaveOptions,
    ) -> Result<Option<Staging>> {
        check_values_json(values_json)?;
        self.begin(step, opts, |meta| plan.image(&meta, Some(values_json)))
    }

    /// Readies every free ring slot for a checkpoint of `tensors` and
    /// `values_json` now (the slot's shared memory is created, populated
    /// and locked, as the first save into it would do: about a second per
    /// GiB on first touch), so that the first saves stall no longer than
    /// later ones. Slots holding checkpoints are left alone. Returns how
    /// many slots are ready. Call it before training: a save meanwhile
    /// waits for a slot (or, with [`WhenFull::Skip`], is skipped).
    ///
    /// # Errors
    /// As [`Engine::begin_save_json`] for the input; [`Error::Io`] or
    /// [`Error::NoSpace`] creating the memory.
    pub fn reserve_json(&self, tensors: &[TensorSpec], values_json: &str) -> Result<usize> {
        check_values_json(values_json)?;
        // The longest header any step can have.
        let layout = self.plan("reserve", u64::MAX, tensors, values_json, BTreeMap::new())?;
        self.shared().ring.reserve(layout.total_len)
    }

    /// The image of a save (values as checked JSON text), refused when it
    /// does not fit a ring slot.
    fn plan(
        &self,
        what: &str,
        step: u64,
        tensors: &[TensorSpec],
        values_json: &str,
        extra: BTreeMap<String, String>,
    ) -> Result<Layout> {
        let layout = Layout::plan_with_values(tensors, &self.meta(step, extra), values_json)?;
        self.fit(what, layout.total_len)?;
        Ok(layout)
    }

    /// The header fields of this engine's image of `step` (values given
    /// as text beside it).
    fn meta(&self, step: u64, extra: BTreeMap<String, String>) -> ImageMeta {
        let cfg = &self.shared().cfg;
        ImageMeta {
            step,
            rank: cfg.rank,
            world_size: cfg.world_size,
            values: serde_json::Value::Null, // given as text
            extra,
        }
    }

    /// Refuses an image of `total_len` bytes that does not fit a ring slot.
    fn fit(&self, what: &str, total_len: u64) -> Result<()> {
        let shared = self.shared();
        let max = shared.ring.max_image_bytes();
        if total_len > max {
            let cfg = &shared.cfg;
            let need = total_len.saturating_mul(cfg.ring_slots as u64);
            let reason = match &cfg.ring_room {
                // Sized from the room at open: the room is what to raise.
                Some(room) => format!(
                    "checkpoint of {} bytes does not fit a ring slot of {max} bytes: the ring \
                     was sized from the room at open ({room}) to {} bytes, which one slot may \
                     take whole; it needs at least {total_len}, and about {need} for {} slots \
                     (a save beside the resident step); give the container a larger /dev/shm \
                     (`docker run --shm-size`; Kubernetes: an emptyDir with `medium: Memory`), \
                     point shm_dir (ACP_SHM_DIR) at a larger tmpfs, or set ring_bytes",
                    total_len, cfg.ring_bytes, cfg.ring_slots
                ),
                None => format!(
                    "checkpoint of {} bytes does not fit a ring slot of {max} bytes; raise ring_bytes (now {}, about {need} needed) or lower ring_slots (now {})",
                    total_len, cfg.ring_bytes, cfg.ring_slots
                ),
            };
            return Err(Error::invalid(what, reason));
        }
        Ok(())
    }

    /// The stall's start behind [`Engine::begin_save`],
    /// [`Engine::begin_save_json`] and [`Engine::begin_save_planned`]:
    /// `image` gives the image for the header fields of this save.
    fn begin(
        &self,
        step: u64,
        opts: &SaveOptions,
        image: impl FnOnce(ImageMeta) -> Result<Image>,
    ) -> Result<Option<Staging>> {
        let started = Instant::now();
        self.check_process()?;
        let shared = self.shared();
        let (closed, known) = {
            let st = shared.lock();
            (st.closed, st.committed.contains(&step))
        };
        if closed {
            return Err(Error::Closed {
                root: shared.root.location().to_path_buf(),
            });
        }
        // The commit re-checks on storage; this only fails early, without I/O.
        if !opts.overwrite && known {
            return Err(Error::Exists {
                step,
                root: shared.root.location().to_path_buf(),
            });
        }
        let image = image(self.meta(step, opts.extra_metadata.clone()))?;
        self.fit(&format!("step {step}"), image.total_len)?;
        super::reside::give_up_upto(&mut shared.lock(), step);
        let Some(mut slot) = self.acquire_slot(step, image.total_len, opts.on_wait.as_ref())?
        else {
            tracing::warn!(
                step,
                "acp: no free ring slot, save skipped (when_full = skip)"
            );
            shared.lock().counts.skipped += 1;
            return Ok(None);
        };
        slot.image_mut()[..image.header.len()].copy_from_slice(&image.header);
        Ok(Some(Staging {
            engine: self.clone(),
            step,
            overwrite: opts.overwrite,
            persist: opts.persist,
            entries: image.entries,
            total_len: image.total_len,
            slot: Some(slot),
            started,
            slot_wait: started.elapsed(),
        }))
    }

    fn acquire_slot(
        &self,
        step: u64,
        len: u64,
        on_wait: Option<&OnWait>,
    ) -> Result<Option<StagingSlot>> {
        let shared = self.shared();
        // A resident image of the same step (an older attempt) must not be
        // confused with the new one; held, it is let go first.
        {
            let mut st = shared.lock();
            if let Some(job) = Shared::take_held(&mut st, step) {
                shared.let_go(&mut st, job);
            }
        }
        for info in shared.ring.complete() {
            if info.step == step {
                shared.ring.release(info.slot);
            }
        }
        let start = Instant::now();
        let mut first_look = true;
        loop {
            // Slots whose flush failed are given up only when the ring needs
            // room: they keep the newest restorable copy until then.
            let free = shared.ring.acquire(len, None)?;
            if let Some(s) = free {
                return Ok(Some(shared.reused(s)));
            }
            let failed = shared.lock().failed_slots.pop();
            if let Some(f) = failed {
                // Only the image whose flush failed: an entry whose slot
                // was acquired again since names nothing any more.
                if shared.ring.release_generation(f.slot, f.generation) {
                    tracing::warn!(
                        slot = f.slot,
                        "acp: dropping a resident checkpoint whose flush failed, to make room"
                    );
                }
                continue;
            }
            // Every slot holds an image that is neither persisted nor
            // superseded (RAM snapshots the policy kept) or is being
            // flushed: persisting the newest resident step lets the ring
            // reuse the others' slots, and its own once persisted. Never
            // drop the only copy of the newest step instead. A held one is
            // its caller's to decide: the ring waits for that. A superseded
            // snapshot still pinned (its hash or send running) frees its
            // slot by itself: wait for it instead.
            if shared.lock().in_flight == 0 && !shared.ring.freeing() {
                if let Err(e) = self.persist_newest_of(false) {
                    tracing::warn!(
                        step,
                        "acp: persisting the newest resident step to make room: {e}"
                    );
                }
            }
            let limit = match shared.cfg.when_full {
                WhenFull::Skip => return Ok(None),
                WhenFull::Wait(d) => d,
            };
            if let Some(OnWait(f)) = on_wait {
                f()?;
            }
            let waited = start.elapsed();
            if waited >= limit {
                return Err(Error::Timeout {
                    what: format!(
                        "step {step}: waiting for a free ring slot (every slot is staging, flushing, \
                         held for a decision, or pinned: views of a load(zero_copy=True) still \
                         alive pin their slot)"
                    ),
                    secs: limit.as_secs_f64(),
                });
            }
            // Every slot waits on the flush: when it is stuck, say so now
            // rather than after the whole slot wait (after one tick, as in
            // `wait_until`).
            let stuck = if std::mem::take(&mut first_look) {
                None
            } else {
                shared.stuck(&mut shared.lock())
            };
            if let Some(Error::Timeout { what, secs }) = stuck {
                return Err(Error::Timeout {
                    what: format!("step {step}: waiting for a free ring slot: {what}"),
                    secs,
                });
            }
            match shared
                .ring
                .acquire(len, Some((limit - waited).min(WATCH_TICK)))
            {
                Ok(Some(slot)) => return Ok(Some(shared.reused(slot))),
                Ok(None) | Err(Error::Timeout { .. }) => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// Saves host tensors: [`Engine::begin_save`], a parallel copy into the
    /// slot, [`Staging::finish`]. Returns once the bytes are in the slot.
    ///
    /// # Errors
    /// As [`Engine::begin_save`], and [`Error::Invalid`] when a tensor's
    /// bytes do not match its dtype and shape.
    pub fn save(
        &self,
        step: u64,
        tensors: &[HostTensor<'_>],
        values: &serde_json::Value,
        opts: &SaveOptions,
    ) -> Result<SaveHandle> {
        let specs: Vec<TensorSpec> = tensors.iter().map(HostTensor::spec).collect();
        for (t, spec) in tensors.iter().zip(&specs) {
            let want = spec.byte_len()?;
            if t.data.len() as u64 != want {
                return Err(Error::invalid(
                    format!("tensor `{}`", t.name),
                    format!(
                        "{} bytes given, {} × {:?} needs {want}",
                        t.data.len(),
                        t.dtype.name(),
                        t.shape
                    ),
                ));
            }
        }
        let Some(mut staging) = self.begin_save(step, &specs, values, opts)? else {
            return Ok(SaveHandle::skipped(step));
        };
        let srcs: Vec<&[u8]> = tensors.iter().map(|t| t.data).collect();
        staging.copy_from(&srcs)?;
        Ok(staging.finish())
    }
}
