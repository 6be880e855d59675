//! Torture 2: change a stored checkpoint or a resident slot — flip a
//! random byte, truncate, or delete a random file — then load:
//! - every change that alters what a checkpoint says is detected with an
//!   error naming the file, and the tensor when the change is in a
//!   tensor's bytes; a load never returns bytes other than those saved;
//! - `load` with fallback returns the newest intact step;
//! - a resident copy that changed is never served: the load reads storage
//!   and says why (`LoadReport::rejected`, naming the slot file and tensor).
//!
//! Each trial works on a fresh copy of one pristine root and shm directory
//! (steps 1, 2, 3 committed; steps 2 and 3 resident). CI: 100 trials;
//! `ACP_TORTURE_FULL=1`: 2,000.
//!
//! A change to the index that does not change what it says (a JSON space
//! that becomes a newline, a hex digit that changes case) is not an error:
//! the load then returns the saved bytes, which the test checks; such
//! trials are counted apart.

#![allow(clippy::unwrap_used, reason = "a test fails loudly on any error")]

mod torture_util;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use acp_core::format::{parse_header, Entry};
use acp_core::{Checkpoint, Engine, EngineConfig, Error, LoadRequest, Source};
use torture_util::{check, copy_tree, files_under, report_with, save, trials, Rng};

fn config(root: &Path, shm: &Path) -> EngineConfig {
    EngineConfig::new(root)
        .with_shm_dir(shm)
        .with_job("torture-corrupt")
        .with_ring_bytes(8 << 20)
        .with_ring_slots(2)
        .with_chunk_bytes(64 << 10)
        .with_mlock(false)
}

/// What a slot file holds, read from its control block.
#[derive(Debug, Clone)]
struct SlotLayout {
    step: u64,
    state: u32,
    image_offset: u64,
    image_len: u64,
}

fn slot_layout(path: &Path) -> SlotLayout {
    let b = std::fs::read(path).unwrap();
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    SlotLayout {
        state: u32_at(12),
        step: u64_at(16),
        image_len: u64_at(24),
        image_offset: u64_at(104),
    }
}

struct Pristine {
    _dir: tempfile::TempDir,
    root: PathBuf,
    shm: PathBuf,
    /// The tensors of each step's data file (identical layout for all).
    entries: Vec<Entry>,
    slots: BTreeMap<String, SlotLayout>,
}

fn pristine() -> Pristine {
    let (dir, root, shm) = torture_util::dirs();
    let engine = Engine::open(config(&root, &shm)).unwrap();
    for step in 1..=3 {
        save(&engine, step).unwrap().wait().unwrap();
    }
    assert_eq!(engine.resident_steps(), vec![3, 2]);
    engine.close().unwrap();
    drop(engine);
    let data = root.join("step-000000000003/rank-00000.safetensors");
    let bytes = std::fs::read(&data).unwrap();
    let entries = parse_header(&data, &bytes, bytes.len() as u64)
        .unwrap()
        .entries;
    let slots = files_under(&shm)
        .into_iter()
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            (name, slot_layout(&p))
        })
        .collect();
    Pristine {
        _dir: dir,
        root,
        shm,
        entries,
        slots,
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    Flip,
    Truncate,
    Delete,
}

/// Applies `change` to `path`; returns the byte offset it hit (flip), the
/// new length (truncate), or 0 (delete). A flip lands in `focus` when
/// given (and inside the file).
fn apply(path: &Path, change: Change, rng: &mut Rng, focus: Option<(u64, u64)>) -> u64 {
    let mut bytes = std::fs::read(path).unwrap();
    match change {
        Change::Flip => {
            let at = match focus {
                Some((start, len)) if len > 0 && start + len <= bytes.len() as u64 => {
                    start + rng.below(len)
                }
                _ => rng.below(bytes.len() as u64),
            };
            let x = 1 + rng.below(255) as u8;
            bytes[at as usize] ^= x;
            std::fs::write(path, &bytes).unwrap();
            at
        }
        Change::Truncate => {
            let len = rng.below(bytes.len() as u64);
            bytes.truncate(len as usize);
            std::fs::write(path, &bytes).unwrap();
            len
        }
        Change::Delete => {
            std::fs::remove_file(path).unwrap();
            0
        }
    }
}

/// The tensor holding byte `at` of a data file.
fn tensor_at(entries: &[Entry], at: u64) -> Option<&str> {
    entries
        .iter()
        .find(|e| e.offset <= at && at < e.offset + e.len)
        .map(|e| e.name.as_str())
}

