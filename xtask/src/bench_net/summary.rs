//! Medians over the rounds of each kind, and the one-line summary of a round printed as it ends.

use super::{ChurnResult, EchoResult, KindRound, OpenResult, Options};
use crate::figures::median;

pub(super) fn summarise(round: &KindRound, options: &Options) -> String {
    let mut parts = Vec::new();
    for echo in &round.echo {
        parts.push(format!(
            "{}c {:.0} rt/s p50 {:.1} p99 {:.1} us, per rt server {:.1} us {:.2} cs client {:.1} us {:.2} cs, {:.2} cores",
            echo.connections,
            echo.round_trips_per_second,
            echo.p50_microseconds,
            echo.p99_microseconds,
            echo.server_cpu_microseconds_per_round_trip,
            echo.server_context_switches_per_round_trip,
            echo.client_cpu_microseconds_per_round_trip,
            echo.client_context_switches_per_round_trip,
            echo.cores_busy,
        ));
    }
    if let Some(open) = &round.open {
        parts.push(format!(
            "open {:.0}/s p50 {:.1} p99 {:.1} p99.9 {:.1} us, unanswered {}, behind {:.0} us, server {:.1} us/msg",
            open.sent_per_second,
            open.p50_microseconds,
            open.p99_microseconds,
            open.p999_microseconds,
            open.unanswered,
            open.behind_max_microseconds,
            open.server_cpu_microseconds_per_message,
        ));
    }
    if options.idle {
        parts.push(format!(
            "idle {:.1} KiB/conn ({:.1} whole)",
            round.idle_bytes_per_connection / 1024.0,
            round.idle_total_bytes_per_connection / 1024.0,
        ));
    }
    if options.churn {
        parts.push(format!(
            "paced churn {:.0}/s (server {:.0}/s) stalled {} overflows {} p99 {:.0} us; saturated churn \
             {:.0}/s (server {:.0}/s) stalled {} overflows {}",
            round.churn_paced.per_second,
            round.churn_paced.server_accepts_per_second,
            round.churn_paced.stalled,
            round.churn_paced.listen_overflows,
            round.churn_paced.p99_microseconds,
            round.churn_saturated.per_second,
            round.churn_saturated.server_accepts_per_second,
            round.churn_saturated.stalled,
            round.churn_saturated.listen_overflows,
        ));
    }
    parts.join("; ")
}

/// Medians over the rounds of one kind.
#[derive(Debug, Clone, Default)]
pub(super) struct KindMedians {
    pub(super) echo: Vec<EchoResult>,
    pub(super) open: Option<OpenResult>,
    pub(super) idle_kib_per_connection: f64,
    pub(super) idle_total_kib_per_connection: f64,
    pub(super) idle_served: f64,
    pub(super) churn_paced: ChurnResult,
    pub(super) churn_saturated: ChurnResult,
}

impl KindMedians {
    /// The medians of the echo load at `connections`, if it was measured.
    pub(super) fn echo_at(&self, connections: u32) -> Option<&EchoResult> {
        self.echo
            .iter()
            .find(|echo| echo.connections == connections)
    }
}

