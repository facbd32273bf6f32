//! Two hosts: a stage process in one network namespace serving stage 0 in another, joined by a veth pair that
//! the test makes itself (root only; otherwise the test says why it does not run).

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::channel;
use std::time::Duration;

use candle_core::quantized::GgmlDType;
use stage_server::model::testing::TinyModel;

const BINARY: &str = env!("CARGO_BIN_EXE_stage-server");

/// Two namespaces and the veth pair between them, removed when dropped.
struct Hosts {
    names: [String; 2],
}

impl Hosts {
    /// `ip netns` hosts `a` (10.231.P.1) and `b` (10.231.P.2) on a /30, P from this process's id.
    fn create() -> Result<(Hosts, [String; 2]), String> {
        let id = std::process::id();
        let subnet = id % 250;
        let names = [format!("ss-a-{id}"), format!("ss-b-{id}")];
        let hosts = Hosts {
            names: names.clone(),
        };
        let addresses = [format!("10.231.{subnet}.1"), format!("10.231.{subnet}.2")];
        let veth = [format!("ssa{id}"), format!("ssb{id}")];
        let steps: Vec<Vec<String>> = vec![
            vec!["netns".into(), "add".into(), names[0].clone()],
            vec!["netns".into(), "add".into(), names[1].clone()],
            vec![
                "link".into(),
                "add".into(),
                veth[0].clone(),
                "netns".into(),
                names[0].clone(),
                "type".into(),
                "veth".into(),
                "peer".into(),
                "name".into(),
                veth[1].clone(),
                "netns".into(),
                names[1].clone(),
            ],
        ];
        for step in steps {
            run_ip(&step)?;
        }
        for (index, name) in names.iter().enumerate() {
            let address = format!("{}/30", addresses[index]);
            run_ip(&[
                "-n".into(),
                name.clone(),
                "addr".into(),
                "add".into(),
                address,
                "dev".into(),
                veth[index].clone(),
            ])?;
            run_ip(&[
                "-n".into(),
                name.clone(),
                "link".into(),
                "set".into(),
                veth[index].clone(),
                "up".into(),
            ])?;
            run_ip(&[
                "-n".into(),
                name.clone(),
                "link".into(),
                "set".into(),
                "lo".into(),
                "up".into(),
            ])?;
        }
        Ok((hosts, addresses))
    }

    fn exec(&self, host: usize) -> Command {
        let mut command = Command::new("ip");
        command.args(["netns", "exec", &self.names[host], BINARY]);
        command
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}

fn run_ip(arguments: &[String]) -> Result<(), String> {
    let output = Command::new("ip")
        .args(arguments)
        .output()
        .map_err(|error| format!("ip is not available: {error}"))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(format!(
            "ip {} failed: {}",
            arguments.join(" "),
            String::from_utf8_lossy(&output.stderr).trim()
        ))
    }
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn generate_json(command: &mut Command, model: &Path, extra: &[&str]) -> serde_json::Value {
    let output = command
        .arg("generate")
        .arg("--model")
        .arg(model)
        .args([
            "--prompt-ids",
            "1,300,301,302",
            "--max-tokens",
            "8",
            "--json",
            "--threads",
            "1",
        ])
        .args(extra)
        .output()
        .expect("running stage-server generate");
    assert!(
        output.status.success(),
        "generate {extra:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("--json prints one object")
}

#[test]
fn a_stage_on_another_host_serves_stage_zero_across_a_veth_pair() {
    // Only root may create network namespaces.
    let root = Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|output| output.stdout.starts_with(b"0"));
    if !root {
        eprintln!("not run: creating network namespaces (ip netns) needs root; CI runs as root");
        return;
    }
    let (hosts, addresses) = match Hosts::create() {
        Ok(made) => made,
        Err(error) => {
            // Root without the netns capability (a restricted container) cannot run this test.
            if std::env::var_os("CI").is_some() {
                panic!("CI runs as root but could not make the test hosts: {error}");
            }
            eprintln!("not run: could not make the test hosts: {error}");
            return;
        }
    };
    let dir = std::env::temp_dir().join(format!("stage-server-two-hosts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = TinyModel::llama(GgmlDType::Q4_1)
        .write_to_dir(&dir)
        .unwrap();
    let bind = format!("{}:7411", addresses[1]);
    let mut serve = hosts.exec(1);
    serve
        .arg("serve")
        .arg("--model")
        .arg(&model)
        .args(["--layers", "2..4", "--bind", &bind, "--threads", "1"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    let mut child = serve.spawn().expect("starting the stage in host b");
    let stdout = child.stdout.take().unwrap();
    let stage = Killed(child);
    let (lines, ready) = channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = lines.send(line);
    });
    let line = ready
        .recv_timeout(Duration::from_secs(60))
        .unwrap_or_default();
    assert!(
        line.contains(&format!("on {bind}")),
        "the stage in host b should listen on {bind}: {line:?}"
    );
    let unsplit = generate_json(&mut Command::new(BINARY), &model, &[]);
    let across = generate_json(
        &mut hosts.exec(0),
        &model,
        &["--layers", "0..2", "--next", &bind],
    );
    assert_eq!(
        across["tokens"], unsplit["tokens"],
        "stage 0 in host a with the rest in host b should give the unsplit tokens"
    );
    assert_eq!(
        across["prediction_return"].as_str(),
        Some(bind.as_str()),
        "the tokens should come straight back from the stage in host b: {across}"
    );
    assert!(
        across["tokens_returned_directly"].as_u64() > Some(0),
        "tokens should have come back over the return link: {across}"
    );
    drop(stage);
}
