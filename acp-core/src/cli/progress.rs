//! A progress bar on a terminal's standard error.

use std::io::IsTerminal;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use super::Output;
use crate::ops::{self, Progress};

/// An indicatif bar, one per phase.
struct Bar {
    bar: Mutex<Option<indicatif::ProgressBar>>,
}

impl Progress for Bar {
    fn begin(&self, what: &str, total: u64) {
        let pb = indicatif::ProgressBar::new(total);
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{msg:24} [{bar:30}] {percent:>3}% {bytes}/{total_bytes} {bytes_per_sec}",
        ) {
            pb.set_style(style.progress_chars("#>."));
        }
        pb.set_message(what.to_owned());
        *self.lock() = Some(pb);
    }

    fn advance(&self, n: u64) {
        if let Some(pb) = self.lock().as_ref() {
            pb.inc(n);
        }
    }

    fn end(&self) {
        if let Some(pb) = self.lock().take() {
            pb.finish_and_clear();
        }
    }
}

impl Bar {
    fn lock(&self) -> MutexGuard<'_, Option<indicatif::ProgressBar>> {
        self.bar.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A bar when standard error is a terminal and `--quiet` was not given,
/// else nothing.
pub(super) fn progress(out: &Output) -> Arc<dyn Progress + Send> {
    if !out.quiet && std::io::stderr().is_terminal() {
        Arc::new(Bar {
            bar: Mutex::new(None),
        })
    } else {
        Arc::new(ops::Quiet)
    }
}
