//! Unit tests of the shared stage: step planning, the prompt share, holds for lanes out on their round trip and
//! for arriving generations, and callers running steps in front of a chain.

use super::*;

fn waiting(rows: usize, order: u64) -> LaneState {
    LaneState {
        active: true,
        arriving: false,
        past_prompt: rows == 1,
        pending: Some(Pending {
            position: 10,
            input: OwnedInput::Tokens(vec![7; rows]),
            logits: Logits::Last,
            done: 0,
            output: Vec::new(),
            order,
            awaits_answer: false,
            returned: false,
            first: false,
        }),
        result: None,
        out: None,
        started: true,
        freed: None,
        chunks_left: None,
    }
}

/// A chain's stage 0 over the tiny llama with `lanes` lanes, in a scratch directory: callers run the steps,
/// and one batch goes round at a time.
fn chain_stage_zero(name: &str, lanes: usize) -> (std::path::PathBuf, SharedStage) {
    use crate::model::testing::TinyModel;
    use candle_core::quantized::GgmlDType;
    let (dir, stage) = TinyModel::llama(GgmlDType::Q4_1).scratch_stage(name, lanes);
    let shared = SharedStage::start(
        stage,
        StepPolicy {
            batches_in_flight: 1,
            ..StepPolicy::new(512, Duration::ZERO)
        },
    )
    .expect("start");
    (dir, shared)
}

/// Runs one row of `lane` at `position` as a chunk whose answer comes back after a round trip; the step it
/// ran in.
fn one_row_out(shared: &SharedStage, lane: usize, position: usize) -> StepTag {
    shared
        .forward_tagged(
            lane,
            position,
            StageInput::Tokens(&[7 + position as u32]),
            Logits::Last,
            true,
        )
        .expect("forward")
        .1
}

fn taken(plan: &[Planned]) -> Vec<(usize, usize, bool)> {
    plan.iter()
        .map(|planned| (planned.lane, planned.input.rows(1), planned.ends))
        .collect()
}

/// Lanes 1 and 3 decode (one row each); lanes 0 and 2 wait with prompts of 300 and 400 rows, 0 the older.
fn two_streams_and_two_prompts() -> State {
    State {
        lanes: vec![
            waiting(300, 1),
            waiting(1, 5),
            waiting(400, 2),
            waiting(1, 9),
        ],
        ..State::default()
    }
}

#[test]
fn one_row_chunks_run_first_and_longer_ones_share_what_is_left_of_the_budget_in_order() {
    let state = two_streams_and_two_prompts();
    assert_eq!(
        taken(&plan_step(&state, 512, 1, false, |_| None)),
        [(1, 1, true), (3, 1, true), (0, 300, true), (2, 210, false)]
    );
    // A budget smaller than the streams still runs every stream's token, and nothing else.
    assert_eq!(
        taken(&plan_step(&state, 1, 1, false, |_| None)),
        [(1, 1, true), (3, 1, true)]
    );
}

#[test]
fn while_streams_decode_prompt_rows_are_cut_to_the_cap_and_alone_they_take_the_budget() {
    let state = two_streams_and_two_prompts();
    // Two streams decode: the prompts share 20 rows, the oldest first.
    assert_eq!(
        taken(&plan_step(&state, 512, 1, false, |_| Some(20))),
        [(1, 1, true), (3, 1, true), (0, 20, false)]
    );
    // A cap larger than a prompt lets the next one have the rest.
    let state = State {
        lanes: vec![waiting(5, 1), waiting(1, 5), waiting(400, 2)],
        ..State::default()
    };
    assert_eq!(
        taken(&plan_step(&state, 512, 1, false, |_| Some(8))),
        [(1, 1, true), (0, 5, true), (2, 3, false)]
    );
    // A cap of zero still moves a prompt on by a row.
    assert_eq!(
        taken(&plan_step(&state, 512, 1, false, |_| Some(0))),
        [(1, 1, true), (0, 1, false)]
    );
    // With no stream to decode the cap does not apply: the budget does.
    let state = State {
        lanes: vec![waiting(300, 1), waiting(400, 2)],
        ..State::default()
    };
    assert_eq!(
        taken(&plan_step(&state, 512, 1, false, |_| Some(20))),
        [(0, 300, true), (1, 212, false)]
    );
}

