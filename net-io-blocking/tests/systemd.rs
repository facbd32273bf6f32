//! systemd socket activation for real: each test re-runs this test binary as a child that inherits a real
//! socket on descriptor 3 (and 4) with the `LISTEN_*` variables set, the way systemd starts a service.
//!
//! ```text
//!   parent: make the socket(s) ── spawn sh with socket on stdin (and stderr) ── talk to the socket, read
//!   sh:     exec 3<&0 4<&2 0</dev/null 2>&1; export LISTEN_PID=$$; exec <this test binary> <this test>
//!   child:  the same test, seeing NET_IO_BLOCKING_SYSTEMD_CHILD: adopt, serve or fail, print RESULT lines
//! ```
//!
//! `exec` keeps the shell's pid, so `$$` is the child's own pid, as systemd sets it after its fork.

#![deny(unsafe_code)]

mod common;

use std::env;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::fd::OwnedFd;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use net_io_blocking::systemd::{self, SystemdError};
use net_io_blocking::{
    Admission, CloseReason, ConnectionInfo, Gate, ProxyMode, Refusal, ServerBuilder, TrustedProxies,
};
use net_io_sys::inherit::{self, Unfit};
use std::sync::{Arc, Mutex};

use common::child;
use common::echo::echo;
use common::gates::admit_on_the_default_lane;

/// Set in the child's environment; the child adopts instead of spawning.
const CHILD_VARIABLE: &str = "NET_IO_BLOCKING_SYSTEMD_CHILD";
/// The address the parent's listener is bound to, for the child to compare with what it adopted.
const EXPECTED_VARIABLE: &str = "NET_IO_BLOCKING_SYSTEMD_EXPECTED";
/// How long a child may run before the test gives up on it.
const CHILD_DEADLINE: Duration = Duration::from_secs(60);

/// Whose pid the child's `LISTEN_PID` names.
#[derive(Clone, Copy)]
enum Pid {
    /// The child's own (`$$` before `exec`).
    Own,
    /// Process 1: variables meant for another process.
    Other,
}

/// Starts this test binary running `test` as a child, with `fds` on descriptors 3, 4, ... (at most two)
/// and `variables` set besides `LISTEN_PID`.
fn spawn_child(test: &str, pid: Pid, fds: Vec<OwnedFd>, variables: &[(&str, &str)]) -> Child {
    assert!(fds.len() <= 2, "the shell trick passes at most two fds");
    let mut fds = fds.into_iter();
    let (third, fourth) = (fds.next(), fds.next());
    let mut redirections = String::new();
    if third.is_some() {
        redirections.push_str("3<&0 ");
    }
    if fourth.is_some() {
        redirections.push_str("4<&2 ");
    }
    let pid = match pid {
        Pid::Own => "$$",
        Pid::Other => "1",
    };
    let script =
        format!("exec {redirections}0</dev/null 2>&1; export LISTEN_PID={pid}; exec \"$0\" \"$@\"");
    let mut command = Command::new("/bin/sh");
    command
        .arg("-c")
        .arg(script)
        .arg(child::this_binary())
        .args(child::only_test(test))
        .env_remove("LISTEN_PID")
        .env_remove("LISTEN_PIDFDID")
        .env_remove("LISTEN_FDS")
        .env_remove("LISTEN_FDNAMES")
        .env(CHILD_VARIABLE, "1")
        .stdin(third.map_or_else(Stdio::null, Stdio::from))
        .stdout(Stdio::piped())
        .stderr(fourth.map_or_else(Stdio::null, Stdio::from));
    for (name, value) in variables {
        command.env(name, value);
    }
    command.spawn().expect("could not start the child")
}

/// Waits for the child to exit (killing it past the deadline) and returns its `RESULT` lines.
fn results(child: Child) -> Vec<String> {
    child::result_lines(child, CHILD_DEADLINE)
}

fn activation_variables_left() -> Vec<&'static str> {
    ["LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"]
        .into_iter()
        .filter(|name| env::var_os(name).is_some())
        .collect()
}

