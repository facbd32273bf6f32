//! Invalid configuration fails at build naming the field and the limit; an address in use names the address.

use std::time::Duration;

use net_io_blocking::{
    ConnectionInfo, HandlerDriver, Limits, NetError, ServerBuilder, TcpConnection,
};
use net_io_core::ConfigError;

fn noop(connection: &mut TcpConnection<'_>) -> Result<(), NetError> {
    let _ = connection;
    Ok(())
}

fn build_error(builder: ServerBuilder) -> NetError {
    builder
        .handler(noop)
        .allow_all()
        .build()
        .expect_err("the configuration should be rejected")
}

#[test]
fn zero_workers_is_rejected_naming_the_field() {
    let error = build_error(ServerBuilder::new().listen("127.0.0.1:0").workers(0));
    insta::assert_snapshot!("zero_workers", error.to_string());
}

#[test]
fn coroutine_handlers_over_zero_loops_are_rejected_naming_the_field() {
    let error = build_error(
        ServerBuilder::new()
            .listen("127.0.0.1:0")
            .handler_driver(HandlerDriver::Coroutines { loops: 0 }),
    );
    insta::assert_snapshot!("zero_handler_loops", error.to_string());
}

#[test]
fn a_server_without_listeners_is_rejected() {
    let error = build_error(ServerBuilder::new());
    insta::assert_snapshot!("no_listeners", error.to_string());
}

#[test]
fn a_per_listener_cap_above_the_global_cap_is_rejected() {
    let error = build_error(
        ServerBuilder::new()
            .listen("127.0.0.1:0")
            .workers(4)
            .limits(Limits::new().max_connections(4).max_per_listener(8)),
    );
    insta::assert_snapshot!("per_listener_above_global", error.to_string());
}

#[test]
fn a_deadline_shorter_than_the_tick_is_rejected() {
    let error = build_error(
        ServerBuilder::new()
            .listen("127.0.0.1:0")
            .workers(2)
            .limits(Limits::new().idle_timeout(Duration::from_millis(1))),
    );
    insta::assert_snapshot!("idle_below_tick", error.to_string());
}

#[test]
fn zero_accept_batch_is_rejected() {
    let error = build_error(
        ServerBuilder::new()
            .listen("127.0.0.1:0")
            .workers(2)
            .limits(Limits::new().accept_batch(0)),
    );
    insta::assert_snapshot!("zero_accept_batch", error.to_string());
}

#[test]
fn a_connection_cap_beyond_the_descriptor_limit_names_have_and_need() {
    let error = build_error(
        ServerBuilder::new()
            .listen("127.0.0.1:0")
            .workers(2)
            .limits(Limits::new().max_connections(1 << 40)),
    );
    let NetError::InvalidConfig(ConfigError::DescriptorLimit { have, need }) = error else {
        panic!("expected a descriptor budget error, got {error}");
    };
    assert!(need > have, "need {need} should exceed have {have}");
    assert!(error_text(have, need).contains("RLIMIT_NOFILE"));
}

fn error_text(have: u64, need: u64) -> String {
    NetError::InvalidConfig(ConfigError::DescriptorLimit { have, need }).to_string()
}

#[test]
fn an_address_in_use_names_the_address_and_the_remedy() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = taken.local_addr().unwrap();
    let error = ServerBuilder::new()
        .listen(address)
        .workers(1)
        .sessions(|_info: &ConnectionInfo| None::<NeverSession>)
        .allow_all()
        .build()
        .expect_err("the port is taken");
    assert!(
        matches!(error, NetError::AddressInUse { .. }),
        "got {error:?}"
    );
    let text = error
        .to_string()
        .replace(&address.port().to_string(), "PORT");
    insta::assert_snapshot!("address_in_use", text);
}

struct NeverSession;

impl net_io_blocking::Session for NeverSession {
    fn on_data(
        &mut self,
        _input: &mut net_io_blocking::Input<'_>,
        _context: &mut net_io_blocking::SessionContext<'_>,
    ) -> net_io_blocking::Step {
        net_io_blocking::Step::Abort
    }
}
