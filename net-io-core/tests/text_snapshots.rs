//! Pins the stable names and human-readable texts: every close-reason name and every error message.
//!
//! Changing one of these is a visible change for logs, dashboards and users; the snapshot diff makes it
//! deliberate. Snapshots live in `tests/snapshots/`.

use std::fmt::Write as _;
use std::io;
use std::time::Duration;

use net_io_core::addr::{Cidr, CidrError};
use net_io_core::buffer::{BudgetExhausted, SizeClass};
use net_io_core::close::{
    CloseReason, Direction, LimitKind, OsErrorClass, RefusalCause, TimeoutKind,
};
use net_io_core::completion::PostError;
use net_io_core::error::NetError;
use net_io_core::id::ListenerId;
use net_io_core::limits::ConfigError;
use net_io_core::output::OutputFull;
use net_io_core::proxy::ProxyError;

/// Every close reason, with every payload of the small enums spelled out.
fn every_close_reason() -> Vec<CloseReason> {
    let mut reasons = Vec::new();
    for reason in CloseReason::ALL {
        match reason {
            CloseReason::SlowPeer { .. } => {
                for direction in [Direction::In, Direction::Out] {
                    reasons.push(CloseReason::SlowPeer { direction });
                }
            }
            CloseReason::Refused(_) => {
                reasons.extend(
                    RefusalCause::ALL
                        .iter()
                        .map(|&cause| CloseReason::Refused(cause)),
                );
            }
            CloseReason::Limit(_) => {
                reasons.extend(LimitKind::ALL.iter().map(|&kind| CloseReason::Limit(kind)));
            }
            CloseReason::Io(_) => {
                reasons.extend(
                    OsErrorClass::ALL
                        .iter()
                        .map(|&class| CloseReason::Io(class)),
                );
            }
            other => reasons.push(other),
        }
    }
    reasons
}

#[test]
fn close_reason_names_are_stable() {
    let mut text = String::new();
    for reason in every_close_reason() {
        let style = if reason.is_abortive() {
            "abortive"
        } else {
            "graceful"
        };
        writeln!(text, "{:<28} {style}", reason.as_str()).unwrap();
    }
    insta::assert_snapshot!("close_reason_names", text);
}

#[test]
fn close_reason_names_are_unique_snake_case() {
    let reasons = every_close_reason();
    let mut names: Vec<&str> = reasons.iter().map(|reason| reason.as_str()).collect();
    for name in &names {
        assert!(
            name.bytes()
                .all(|byte| byte.is_ascii_lowercase() || byte == b'_'),
            "{name} is not snake_case"
        );
    }
    let count = names.len();
    names.sort_unstable();
    names.dedup();
    assert_eq!(names.len(), count, "two close reasons share a name");
}

#[test]
fn other_vocabulary_names_are_stable() {
    let mut text = String::new();
    for cause in RefusalCause::ALL {
        writeln!(text, "refusal {}", cause.as_str()).unwrap();
    }
    for kind in LimitKind::ALL {
        writeln!(text, "limit   {}", kind.as_str()).unwrap();
    }
    for kind in TimeoutKind::ALL {
        writeln!(text, "timeout {} -> {}", kind.as_str(), kind.close_reason()).unwrap();
    }
    for class in OsErrorClass::ALL {
        writeln!(text, "os      {}", class.as_str()).unwrap();
    }
    insta::assert_snapshot!("vocabulary_names", text);
}

#[test]
fn handler_stack_hints_are_stable() {
    let mut text = String::new();
    for (name, errno) in [("ENOMEM", libc::ENOMEM), ("EAGAIN", libc::EAGAIN)] {
        writeln!(text, "{name}: {}", net_io_core::handler_stack_hint(errno)).unwrap();
    }
    insta::assert_snapshot!("handler_stack_hints", text);
}