/// Lane 0 decodes a stream that said it has `chunks_left` chunks to go (`None`: it said nothing); lane 1's
/// generation hands in its first prompt chunk of 8 rows. A decode row and a prompt row cost a millisecond each,
/// so the prompt adds 8 decode steps' worth to a step.
fn a_stream_and_a_prompt_starting(chunks_left: Option<usize>) -> State {
    let mut stream = waiting(1, 2);
    stream.chunks_left = chunks_left;
    let mut prompt = waiting(8, 1);
    if let Some(pending) = prompt.pending.as_mut() {
        pending.first = true;
    }
    prompt.started = false;
    State {
        lanes: vec![stream, prompt],
        costs: StepCosts {
            decode_row: Some(0.001),
            prompt_row_mixed: Some(0.001),
            prompt_row_alone: None,
        },
        ..State::default()
    }
}

#[test]
fn a_prompt_about_to_start_sits_out_the_steps_of_streams_about_to_end_and_no_others() {
    let policy = StepPolicy::new(512, Duration::from_millis(2));
    // The stream ends within 2 steps, the prompt would add 8: the prompt waits, the stream runs alone, and the
    // step is no reason to wait for arrivals (no prompt starts in it).
    let state = a_stream_and_a_prompt_starting(Some(2));
    assert!(state.prompts_wait_for_ending_streams(1, &policy));
    let hold = state.prompts_wait_for_ending_streams(1, &policy);
    assert_eq!(
        taken(&plan_step(&state, 512, 1, hold, |_| None)),
        [(0, 1, true)]
    );
    assert!(!state.admitting(1, &policy));
    // Exactly as many steps as the prompt would add still wait; one more does not.
    assert!(a_stream_and_a_prompt_starting(Some(8)).prompts_wait_for_ending_streams(1, &policy));
    let state = a_stream_and_a_prompt_starting(Some(9));
    assert!(!state.prompts_wait_for_ending_streams(1, &policy));
    assert_eq!(
        taken(&plan_step(&state, 512, 1, false, |_| None)),
        [(0, 1, true), (1, 8, true)]
    );
    assert!(state.admitting(1, &policy));
    // A stream that never said when it ends is not waited for.
    assert!(!a_stream_and_a_prompt_starting(None).prompts_wait_for_ending_streams(1, &policy));
    // The policy's cap, a zero cap, and a decode stretch each end the wait.
    let capped = StepPolicy {
        prompt_hold_steps: 1,
        ..policy
    };
    assert!(!a_stream_and_a_prompt_starting(Some(2)).prompts_wait_for_ending_streams(1, &capped));
    let never = StepPolicy {
        prompt_hold_steps: 0,
        ..policy
    };
    assert!(!a_stream_and_a_prompt_starting(Some(1)).prompts_wait_for_ending_streams(1, &never));
    let stretched = StepPolicy {
        decode_stretch: Some(2.0),
        ..policy
    };
    assert!(
        !a_stream_and_a_prompt_starting(Some(1)).prompts_wait_for_ending_streams(1, &stretched)
    );
    // Before the costs are measured nothing waits.
    let mut state = a_stream_and_a_prompt_starting(Some(1));
    state.costs = StepCosts::default();
    assert!(!state.prompts_wait_for_ending_streams(1, &policy));
    // A prompt already under way (not its first chunk) never waits, and with no stream waiting for the step
    // there is nothing to stall.
    let mut state = a_stream_and_a_prompt_starting(Some(1));
    if let Some(pending) = state.lanes[1].pending.as_mut() {
        pending.first = false;
    }
    assert!(!state.prompts_wait_for_ending_streams(1, &policy));
    let mut state = a_stream_and_a_prompt_starting(Some(1));
    state.lanes[0].pending = None;
    assert!(!state.prompts_wait_for_ending_streams(1, &policy));
    // A lane with a chunk waiting that never said when it ends counts, active or not.
    let mut state = a_stream_and_a_prompt_starting(Some(1));
    let mut unannounced = waiting(1, 3);
    unannounced.active = false;
    state.lanes.push(unannounced);
    assert!(!state.prompts_wait_for_ending_streams(1, &policy));
}

