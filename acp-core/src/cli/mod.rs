//! The `acp` command line: one clap program for the Rust binary and for
//! the `acp` command the Python wheel installs.
//!
//! Both fronts call [`run`] with their arguments and a [`Front`]: the Rust
//! binary's front has no framework, so `export --to torch|mindspore` and
//! `import` of torch or MindSpore files tell the user to use the wheel's
//! `acp`; the wheel's front hands those conversions to Python
//! (`acp.convert`). Everything else (parsing, usage checks, the exit codes,
//! progress bars, JSON and text output) is here, once.
//!
//! The program prints its reports on standard output and errors on
//! standard error, as `acp COMMAND: error: MESSAGE`, and returns the exit
//! code of [`ops::exit_code`](crate::ops::exit_code) (2 for usage errors).

mod args;
mod progress;

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

use crate::error::{Error, Result};
use crate::ops::{self, text, Progress};

pub use args::{Cli, Command, ExportFormat, ImportFormat, Output};
use progress::progress;

/// The help text's list of exit codes.
pub const EXIT_CODES: &str = "\
exit codes:
  0  success (verify: intact)        4  other error (I/O, no space, timeout)
  1  corrupt / verification failed   5  busy: a live process holds the slots
  2  usage error                     6  unsupported: written by a newer acp
  3  not found (root, step, file)";

/// A command's outcome that a [`Front`] computed: its report as JSON (the
/// `--json` output) and as text.
#[derive(Debug, Clone)]
pub struct Converted {
    /// The report, printed with `--json`.
    pub json: serde_json::Value,
    /// The report for people (a trailing newline is added when missing).
    pub text: String,
}

/// A failure a [`Front`] reports: the message and the exit code.
#[derive(Debug, Clone)]
pub struct Failure {
    /// What went wrong, naming the object.
    pub message: String,
    /// The exit code (see [`ops::exit_code`]).
    pub exit_code: u8,
}

impl From<Error> for Failure {
    fn from(e: Error) -> Failure {
        Failure {
            exit_code: ops::exit_code(&e),
            message: e.to_string(),
        }
    }
}

/// `acp export --to torch|mindspore`: what to write.
#[derive(Debug, Clone)]
pub struct ExportRequest {
    /// The checkpoint root.
    pub root: PathBuf,
    /// The file to write.
    pub out: PathBuf,
    /// The step (the newest when `None`).
    pub step: Option<u64>,
    /// Only this rank's file.
    pub rank: Option<u32>,
    /// The output format (never safetensors: that one is done here).
    pub format: ExportFormat,
}

/// `acp import` of torch or MindSpore files: what to commit.
#[derive(Debug, Clone)]
pub struct ImportRequest {
    /// The input files, all of `format`.
    pub files: Vec<PathBuf>,
    /// The checkpoint root.
    pub root: PathBuf,
    /// The step to commit.
    pub step: u64,
    /// The input format (never safetensors: that one is done here).
    pub format: ImportFormat,
    /// Replace the step when it is committed already.
    pub force: bool,
    /// Where the temporary ring slot goes.
    pub shm_dir: PathBuf,
}

/// What the program needs from the front that runs it: the conversions to
/// and from framework formats.
pub trait Front {
    /// The framework a plain safetensors import is read back with
    /// (`"torch"` or `"numpy"`: the tensor references of its values tree).
    fn tensor_framework(&self) -> &str {
        "torch"
    }

    /// Writes a step as a torch or MindSpore file.
    ///
    /// # Errors
    /// A [`Failure`] naming what went wrong.
    fn export(
        &self,
        req: &ExportRequest,
        progress: Arc<dyn Progress + Send>,
    ) -> std::result::Result<Converted, Failure>;

    /// Commits torch or MindSpore files as a step.
    ///
    /// # Errors
    /// A [`Failure`] naming what went wrong.
    fn import(
        &self,
        req: &ImportRequest,
        progress: Arc<dyn Progress + Send>,
    ) -> std::result::Result<Converted, Failure>;
}

/// The front of a build without a framework: conversions need the Python
/// `acp`.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoFramework;

