//! `acp`: see, check and repair acp checkpoints (the Rust build of the
//! command line the Python wheel installs; the torch and MindSpore export
//! and import paths are in the Python one).
//!
//! Build with `cargo build -p acp-core --features cli --bin acp`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use acp_core::ops::{self, text, Progress};
use acp_core::{Error, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};

const EXIT_CODES: &str = "\
exit codes:
  0  success (verify: intact)        4  other error (I/O, no space, timeout)
  1  corrupt / verification failed   5  busy: a live process holds the slots
  2  usage error                     6  unsupported: written by a newer acp
  3  not found (root, step, file)";

#[derive(Debug, Parser)]
#[command(name = "acp", version, about = "See, check and repair acp checkpoints.", after_help = EXIT_CODES)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Args)]
struct Output {
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// No progress bar.
    #[arg(short, long)]
    quiet: bool,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Format {
    Safetensors,
    Torch,
    Mindspore,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// List committed steps, and which are resident in this node's shared memory.
    #[command(after_help = EXIT_CODES)]
    Ls {
        /// The checkpoint directory.
        root: PathBuf,
        /// The job id the trainer used (default: the root path).
        #[arg(long)]
        job: Option<String>,
        /// Where the ring's slot files are.
        #[arg(long, default_value = ops::DEFAULT_SHM_DIR)]
        shm_dir: PathBuf,
        #[command(flatten)]
        out: Output,
    },
    /// Show a step's files, tensors and plain values.
    #[command(after_help = EXIT_CODES)]
    Inspect {
        root: PathBuf,
        /// The step (default: the newest).
        #[arg(long)]
        step: Option<u64>,
        #[command(flatten)]
        out: Output,
    },
    /// Re-hash a step (or every step) against its index; exit 0 only if intact.
    #[command(after_help = EXIT_CODES)]
    Verify {
        root: PathBuf,
        /// The step (default: the newest).
        #[arg(long, conflicts_with = "all")]
        step: Option<u64>,
        /// Every committed step.
        #[arg(long)]
        all: bool,
        #[command(flatten)]
        out: Output,
    },
    /// Write a step as one plain safetensors file (verified; a corrupt step is refused).
    #[command(after_help = EXIT_CODES)]
    Export {
        root: PathBuf,
        /// The file to write.
        out_path: PathBuf,
        /// The step (default: the newest).
        #[arg(long)]
        step: Option<u64>,
        /// Output format (torch and mindspore: use the Python `acp`).
        #[arg(long = "to", value_enum, default_value = "safetensors")]
        format: Format,
        /// Only this rank's file.
        #[arg(long)]
        rank: Option<u32>,
        /// Replace the output if it exists.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        out: Output,
    },
    /// Commit safetensors files as a step.
    #[command(after_help = EXIT_CODES)]
    Import {
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// The checkpoint directory.
        #[arg(long = "to")]
        root: PathBuf,
        #[arg(long)]
        step: u64,
        /// Replace the step if it exists.
        #[arg(long)]
        force: bool,
        #[arg(long, default_value = ops::DEFAULT_SHM_DIR)]
        shm_dir: PathBuf,
        #[command(flatten)]
        out: Output,
    },
    /// Which tensors and values changed between two steps, and by how much.
    #[command(after_help = EXIT_CODES)]
    Diff {
        root: PathBuf,
        /// Give twice: --step A --step B.
        #[arg(long, required = true, num_args = 1)]
        step: Vec<u64>,
        #[command(flatten)]
        out: Output,
    },
    /// Keep the newest K steps (and multiples of M); remove old unfinished saves.
    #[command(after_help = EXIT_CODES)]
    Gc {
        root: PathBuf,
        #[arg(long)]
        keep: Option<usize>,
        #[arg(long, requires = "keep")]
        every: Option<u64>,
        /// Remove unfinished saves older than --older-than.
        #[arg(long)]
        pending: bool,
        #[arg(long, default_value_t = 3600.0)]
        older_than: f64,
        #[arg(long)]
        dry_run: bool,
        #[command(flatten)]
        out: Output,
    },
    /// Commit what a dead trainer left resident in this node's shared memory.
    #[command(after_help = EXIT_CODES)]
    Persist {
        root: PathBuf,
        #[arg(long)]
        job: Option<String>,
        /// Only this rank (repeat; default: every rank found).
        #[arg(long)]
        rank: Vec<u32>,
        #[arg(long)]
        world_size: Option<u32>,
        /// With several ranks, how long rank 0 waits for the others, in seconds.
        #[arg(long, default_value_t = 600.0)]
        timeout: f64,
        #[arg(long, default_value = ops::DEFAULT_SHM_DIR)]
        shm_dir: PathBuf,
        #[command(flatten)]
        out: Output,
    },
    /// A quick self-benchmark: memcpy, stall, flush and load, side by side.
    #[command(after_help = EXIT_CODES)]
    Bench {
        /// e.g. 256MiB, 1G.
        #[arg(long, default_value = "256MiB", value_parser = parse_size)]
        size: u64,
        /// Directory on the storage to measure (default: the temp directory).
        #[arg(long)]
        dir: Option<PathBuf>,
        #[arg(long, default_value = ops::DEFAULT_SHM_DIR)]
        shm_dir: PathBuf,
        #[command(flatten)]
        out: Output,
    },
}

/// `"256MiB"`, `"1G"`, `"4096"` → bytes (binary units).
fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim().to_ascii_lowercase();
    let t = t
        .strip_suffix("ib")
        .or_else(|| t.strip_suffix('b'))
        .unwrap_or(&t);
    let (num, scale) = match t.char_indices().last() {
        Some((i, 'k')) => (&t[..i], 1u64 << 10),
        Some((i, 'm')) => (&t[..i], 1 << 20),
        Some((i, 'g')) => (&t[..i], 1 << 30),
        Some((i, 't')) => (&t[..i], 1 << 40),
        _ => (t, 1),
    };
    let n: u64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a size such as 256MiB or 1G"))?;
    n.checked_mul(scale)
        .filter(|v| *v > 0)
        .ok_or_else(|| format!("{s:?}: the size must be positive and fit 64 bits"))
}