#[test]
fn the_prompt_share_follows_the_measured_costs() {
    let mut costs = StepCosts::default();
    assert_eq!(
        costs.prompt_rows_within(2.0, 3),
        None,
        "nothing measured yet"
    );
    // Binary fractions of a second, so the divisions are exact: a decode row costs 1/64 s.
    let row = 1.0 / 64.0;
    costs.observe(4, 0, 4.0 * row);
    // No prompt row measured: one is taken to cost a whole decode step, so twice a step allows one row.
    assert_eq!(costs.prompt_rows_within(2.0, 4), Some(1));
    costs.observe(0, 128, 128.0 / 256.0);
    // A prompt row alone costs 1/256 s: a step of 4 streams (1/16 s) may take 1/16 s more, 16 rows.
    assert_eq!(costs.prompt_rows_within(2.0, 4), Some(16));
    assert_eq!(costs.prompt_rows_within(3.0, 4), Some(32));
    // Fewer streams, a shorter step, fewer rows: the decode figure is per row.
    assert_eq!(costs.prompt_rows_within(2.0, 1), Some(4));
    // A prompt row beside decode rows cost 1/128 s: that figure wins over the prompt-only one.
    costs.observe(4, 8, 4.0 * row + 8.0 / 128.0);
    assert_eq!(costs.prompt_rows_within(2.0, 4), Some(8));
    // A stretch of one leaves no room, and a prompt still gets its row.
    assert_eq!(costs.prompt_rows_within(1.0, 4), Some(1));
    // A step cheaper than the decode average does not make prompt rows free.
    costs.observe(4, 8, row);
    assert!(
        costs
            .prompt_rows_within(2.0, 4)
            .is_some_and(|rows| (8..100).contains(&rows))
    );
    // A slower host: decode rows twice as dear allow twice the prompt rows at the same row cost.
    let mut slow = StepCosts::default();
    slow.observe(2, 0, 4.0 * row);
    slow.observe(4, 8, 8.0 * row + 8.0 / 128.0);
    assert_eq!(slow.prompt_rows_within(2.0, 4), Some(16));
}

#[test]
fn a_step_waits_longer_for_arrivals_when_no_stream_decodes_or_a_prompt_starts() {
    let gather = Duration::from_millis(2);
    let policy = StepPolicy::new(512, gather);
    let free = LaneState::default();
    let decoding = waiting(1, 1);
    let prompt = waiting(50, 2);
    let lanes = |lanes: Vec<LaneState>| State {
        lanes,
        ..State::default()
    };
    let copy = |lane: &LaneState| match &lane.pending {
        Some(pending) => waiting(pending.input.rows(1), pending.order),
        None => LaneState::default(),
    };
    let started = Instant::now();
    let until = |state: &State| gather_until(state, 1, &policy, started);
    // Nothing on its way: no wait.
    assert_eq!(until(&lanes(vec![copy(&prompt), copy(&free)])), None);
    // A queued request and a free lane: wait for it, longer when only prompts would run.
    let mut state = lanes(vec![copy(&prompt), copy(&free)]);
    state.backlog = 2;
    assert_eq!(until(&state), Some(started + ARRIVAL_WAIT));
    let mut state = lanes(vec![copy(&decoding), copy(&free)]);
    state.backlog = 2;
    assert_eq!(until(&state), Some(started + gather));
    // A queue but every lane taken: no request can arrive.
    let mut state = lanes(vec![copy(&prompt), copy(&decoding)]);
    state.backlog = 2;
    assert_eq!(until(&state), None);
    // An announced arrival counts whether or not a lane is free.
    let mut state = lanes(vec![copy(&prompt), copy(&decoding)]);
    state.arriving = 1;
    assert_eq!(until(&state), Some(started + gather));
    // ... and a generation's first prompt chunk beside a stream waits for it as long as a prompt alone does.
    let mut starting = copy(&prompt);
    if let Some(pending) = starting.pending.as_mut() {
        pending.first = true;
    }
    let mut state = lanes(vec![starting, copy(&decoding)]);
    state.arriving = 1;
    assert_eq!(until(&state), Some(started + ARRIVAL_WAIT));
    // An active lane that has not handed in its chunk yet: the short gather.
    let idle_active = || LaneState {
        active: true,
        ..LaneState::default()
    };
    let state = lanes(vec![copy(&prompt), idle_active()]);
    assert_eq!(until(&state), Some(started + gather));
    // A lane freed 4 ms ago: a prompt waits for its client's next request until its window ends, a stream's
    // row does not wait at all, and a window that ended is not waited for.
    let freed_at = |ago: Duration| LaneState {
        freed: Some(Instant::now() - ago),
        ..LaneState::default()
    };
    let recent = freed_at(Duration::from_millis(4));
    let window_end = recent.freed.map(|freed| freed + ARRIVAL_WAIT);
    let state = lanes(vec![copy(&prompt), recent]);
    assert_eq!(until(&state), window_end);
    let state = lanes(vec![copy(&decoding), freed_at(Duration::from_millis(4))]);
    assert_eq!(until(&state), None);
    let state = lanes(vec![copy(&prompt), freed_at(ARRIVAL_WAIT * 2)]);
    assert_eq!(until(&state), None);
}

