//! A scratch crate outside the workspace that depends on net-io-blocking alone builds and serves an echo.
//!
//! Inside the workspace, features and dependencies of every member are unified, so a crate can compile
//! only because a sibling happened to switch something on. This builds a new crate in a temporary
//! directory, with no workspace around it and `net-io-blocking` as its only dependency (by path), and runs
//! a small echo through it: a hidden reliance on a sibling fails here first.
//!
//! The scratch crate takes the workspace's `Cargo.lock`, so it resolves the same versions the workspace
//! already downloaded and builds with `--offline`; only if that fails does it try again with the registry.
//! Its target directory is `target/standalone` (under `CARGO_TARGET_DIR` when that is set), so a repeated
//! run rebuilds only the scratch crate itself.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The scratch crate's program: the README's echo, with deadlines so that a broken server fails, not hangs.
const MAIN: &str = r#"//! Serves an echo with net-io-blocking on 127.0.0.1:0, sends through it with std and checks the reply.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use net_io_blocking::{NetError, TcpConnection, serve};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let server = serve("127.0.0.1:0", |connection: &mut TcpConnection<'_>| {
        let mut buffer = [0u8; 4096];
        loop {
            let count = connection.read(&mut buffer)?;
            if count == 0 {
                return Ok::<(), NetError>(());
            }
            connection.write_all(&buffer[..count])?;
        }
    })?;
    let mut client = TcpStream::connect(server.local_addr())?;
    client.set_read_timeout(Some(Duration::from_secs(10)))?;
    let message = b"standalone echo";
    client.write_all(message)?;
    let mut reply = vec![0u8; message.len()];
    client.read_exact(&mut reply)?;
    if reply != message {
        return Err(format!("the echo came back as {:?}", String::from_utf8_lossy(&reply)).into());
    }
    drop(client);
    server.shutdown(Instant::now() + Duration::from_secs(5));
    println!("echoed {} bytes", message.len());
    Ok(())
}
"#;

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits inside the workspace")
        .to_path_buf()
}

/// `target/standalone` under the target directory this test run uses.
fn target_directory(root: &Path) -> PathBuf {
    let target = match env::var_os("CARGO_TARGET_DIR") {
        Some(path) if Path::new(&path).is_absolute() => PathBuf::from(path),
        Some(path) => root.join(path),
        None => root.join("target"),
    };
    target.join("standalone")
}

/// A directory outside the workspace for the scratch crate, removed when dropped.
struct ScratchDirectory(PathBuf);

impl Drop for ScratchDirectory {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn cargo_run(manifest: &Path, target: &Path, offline: bool) -> Output {
    let cargo = env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut command = Command::new(cargo);
    command
        .args(["run", "--quiet", "--manifest-path"])
        .arg(manifest)
        .env("CARGO_TARGET_DIR", target)
        // Run from the scratch directory so no configuration of the workspace applies.
        .current_dir(manifest.parent().expect("the manifest has a directory"));
    if offline {
        command.arg("--offline");
    }
    command
        .output()
        .expect("could not start cargo for the scratch crate")
}

#[test]
fn a_crate_outside_the_workspace_serves_an_echo_with_net_io_blocking_alone() {
    let root = workspace_root();
    let scratch = ScratchDirectory(
        env::temp_dir().join(format!("net-io-blocking-standalone-{}", std::process::id())),
    );
    assert!(
        !scratch.0.starts_with(&root),
        "the scratch crate must live outside the workspace, not in {}",
        scratch.0.display()
    );
    fs::create_dir_all(scratch.0.join("src")).expect("create the scratch crate");
    let dependency = root.join("net-io-blocking");
    let manifest = format!(
        "[package]\nname = \"standalone-echo\"\nversion = \"0.0.0\"\nedition = \"2024\"\npublish = false\n\n\
         [dependencies]\nnet-io-blocking = {{ path = {:?} }}\n\n\
         # Its own workspace of one, so no workspace above the temporary directory can claim it.\n[workspace]\n",
        dependency.to_string_lossy()
    );
    fs::write(scratch.0.join("Cargo.toml"), manifest).expect("write the scratch manifest");
    fs::write(scratch.0.join("src/main.rs"), MAIN).expect("write the scratch program");
    // The workspace's versions, which its own builds have already downloaded.
    fs::copy(root.join("Cargo.lock"), scratch.0.join("Cargo.lock")).expect("copy Cargo.lock");

    let target = target_directory(&root);
    let manifest = scratch.0.join("Cargo.toml");
    let offline = cargo_run(&manifest, &target, true);
    // Only a resolution that needed the network is worth a second try; a compile error is the answer.
    let output = if offline.status.success()
        || !String::from_utf8_lossy(&offline.stderr).contains("offline")
    {
        offline
    } else {
        eprintln!(
            "the offline build failed; trying with the registry:\n{}",
            String::from_utf8_lossy(&offline.stderr)
        );
        cargo_run(&manifest, &target, false)
    };
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the scratch crate that depends on net-io-blocking alone failed ({}); a dependency or feature it \
         needs may come only from a sibling in the workspace:\n{stderr}\n{stdout}",
        output.status
    );
    assert_eq!(
        stdout.trim(),
        "echoed 15 bytes",
        "the scratch echo printed something else; stderr:\n{stderr}"
    );
}