/// Whether descriptor `fd` of this process is closed, open and close-on-exec, or open and inheritable, from
/// `/proc/self/fdinfo`: its `flags` carry `O_CLOEXEC` exactly when the descriptor is close-on-exec.
fn descriptor_state(fd: i32) -> String {
    let Ok(info) = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")) else {
        return "closed".to_owned();
    };
    let flags = info
        .lines()
        .find_map(|line| line.strip_prefix("flags:"))
        .and_then(|flags| u32::from_str_radix(flags.trim(), 8).ok());
    match flags {
        Some(flags) if flags & libc::O_CLOEXEC as u32 != 0 => "cloexec".to_owned(),
        Some(_) => "inheritable".to_owned(),
        None => format!("unreadable flags in {info:?}"),
    }
}

/// The descriptors among `3 .. 3 + passed` that a child started now would inherit: the leak a failed
/// adoption must not leave.
fn inherited_by_a_child(passed: i32) -> Vec<i32> {
    let script = format!(
        "fd=3; while [ $fd -lt {} ]; do [ -e /proc/$$/fd/$fd ] && echo $fd; fd=$((fd+1)); done; true",
        3 + passed
    );
    let grandchild = Command::new("/bin/sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("could not start a shell to look at inherited descriptors");
    let output = child::output_within(grandchild, CHILD_DEADLINE);
    assert!(
        output.status.success(),
        "the shell listing descriptors failed: {}",
        output.status
    );
    let listed = String::from_utf8_lossy(&output.stdout);
    listed
        .lines()
        .filter_map(|line| line.trim().parse().ok())
        .collect()
}

/// The child's side of a failing adoption: the error text, whether the variables were left, and what became
/// of the `passed` descriptors (fds 3, 4, ...): left where they were but close-on-exec, so no child of ours
/// inherits them.
fn report_failed_adoption(passed: i32) {
    let error = systemd::listeners().expect_err("the adoption should have failed");
    println!("RESULT error {error}");
    println!("RESULT left {:?}", activation_variables_left());
    // All or nothing: fd 3 is still where it was, not taken.
    let fd3 = match inherit::check_listener(3) {
        Ok(_) => "listener".to_string(),
        Err(problem) => problem.to_string(),
    };
    println!("RESULT fd3 {fd3}");
    if let SystemdError::Unfit { fd, .. } = error {
        println!("RESULT unfit fd {fd}");
    }
    for fd in 3..3 + passed {
        println!("RESULT fd{fd} is {}", descriptor_state(fd));
    }
    println!("RESULT a child inherits {:?}", inherited_by_a_child(passed));
}

fn listening_socket() -> (TcpListener, String) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the socket to pass on");
    let address = listener.local_addr().unwrap().to_string();
    (listener, address)
}

#[test]
fn an_adopted_listener_serves_and_the_variables_are_cleared() {
    if child::is_child(CHILD_VARIABLE) {
        let builder = ServerBuilder::new()
            .systemd()
            .expect("the child could not adopt its listener");
        println!("RESULT left {:?}", activation_variables_left());
        println!(
            "RESULT again {}",
            systemd::listeners().map_or(usize::MAX, |listeners| listeners.len())
        );
        println!(
            "RESULT retake {}",
            matches!(inherit::take_listener(3), Err(Unfit::AlreadyTaken))
        );
        let server = builder
            .workers(2)
            .handler(echo)
            .allow_all()
            .build()
            .expect("the child's server did not start");
        let expected = env::var(EXPECTED_VARIABLE).unwrap_or_default();
        println!(
            "RESULT address {}",
            server.local_addr() == expected.parse().unwrap()
        );
        let end = Instant::now() + Duration::from_secs(20);
        while server.stats().closed == 0 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        println!("RESULT closed {}", server.stats().closed);
        return;
    }
    let (listener, address) = listening_socket();
    let child = spawn_child(
        "an_adopted_listener_serves_and_the_variables_are_cleared",
        Pid::Own,
        vec![OwnedFd::from(listener)],
        &[
            ("LISTEN_FDS", "1"),
            ("LISTEN_FDNAMES", "web"),
            (EXPECTED_VARIABLE, &address),
        ],
    );
    // The parent no longer holds the socket: whatever answers is the child that adopted it.
    let mut stream = TcpStream::connect(&address).expect("connect to the adopted listener");
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    stream.write_all(b"hello").unwrap();
    let mut echoed = [0_u8; 5];
    stream
        .read_exact(&mut echoed)
        .expect("the adopted listener did not answer");
    assert_eq!(&echoed, b"hello", "the adopted listener echoed wrongly");
    drop(stream);
    assert_eq!(
        results(child),
        [
            "left []",
            "again 0",
            "retake true",
            "address true",
            "closed 1"
        ],
        "the child did not adopt once, clear the variables, listen on the passed address and serve"
    );
}