/// A progress bar on a terminal's stderr.
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
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<indicatif::ProgressBar>> {
        self.bar
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn progress(out: &Output) -> Box<dyn Progress> {
    if !out.quiet && std::io::stderr().is_terminal() {
        Box::new(Bar {
            bar: Mutex::new(None),
        })
    } else {
        Box::new(ops::Quiet)
    }
}

/// Prints a report as JSON or text; returns `ok`.
fn emit<T: serde::Serialize>(
    out: &Output,
    report: &T,
    text: impl FnOnce(&T) -> String,
) -> Result<()> {
    if out.json {
        let json = serde_json::to_string_pretty(report).map_err(|e| Error::invalid("report", e))?;
        println!("{json}");
    } else {
        print!("{}", text(report));
    }
    Ok(())
}

fn usage(what: &str, reason: &str) -> Error {
    Error::invalid(what, reason)
}

fn run(command: Command) -> Result<u8> {
    match command {
        Command::Ls {
            root,
            job,
            shm_dir,
            out,
        } => emit(
            &out,
            &ops::list(&root, job.as_deref(), &shm_dir)?,
            text::list,
        )?,
        Command::Inspect { root, step, out } => {
            emit(&out, &ops::inspect(&root, step)?, text::inspect)?;
        }
        Command::Verify {
            root,
            step,
            all,
            out,
        } => {
            let r = ops::verify(&root, step, all, progress(&out).as_ref())?;
            emit(&out, &r, text::verify)?;
            return Ok(if r.ok { 0 } else { 1 });
        }
        Command::Export {
            root,
            out_path,
            step,
            format,
            rank,
            force,
            out,
        } => {
            if !matches!(format, Format::Safetensors) {
                return Err(usage(
                    "export",
                    "torch and mindspore exports are in the Python `acp` (pip install acp)",
                ));
            }
            let p = progress(&out);
            let r = ops::export_safetensors(&root, step, rank, &out_path, force, p.as_ref())?;
            emit(&out, &r, text::export)?;
        }
        Command::Import {
            files,
            root,
            step,
            force,
            shm_dir,
            out,
        } => {
            let opts = ops::ImportOptions {
                root,
                step,
                overwrite: force,
                values: None,
                shm_dir,
            };
            let r = ops::import_safetensors(&files, &opts, progress(&out).as_ref())?;
            emit(&out, &r, text::import)?;
        }
        Command::Diff { root, step, out } => {
            let [a, b] = step[..] else {
                return Err(usage("diff", "give exactly two steps: --step A --step B"));
            };
            let r = ops::diff(&root, a, b, progress(&out).as_ref())?;
            emit(&out, &r, text::diff)?;
        }
        Command::Gc {
            root,
            keep,
            every,
            pending,
            older_than,
            dry_run,
            out,
        } => {
            if keep.is_none() && !pending {
                return Err(usage("gc", "say what to remove: --keep K and/or --pending"));
            }
            let age = Duration::try_from_secs_f64(older_than)
                .map_err(|_| usage("--older-than", "not a number of seconds"))?;
            let opts = ops::GcOptions {
                keep_last: keep,
                keep_every: every,
                unfinished_older_than: pending.then_some(age),
                dry_run,
            };
            emit(&out, &ops::gc(&root, &opts)?, text::gc)?;
        }
        Command::Persist {
            root,
            job,
            rank,
            world_size,
            timeout,
            shm_dir,
            out,
        } => {
            let opts = ops::PersistOptions {
                root,
                job,
                ranks: (!rank.is_empty()).then_some(rank),
                shm_dir,
                world_size,
                commit_timeout: Duration::try_from_secs_f64(timeout)
                    .map_err(|_| usage("--timeout", "not a number of seconds"))?,
            };
            emit(&out, &ops::persist(&opts)?, text::persist)?;
        }
        Command::Bench {
            size,
            dir,
            shm_dir,
            out,
        } => {
            let opts = ops::BenchOptions {
                size,
                dir: dir.unwrap_or_else(std::env::temp_dir),
                shm_dir,
            };
            let r = ops::bench(&opts, progress(&out).as_ref())?;
            emit(&out, &r, text::bench)?;
        }
    }
    Ok(0)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let name = format!("{:?}", cli.command)
        .split([' ', '{'])
        .next()
        .unwrap_or_default()
        .to_lowercase();
    match run(cli.command) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("acp {name}: error: {e}");
            ExitCode::from(ops::exit_code(&e))
        }
    }
}
