//! Repository tasks: `cargo xtask ci`, `cargo xtask bench ...` and helpers, invoked through `$CARGO`.

use std::env;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use anyhow::{Context, Result, bail};

const HELP: &str = "\
usage: cargo xtask <task>

tasks:
  ci            format check, clippy with -D warnings, then every test
  help          this text
";

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: {error:#}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let arguments: Vec<String> = env::args().skip(1).collect();
    let Some(task) = arguments.first() else {
        print!("{HELP}");
        return Ok(());
    };
    match task.as_str() {
        "ci" => ci(),
        "help" | "--help" | "-h" => {
            print!("{HELP}");
            Ok(())
        }
        other => bail!("unknown task `{other}`; run `cargo xtask help` for the list"),
    }
}

/// Runs what CI runs, in the order that fails fastest.
fn ci() -> Result<()> {
    cargo(&["fmt", "--all", "--", "--check"])?;
    cargo(&["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
    cargo(&["test", "--workspace", "--all-targets"])?;
    cargo(&["test", "--workspace", "--doc"])?;
    Ok(())
}

/// Runs `$CARGO` (the cargo that started xtask) in the workspace root.
fn cargo(arguments: &[&str]) -> Result<()> {
    let program = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    eprintln!("xtask: cargo {}", arguments.join(" "));
    let status = Command::new(program)
        .args(arguments)
        .current_dir(workspace_root())
        .status()
        .with_context(|| format!("could not start cargo {}", arguments.join(" ")))?;
    if !status.success() {
        bail!("cargo {} failed with {status}", arguments.join(" "));
    }
    Ok(())
}

/// The workspace root: the parent of this crate's manifest directory.
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}