#[test]
fn variables_meant_for_another_process_are_ignored() {
    if child::is_child(CHILD_VARIABLE) {
        let adopted = systemd::listeners().expect("variables of another process are no error");
        println!("RESULT adopted {}", adopted.len());
        println!("RESULT left {:?}", activation_variables_left());
        println!("RESULT fd3 {}", inherit::check_listener(3).is_ok());
        return;
    }
    let (listener, _) = listening_socket();
    let child = spawn_child(
        "variables_meant_for_another_process_are_ignored",
        Pid::Other,
        vec![OwnedFd::from(listener)],
        &[("LISTEN_FDS", "1")],
    );
    assert_eq!(
        results(child),
        [
            "adopted 0",
            "left [\"LISTEN_PID\", \"LISTEN_FDS\"]",
            "fd3 true"
        ],
        "a LISTEN_PID of another process was acted on (or its variables were touched)"
    );
}

#[test]
fn an_fd_that_is_not_a_listener_is_refused_by_number_and_name() {
    if child::is_child(CHILD_VARIABLE) {
        report_failed_adoption(2);
        return;
    }
    let (listener, _) = listening_socket();
    let (other, other_address) = listening_socket();
    // fd 4 is a connected socket: a stream, but not listening.
    let connected = TcpStream::connect(&other_address).unwrap();
    let child = spawn_child(
        "an_fd_that_is_not_a_listener_is_refused_by_number_and_name",
        Pid::Own,
        vec![OwnedFd::from(listener), OwnedFd::from(connected)],
        &[("LISTEN_FDS", "2"), ("LISTEN_FDNAMES", "web:admin")],
    );
    let lines = results(child);
    drop(other);
    insta::assert_snapshot!("not_a_listener", lines.join("\n"));
}

#[test]
fn a_file_passed_as_a_socket_is_refused() {
    if child::is_child(CHILD_VARIABLE) {
        report_failed_adoption(1);
        return;
    }
    let file = std::fs::File::open("/dev/null").unwrap();
    let child = spawn_child(
        "a_file_passed_as_a_socket_is_refused",
        Pid::Own,
        vec![OwnedFd::from(file)],
        &[("LISTEN_FDS", "1")],
    );
    insta::assert_snapshot!("not_a_socket", results(child).join("\n"));
}

#[test]
fn a_count_above_the_limit_is_refused() {
    if child::is_child(CHILD_VARIABLE) {
        report_failed_adoption(1);
        return;
    }
    let (listener, _) = listening_socket();
    let child = spawn_child(
        "a_count_above_the_limit_is_refused",
        Pid::Own,
        vec![OwnedFd::from(listener)],
        &[("LISTEN_FDS", "65")],
    );
    insta::assert_snapshot!("too_many", results(child).join("\n"));
}

#[test]
fn names_that_do_not_match_the_count_are_refused() {
    if child::is_child(CHILD_VARIABLE) {
        report_failed_adoption(1);
        return;
    }
    let (listener, _) = listening_socket();
    let child = spawn_child(
        "names_that_do_not_match_the_count_are_refused",
        Pid::Own,
        vec![OwnedFd::from(listener)],
        &[("LISTEN_FDS", "1"), ("LISTEN_FDNAMES", "web:admin")],
    );
    insta::assert_snapshot!("name_count", results(child).join("\n"));
}

