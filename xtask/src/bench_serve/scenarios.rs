//! The shaped scenarios of `cargo xtask bench serve`: prefix reuse (a long system prompt sent cold, then again
//! with another user message) and admission under load (a long prompt posted while three streams decode),
//! with their reductions to figures and their report sections.
//!
//! ```text
//!   prefix:     cold(system 1, question A) -> repeat(system 1, question B) -> cold(system 2, ...) -> ...
//!               one request at a time; each repeat may reuse its cold request's cached system prompt
//!
//!   admission:  phase A   stream 1 ══════════════════════>    phase B   stream 4 ═════════════════════>
//!                         stream 2 ══════════════════════>              stream 5 ═════════════════════>
//!                         stream 3 ══════════════════════>              stream 6 ═════════════════════>
//!                                                                           late ──prefill──═══>
//!                                                        (posted once streams 4 to 6 all had content)
//! ```
//!
//! Every prompt here is new to the server (a session or worker number no load level uses opens it), so the
//! only cache hits are the ones the prefix scenario sets up.

use std::fmt::Write as _;
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Result;

use super::client::{self, Load, RequestRecord, percentile};
use super::{Server, ServerResult, one_minute_load};

/// Cold and repeat pairs of the prefix scenario, each with its own system prompt.
const PREFIX_PAIRS: usize = 3;
/// Words of each prefix system prompt: about 1,000 tokens for the SmolLM2 and Gemma 3 tokenizers.
const PREFIX_WORDS: usize = 750;
/// `max_tokens` of the prefix requests and of the late request: enough for a first token and a few more.
const SHORT_MAX_TOKENS: usize = 16;
/// The user message of each pair's first request.
const COLD_QUESTION: &str = "Summarise the rules above in one sentence.";
/// The user message of each pair's second request: different, so only the system prompt is shared.
const REPEAT_QUESTION: &str = "Which of the rules above matters most, and why?";
/// Streams decoding in each admission phase.
const ADMISSION_STREAMS: usize = 3;
/// `max_tokens` of the admission streams: long enough that the late request's prefill lands mid-stream.
const ADMISSION_STREAM_TOKENS: usize = 192;
/// Words of the late request's user prompt: about 512 tokens for these tokenizers.
const LATE_WORDS: usize = 384;
/// The first worker number of the admission streams' prompts; the load levels use 0 to C-1 and the warm-up
/// 1000, so none of these prompts was seen before.
const ADMISSION_WORKER: usize = 2000;
/// The issue's target for prefix reuse: repeat TTFT at most this fraction of cold TTFT.
const PREFIX_TARGET: f64 = 0.2;
/// The issue's target for admission: ITL p99 with the late request at most this multiple of without it.
const ADMISSION_TARGET: f64 = 2.0;