fn load(
    engine: &Engine,
    step: Option<u64>,
    storage_only: bool,
    fallback: bool,
) -> Result<Checkpoint, Error> {
    engine.load(&LoadRequest {
        step,
        storage_only,
        fallback,
        ..LoadRequest::default()
    })
}

/// The step directory number of a stored file, if any.
fn step_of(path: &Path) -> Option<u64> {
    path.parent()?
        .file_name()?
        .to_str()?
        .strip_prefix("step-")?
        .parse()
        .ok()
}

#[derive(Default)]
struct Tally {
    detected: u64,
    neutral: u64,
    hint: u64,
    resident_rejected: u64,
    harmless: u64,
}

/// What a change to a stored file came to.
enum Outcome {
    /// Reported as corrupt.
    Detected,
    /// An index edit that kept its meaning: the saved bytes loaded.
    Neutral,
    /// The `latest` hint changed: loads do not depend on it.
    Hint,
}

/// One change to a stored file.
fn stored_trial(
    p: &Pristine,
    engine: &Engine,
    file: &Path,
    change: Change,
    at: u64,
) -> Result<Outcome, String> {
    let name = file.file_name().unwrap().to_string_lossy().into_owned();
    let Some(step) = step_of(file) else {
        // The `latest` hint: loads never depend on it.
        let ck = load(engine, None, true, false).map_err(|e| format!("{name}: {e}"))?;
        check(&ck)?;
        return if ck.step() == 3 {
            Ok(Outcome::Hint)
        } else {
            Err(format!("{name}: loaded step {}", ck.step()))
        };
    };
    let is_data = name.ends_with(".safetensors");
    let detected = match load(engine, Some(step), true, false) {
        Ok(ck) => {
            // Only an index edit that keeps its meaning may load, and then
            // with exactly the saved bytes.
            if is_data || change != Change::Flip {
                return Err(format!(
                    "{change:?} of {name} (step {step}, at {at}) not detected"
                ));
            }
            check(&ck).map_err(|e| format!("{change:?} of {name} at {at}: {e}"))?;
            false
        }
        Err(e) => {
            let msg = e.to_string();
            if !matches!(e, Error::Corrupt { .. } | Error::Unsupported { .. }) {
                return Err(format!(
                    "{change:?} of {name}: not a corruption error: {msg}"
                ));
            }
            if !msg.contains(&name) {
                return Err(format!(
                    "{change:?} of {name}: error does not name it: {msg}"
                ));
            }
            let tensor = match change {
                Change::Flip if is_data => tensor_at(&p.entries, at),
                Change::Truncate if is_data => tensor_at(&p.entries, at),
                Change::Delete if is_data => Some(""),
                _ => None,
            };
            match tensor {
                Some("") if !msg.contains("tensor `") => {
                    return Err(format!("{change:?} of {name}: no tensor named: {msg}"));
                }
                Some(t) if !t.is_empty() && !msg.contains(&format!("`{t}`")) => {
                    return Err(format!(
                        "{change:?} of {name} at {at}: tensor `{t}` not named: {msg}"
                    ));
                }
                _ => {}
            }
            true
        }
    };
    // Fallback: the newest intact step, from storage and from anywhere
    // (the resident copy of step 3 is intact and verifies against its
    // index, so only a damaged index makes step 2 the newest there).
    for storage_only in [true, false] {
        let newest_intact = if detected && step == 3 && (storage_only || !is_data) {
            2
        } else {
            3
        };
        let ck = load(engine, None, storage_only, true)
            .map_err(|e| format!("{change:?} of {name}: fallback load: {e}"))?;
        check(&ck)?;
        if ck.step() != newest_intact {
            return Err(format!(
                "{change:?} of {name}: fallback gave step {}, newest intact is {newest_intact}",
                ck.step()
            ));
        }
    }
    Ok(if detected {
        Outcome::Detected
    } else {
        Outcome::Neutral
    })
}