pub(super) fn medians(rounds: &[KindRound]) -> KindMedians {
    let of =
        |pick: &dyn Fn(&KindRound) -> f64| median(&rounds.iter().map(pick).collect::<Vec<_>>());
    // Every round measures the same echo loads in the same order, so the first round's list indexes them all.
    let loads = rounds.first().map_or(0, |round| round.echo.len());
    let echo = (0..loads)
        .map(|load| EchoResult {
            connections: rounds[0].echo[load].connections,
            round_trips_per_second: of(&|round| round.echo[load].round_trips_per_second),
            p50_microseconds: of(&|round| round.echo[load].p50_microseconds),
            p99_microseconds: of(&|round| round.echo[load].p99_microseconds),
            server_cpu_microseconds_per_round_trip: of(&|round| {
                round.echo[load].server_cpu_microseconds_per_round_trip
            }),
            server_context_switches_per_round_trip: of(&|round| {
                round.echo[load].server_context_switches_per_round_trip
            }),
            client_context_switches_per_round_trip: of(&|round| {
                round.echo[load].client_context_switches_per_round_trip
            }),
            client_cpu_microseconds_per_round_trip: of(&|round| {
                round.echo[load].client_cpu_microseconds_per_round_trip
            }),
            cores_busy: of(&|round| round.echo[load].cores_busy),
        })
        .collect();
    let open = rounds
        .iter()
        .all(|round| round.open.is_some())
        .then(|| {
            let of_open = |pick: fn(&OpenResult) -> f64| {
                of(&|round| round.open.as_ref().map_or(f64::NAN, pick))
            };
            OpenResult {
                sent_per_second: of_open(|open| open.sent_per_second),
                p50_microseconds: of_open(|open| open.p50_microseconds),
                p99_microseconds: of_open(|open| open.p99_microseconds),
                p999_microseconds: of_open(|open| open.p999_microseconds),
                max_microseconds: of_open(|open| open.max_microseconds),
                unanswered: of_open(|open| open.unanswered),
                behind_max_microseconds: of_open(|open| open.behind_max_microseconds),
                server_cpu_microseconds_per_message: of_open(|open| {
                    open.server_cpu_microseconds_per_message
                }),
                cores_busy: of_open(|open| open.cores_busy),
            }
        })
        .filter(|_| !rounds.is_empty());
    KindMedians {
        echo,
        open,
        idle_kib_per_connection: of(&|round| round.idle_bytes_per_connection) / 1024.0,
        idle_total_kib_per_connection: of(&|round| round.idle_total_bytes_per_connection) / 1024.0,
        idle_served: of(&|round| round.idle_served),
        churn_paced: churn_medians(rounds, |round| &round.churn_paced),
        churn_saturated: churn_medians(rounds, |round| &round.churn_saturated),
    }
}

/// Round trips per second of one kind's echo load at `connections`, round by round.
pub(super) fn echo_rates(rounds: &[KindRound], connections: u32) -> Vec<f64> {
    echo_series(rounds, connections, |echo| echo.round_trips_per_second)
}

/// One figure of one kind's echo load at `connections`, round by round (NaN where a round lacks it).
pub(super) fn echo_series(
    rounds: &[KindRound],
    connections: u32,
    figure: fn(&EchoResult) -> f64,
) -> Vec<f64> {
    rounds
        .iter()
        .map(|round| {
            round
                .echo
                .iter()
                .find(|echo| echo.connections == connections)
                .map_or(f64::NAN, figure)
        })
        .collect()
}

/// Client plus server CPU per round trip: what one round trip cost the machine.
pub(super) fn cpu_per_round_trip(echo: &EchoResult) -> f64 {
    echo.server_cpu_microseconds_per_round_trip + echo.client_cpu_microseconds_per_round_trip
}

/// Picks one of the two churns out of a kind's medians.
pub(super) type ChurnPick = fn(&KindMedians) -> &ChurnResult;

/// Field-by-field medians of one churn over the rounds.
pub(super) fn churn_medians(
    rounds: &[KindRound],
    pick: fn(&KindRound) -> &ChurnResult,
) -> ChurnResult {
    let of = |field: fn(&ChurnResult) -> f64| {
        median(
            &rounds
                .iter()
                .map(|round| field(pick(round)))
                .collect::<Vec<_>>(),
        )
    };
    ChurnResult {
        per_second: of(|churn| churn.per_second),
        stalled: of(|churn| churn.stalled),
        errors: of(|churn| churn.errors),
        p99_microseconds: of(|churn| churn.p99_microseconds),
        slowest_milliseconds: of(|churn| churn.slowest_milliseconds),
        listen_overflows: of(|churn| churn.listen_overflows),
        server_accepts_per_second: of(|churn| churn.server_accepts_per_second),
    }
}