#[test]
fn net_error_texts_are_stable() {
    let address = "127.0.0.1:7000".parse().unwrap();
    let errors = [
        NetError::AddressInUse { address },
        NetError::AddressNotAvailable {
            address: "[2001:db8::1]:443".parse().unwrap(),
        },
        NetError::PermissionDenied {
            address: "0.0.0.0:80".parse().unwrap(),
        },
        NetError::InvalidConfig(ConfigError::Zero { field: "workers" }),
        NetError::Timeout(TimeoutKind::Handshake),
        NetError::Closed(CloseReason::Killed(7)),
        NetError::OutputFull(OutputFull { budget: 65_536 }),
        NetError::Proxy(ProxyError::V1TooLong),
        NetError::ShuttingDown,
        NetError::ServerStopped,
        NetError::UnknownListener {
            listener: ListenerId(9),
        },
        NetError::WrongSessionType {
            expected: "stage_server::serve::LinkSession",
            given: "alloc::string::String",
        },
        NetError::ConnectionCap { cap: 1024 },
        NetError::from(io::Error::from_raw_os_error(libc_errno::EMFILE)),
        NetError::from(io::Error::from_raw_os_error(libc_errno::ECONNRESET)),
        NetError::from(io::Error::other("custom failure")),
    ];
    let mut text = String::new();
    for error in errors {
        writeln!(text, "{:?} | {error}", error.class()).unwrap();
    }
    insta::assert_snapshot!("net_error_texts", text);
}

#[test]
fn config_error_texts_are_stable() {
    let errors = [
        ConfigError::Zero {
            field: "accept_batch",
        },
        ConfigError::TooLarge {
            field: "proxy_header_max",
            value: 70_000,
            max: 65_519,
        },
        ConfigError::TooSmall {
            field: "read_buffer_max",
            value: 4096,
            min: 16_384,
        },
        ConfigError::AboveGlobal {
            field: "max_per_listener",
            value: 200,
            global: 128,
        },
        ConfigError::BelowTick {
            field: "idle_timeout",
            value: Duration::from_millis(5),
            tick: Duration::from_millis(10),
        },
        ConfigError::WindowBelowCheck {
            window: Duration::from_millis(100),
            check: Duration::from_millis(200),
        },
        ConfigError::BudgetBelowWorkers {
            have: 1 << 20,
            need: 16 << 20,
        },
        ConfigError::DescriptorLimit {
            have: 1024,
            need: 1304,
        },
    ];
    let text: String = errors.iter().map(|error| format!("{error}\n")).collect();
    insta::assert_snapshot!("config_error_texts", text);
}

#[test]
fn parser_and_resource_error_texts_are_stable() {
    let mut text = String::new();
    let proxy_errors = [
        ProxyError::NotProxy,
        ProxyError::V1TooLong,
        ProxyError::V1Malformed("the line does not end in CRLF"),
        ProxyError::UnsupportedVersion(3),
        ProxyError::UnsupportedCommand(2),
        ProxyError::UnsupportedFamily(0x41),
        ProxyError::BodyTooLarge {
            length: 2000,
            max: 1024,
        },
        ProxyError::AddressTooShort {
            length: 4,
            need: 12,
        },
        ProxyError::TlvMalformed,
        ProxyError::ChecksumMismatch,
    ];
    for error in proxy_errors {
        writeln!(text, "{error}").unwrap();
    }
    for input in ["10.0.0.1/8", "10.0.0.0/33", "ten/8"] {
        writeln!(text, "{}", input.parse::<Cidr>().unwrap_err()).unwrap();
    }
    writeln!(
        text,
        "{}",
        CidrError::TooManyBlocks {
            count: 2000,
            max: 1024
        }
    )
    .unwrap();
    writeln!(
        text,
        "{}",
        BudgetExhausted {
            class: SizeClass::Large,
            budget: 1 << 20
        }
    )
    .unwrap();
    writeln!(text, "{}", PostError::Full).unwrap();
    writeln!(text, "{}", PostError::Closed).unwrap();
    insta::assert_snapshot!("parser_and_resource_error_texts", text);
}

/// The two errno values the snapshots use, spelled out so the test needs no libc dependency.
mod libc_errno {
    pub const EMFILE: i32 = 24;
    pub const ECONNRESET: i32 = 104;
}