/// Varied English sentences the long prompts are built from, so they tokenize like ordinary prose (a
/// repeated word would tokenize unusually well). Together they hold more words than one system prompt
/// needs, so no sentence repeats inside one.
const SENTENCES: [&str; 56] = [
    "Answer every question as plainly as you can, and prefer short words to long ones.",
    "When a visitor asks about opening hours, remind them that the library closes early on public holidays.",
    "Never invent a reference; if you do not know the source of a claim, say so and suggest where to look.",
    "The reading room on the second floor is kept quiet, so phone calls belong in the hallway by the stairs.",
    "Children under twelve may borrow up to six books at a time, and their cards are renewed every spring.",
    "If someone reports a damaged book, thank them, note the title and shelf mark, and pass it to the desk.",
    "Old newspapers are stored on microfilm in the basement, where the readers need to be booked a day ahead.",
    "Keep a friendly tone even when a request is unusual, because most people ask for a good reason.",
    "The garden behind the building was planted by volunteers and is open whenever the weather allows.",
    "Printing costs ten cents a page in black and white and fifty cents a page in colour.",
    "Explain any rule you enforce, since people follow a rule more willingly when they understand it.",
    "Lost property is kept for one month in the cupboard behind the main desk and then given to charity.",
    "A local history group meets on the first Tuesday of every month to sort donated letters and photographs.",
    "Rare maps may only be handled with clean, dry hands, and pencils are the only writing tools allowed nearby.",
    "The café near the entrance sells soup at lunchtime, but food must not be carried into the stacks.",
    "Should a question touch on medicine or law, give general information and recommend a qualified expert.",
    "Bicycles can be locked to the rails along the east wall, which are covered by the security camera.",
    "During exam season the study rooms fill quickly, so students are asked to book them no more than twice a week.",
    "Our catalogue lists every item by author, title and subject, and it can be searched from home as well.",
    "Volunteers who help with the summer reading club receive a short training session in the last week of May.",
    "A wheelchair ramp leads to the side door, and the lift reaches every floor except the small attic archive.",
    "If the fire alarm sounds, leave by the nearest exit and gather on the lawn across the road.",
    "Patrons may suggest new books through a form at the desk, and the staff read every suggestion they receive.",
    "Late returns cost nothing for the first three days, after which a small fine is added for each week.",
    "The music collection includes sheet music for piano, strings and choir, along with a few rare recordings.",
    "Computers in the public area log out automatically after forty minutes so that others get a turn.",
    "Please speak to people by name when they offer it, and never ask for personal details you do not need.",
    "Art exhibitions in the entrance hall change every six weeks and usually feature painters from the valley.",
    "A book club for older readers gathers on Thursday mornings, and new members are always made welcome.",
    "The building dates from the last century and was once a grain store before the town bought it.",
    "Wireless internet is free for everyone, and the password is printed on the small card beside each table.",
    "When the weather turns cold, the heating in the west wing takes about an hour to warm the rooms.",
    "Dogs are not allowed inside, with the exception of trained assistance animals, who are always welcome.",
    "Staff wear green lanyards, so visitors who need help can find someone easily in a crowded room.",
    "Language courses in Spanish, French and Polish run in the evenings, taught by volunteers from the town.",
    "If two people want the same room at the same time, the one who booked first keeps it.",
    "Photocopies of copyrighted works are limited to a single chapter or one article from a journal issue.",
    "The reference desk can help with family history, using census records, parish books and old directories.",
    "Loud music, running and ball games belong outdoors, although younger children may play in the story corner.",
    "Each autumn the library holds a book sale, and the money pays for new furniture and craft supplies.",
    "Visitors sometimes ask for recommendations; offer two or three titles and explain briefly why each might suit.",
    "Water in bottles with lids is fine at the tables, but hot drinks should stay in the café.",
    "The storytelling hour for toddlers starts at ten on Saturdays and lasts about forty-five minutes.",
    "Maps of walking routes around the lake are free, and the desk keeps a few spare copies of each.",
    "When a book is missing from its shelf, check the returns trolley before marking it as lost.",
    "Meeting rooms seat up to twenty people and come with a projector, a whiteboard and a jug of water.",
    "Our opening hours are longer in winter, when fewer people spend their evenings outside.",
    "Students from the nearby college often bring questions about essays, citations and finding good sources.",
    "A small museum corner shows tools once used by farmers, weavers and blacksmiths in this district.",
    "Respect each visitor's privacy: the books someone borrows are nobody else's business.",
    "If you are unsure of an answer, it is better to check and come back than to guess.",
    "The parking spaces nearest the door are reserved for people with limited mobility and for parents with prams.",
    "Gifts of books are accepted when they are clean and in good condition, though we cannot keep every one.",
    "Large print editions and audio books are shelved together near the entrance for easier reach.",
    "At closing time, a bell rings fifteen minutes early so that everyone can finish what they are doing.",
    "Finally, end every conversation politely and invite the visitor to come back whenever they like.",
];

/// Both scenarios' figures for one server.
#[derive(Debug, Clone)]
pub(crate) struct ScenarioFigures {
    /// Prefix reuse.
    pub(crate) prefix: PrefixFigures,
    /// Admission under load.
    pub(crate) admission: AdmissionFigures,
}

/// What the prefix scenario measured: the completed requests of each kind and the failures.
#[derive(Debug, Clone, Default)]
pub(crate) struct PrefixOutcome {
    /// Each pair's first request, in pair order.
    pub(crate) cold: Vec<RequestRecord>,
    /// Each pair's second request, sent only after its cold request completed.
    pub(crate) repeat: Vec<RequestRecord>,
    /// The failures, naming the pair.
    pub(crate) errors: Vec<String>,
    /// The 1-minute load average when the scenario ended.
    pub(crate) load_after: String,
}

/// The prefix scenario's figures in the report's units; NaN or `None` where nothing was measured.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PrefixFigures {
    /// Pairs whose two requests completed.
    pub(crate) pairs: usize,
    /// Failed requests.
    pub(crate) errors: usize,
    /// The first failure's message.
    pub(crate) first_error: Option<String>,
    /// Median (nearest rank) time to first token of the cold requests, milliseconds.
    pub(crate) cold_first_token_ms: f64,
    /// Median time to first token of the repeat requests, milliseconds.
    pub(crate) repeat_first_token_ms: f64,
    /// `repeat_first_token_ms / cold_first_token_ms`.
    pub(crate) repeat_over_cold: f64,
    /// Median `prompt_tokens` of the cold requests.
    pub(crate) cold_prompt_tokens: Option<u64>,
    /// Median `prompt_tokens` of the repeat requests.
    pub(crate) repeat_prompt_tokens: Option<u64>,
    /// Median `cached_tokens` of the cold requests, where the server reported them.
    pub(crate) cold_cached_tokens: Option<u64>,
    /// Median `cached_tokens` of the repeat requests, where the server reported them.
    pub(crate) repeat_cached_tokens: Option<u64>,
    /// The 1-minute load average when the scenario ended.
    pub(crate) load_after: String,
}