impl NoFramework {
    fn refuse(what: &str, detail: String) -> Failure {
        Error::invalid(
            what,
            format!("{detail}: conversions of framework formats are in the Python `acp` (pip install acp)"),
        )
        .into()
    }
}

impl Front for NoFramework {
    fn export(
        &self,
        req: &ExportRequest,
        _: Arc<dyn Progress + Send>,
    ) -> std::result::Result<Converted, Failure> {
        Err(Self::refuse(
            "export",
            format!("--to {}", req.format.name()),
        ))
    }

    fn import(
        &self,
        req: &ImportRequest,
        _: Arc<dyn Progress + Send>,
    ) -> std::result::Result<Converted, Failure> {
        Err(Self::refuse(
            "import",
            format!("{} files", req.format.name()),
        ))
    }
}

/// Runs the command line on `args` (the program name first) and returns
/// the exit code. Prints help, reports and errors itself.
pub fn run<I, T>(args: I, front: &dyn Front) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // Help and --version go to stdout with code 0; usage errors to
            // stderr with code 2.
            let _ = e.print();
            return u8::try_from(e.exit_code()).unwrap_or(2);
        }
    };
    let (name, json) = (cli.command.name(), cli.command.json());
    let code = match execute(cli.command, front) {
        Ok(code) => code,
        Err(f) => {
            eprintln!("acp {name}: error: {}", f.message);
            if json {
                // A reader of the JSON report gets the failure in JSON too.
                let error = serde_json::json!({"error": {
                    "command": name,
                    "message": f.message,
                    "exit_code": f.exit_code,
                }});
                println!("{error:#}");
            }
            f.exit_code
        }
    };
    let _ = std::io::stdout().flush();
    code
}

/// Prints a report as JSON or text.
fn emit<T: serde::Serialize>(
    out: &Output,
    report: &T,
    text: impl FnOnce(&T) -> String,
) -> Result<()> {
    if out.json {
        let json = serde_json::to_string_pretty(report).map_err(|e| Error::invalid("report", e))?;
        println!("{json}");
    } else {
        let t = text(report);
        if t.ends_with('\n') {
            print!("{t}");
        } else {
            println!("{t}");
        }
    }
    Ok(())
}

fn usage(what: &str, reason: &str) -> Failure {
    Error::invalid(what, reason).into()
}

fn secs(option: &str, value: f64) -> std::result::Result<Duration, Failure> {
    Duration::try_from_secs_f64(value)
        .map_err(|_| usage(option, "not a non-negative number of seconds"))
}

