//! Property test for the minimum rate: a steady trickle well above the floor is never flagged, one well below always is.

use std::time::{Duration, Instant};

use net_io_core::limits::MinRateRule;
use net_io_core::rate::{MinRate, RateVerdict};
use proptest::prelude::*;

/// Sends `bytes_per_tick` every `tick` for `total` while the driver checks every `rule.check`, as a worker
/// does; returns when the peer was flagged. Time moves in 1 ms steps.
fn run(
    rule: MinRateRule,
    tick: Duration,
    bytes_per_tick: u64,
    total: Duration,
) -> Option<Duration> {
    let start = Instant::now();
    let mut rate = MinRate::new(rule);
    rate.start(start);
    let step = Duration::from_millis(1);
    let mut elapsed = Duration::ZERO;
    let mut next_send = tick;
    let mut next_check = rule.check;
    while elapsed <= total {
        elapsed += step;
        let now = start + elapsed;
        if elapsed >= next_send {
            rate.record(now, bytes_per_tick);
            next_send += tick;
        }
        if elapsed >= next_check {
            next_check += rule.check;
            if rate.check(now) == RateVerdict::TooSlow {
                return Some(elapsed);
            }
        }
    }
    None
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn a_trickle_at_twice_the_floor_is_never_too_slow(
        floor in 100u64..10_000,
        check_ms in 10u64..500,
        buckets in 1u64..20,
        grace_checks in 1u64..10,
        tick_ms in 1u64..50,
    ) {
        let rule = MinRateRule {
            bytes_per_second: floor,
            window: Duration::from_millis(check_ms * buckets),
            grace: Duration::from_millis(check_ms * grace_checks),
            check: Duration::from_millis(check_ms),
        };
        // Bytes per tick for at least twice the floor, rounded up so short ticks still send something.
        let bytes = (2 * floor * tick_ms).div_ceil(1000).max(1);
        // A window judges the bytes inside it, so it must hold several sends (plus one bucket of
        // granularity), and the grace must cover the first send.
        prop_assume!(rule.window >= Duration::from_millis(4 * tick_ms) + rule.check);
        prop_assume!(rule.grace >= Duration::from_millis(2 * tick_ms));
        let flagged = run(rule, Duration::from_millis(tick_ms), bytes, rule.grace + rule.window * 3);
        prop_assert_eq!(flagged, None, "a peer at twice the floor was flagged");
    }

    #[test]
    fn a_trickle_at_half_the_floor_is_too_slow_within_grace_plus_window(
        floor in 1000u64..10_000,
        check_ms in 10u64..500,
        buckets in 1u64..20,
        grace_checks in 1u64..10,
        tick_ms in 1u64..50,
    ) {
        let rule = MinRateRule {
            bytes_per_second: floor,
            window: Duration::from_millis(check_ms * buckets),
            grace: Duration::from_millis(check_ms * grace_checks),
            check: Duration::from_millis(check_ms),
        };
        let bytes = floor * tick_ms / 2000;
        let deadline = rule.grace + rule.window + rule.check + Duration::from_millis(tick_ms);
        let flagged = run(rule, Duration::from_millis(tick_ms), bytes, deadline);
        prop_assert!(flagged.is_some(), "a peer at half the floor was never flagged");
        prop_assert!(flagged.unwrap() >= rule.grace, "flagged inside the grace period");
    }
}