/// What the admission scenario measured.
#[derive(Debug, Clone, Default)]
pub(crate) struct AdmissionOutcome {
    /// Phase A: the completed streams that ran alone.
    pub(crate) alone: Vec<RequestRecord>,
    /// Phase B: the completed streams the late request joined.
    pub(crate) joined: Vec<RequestRecord>,
    /// Phase B's late request, if it was sent and completed.
    pub(crate) late: Option<RequestRecord>,
    /// Phase B streams that had not yet ended when the late request's first token arrived.
    pub(crate) running_at_late_first_token: Option<usize>,
    /// The failures, naming the phase.
    pub(crate) errors: Vec<String>,
    /// The 1-minute load average when the scenario ended.
    pub(crate) load_after: String,
}

/// The inter-token gaps of one admission phase's streams, pooled.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PhaseFigures {
    /// Streams that completed.
    pub(crate) streams: usize,
    /// Gaps pooled. With the 573 of three full 192-token streams, the p99 by nearest rank is the sixth longest.
    pub(crate) gaps: usize,
    /// Inter-token gap, milliseconds.
    pub(crate) gap_p50_ms: f64,
    /// Inter-token gap, milliseconds.
    pub(crate) gap_p99_ms: f64,
    /// The longest single gap, milliseconds: a stall that hits each stream once shows here, not in the p99.
    pub(crate) gap_max_ms: f64,
}

/// The admission scenario's figures in the report's units.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct AdmissionFigures {
    /// Phase A, the streams alone.
    pub(crate) alone: PhaseFigures,
    /// Phase B, the streams with the late request.
    pub(crate) joined: PhaseFigures,
    /// `joined.gap_p99_ms / alone.gap_p99_ms`.
    pub(crate) p99_joined_over_alone: f64,
    /// The late request's time to first token, milliseconds (NaN if it did not complete).
    pub(crate) late_first_token_ms: f64,
    /// The late request's `prompt_tokens`.
    pub(crate) late_prompt_tokens: Option<u64>,
    /// Phase B streams still running when the late request's first token arrived.
    pub(crate) running_at_late_first_token: Option<usize>,
    /// Failed requests.
    pub(crate) errors: usize,
    /// The first failure's message.
    pub(crate) first_error: Option<String>,
    /// The 1-minute load average when the scenario ended.
    pub(crate) load_after: String,
}

impl PrefixOutcome {
    /// Reduces the records to the report's figures.
    pub(crate) fn figures(&self) -> PrefixFigures {
        let cold_first_token_ms = median_milliseconds(&self.cold);
        let repeat_first_token_ms = median_milliseconds(&self.repeat);
        PrefixFigures {
            pairs: self.repeat.len(),
            errors: self.errors.len(),
            first_error: self.errors.first().cloned(),
            cold_first_token_ms,
            repeat_first_token_ms,
            repeat_over_cold: repeat_first_token_ms / cold_first_token_ms,
            cold_prompt_tokens: median_count(self.cold.iter().map(|record| record.prompt_tokens)),
            repeat_prompt_tokens: median_count(
                self.repeat.iter().map(|record| record.prompt_tokens),
            ),
            cold_cached_tokens: median_count(self.cold.iter().map(|record| record.cached_tokens)),
            repeat_cached_tokens: median_count(
                self.repeat.iter().map(|record| record.cached_tokens),
            ),
            load_after: self.load_after.clone(),
        }
    }
}

impl AdmissionOutcome {
    /// Reduces the records to the report's figures.
    pub(crate) fn figures(&self) -> AdmissionFigures {
        let alone = PhaseFigures::of(&self.alone);
        let joined = PhaseFigures::of(&self.joined);
        AdmissionFigures {
            p99_joined_over_alone: joined.gap_p99_ms / alone.gap_p99_ms,
            alone,
            joined,
            late_first_token_ms: self
                .late
                .as_ref()
                .map_or(f64::NAN, |late| milliseconds(late.first_token)),
            late_prompt_tokens: self.late.as_ref().and_then(|late| late.prompt_tokens),
            running_at_late_first_token: self.running_at_late_first_token,
            errors: self.errors.len(),
            first_error: self.errors.first().cloned(),
            load_after: self.load_after.clone(),
        }
    }
}

impl PhaseFigures {
    /// The pooled gaps of `streams`; percentiles are NaN when no gap was recorded.
    fn of(streams: &[RequestRecord]) -> PhaseFigures {
        let gaps: Vec<f64> = streams
            .iter()
            .flat_map(|record| record.gaps.iter().copied().map(milliseconds))
            .collect();
        PhaseFigures {
            streams: streams.len(),
            gaps: gaps.len(),
            gap_p50_ms: percentile(&gaps, 50.0),
            gap_p99_ms: percentile(&gaps, 99.0),
            gap_max_ms: percentile(&gaps, 100.0),
        }
    }
}