#[test]
fn a_chunk_over_several_steps_resumes_where_it_stopped() {
    let mut lane = waiting(700, 1);
    if let Some(pending) = lane.pending.as_mut() {
        pending.done = 512;
    }
    let state = State {
        lanes: vec![lane],
        ..State::default()
    };
    let plan = plan_step(&state, 512, 1, false, |_| Some(3));
    assert_eq!(taken(&plan), [(0, 188, true)]);
    assert_eq!(plan[0].position, 10 + 512);
}

#[test]
fn a_prompt_share_is_offered_only_beside_another_lanes_decoding_stream() {
    use crate::model::testing::TinyModel;
    use candle_core::quantized::GgmlDType;
    let (dir, stage) = TinyModel::llama(GgmlDType::Q4_1).scratch_stage("shared-share", 2);
    let policy = StepPolicy {
        decode_stretch: Some(2.0),
        ..StepPolicy::new(512, Duration::ZERO)
    };
    let shared = SharedStage::start(stage, policy).expect("start");
    shared.activate(0, true);
    shared.activate(1, true);
    let run = |lane: usize, position: usize, tokens: &[u32]| {
        shared
            .forward(lane, position, StageInput::Tokens(tokens), Logits::Last)
            .expect("forward");
    };
    run(1, 0, &[5, 6, 7]);
    assert_eq!(shared.prompt_share(0), None, "lane 1 prefills: no share");
    // A prompt handed in a row at a time is still a prompt, not a stream to protect.
    run(1, 3, &[8]);
    assert_eq!(
        shared.prompt_share(0),
        None,
        "a one-row prompt chunk is not a stream"
    );
    shared.mark_decoding(1);
    run(1, 4, &[9]);
    let share = shared.prompt_share(0);
    assert!(
        share.is_some_and(|rows| rows >= 1),
        "lane 1 decodes and a decode step is measured: lane 0 gets a share, got {share:?}"
    );
    assert_eq!(
        shared.prompt_share(1),
        None,
        "a lane's own stream does not count"
    );
    shared.activate(1, false);
    assert_eq!(shared.prompt_share(0), None, "lane 1 left its generation");
    shared.activate(1, true);
    assert_eq!(
        shared.prompt_share(0),
        None,
        "a new generation on lane 1 starts with its prompt"
    );
    drop(shared);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_caller_runs_its_step_itself_only_where_steps_never_gather_and_lanes_racing_get_their_solo_rows()
 {
    use crate::model::testing::TinyModel;
    use candle_core::quantized::GgmlDType;
    use std::sync::atomic::Ordering;
    let by_callers = |shared: &SharedStage| shared.shared.steps_by_callers.load(Ordering::Relaxed);
    let bits = |output: StageOutput| match output {
        StageOutput::Activations(values) | StageOutput::Logits(values) => values
            .iter()
            .map(|value| value.to_bits())
            .collect::<Vec<_>>(),
    };
    // No gather (a chain's stage 0): every step runs on the caller's thread.
    let (dir, stage) = TinyModel::llama(GgmlDType::Q4_1).scratch_stage("shared-inline", 2);
    let shared = SharedStage::start(stage, StepPolicy::new(512, Duration::ZERO)).expect("start");
    let run = |lane: usize, position: usize, token: u32| {
        shared
            .forward(lane, position, StageInput::Tokens(&[token]), Logits::Last)
            .expect("forward")
    };
    let solo: Vec<Vec<u32>> = (0..8)
        .map(|position| bits(run(0, position, 7 + position as u32)))
        .collect();
    assert_eq!(
        by_callers(&shared),
        8,
        "a lone caller runs every step itself"
    );
    // Two lanes racing from two threads: each step is planned once, whoever runs it, and every row equals
    // the lane's solo run.
    shared.with_stage(|stage| stage.reset(0)).expect("reset");
    std::thread::scope(|scope| {
        for lane in 0..2 {
            let run = &run;
            let solo = &solo;
            scope.spawn(move || {
                for (position, solo) in solo.iter().enumerate() {
                    assert_eq!(
                        &bits(run(lane, position, 7 + position as u32)),
                        solo,
                        "lane {lane} at {position}"
                    );
                }
            });
        }
    });
    drop(shared);
    // A whole model's gather: lane 0 hands its chunk in while lane 1, active, has not; the step waits for
    // lane 1 on the compute thread, not on lane 0's caller.
    let (gather_dir, stage) =
        TinyModel::llama(GgmlDType::Q4_1).scratch_stage("shared-inline-gather", 2);
    let shared = SharedStage::start(stage, StepPolicy::new(512, GATHER_WAIT)).expect("start");
    shared.activate(0, true);
    shared.activate(1, true);
    shared
        .forward(0, 0, StageInput::Tokens(&[7]), Logits::Last)
        .expect("forward after the gather");
    assert_eq!(
        by_callers(&shared),
        0,
        "a step that gathers runs on the compute thread"
    );
    shared.activate(1, false);
    shared
        .forward(0, 1, StageInput::Tokens(&[8]), Logits::Last)
        .expect("forward");
    assert_eq!(
        by_callers(&shared),
        0,
        "a stage whose steps gather keeps them on its compute thread, with nothing to gather for too"
    );
    drop(shared);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&gather_dir);
}

