//! Running out of descriptors for real: a server under a low `RLIMIT_NOFILE` sheds, then recovers.
//!
//! The server runs in a child process (this same test binary, re-run with an environment variable) so that
//! the lowered limit binds only the server, while the clients in this process keep the normal limit.
//!
//! ```text
//!   parent (normal limit)                       child (RLIMIT_NOFILE = open + SPARE)
//!   spawn ─────────────────────────────────────> build server, lower the limit, print `listening on ADDR`
//!   connect, round trip, keep open ... ───────> accepts until accept4 fails with EMFILE, then sheds
//!   `stats` ──────────────────────────────────> prints `stats descriptor_pressure=N ...`
//!   close every connection, connect again ────> served again
//!   close stdin ──────────────────────────────> shuts down, exits 0
//! ```

#![deny(unsafe_code)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Stdio;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use net_io_blocking::ServerBuilder;
use net_io_sys::rlimit::{self, ResourceLimit};

use common::echo::echo;
use common::{child, open_descriptors};

/// Set in the child's environment; the child runs the server instead of the clients.
const CHILD_VARIABLE: &str = "NET_IO_BLOCKING_EMFILE_CHILD";

/// Descriptors the child may open beyond those open once its server is running.
const SPARE_DESCRIPTORS: u64 = 8;

/// More connections than this without a shed means the limit did not bite.
const MOST_CONNECTIONS: usize = 200;

/// The child: a server with plenty of workers, under a descriptor limit just above what it holds.
fn run_child() {
    let server = ServerBuilder::new()
        .listen("127.0.0.1:0")
        .workers(64)
        .handler(echo)
        .allow_all()
        .build()
        .expect("the child's server did not start");
    let limit = rlimit::descriptor_limit().expect("could not read RLIMIT_NOFILE");
    let low = open_descriptors() + SPARE_DESCRIPTORS;
    rlimit::set_descriptor_limit(ResourceLimit {
        soft: low,
        hard: limit.hard,
    })
    .expect("could not lower RLIMIT_NOFILE");
    println!("listening on {}", server.local_addr());
    let stdin = std::io::stdin();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        if line == "stats" {
            let stats = server.stats();
            println!(
                "stats descriptor_pressure={} accepted={} refused={} closed={} open={}",
                stats.descriptor_pressure, stats.accepted, stats.refused, stats.closed, stats.open
            );
        }
    }
    let _ = server.shutdown(Instant::now() + Duration::from_secs(2));
}

/// Connects and does one round trip; `None` when the server shed or did not serve the connection.
fn served_connection(address: SocketAddr) -> Option<TcpStream> {
    let mut stream = TcpStream::connect_timeout(&address, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    stream.write_all(b"ping").ok()?;
    let mut echo = [0_u8; 4];
    stream.read_exact(&mut echo).ok()?;
    (&echo == b"ping").then_some(stream)
}

/// Waits up to `timeout` for a stdout line of the child holding `marker`; returns the text from the marker on.
///
/// The marker may sit mid-line: libtest prints `test NAME ... ` without a newline before the test's output.
fn line_from(lines: &mpsc::Receiver<String>, marker: &str, timeout: Duration) -> String {
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                if let Some(start) = line.find(marker) {
                    return line[start..].to_owned();
                }
            }
            Err(error) => panic!("the child printed no `{marker}` line: {error}"),
        }
    }
}

fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .filter_map(|word| word.split_once('='))
        .find(|(name, _)| *name == key)
        .and_then(|(_, value)| value.parse().ok())
        .unwrap_or_else(|| panic!("no number for `{key}` in `{line}`"))
}

#[test]
fn a_server_out_of_descriptors_sheds_then_serves_again_once_clients_close() {
    if child::is_child(CHILD_VARIABLE) {
        run_child();
        return;
    }
    let mut child = child::rerun(
        "a_server_out_of_descriptors_sheds_then_serves_again_once_clients_close",
        CHILD_VARIABLE,
    )
    .stdin(Stdio::piped())
    .stdout(Stdio::piped())
    .spawn()
    .expect("could not start the child server");
    let stdout = child.stdout.take().expect("the child has no stdout");
    let mut stdin = child.stdin.take().expect("the child has no stdin");
    let (sender, lines) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                return;
            }
        }
    });
    let listening = line_from(&lines, "listening on ", Duration::from_secs(30));
    let address: SocketAddr = listening
        .trim_start_matches("listening on ")
        .parse()
        .expect("the child printed a bad address");

    let mut held = Vec::new();
    let shed = loop {
        match served_connection(address) {
            Some(stream) => held.push(stream),
            None => break true,
        }
        if held.len() >= MOST_CONNECTIONS {
            break false;
        }
    };
    assert!(
        shed,
        "{MOST_CONNECTIONS} connections were all served under a limit of {SPARE_DESCRIPTORS} spare descriptors"
    );
    assert!(
        !held.is_empty(),
        "not one connection was served before the descriptor limit bit"
    );

    writeln!(stdin, "stats").expect("could not ask the child for stats");
    let stats = line_from(&lines, "stats ", Duration::from_secs(10));
    assert!(
        field(&stats, "descriptor_pressure") >= 1,
        "the server hit the descriptor limit but counted no descriptor pressure: {stats}"
    );

    let served_before = held.len();
    println!("{served_before} connections served before the shed; child: {stats}");
    drop(held);
    let deadline = Instant::now() + Duration::from_secs(10);
    let recovered = loop {
        if let Some(stream) = served_connection(address) {
            break Some(stream);
        }
        if Instant::now() >= deadline {
            break None;
        }
        thread::sleep(Duration::from_millis(50));
    };
    assert!(
        recovered.is_some(),
        "after the {served_before} served clients closed, a new connection was still not served within 10 s"
    );
    drop(recovered);

    drop(stdin);
    let Some(status) = child::exit_within(&mut child, Duration::from_secs(10)) else {
        panic!("the child server did not exit within 10 s of its stdin closing");
    };
    assert!(status.success(), "the child server exited with {status}");
}