/// Runs both scenarios against the server `load` points at, one after the other, with nothing else in
/// flight. Failures are recorded in the figures, never returned: one failed request costs its row's cells,
/// not the rest of the run.
pub(crate) fn run(load: &Load) -> ScenarioFigures {
    let prefix = prefix_reuse(load).figures();
    eprintln!(
        "xtask:   prefix reuse: cold TTFT p50 {:.0} ms, repeat {:.0} ms ({:.2}x), cached tokens {}, {} errors",
        prefix.cold_first_token_ms,
        prefix.repeat_first_token_ms,
        prefix.repeat_over_cold,
        count_or_not_reported(prefix.repeat_cached_tokens),
        prefix.errors
    );
    let admission = admission(load).figures();
    eprintln!(
        "xtask:   admission: ITL p99 {:.1} ms alone, {:.1} ms joined ({:.2}x), late TTFT {:.0} ms, {} errors",
        admission.alone.gap_p99_ms,
        admission.joined.gap_p99_ms,
        admission.p99_joined_over_alone,
        admission.late_first_token_ms,
        admission.errors
    );
    ScenarioFigures { prefix, admission }
}

/// The Method bullets that describe the scenarios, with the word counts of the prompts this build sends.
pub(crate) fn method() -> String {
    let prefix_words: Vec<usize> = (1..=PREFIX_PAIRS)
        .map(|session| words(&system_prompt(session)))
        .collect();
    let (shortest, longest) = (
        prefix_words.iter().min().copied().unwrap_or_default(),
        prefix_words.iter().max().copied().unwrap_or_default(),
    );
    let prefix_words = if shortest == longest {
        shortest.to_string()
    } else {
        format!("{shortest} to {longest}")
    };
    let late_words = words(&late_prompt());
    format!(
        "- Prefix reuse, after the concurrency levels with nothing else in flight: {PREFIX_PAIRS} pairs of \
         requests, one request at a time. Each pair has its own system prompt of {prefix_words} words of \
         English prose, opened with a sentence naming the pair (`Session 1 rules.`, `Session 2 rules.`, ...) and \
         the sentences rotated, so no two pairs share more than the chat template's opening and `Session`. The \
         pair's first request (cold) asks \"{COLD_QUESTION}\", its second (repeat) \"{REPEAT_QUESTION}\", so a \
         server that kept the cold request's tokens can skip the system prompt when it prefills the repeat. \
         `max_tokens` {SHORT_MAX_TOKENS}, `temperature` 0, streamed with usage. TTFT as above, the median by \
         nearest rank over the pairs; prompt and cached tokens are the medians of the usage chunk's \
         `prompt_tokens` and `prompt_tokens_details.cached_tokens` (`not reported` where the server sent none). \
         The issue's target: repeat TTFT at most {PREFIX_TARGET}x cold.\n\
         - Admission under load, after the prefix pairs: phase A posts {ADMISSION_STREAMS} streaming requests at \
         once (the body of the load requests, with worker numbers no level used, `max_tokens` \
         {ADMISSION_STREAM_TOKENS}) and waits for all of them; phase B posts {ADMISSION_STREAMS} more the same \
         way and, once each has received its first content delta, a late streaming request whose user prompt is \
         {late_words} words of English prose (`max_tokens` {SHORT_MAX_TOKENS}). ITL is pooled over each phase's \
         {ADMISSION_STREAMS} streams, whole streams (so phase B's include the gaps before the late request \
         arrived and after it ended). `gaps` is how many were pooled; at most 1 % of them are longer than \
         the p99 (nearest rank), so a stall that hits each stream once may show only in max, the longest single \
         gap. `running` is how many of phase B's streams had not ended when the late request's first token \
         arrived. The issue's target: phase B's \
         ITL p99 at most {ADMISSION_TARGET}x phase A's.\n"
    )
}

