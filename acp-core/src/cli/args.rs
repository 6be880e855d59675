//! The command line's arguments.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use super::EXIT_CODES;
use crate::ops;

/// `acp`: see, check and repair acp checkpoints.
#[derive(Debug, Parser)]
#[command(
    name = "acp",
    version,
    about = "See, check and repair acp checkpoints.",
    after_help = EXIT_CODES,
    subcommand_required = true,
    arg_required_else_help = true
)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The output options every command has.
#[derive(Debug, Args)]
pub struct Output {
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// No progress bar.
    #[arg(short, long)]
    pub quiet: bool,
}

/// The formats `export` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExportFormat {
    /// One plain safetensors file (a multi-rank step is merged).
    Safetensors,
    /// A `torch.save` file of the saved state, tensors on CPU.
    Torch,
    /// A MindSpore `.ckpt` of the tensors.
    Mindspore,
}

impl ExportFormat {
    /// Its name on the command line.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            ExportFormat::Safetensors => "safetensors",
            ExportFormat::Torch => "torch",
            ExportFormat::Mindspore => "mindspore",
        }
    }
}

/// The formats `import` reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ImportFormat {
    /// From each file's name and first bytes.
    Auto,
    /// safetensors files.
    Safetensors,
    /// torch state dicts, read with `weights_only=True`.
    Torch,
    /// MindSpore `.ckpt` files.
    Mindspore,
}

impl ImportFormat {
    /// Its name on the command line.
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            ImportFormat::Auto => "auto",
            ImportFormat::Safetensors => "safetensors",
            ImportFormat::Torch => "torch",
            ImportFormat::Mindspore => "mindspore",
        }
    }
}

fn at_least_one(s: &str) -> Result<u64, String> {
    match s.parse::<u64>() {
        Ok(0) => Err(format!("{s}: must be at least 1")),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number")),
    }
}

fn keep_count(s: &str) -> Result<usize, String> {
    at_least_one(s).and_then(|n| usize::try_from(n).map_err(|_| format!("{s}: too large")))
}