#[test]
fn in_front_of_a_chain_lanes_that_went_down_apart_come_back_into_one_step_and_a_lane_that_leaves_frees_it()
 {
    let (dir, shared) = chain_stage_zero("shared-hold", 2);
    let run = |lane: usize, position: usize| one_row_out(&shared, lane, position);
    shared.activate(0, true);
    shared.activate(1, true);
    // Nothing out yet: lane 0's first chunk runs at once; lane 1's, held for lane 0 out on its round trip (for
    // the shortest hold: no round trip is measured yet), runs in a step of its own.
    let first = (run(0, 0), run(1, 0));
    assert_eq!((first.0.chunks, first.1.chunks), (1, 1), "{first:?}");
    assert_ne!(first.0.id, first.1.id);
    // Round trips of 200 ms (a slow chain), so a hold lasts about 400 ms from here.
    std::thread::sleep(Duration::from_millis(200));
    // Lane 0 comes back while lane 1 is still out: it waits for lane 1, and both run in one step.
    std::thread::scope(|scope| {
        let early = scope.spawn(|| run(0, 1));
        std::thread::sleep(Duration::from_millis(3));
        let late = run(1, 1);
        let early = early.join().expect("lane 0");
        assert_eq!(early, late, "the two lanes ran in one step");
        assert_eq!(late.chunks, 2);
    });
    // Lane 1 leaves instead of coming back: lane 0, held for it, runs at once rather than at the hold's end.
    std::thread::scope(|scope| {
        let started = Instant::now();
        let alone = scope.spawn(|| run(0, 2));
        std::thread::sleep(Duration::from_millis(1));
        shared.activate(1, false);
        let alone = alone.join().expect("lane 0");
        assert_eq!(alone.chunks, 1);
        assert!(
            started.elapsed() < Duration::from_millis(150),
            "lane 0 was held {:?} for a lane that had left",
            started.elapsed()
        );
    });
    // A lane out that stays in its generation and does not come back holds the other for the hold's length,
    // and no longer.
    shared.activate(1, true);
    run(1, 2);
    let started = Instant::now();
    let tag = run(0, 3);
    let held = started.elapsed();
    assert_eq!(tag.chunks, 1);
    assert!(
        (HOLD_WAIT_MIN..HOLD_WAIT_MAX + Duration::from_millis(500)).contains(&held),
        "held {held:?}"
    );
    drop(shared);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn in_front_of_a_chain_a_new_generation_joins_the_batch_out_on_its_round_trip_and_runs_once_that_batch_leaves()
 {
    let (dir, shared) = chain_stage_zero("shared-join", 3);
    let run = |lane: usize, position: usize| one_row_out(&shared, lane, position);
    // Waits until `lane` has handed its chunk in, held or already run (so a test never rests on a thread being
    // scheduled in time).
    let handed_in = |lane: usize| {
        let deadline = Instant::now() + Duration::from_secs(30);
        while {
            let state = lock(&shared.shared.state);
            state.lanes[lane].pending.is_none() && state.lanes[lane].out.is_none()
        } {
            assert!(
                Instant::now() < deadline,
                "lane {lane} never handed its chunk in"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    // A stream with a round trip of 500 ms (a slow chain), so a hold lasts hundreds of milliseconds from here.
    shared.activate(0, true);
    run(0, 0);
    std::thread::sleep(Duration::from_millis(500));
    run(0, 1);
    // A generation starts on lane 1 while lane 0's row is out: its first chunk waits for lane 0 to come back,
    // and the two run in one step.
    std::thread::scope(|scope| {
        let joining = scope.spawn(|| {
            shared.activate(1, true);
            run(1, 0)
        });
        handed_in(1);
        let stream = run(0, 2);
        let joining = joining.join().expect("lane 1");
        assert_eq!(
            joining, stream,
            "the new generation joined the stream's step"
        );
        assert_eq!(stream.chunks, 2);
    });
    // Both out; a generation starts on lane 2, and the batch's lanes leave instead of coming back (their
    // generations ended): lane 2 runs at once, not at the hold's end.
    std::thread::scope(|scope| {
        let started = Instant::now();
        let alone = scope.spawn(|| {
            shared.activate(2, true);
            run(2, 0)
        });
        handed_in(2);
        shared.activate(0, false);
        shared.activate(1, false);
        let alone = alone.join().expect("lane 2");
        assert_eq!(alone.chunks, 1);
        assert!(
            started.elapsed() < Duration::from_millis(150),
            "lane 2 was held {:?} for lanes that had left",
            started.elapsed()
        );
    });
    drop(shared);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_chunk_longer_than_the_budget_gives_the_rows_of_one_pass() {
    use crate::model::testing::TinyModel;
    use crate::model::{StageOptions, StageSpec};
    use candle_core::quantized::GgmlDType;
    let model = TinyModel::llama(GgmlDType::Q4_1);
    let dir = std::env::temp_dir().join(format!("stage-server-shared-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch directory");
    let path = model.write_to_dir(&dir).expect("write the tiny model");
    let first = StageSpec::split(model.block_count, &[2]).expect("split")[0].clone();
    let load = || {
        Stage::load(
            &path,
            first.clone(),
            StageOptions {
                lane_count: 1,
                context_length: None,
            },
        )
        .expect("load")
    };
    let prompt: Vec<u32> = (0..11).map(|index| 40 + index).collect();
    let whole = load()
        .forward(0, 0, StageInput::Tokens(&prompt), Logits::Last)
        .expect("one pass");
    // A budget of 4 rows: the 11 rows run in three steps, their activation rows joined in order.
    let shared = SharedStage::start(load(), StepPolicy::new(4, Duration::ZERO)).expect("start");
    let stepped = shared
        .forward(0, 0, StageInput::Tokens(&prompt), Logits::Last)
        .expect("three steps");
    let bits = |output: &StageOutput| match output {
        StageOutput::Activations(values) | StageOutput::Logits(values) => values
            .iter()
            .map(|value| value.to_bits())
            .collect::<Vec<_>>(),
    };
    assert!(matches!(stepped, StageOutput::Activations(_)));
    assert_eq!(bits(&stepped), bits(&whole));
    drop(shared);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn in_front_of_a_chain_a_prompt_waits_for_one_announced_on_another_lane_and_a_stream_alone_never_does()
 {
    use crate::model::testing::TinyModel;
    use candle_core::quantized::GgmlDType;
    let (dir, stage) = TinyModel::llama(GgmlDType::Q4_1).scratch_stage("shared-arrivals", 3);
    // A long arrival wait, so that nothing here depends on how fast a thread is scheduled: a prompt waits
    // for an announced generation up to it, and a stream or an unannounced lane never does.
    let wait = Duration::from_secs(30);
    let shared = SharedStage::start(
        stage,
        StepPolicy {
            batches_in_flight: 1,
            arrival_wait: wait,
            ..StepPolicy::new(512, Duration::ZERO)
        },
    )
    .expect("start");
    let prompts: [Vec<u32>; 2] = [vec![5, 6, 7], vec![8, 9, 10, 11]];
    let prefill = |lane: usize| {
        shared.activate(lane, true);
        let (_, tag) = shared
            .forward_tagged(
                lane,
                0,
                StageInput::Tokens(&prompts[lane]),
                Logits::Last,
                true,
            )
            .expect("prefill");
        shared.activate(lane, false);
        tag
    };
    let reset_lanes = || {
        for lane in 0..3 {
            shared.with_stage(|stage| stage.reset(lane)).expect("reset");
        }
    };
    // Lane 1's generation is announced (its request left the queue) and becomes active only later, as a
    // chain lane's does after its Configure: lane 0's prompt waits for its first chunk, however long.
    let arrival = shared.expect_arrival_on(1);
    let (early, late) = std::thread::scope(|scope| {
        let early = scope.spawn(|| prefill(0));
        std::thread::sleep(Duration::from_millis(50));
        // A lane leaving meanwhile wakes the compute thread (and the callers): they keep the hold.
        shared.activate(2, true);
        shared.activate(2, false);
        std::thread::sleep(Duration::from_millis(50));
        let late = prefill(1);
        (early.join().expect("lane 0"), late)
    });
    assert_eq!(early, late, "both prompts in one step");
    assert_eq!(late.chunks, 2);
    // Its first chunk ended the arrival: the guard's drop counts nothing twice, and a prompt alone now runs
    // at once.
    drop(arrival);
    reset_lanes();
    let started = Instant::now();
    let alone = prefill(0);
    assert_eq!(alone.chunks, 1);
    assert!(started.elapsed() < wait, "a prompt waited for nobody");
    // A stream's row is never held for an arrival, nor is a prompt once the announced guard is dropped
    // without a chunk (a generation that failed before its prompt).
    reset_lanes();
    let arrival = shared.expect_arrival_on(1);
    let started = Instant::now();
    shared.activate(0, true);
    shared
        .forward_tagged(0, 0, StageInput::Tokens(&[5]), Logits::Last, true)
        .expect("a one-row step");
    shared.activate(0, false);
    assert!(
        started.elapsed() < wait,
        "a stream's row waited for an arrival"
    );
    reset_lanes();
    std::thread::scope(|scope| {
        let held = scope.spawn(|| prefill(0));
        std::thread::sleep(Duration::from_millis(50));
        drop(arrival);
        assert_eq!(held.join().expect("lane 0").chunks, 1);
    });
    assert!(
        started.elapsed() < wait,
        "a dropped arrival still held the step"
    );
    drop(shared);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_chunk_over_several_steps_is_tagged_with_its_rows_of_every_step() {
    use crate::model::testing::TinyModel;
    use candle_core::quantized::GgmlDType;
    let (dir, stage) = TinyModel::llama(GgmlDType::Q4_1).scratch_stage("shared-tag-rows", 1);
    // A budget of 4 rows a step: a 10-row prompt runs over 3 steps and goes on as one chunk of 10 rows.
    let shared = SharedStage::start(stage, StepPolicy::new(4, Duration::ZERO)).expect("start");
    let prompt: Vec<u32> = (0..10).map(|index| 5 + index).collect();
    let (_, tag) = shared
        .forward_tagged(0, 0, StageInput::Tokens(&prompt), Logits::Last, true)
        .expect("forward");
    assert_eq!((tag.id, tag.chunks, tag.rows), (3, 1, 10), "{tag:?}");
    drop(shared);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Waits until `lane` of `shared` has a chunk pending (handed in and not yet run).
fn pending_on(shared: &SharedStage, lane: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while lock(&shared.shared.state).lanes[lane].pending.is_none() {
        assert!(
            Instant::now() < deadline,
            "lane {lane} never handed its chunk in"
        );
        std::thread::sleep(Duration::from_micros(100));
    }
}

#[test]
fn a_prompt_waits_for_the_next_request_of_a_lane_freed_moments_ago_with_or_without_streams() {
    use crate::model::testing::TinyModel;
    use candle_core::quantized::GgmlDType;
    let (dir, stage) = TinyModel::llama(GgmlDType::Q4_1).scratch_stage("shared-freed", 4);
    // A whole model's steps with a gather far shorter than the test's hand-ins take, and waits for a free lane's
    // next request far longer: whatever joins a step here joins for that wait, however the threads are
    // scheduled (a step that waited in vain would run after 30 s, apart).
    let wait = Duration::from_secs(30);
    let shared = SharedStage::start(
        stage,
        StepPolicy {
            arrival_wait: wait,
            next_request_wait: wait,
            ..StepPolicy::new(512, Duration::from_micros(50))
        },
    )
    .expect("start");
    let prompt = |lane: usize, length: u32| {
        shared.with_stage(|stage| stage.reset(lane)).expect("reset");
        let tokens: Vec<u32> = (0..length).map(|index| 5 + index).collect();
        shared
            .forward_tagged(lane, 0, StageInput::Tokens(&tokens), Logits::Last, false)
            .expect("forward")
            .1
    };
    // Generations on `lanes` that end together.
    let end_together = |lanes: &[usize]| {
        for &lane in lanes {
            shared.activate(lane, true);
        }
        for &lane in lanes {
            shared.activate(lane, false);
        }
    };
    // The generations of lanes 0 and 1 end together; lane 0's client's next request comes first: its prompt
    // waits for lane 1's client's, and the two prefill in one pass.
    end_together(&[0, 1]);
    std::thread::scope(|scope| {
        let first = scope.spawn(|| {
            shared.activate(0, true);
            prompt(0, 4)
        });
        pending_on(&shared, 0);
        shared.activate(1, true);
        let second = prompt(1, 5);
        assert_eq!(
            first.join().expect("lane 0").id,
            second.id,
            "the two prompts ran in different steps"
        );
    });
    // With a stream decoding on lane 0: lanes 1 and 2 end together, and lane 2's next prompt stalls the stream
    // anyway, so the step waits for lane 1's next request too, and the stream's row and both prompts run in it.
    end_together(&[1, 2]);
    std::thread::scope(|scope| {
        let starting = scope.spawn(|| {
            shared.activate(2, true);
            prompt(2, 3)
        });
        pending_on(&shared, 2);
        let stream = scope.spawn(|| {
            shared
                .forward_tagged(0, 4, StageInput::Tokens(&[9]), Logits::Last, false)
                .expect("the stream's row")
                .1
        });
        pending_on(&shared, 0);
        shared.activate(1, true);
        let joining = prompt(1, 2);
        let (stream, starting) = (
            stream.join().expect("lane 0"),
            starting.join().expect("lane 2"),
        );
        assert_eq!(
            (stream.id, starting.id),
            (joining.id, joining.id),
            "the stream's row and the two prompts ran in different steps"
        );
    });
    // A new generation on a lane other than the one just freed is taken for that lane's client's next request:
    // lane 3's prompt does not wait for lane 1's window.
    end_together(&[1]);
    let started = Instant::now();
    shared.activate(3, true);
    prompt(3, 3);
    assert!(
        started.elapsed() < wait / 2,
        "a prompt waited {:?} for a request that had already come",
        started.elapsed()
    );
    drop(shared);
    let _ = std::fs::remove_dir_all(&dir);
}