/// One change to a resident slot file. `Ok(true)` when a changed image was
/// rejected, `Ok(false)` when the change could not reach a load.
fn resident_trial(
    p: &Pristine,
    engine: &Engine,
    file: &Path,
    change: Change,
    at: u64,
) -> Result<bool, String> {
    let name = file.file_name().unwrap().to_string_lossy().into_owned();
    let layout = &p.slots[&name];
    let complete = matches!(layout.state, 2..=4);
    let image = layout.image_offset..layout.image_offset + layout.image_len;
    // The bytes a load could serve changed (a flip inside the image).
    let image_hit = complete && change == Change::Flip && image.contains(&at);
    let mut rejected = false;
    for step in [3, 2] {
        let ck = load(engine, Some(step), false, false)
            .map_err(|e| format!("{change:?} of slot {name}: load of step {step}: {e}"))?;
        check(&ck).map_err(|e| format!("{change:?} of slot {name} at {at}: {e}"))?;
        if image_hit && layout.step == step {
            if ck.report().source == Source::Ram {
                return Err(format!(
                    "flip of slot {name} at {at} (image of step {step}) served from RAM"
                ));
            }
            let why = ck.report().rejected.clone().unwrap_or_default();
            if !why.contains(&name) {
                return Err(format!(
                    "flip of slot {name}: rejection does not name it: {why:?}"
                ));
            }
            if let Some(t) = tensor_at(&p.entries, at - layout.image_offset) {
                if !why.contains(&format!("`{t}`")) {
                    return Err(format!(
                        "flip of slot {name} at {at}: tensor `{t}` not named: {why}"
                    ));
                }
            }
            rejected = true;
        }
    }
    let ck = load(engine, None, false, true).map_err(|e| format!("fallback: {e}"))?;
    check(&ck)?;
    if ck.step() != 3 {
        return Err(format!("slot {name}: fallback gave step {}", ck.step()));
    }
    Ok(rejected)
}

#[test]
fn every_change_to_a_stored_or_resident_checkpoint_is_detected() {
    let n = trials(100, 2000);
    let p = pristine();
    let mut rng = Rng::new(0x5eed_0002, 2);
    let mut failures = Vec::new();
    let mut tally = Tally::default();
    let stored = files_under(&p.root);
    let slots = files_under(&p.shm);
    assert_eq!(stored.len(), 7, "{stored:?}");
    assert_eq!(slots.len(), 2, "{slots:?}");
    for trial in 0..n {
        let t = tempfile::tempdir().unwrap();
        let (root, shm) = (t.path().join("ckpt"), t.path().join("shm"));
        copy_tree(&p.root, &root);
        copy_tree(&p.shm, &shm);
        let change = match rng.below(4) {
            0 | 1 => Change::Flip,
            2 => Change::Truncate,
            _ => Change::Delete,
        };
        let resident = rng.below(2) == 0;
        let result = if resident {
            let pick = &slots[rng.below(slots.len() as u64) as usize];
            let file = acp_core::staging::user_dir(&shm).join(pick.file_name().unwrap());
            // Most flips aim at the image, a small part of a slot file.
            let layout = &p.slots[&pick.file_name().unwrap().to_string_lossy().into_owned()];
            let focus = (rng.below(4) != 0).then_some((layout.image_offset, layout.image_len));
            let at = apply(&file, change, &mut rng, focus);
            Engine::open(config(&root, &shm))
                .map_err(|e| format!("open: {e}"))
                .and_then(|engine| {
                    let r = resident_trial(&p, &engine, &file, change, at);
                    engine.close().map_err(|e| format!("close: {e}"))?;
                    r
                })
                .map(|rejected| {
                    if rejected {
                        tally.resident_rejected += 1;
                    } else {
                        tally.harmless += 1;
                    }
                })
        } else {
            let pick = &stored[rng.below(stored.len() as u64) as usize];
            let file = root.join(pick.strip_prefix(&p.root).unwrap());
            let at = apply(&file, change, &mut rng, None);
            Engine::open(config(&root, &shm))
                .map_err(|e| format!("open: {e}"))
                .and_then(|engine| {
                    let r = stored_trial(&p, &engine, &file, change, at);
                    engine.close().map_err(|e| format!("close: {e}"))?;
                    r
                })
                .map(|outcome| match outcome {
                    Outcome::Detected => tally.detected += 1,
                    Outcome::Neutral => tally.neutral += 1,
                    Outcome::Hint => tally.hint += 1,
                })
        };
        if let Err(e) = result {
            failures.push(format!("trial {trial}: {e}"));
        }
    }
    let notes = format!(
        "stored changes detected: {}, index edits that kept the meaning: {}, \
         `latest` hint changes: {}, resident images rejected: {}, \
         resident changes no load could see: {}",
        tally.detected, tally.neutral, tally.hint, tally.resident_rejected, tally.harmless
    );
    eprintln!("{notes}");
    report_with("corrupt", n, &failures, &notes);
}