/// `"256MiB"`, `"1G"`, `"4096"` → bytes (binary units).
fn parse_size(s: &str) -> Result<u64, String> {
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
    let num = num.trim();
    let bytes = match num.parse::<u64>() {
        Ok(n) => n.checked_mul(scale),
        // Fractions of a unit, e.g. 1.5G.
        Err(_) => num
            .parse::<f64>()
            .ok()
            .filter(|f| f.is_finite() && *f >= 0.0)
            .map(|f| f * scale as f64)
            .filter(|b| *b < u64::MAX as f64)
            .map(|b| b as u64),
    }
    .ok_or_else(|| format!("{s:?} is not a size such as 256MiB or 1G"))?;
    if bytes == 0 {
        return Err(format!("{s:?}: the size must be positive"));
    }
    Ok(bytes)
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List committed steps, and which are resident in this node's shared memory.
    #[command(
        after_help = EXIT_CODES,
        long_about = "List the committed steps of ROOT with their size, ranks and tensors, and \
            which are resident in this node's shared memory (and any resident checkpoint that \
            is not committed: `acp persist` commits it). With --shm, list every ring of this \
            user on the node instead: its job, rank and root, the steps it holds (which are \
            committed in the root, which are the only copy), its size, whether a live process \
            holds it, and its age."
    )]
    Ls {
        /// The checkpoint directory (not with --shm).
        #[arg(required_unless_present = "shm", conflicts_with = "shm")]
        root: Option<PathBuf>,
        /// Every ring of this user on the node instead: job, rank, root,
        /// resident steps (which are committed), size, live holder, age.
        #[arg(long)]
        shm: bool,
        /// The job id the trainer used (default: the root path).
        #[arg(long, conflicts_with = "shm")]
        job: Option<String>,
        /// Where the ring's slot files are.
        #[arg(long, default_value = ops::DEFAULT_SHM_DIR)]
        shm_dir: PathBuf,
        /// Output options.
        #[command(flatten)]
        out: Output,
    },
    /// Show a step's files, tensors and plain values.
    #[command(
        after_help = EXIT_CODES,
        long_about = "Show a step's files (sizes, digests, format version), tensors (dtype, \
            shape, bytes) and plain values. Headers are checked against their digests; tensor \
            bytes are not read (see `verify`)."
    )]
    Inspect {
        /// The checkpoint directory.
        root: PathBuf,
        /// The step (default: the newest).
        #[arg(long)]
        step: Option<u64>,
        /// Output options.
        #[command(flatten)]
        out: Output,
    },
    /// Re-hash a step (or every step) against its index; exit 0 only if intact.
    #[command(
        after_help = EXIT_CODES,
        long_about = "Re-hash every file of a step (or of every step with --all) against the \
            digests of its index. Exits 0 only if every byte is intact; 1 naming each changed \
            file and tensor otherwise."
    )]
    Verify {
        /// The checkpoint directory.
        root: PathBuf,
        /// The step (default: the newest).
        #[arg(long, conflicts_with = "all")]
        step: Option<u64>,
        /// Every committed step.
        #[arg(long)]
        all: bool,
        /// Output options.
        #[command(flatten)]
        out: Output,
    },
    /// Write a step as safetensors, torch or MindSpore (verified first).
    #[command(
        after_help = EXIT_CODES,
        long_about = "Write a step to OUT: `safetensors` (one plain file; a multi-rank step is \
            merged), `torch` (a torch.save file of the saved state, tensors on CPU; several \
            ranks give {'rank0': ..., 'rank1': ...}), or `mindspore` (a .ckpt of the tensors). \
            Every byte is verified first: a corrupt step is refused and nothing is written."
    )]
    Export {
        /// The checkpoint directory.
        root: PathBuf,
        /// The file to write.
        #[arg(value_name = "OUT")]
        out_path: PathBuf,
        /// The step (default: the newest).
        #[arg(long)]
        step: Option<u64>,
        /// Output format.
        #[arg(long = "to", value_enum, default_value = "safetensors")]
        format: ExportFormat,
        /// Only this rank's file.
        #[arg(long)]
        rank: Option<u32>,
        /// Replace OUT if it exists.
        #[arg(long)]
        force: bool,
        /// Output options.
        #[command(flatten)]
        out: Output,
    },
    /// Commit safetensors, torch or MindSpore files as a step.
    #[command(
        after_help = EXIT_CODES,
        long_about = "Commit safetensors files, a torch state dict (read with \
            torch.load(weights_only=True): no pickled code runs) or a MindSpore .ckpt as step \
            STEP of ROOT, hashed and indexed like any save."
    )]
    Import {
        /// The input files.
        #[arg(required = true, value_name = "FILE")]
        files: Vec<PathBuf>,
        /// The checkpoint directory.
        #[arg(long = "to", value_name = "ROOT")]
        root: PathBuf,
        /// The step to commit.
        #[arg(long)]
        step: u64,
        /// Input format (default: from each file's name and first bytes).
        #[arg(long, value_enum, default_value = "auto")]
        format: ImportFormat,
        /// Replace the step if it exists.
        #[arg(long)]
        force: bool,
        /// Where the temporary ring slot goes.
        #[arg(long, default_value = ops::DEFAULT_SHM_DIR)]
        shm_dir: PathBuf,
        /// Output options.
        #[command(flatten)]
        out: Output,
    },
    /// Which tensors and values changed between two steps, and by how much.
    #[command(
        after_help = EXIT_CODES,
        long_about = "Which tensors were added, removed or changed between two steps; for \
            changed float tensors the largest absolute difference and the relative L2 norm of \
            the difference, for others the count of differing bytes; and which plain values \
            differ."
    )]
    Diff {
        /// The checkpoint directory.
        root: PathBuf,
        /// Give twice: --step A --step B.
        #[arg(long, required = true, num_args = 1, value_name = "N")]
        step: Vec<u64>,
        /// Output options.
        #[command(flatten)]
        out: Output,
    },
    /// Keep the newest K steps (and multiples of M); remove old unfinished saves or dead rings.
    #[command(
        after_help = EXIT_CODES,
        long_about = "Keep the newest K committed steps (and every multiple of M), removing \
            the rest atomically; with --pending also remove unfinished saves left by dead \
            processes. Safe beside a live trainer: the newest step is always kept, and \
            unfinished saves younger than --older-than are left alone. With --shm instead, \
            remove this user's rings in shared memory that no live process holds and whose \
            resident steps are all committed in their root (or superseded by a newer \
            committed step), reporting each ring removed or kept and the bytes freed; a ring \
            holding the only copy of a step is kept unless --force, a ring a live process \
            holds always."
    )]
    Gc {
        /// The checkpoint directory (not with --shm).
        #[arg(required_unless_present = "shm", conflicts_with = "shm")]
        root: Option<PathBuf>,
        /// Remove this user's rings in shared memory that no live process
        /// holds and whose resident steps are all committed.
        #[arg(long, conflicts_with_all = ["keep", "pending"])]
        shm: bool,
        /// With --shm: also remove rings holding the only copy of a step
        /// (never a ring a live process holds).
        #[arg(long, requires = "shm")]
        force: bool,
        /// With --shm: only rings whose files have not changed for SECS.
        #[arg(long, value_name = "SECS", requires = "shm")]
        ttl: Option<f64>,
        /// Where the rings' slot files are (with --shm).
        #[arg(long, default_value = ops::DEFAULT_SHM_DIR, requires = "shm")]
        shm_dir: PathBuf,
        /// Keep the newest K steps.
        #[arg(long, value_name = "K", value_parser = keep_count)]
        keep: Option<usize>,
        /// Also keep multiples of M (needs --keep).
        #[arg(long, value_name = "M", requires = "keep", value_parser = at_least_one)]
        every: Option<u64>,
        /// Remove unfinished saves older than --older-than.
        #[arg(long)]
        pending: bool,
        /// Age in seconds of an unfinished save before --pending removes it.
        #[arg(long, value_name = "SECS", default_value_t = 3600.0)]
        older_than: f64,
        /// Only show what would be removed.
        #[arg(long)]
        dry_run: bool,
        /// Output options.
        #[command(flatten)]
        out: Output,
    },
    /// Commit what a dead trainer left resident in this node's shared memory.
    #[command(
        after_help = EXIT_CODES,
        long_about = "Flush and commit the checkpoints a dead process left resident in this \
            node's shared memory that are newer than the newest committed step. Of a multi-rank \
            job, without --rank: the steps whose every rank's image is on this node, in the \
            ranks' own slots or in replica slots kept here for the ranks of a lost node \
            (replicas=N), are committed; a newer step some ranks' images are missing from is \
            never committed partially, and the missing ranks are named. With --rank, only those \
            ranks (their own images, or for a rank with none here its newest replica kept \
            here), while the other ranks are persisted on their nodes at the same time. Refuses (exit 5) while a live trainer holds the slots: it persists its own."
    )]
    Persist {
        /// The checkpoint directory.
        root: PathBuf,
        /// The job id the trainer used (default: the root path).
        #[arg(long)]
        job: Option<String>,
        /// Only this rank (repeat; default: every rank found).
        #[arg(long)]
        rank: Vec<u32>,
        /// Default: read from the resident image.
        #[arg(long)]
        world_size: Option<u32>,
        /// With several ranks, how long rank 0 waits for the others, in seconds.
        #[arg(long, default_value_t = 600.0)]
        timeout: f64,
        /// Where the ring's slot files are.
        #[arg(long, default_value = ops::DEFAULT_SHM_DIR)]
        shm_dir: PathBuf,
        /// Output options.
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
        /// Where the ring's slot files are.
        #[arg(long, default_value = ops::DEFAULT_SHM_DIR)]
        shm_dir: PathBuf,
        /// Output options.
        #[command(flatten)]
        out: Output,
    },
}