/// The scenario sections of the report: a table per scenario, one row per server, and our ratios against
/// llama-server. Empty when no server ran them.
pub(super) fn render(results: &[ServerResult]) -> String {
    let measured: Vec<(Server, &ScenarioFigures)> = results
        .iter()
        .filter_map(|result| Some((result.server, result.scenarios.as_ref()?)))
        .collect();
    if measured.is_empty() {
        return String::new();
    }
    let peer = measured
        .iter()
        .find(|(server, _)| *server == Server::Llama)
        .map(|(_, figures)| *figures);
    let ours = || {
        measured
            .iter()
            .filter(|(server, _)| matches!(server, Server::Ours { .. }))
    };
    let mut failures = String::new();
    let mut text = format!(
        "\n## Prefix reuse\n\n\
         The issue's target: repeat TTFT at most {PREFIX_TARGET}x cold (the `repeat/cold` column).\n\n\
         | Server | pairs | errors | cold TTFT p50 ms | repeat TTFT p50 ms | repeat/cold | prompt tokens cold / \
         repeat | cached tokens cold / repeat | load after |\n|---|---|---|---|---|---|---|---|---|\n"
    );
    for (server, figures) in &measured {
        let prefix = &figures.prefix;
        let _ = writeln!(
            text,
            "| {} | {} | {} | {:.0} | {:.0} | {:.2}x | {} / {} | {} / {} | {} |",
            server.label(),
            prefix.pairs,
            prefix.errors,
            prefix.cold_first_token_ms,
            prefix.repeat_first_token_ms,
            prefix.repeat_over_cold,
            count_or_not_reported(prefix.cold_prompt_tokens),
            count_or_not_reported(prefix.repeat_prompt_tokens),
            count_or_not_reported(prefix.cold_cached_tokens),
            count_or_not_reported(prefix.repeat_cached_tokens),
            prefix.load_after,
        );
        if let Some(error) = &prefix.first_error {
            let _ = writeln!(
                failures,
                "- {}, prefix reuse, first error: {}",
                server.label(),
                error.replace('\n', " ")
            );
        }
    }
    if let Some(peer) = peer {
        let mut ratios = String::new();
        for (server, figures) in ours() {
            let _ = writeln!(
                ratios,
                "| {} | {:.2}x | {:.2}x |",
                server.label(),
                figures.prefix.cold_first_token_ms / peer.prefix.cold_first_token_ms,
                figures.prefix.repeat_first_token_ms / peer.prefix.repeat_first_token_ms,
            );
        }
        if !ratios.is_empty() {
            let _ = write!(
                text,
                "\nOurs over llama-server, below 1 is better:\n\n\
                 | Server | cold TTFT p50 | repeat TTFT p50 |\n|---|---|---|\n{ratios}"
            );
        }
    }
    let _ = write!(
        text,
        "\n## Admission under load\n\n\
         The issue's target: phase B's ITL p99 at most {ADMISSION_TARGET}x phase A's (the `B/A p99` column). A is \
         {ADMISSION_STREAMS} streams alone, B the same with the late request posted once all had content.\n\n\
         | Server | errors | A gaps | A ITL p50 ms | A ITL p99 ms | A ITL max ms | B gaps | B ITL p50 ms | \
         B ITL p99 ms | B ITL max ms | B/A p99 | late TTFT ms | late prompt tokens | running | load after |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    );
    for (server, figures) in &measured {
        let admission = &figures.admission;
        let (alone, joined) = (&admission.alone, &admission.joined);
        let _ = writeln!(
            text,
            "| {} | {} | {} | {:.1} | {:.1} | {:.1} | {} | {:.1} | {:.1} | {:.1} | {:.2}x | {:.0} | {} | {} | {} |",
            server.label(),
            admission.errors,
            alone.gaps,
            alone.gap_p50_ms,
            alone.gap_p99_ms,
            alone.gap_max_ms,
            joined.gaps,
            joined.gap_p50_ms,
            joined.gap_p99_ms,
            joined.gap_max_ms,
            admission.p99_joined_over_alone,
            admission.late_first_token_ms,
            count_or_not_reported(admission.late_prompt_tokens),
            admission.running_at_late_first_token.map_or_else(
                || "not measured".to_owned(),
                |running| format!("{running} of {ADMISSION_STREAMS}")
            ),
            admission.load_after,
        );
        if let Some(error) = &admission.first_error {
            let _ = writeln!(
                failures,
                "- {}, admission under load, first error: {}",
                server.label(),
                error.replace('\n', " ")
            );
        }
    }
    if let Some(peer) = peer {
        let mut ratios = String::new();
        for (server, figures) in ours() {
            let admission = &figures.admission;
            let _ = writeln!(
                ratios,
                "| {} | {:.2}x | {:.2}x | {:.2}x |",
                server.label(),
                admission.alone.gap_p99_ms / peer.admission.alone.gap_p99_ms,
                admission.joined.gap_p99_ms / peer.admission.joined.gap_p99_ms,
                admission.late_first_token_ms / peer.admission.late_first_token_ms,
            );
        }
        if !ratios.is_empty() {
            let _ = write!(
                text,
                "\nOurs over llama-server, below 1 is better:\n\n\
                 | Server | A ITL p99 | B ITL p99 | late TTFT |\n|---|---|---|---|\n{ratios}"
            );
        }
    }
    if !failures.is_empty() {
        let _ = write!(text, "\n### Scenario failures\n\n{failures}");
    }
    text
}

/// The prefix scenario: [`PREFIX_PAIRS`] cold and repeat pairs, one request at a time.
fn prefix_reuse(load: &Load) -> PrefixOutcome {
    let mut outcome = PrefixOutcome::default();
    for session in 1..=PREFIX_PAIRS {
        let system = system_prompt(session);
        let cold = prefix_body(load, &system, COLD_QUESTION);
        match client::stream_request(load.address, &cold, || {}) {
            Ok(record) => outcome.cold.push(record),
            Err(error) => {
                // Without a completed cold request the prefix may not be cached, so a repeat would not be one.
                outcome.errors.push(format!(
                    "session {session}, cold request (its repeat was not sent): {error:#}"
                ));
                continue;
            }
        }
        let repeat = prefix_body(load, &system, REPEAT_QUESTION);
        match client::stream_request(load.address, &repeat, || {}) {
            Ok(record) => outcome.repeat.push(record),
            Err(error) => outcome
                .errors
                .push(format!("session {session}, repeat request: {error:#}")),
        }
    }
    outcome.load_after = one_minute_load();
    outcome
}

/// The admission scenario: phase A's streams alone, then phase B's with the late request.
fn admission(load: &Load) -> AdmissionOutcome {
    let streams = Load {
        max_tokens: ADMISSION_STREAM_TOKENS,
        ..load.clone()
    };
    let mut outcome = AdmissionOutcome::default();
    let (alone, _) = start_streams(&streams, ADMISSION_WORKER);
    for (stream, result) in alone.into_iter().enumerate() {
        match join_stream(result) {
            Ok((record, _)) => outcome.alone.push(record),
            Err(error) => outcome
                .errors
                .push(format!("phase A, stream {}: {error:#}", stream + 1)),
        }
    }
    let (joined, first_tokens) = start_streams(&streams, ADMISSION_WORKER + ADMISSION_STREAMS);
    // Each stream's sender is dropped when it has signalled or failed, so this ends even if one never streams.
    let decoding = first_tokens.iter().take(ADMISSION_STREAMS).count();
    let mut late_first_token_at = None;
    if decoding == ADMISSION_STREAMS {
        let body = late_body(load);
        match client::stream_request(load.address, &body, || {
            late_first_token_at = Some(Instant::now());
        }) {
            Ok(record) => outcome.late = Some(record),
            Err(error) => outcome
                .errors
                .push(format!("phase B, late request: {error:#}")),
        }
    } else {
        outcome.errors.push(format!(
            "phase B: only {decoding} of {ADMISSION_STREAMS} streams produced content, so the late request was \
             not sent"
        ));
    }
    let mut ended = Vec::new();
    for (stream, result) in joined.into_iter().enumerate() {
        match join_stream(result) {
            Ok((record, end)) => {
                outcome.joined.push(record);
                ended.push(end);
            }
            Err(error) => outcome
                .errors
                .push(format!("phase B, stream {}: {error:#}", stream + 1)),
        }
    }
    outcome.running_at_late_first_token =
        late_first_token_at.map(|first| ended.iter().filter(|&&end| end > first).count());
    outcome.load_after = one_minute_load();
    outcome
}

/// A stream's thread: its record and the moment it ended.
type StreamThread = thread::JoinHandle<Result<(RequestRecord, Instant)>>;

/// Starts [`ADMISSION_STREAMS`] streams on their own threads, prompts of workers `first_worker` onward; the
/// receiver gets one message per stream at its first content delta.
fn start_streams(load: &Load, first_worker: usize) -> (Vec<StreamThread>, mpsc::Receiver<()>) {
    let (sender, receiver) = mpsc::channel();
    let threads = (first_worker..first_worker + ADMISSION_STREAMS)
        .map(|worker| {
            let (load, sender) = (load.clone(), sender.clone());
            thread::spawn(move || {
                let record =
                    client::stream_request(load.address, &load.body(worker, 0), move || {
                        // The receiver may be gone (phase A ignores it); the stream goes on regardless.
                        let _ = sender.send(());
                    })?;
                Ok((record, Instant::now()))
            })
        })
        .collect();
    (threads, receiver)
}

/// Joins a stream's thread, turning a panic into an error.
fn join_stream(stream: StreamThread) -> Result<(RequestRecord, Instant)> {
    stream
        .join()
        .unwrap_or_else(|_| Err(anyhow::anyhow!("a stream thread panicked")))
}

/// A prefix request: the session's system prompt and `question` as the user message.
fn prefix_body(load: &Load, system: &str, question: &str) -> String {
    serde_json::json!({
        "model": load.model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": SHORT_MAX_TOKENS,
        "temperature": 0,
    })
    .to_string()
}

/// The late request of the admission scenario.
fn late_body(load: &Load) -> String {
    serde_json::json!({
        "model": load.model,
        "messages": [{"role": "user", "content": late_prompt()}],
        "stream": true,
        "stream_options": {"include_usage": true},
        "max_tokens": SHORT_MAX_TOKENS,
        "temperature": 0,
    })
    .to_string()
}

/// Session `session`'s system prompt: a distinct opening sentence, then [`PREFIX_WORDS`] words of sentences
/// starting at a session's own rotation of [`SENTENCES`].
fn system_prompt(session: usize) -> String {
    prose(
        &format!("Session {session} rules."),
        session * 17,
        PREFIX_WORDS,
    )
}

/// The late request's user prompt: a task, then about [`LATE_WORDS`] words of notes.
fn late_prompt() -> String {
    prose(
        "Admission check. Read the notes below and list their three most useful points.",
        5,
        LATE_WORDS,
    )
}

/// `opening`, then whole sentences of [`SENTENCES`] from `rotation` onward (wrapping), stopping at whichever
/// sentence boundary is nearest `target` words.
fn prose(opening: &str, rotation: usize, target: usize) -> String {
    let mut text = opening.to_owned();
    for sentence in SENTENCES.iter().cycle().skip(rotation % SENTENCES.len()) {
        let (have, next) = (words(&text), words(sentence));
        if have >= target || (have + next).abs_diff(target) > target - have {
            break;
        }
        text.push(' ');
        text.push_str(sentence);
    }
    text
}

/// Words as a reader counts them: runs of non-space characters.
fn words(text: &str) -> usize {
    text.split_whitespace().count()
}

fn milliseconds(duration: Duration) -> f64 {
    duration.as_secs_f64() * 1e3
}

/// The median (nearest rank) time to first token of `records`, milliseconds; NaN for none.
fn median_milliseconds(records: &[RequestRecord]) -> f64 {
    let first_tokens: Vec<f64> = records
        .iter()
        .map(|record| milliseconds(record.first_token))
        .collect();
    percentile(&first_tokens, 50.0)
}

/// The median (nearest rank) of the counts that are present; `None` when none is.
fn median_count(counts: impl Iterator<Item = Option<u64>>) -> Option<u64> {
    let present: Vec<f64> = counts.flatten().map(|count| count as f64).collect();
    let median = percentile(&present, 50.0);
    // Counts are far below 2^53, so the round trip through f64 is exact.
    (!median.is_nan()).then_some(median as u64)
}

fn count_or_not_reported(count: Option<u64>) -> String {
    count.map_or_else(|| "not reported".to_owned(), |count| count.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(
        first_token_ms: u64,
        gaps_ms: &[u64],
        prompt: Option<u64>,
        cached: Option<u64>,
    ) -> RequestRecord {
        RequestRecord {
            first_token: Duration::from_millis(first_token_ms),
            gaps: gaps_ms
                .iter()
                .map(|&gap| Duration::from_millis(gap))
                .collect(),
            tokens: gaps_ms.len() as u64 + 1,
            prompt_tokens: prompt,
            cached_tokens: cached,
        }
    }

    #[test]
    fn the_prefix_figures_take_medians_and_divide_repeat_by_cold() {
        let outcome = PrefixOutcome {
            cold: vec![
                record(3000, &[], Some(1040), Some(0)),
                record(2000, &[], Some(1042), Some(4)),
                record(4000, &[], Some(1041), Some(2)),
            ],
            repeat: vec![
                record(300, &[], Some(1045), Some(1030)),
                record(200, &[], Some(1047), None),
            ],
            errors: vec!["session 3, repeat request: status 503".to_owned()],
            load_after: "1.00".to_owned(),
        };
        let figures = outcome.figures();
        assert_eq!(
            figures.pairs, 2,
            "a pair counts only when its repeat completed"
        );
        assert_eq!(figures.errors, 1);
        assert_eq!(
            figures.cold_first_token_ms, 3000.0,
            "the middle of three cold TTFTs"
        );
        assert_eq!(
            figures.repeat_first_token_ms, 200.0,
            "the nearest-rank median of two is the lower"
        );
        assert!(
            (figures.repeat_over_cold - 200.0 / 3000.0).abs() < 1e-12,
            "the ratio is repeat over cold, got {}",
            figures.repeat_over_cold
        );
        assert_eq!(figures.cold_prompt_tokens, Some(1041));
        assert_eq!(figures.cold_cached_tokens, Some(2));
        assert_eq!(
            figures.repeat_cached_tokens,
            Some(1030),
            "a request without cached_tokens is left out of the median, not read as zero"
        );
    }

    #[test]
    fn the_prefix_figures_say_not_reported_and_nan_when_nothing_was_measured() {
        let figures = PrefixOutcome {
            cold: vec![record(3000, &[], None, None)],
            ..PrefixOutcome::default()
        }
        .figures();
        assert_eq!(figures.pairs, 0);
        assert!(
            figures.repeat_first_token_ms.is_nan(),
            "no repeat gives NaN, not zero"
        );
        assert!(
            figures.repeat_over_cold.is_nan(),
            "a ratio over nothing is NaN"
        );
        assert_eq!(figures.cold_cached_tokens, None);
        assert_eq!(
            count_or_not_reported(figures.cold_cached_tokens),
            "not reported"
        );
    }

    #[test]
    fn the_admission_figures_pool_each_phases_gaps_and_divide_the_p99s() {
        let outcome = AdmissionOutcome {
            alone: vec![
                record(100, &[10, 10, 20], None, None),
                record(100, &[10, 30], None, None),
            ],
            joined: vec![
                record(100, &[10, 10, 200], None, None),
                record(100, &[20, 40], None, None),
            ],
            late: Some(record(900, &[12], Some(520), None)),
            running_at_late_first_token: Some(2),
            errors: Vec::new(),
            load_after: "1.00".to_owned(),
        };
        let figures = outcome.figures();
        assert_eq!(figures.alone.streams, 2);
        assert_eq!(figures.alone.gaps, 5, "the gaps of both streams pool");
        assert_eq!(figures.alone.gap_p50_ms, 10.0);
        assert_eq!(
            figures.alone.gap_p99_ms, 30.0,
            "with five gaps the p99 is the longest"
        );
        assert_eq!(figures.joined.gap_p50_ms, 20.0);
        assert_eq!(figures.joined.gap_max_ms, 200.0);
        assert!(
            (figures.p99_joined_over_alone - 200.0 / 30.0).abs() < 1e-12,
            "the ratio is B's p99 over A's, got {}",
            figures.p99_joined_over_alone
        );
        assert_eq!(figures.late_first_token_ms, 900.0);
        assert_eq!(figures.late_prompt_tokens, Some(520));
        assert_eq!(figures.running_at_late_first_token, Some(2));
    }

    #[test]
    fn the_p99_of_many_gaps_misses_one_stall_per_stream_but_the_max_keeps_it() {
        let stalled = |stall| {
            let mut gaps = vec![30; 190];
            gaps[100] = stall;
            record(100, &gaps, None, None)
        };
        let phase = PhaseFigures::of(&[stalled(900), stalled(800), stalled(700)]);
        assert_eq!(phase.gaps, 570);
        assert_eq!(
            phase.gap_p99_ms, 30.0,
            "three stalls in 570 gaps stay above the p99"
        );
        assert_eq!(phase.gap_max_ms, 900.0, "the max is the worst stall");
    }

    #[test]
    fn the_sections_hold_a_row_per_server_and_divide_ours_by_llama_server() {
        let figures = |first_token_ms: u64, gap_ms: u64| {
            let prefix = PrefixOutcome {
                cold: vec![record(first_token_ms, &[], Some(1040), Some(0))],
                repeat: vec![record(first_token_ms / 10, &[], Some(1045), Some(1030))],
                errors: Vec::new(),
                load_after: "1.00".to_owned(),
            };
            let admission = AdmissionOutcome {
                alone: vec![record(100, &[gap_ms; 4], None, None)],
                joined: vec![record(100, &[gap_ms * 3; 4], None, None)],
                late: Some(record(first_token_ms, &[], Some(520), None)),
                running_at_late_first_token: Some(3),
                errors: vec!["phase A, stream 2: status 503".to_owned()],
                load_after: "1.00".to_owned(),
            };
            Some(ScenarioFigures {
                prefix: prefix.figures(),
                admission: admission.figures(),
            })
        };
        let results = [
            ServerResult {
                server: Server::Ours { stages: 1 },
                levels: Ok(Vec::new()),
                scenarios: figures(2000, 20),
            },
            ServerResult {
                server: Server::Ours { stages: 3 },
                levels: Err("stage-server exited".to_owned()),
                scenarios: None,
            },
            ServerResult {
                server: Server::Llama,
                levels: Ok(Vec::new()),
                scenarios: figures(1000, 10),
            },
        ];
        let text = render(&results);
        assert!(
            text.contains(
                "| stage-server, whole | 1 | 0 | 2000 | 200 | 0.10x | 1040 / 1045 | 0 / 1030 | 1.00 |"
            ),
            "the prefix row is wrong:\n{text}"
        );
        assert!(
            text.contains("| stage-server, whole | 2.00x | 2.00x |"),
            "the prefix ratio row is wrong:\n{text}"
        );
        assert!(
            text.contains(
                "| llama-server | 1 | 4 | 10.0 | 10.0 | 10.0 | 4 | 30.0 | 30.0 | 30.0 | 3.00x | 1000 | 520 | 3 of 3 \
                 | 1.00 |"
            ),
            "the admission row is wrong:\n{text}"
        );
        assert!(
            text.contains("| stage-server, whole | 2.00x | 2.00x | 2.00x |"),
            "the admission ratio row is wrong:\n{text}"
        );
        assert!(
            !text.contains("3 stages"),
            "a server without scenario figures gets no row:\n{text}"
        );
        assert!(
            text.contains(
                "- llama-server, admission under load, first error: phase A, stream 2: status 503"
            ),
            "a scenario's first error must be listed:\n{text}"
        );
        assert!(
            render(&results[1..2]).is_empty(),
            "no scenario figures, no sections"
        );
    }

    #[test]
    fn the_prompts_have_the_intended_length_and_no_two_sessions_share_a_prefix() {
        let sessions: Vec<String> = (1..=PREFIX_PAIRS).map(system_prompt).collect();
        for (index, system) in sessions.iter().enumerate() {
            let count = words(system);
            assert!(
                PREFIX_WORDS.abs_diff(count) <= 20,
                "session {}'s system prompt has {count} words",
                index + 1
            );
            for sentence in SENTENCES {
                assert!(
                    system.matches(sentence).count() <= 1,
                    "session {}'s system prompt repeats {sentence:?}",
                    index + 1
                );
            }
        }
        assert!(
            sessions[0].starts_with("Session 1 rules. ")
                && sessions[1].starts_with("Session 2 rules. "),
            "each system prompt opens with its own session sentence"
        );
        let bank_words: usize = SENTENCES.iter().map(|sentence| words(sentence)).sum();
        assert!(
            bank_words > PREFIX_WORDS + 20,
            "the sentence bank ({bank_words} words) must hold one system prompt without repeating"
        );
        let late = words(&late_prompt());
        assert!(
            LATE_WORDS.abs_diff(late) <= 20,
            "the late prompt has {late} words"
        );
    }
}