fn execute(command: Command, front: &dyn Front) -> std::result::Result<u8, Failure> {
    match command {
        Command::Ls {
            root,
            shm,
            job,
            shm_dir,
            out,
        } => match root {
            Some(root) if !shm => emit(
                &out,
                &ops::list(&root, job.as_deref(), &shm_dir)?,
                text::list,
            )?,
            _ => emit(&out, &ops::shm_list(&shm_dir)?, ops::shm_list_text)?,
        },
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
            let p = progress(&out);
            if format == ExportFormat::Safetensors {
                let r = ops::export_safetensors(&root, step, rank, &out_path, force, p.as_ref())?;
                emit(&out, &r, text::export)?;
                return Ok(0);
            }
            if !force && std::fs::symlink_metadata(&out_path).is_ok() {
                return Err(usage(
                    &out_path.display().to_string(),
                    "exists; pass --force to replace it",
                ));
            }
            let req = ExportRequest {
                root,
                out: out_path,
                step,
                rank,
                format,
            };
            let r = front.export(&req, p);
            emit_converted(&out, r?)?;
        }
        Command::Import {
            files,
            root,
            step,
            format,
            force,
            shm_dir,
            out,
        } => {
            let format = input_format(&files, format)?;
            let p = progress(&out);
            if format == ImportFormat::Safetensors {
                let opts = ops::ImportOptions {
                    root,
                    step,
                    overwrite: force,
                    values: None,
                    framework: front.tensor_framework().to_owned(),
                    shm_dir,
                };
                let r = ops::import_safetensors(&files, &opts, p.as_ref())?;
                emit(&out, &r, text::import)?;
                return Ok(0);
            }
            let req = ImportRequest {
                files,
                root,
                step,
                format,
                force,
                shm_dir,
            };
            let r = front.import(&req, p);
            emit_converted(&out, r?)?;
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
            shm,
            force,
            ttl,
            shm_dir,
            keep,
            every,
            pending,
            older_than,
            dry_run,
            out,
        } => {
            let root = match root {
                Some(root) if !shm => root,
                _ => {
                    let opts = ops::ShmGcOptions {
                        dry_run,
                        force,
                        ttl: ttl.map(|t| secs("--ttl", t)).transpose()?,
                    };
                    emit(&out, &ops::shm_gc(&shm_dir, &opts)?, ops::shm_gc_text)?;
                    return Ok(0);
                }
            };
            if force || ttl.is_some() {
                return Err(usage("gc", "--force and --ttl go with --shm"));
            }
            if keep.is_none() && !pending {
                return Err(usage("gc", "say what to remove: --keep K and/or --pending"));
            }
            let opts = ops::GcOptions {
                keep_last: keep,
                keep_every: every,
                unfinished_older_than: pending
                    .then(|| secs("--older-than", older_than))
                    .transpose()?,
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
                commit_timeout: secs("--timeout", timeout)?,
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

fn emit_converted(out: &Output, r: Converted) -> Result<()> {
    emit(out, &r.json, |_| r.text.clone())
}

/// The one format of the input files: `--format`, else each file's by its
/// name and first bytes.
fn input_format(
    files: &[PathBuf],
    format: ImportFormat,
) -> std::result::Result<ImportFormat, Failure> {
    if format != ImportFormat::Auto {
        return Ok(format);
    }
    let mut kinds = files
        .iter()
        .map(|f| sniff(f).map(|k| (f, k)))
        .collect::<Result<Vec<_>>>()?;
    kinds.dedup_by_key(|(_, k)| *k);
    match kinds[..] {
        [(_, k)] => Ok(k),
        _ => Err(usage(
            "import",
            &format!(
                "the files are of different formats: {}",
                kinds
                    .iter()
                    .map(|(f, k)| format!("{} is {}", f.display(), k.name()))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )),
    }
}

/// The format of an input file: by its name, else by its first bytes.
fn sniff(path: &std::path::Path) -> Result<ImportFormat> {
    let name = path.to_string_lossy().to_lowercase();
    if name.ends_with(".safetensors") {
        return Ok(ImportFormat::Safetensors);
    }
    if [".pt", ".pth", ".bin", ".tar"]
        .iter()
        .any(|s| name.ends_with(s))
    {
        return Ok(ImportFormat::Torch);
    }
    if name.ends_with(".ckpt") {
        return Ok(ImportFormat::Mindspore);
    }
    let file = open_input(path)?;
    let size = file
        .metadata()
        .map_err(|e| Error::io("stat", path, e))?
        .len();
    let mut head = [0u8; 9];
    let n = std::os::unix::fs::FileExt::read_at(&file, &mut head, 0)
        .map_err(|e| Error::io("read", path, e))?;
    if n >= 2 && head[..2] == *b"PK" {
        return Ok(ImportFormat::Torch);
    }
    if let (9, Some(prefix)) = (n, head.first_chunk::<8>()) {
        if head[8] == b'{' && crate::format::header_end(*prefix) <= size {
            return Ok(ImportFormat::Safetensors);
        }
    }
    Err(Error::invalid(
        path.display(),
        "unknown format; pass --format",
    ))
}

/// Opens a user's input file for reading, without blocking on a FIFO. It
/// follows symlinks, unlike [`crate::io::open_regular`] (which guards
/// checkpoint content): a file the user names is often a link, e.g. into a
/// model cache.
fn open_input(path: &std::path::Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::NotFound {
                what: path.display().to_string(),
            },
            _ => Error::io("open", path, e),
        })?;
    let meta = file.metadata().map_err(|e| Error::io("stat", path, e))?;
    if !meta.is_file() {
        return Err(Error::invalid(path.display(), "not a regular file"));
    }
    Ok(file)
}