impl Command {
    /// The subcommand's name, for error messages.
    #[must_use]
    pub fn name(&self) -> &'static str {
        match self {
            Command::Ls { .. } => "ls",
            Command::Inspect { .. } => "inspect",
            Command::Verify { .. } => "verify",
            Command::Export { .. } => "export",
            Command::Import { .. } => "import",
            Command::Diff { .. } => "diff",
            Command::Gc { .. } => "gc",
            Command::Persist { .. } => "persist",
            Command::Bench { .. } => "bench",
        }
    }

    /// Whether the report was asked for as JSON (`--json`).
    pub fn json(&self) -> bool {
        match self {
            Command::Ls { out, .. }
            | Command::Inspect { out, .. }
            | Command::Verify { out, .. }
            | Command::Export { out, .. }
            | Command::Import { out, .. }
            | Command::Diff { out, .. }
            | Command::Gc { out, .. }
            | Command::Persist { out, .. }
            | Command::Bench { out, .. } => out.json,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("256MiB"), Ok(256 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("1.5k"), Ok(1536));
        assert_eq!(parse_size("4096"), Ok(4096));
        assert!(parse_size("0").is_err());
        assert!(parse_size("lots").is_err());
        assert!(parse_size("99999999999T").is_err());
    }

    #[test]
    fn gc_every_needs_keep() {
        assert!(Cli::try_parse_from(["acp", "gc", "r", "--every", "2", "--pending"]).is_err());
        assert!(Cli::try_parse_from(["acp", "gc", "r", "--keep", "0"]).is_err());
        assert!(Cli::try_parse_from(["acp", "gc", "r", "--keep", "2", "--every", "5"]).is_ok());
    }

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}