#[test]
fn a_pidfd_id_of_another_process_is_ignored_even_with_our_pid() {
    if child::is_child(CHILD_VARIABLE) {
        let adopted = systemd::listeners().expect("variables of another process are no error");
        println!("RESULT adopted {}", adopted.len());
        println!("RESULT fd3 {}", inherit::check_listener(3).is_ok());
        return;
    }
    let (listener, _) = listening_socket();
    // No pidfd has inode 1 (the pidfs root holds it), so this names a process that reused our pid.
    let child = spawn_child(
        "a_pidfd_id_of_another_process_is_ignored_even_with_our_pid",
        Pid::Own,
        vec![OwnedFd::from(listener)],
        &[("LISTEN_FDS", "1"), ("LISTEN_PIDFDID", "1")],
    );
    assert_eq!(
        results(child),
        ["adopted 0", "fd3 true"],
        "a LISTEN_PIDFDID of another process was acted on"
    );
}

/// Refuses one real client behind the proxy and remembers every close reason.
#[derive(Clone, Default)]
struct BlockOne {
    closes: Arc<Mutex<Vec<&'static str>>>,
}

impl Gate for BlockOne {
    type Ticket = ();

    fn admit(&self, _info: &ConnectionInfo) -> Result<Admission<()>, Refusal> {
        admit_on_the_default_lane()
    }

    fn readmit(&self, _ticket: &mut (), info: &ConnectionInfo) -> Result<(), Refusal> {
        if info.client_addr().ip().to_string() == "203.0.113.66" {
            return Err(Refusal::Reset { code: 3 });
        }
        Ok(())
    }

    fn closed(&self, _ticket: (), _info: &ConnectionInfo, reason: CloseReason) {
        self.closes
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push(reason.as_str());
    }
}

#[test]
fn an_adopted_listener_takes_its_own_proxy_settings_and_the_gate_readmits_behind_it() {
    if child::is_child(CHILD_VARIABLE) {
        let mut inherited = systemd::listeners().expect("the child could not adopt its listener");
        let inherited = inherited.pop().expect("no listener was passed");
        let gate = BlockOne::default();
        let server = ServerBuilder::new()
            .adopt_with(inherited, |spec| {
                spec.proxy(
                    ProxyMode::V1,
                    TrustedProxies::parse(&["127.0.0.1/32"]).unwrap(),
                )
            })
            .workers(2)
            .handler(echo)
            .gate(gate.clone())
            .build()
            .expect("the child's server did not start");
        let end = Instant::now() + Duration::from_secs(20);
        while server.stats().closed < 2 && Instant::now() < end {
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut closes = gate.closes.lock().unwrap().clone();
        closes.sort_unstable();
        println!("RESULT closes {closes:?}");
        return;
    }
    let (listener, address) = listening_socket();
    let port = listener.local_addr().unwrap().port();
    let child = spawn_child(
        "an_adopted_listener_takes_its_own_proxy_settings_and_the_gate_readmits_behind_it",
        Pid::Own,
        vec![OwnedFd::from(listener)],
        &[("LISTEN_FDS", "1")],
    );
    let mut kept = TcpStream::connect(&address).expect("connect to the adopted listener");
    kept.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    kept.write_all(format!("PROXY TCP4 198.51.100.9 127.0.0.1 6000 {port}\r\nhello").as_bytes())
        .unwrap();
    let mut echoed = [0_u8; 5];
    kept.read_exact(&mut echoed)
        .expect("the adopted PROXY listener did not serve a kept client");
    assert_eq!(
        &echoed, b"hello",
        "the bytes after the header were not echoed"
    );
    drop(kept);
    let mut refused = TcpStream::connect(&address).expect("connect to the adopted listener");
    refused
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    refused
        .write_all(format!("PROXY TCP4 203.0.113.66 127.0.0.1 5000 {port}\r\nhello").as_bytes())
        .unwrap();
    let mut byte = [0_u8; 1];
    assert!(
        !matches!(refused.read(&mut byte), Ok(count) if count > 0),
        "a client the gate refused at readmit was served"
    );
    assert_eq!(
        results(child),
        ["closes [\"peer_closed\", \"refused_gate\"]"],
        "the adopted listener did not require PROXY or the gate did not readmit behind it"
    );
}
