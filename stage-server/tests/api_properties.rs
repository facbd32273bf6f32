//! Properties of the API's sans-IO half: stop strings cut streamed text as they cut whole text, decoders never panic.

use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use serde_json::{Map, Number, Value};
use stage_server::api::{
    StopMatcher, decode_chat, decode_completion, decode_detokenize, decode_tokenize,
};

/// Characters of one, two, three and four UTF-8 bytes, few enough that stop strings match often.
const ALPHABET: &[char] = &['a', 'b', '\n', 'é', 'ü', '日', '🎉'];

fn text(max: usize) -> impl Strategy<Value = String> {
    vec(proptest::sample::select(ALPHABET), 0..max).prop_map(|chars| chars.into_iter().collect())
}

/// A text and up to four stop strings: random ones, and pieces of the text itself so that matches, overlaps and
/// stops inside other stops (`"b"` in `"abc"`) are common rather than rare.
fn text_and_stops() -> impl Strategy<Value = (String, Vec<String>)> {
    let stop = prop_oneof![
        text(4).prop_map(|stop| (None, stop)),
        (any::<usize>(), 1usize..5)
            .prop_map(|(start, length)| (Some((start, length)), String::new())),
    ];
    (text(40), vec(stop, 0..4)).prop_map(|(text, stops)| {
        let chars: Vec<char> = text.chars().collect();
        let stops = stops
            .into_iter()
            .map(|(slice, random)| match slice {
                Some((start, length)) if !chars.is_empty() => {
                    let start = start % chars.len();
                    let end = (start + length).min(chars.len());
                    chars[start..end].iter().collect()
                }
                _ => random,
            })
            .collect();
        (text, stops)
    })
}

/// Where the whole text is cut: before the stop occurrence that ends first, the longest of those on a tie.
fn reference_cut(text: &str, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter(|stop| !stop.is_empty())
        .filter_map(|stop| {
            let start = text.find(stop.as_str())?;
            Some((start + stop.len(), start))
        })
        .min()
        .map(|(_, start)| start)
}

/// `text` split at the character positions in `cuts` (taken modulo the character count).
fn pieces(text: &str, cuts: &[usize]) -> Vec<String> {
    let boundaries: Vec<usize> = text
        .char_indices()
        .map(|(index, _)| index)
        .chain([text.len()])
        .collect();
    let mut points: Vec<usize> = cuts
        .iter()
        .map(|cut| boundaries[cut % boundaries.len()])
        .chain([0, text.len()])
        .collect();
    points.sort_unstable();
    points.dedup();
    points
        .windows(2)
        .map(|pair| text[pair[0]..pair[1]].to_owned())
        // Empty pieces happen too (a token whose text is empty); keep one in the mix.
        .chain([String::new()])
        .collect()
}

/// Any JSON value nested up to `depth` levels, numbers of every kind included (huge, negative, fractional).
fn json_value(depth: u32) -> impl Strategy<Value = Value> {
    let number = prop_oneof![
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(|float| Number::from_f64(float).map_or(Value::Null, Value::Number)),
        (-3i64..25).prop_map(Value::from),
        (-3.0f64..3.0).prop_map(Value::from),
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        number,
        text(6).prop_map(Value::String),
        "[0-9]{1,11}".prop_map(Value::String),
    ];
    leaf.prop_recursive(depth, 12 * depth, 6, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..6).prop_map(Value::Array),
            btree_map(key(), inner, 0..6)
                .prop_map(|entries| Value::Object(entries.into_iter().collect())),
        ]
    })
}

/// Field names the decoders read, and a few they do not, so random objects reach deep into the checks.
fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        proptest::sample::select(vec![
            "messages",
            "role",
            "content",
            "type",
            "text",
            "prompt",
            "model",
            "max_tokens",
            "max_completion_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repeat_penalty",
            "seed",
            "stop",
            "logprobs",
            "top_logprobs",
            "n",
            "stream",
            "stream_options",
            "include_usage",
            "logit_bias",
            "tokens",
            "add_special",
            "with_pieces",
            "user",
            "7",
        ])
        .prop_map(str::to_owned),
        "[a-z0-9_]{0,8}",
    ]
}

/// A chat or completion body with known fields holding random values: close enough to valid that the
/// decoders get past the first check.
fn near_valid_body() -> impl Strategy<Value = Value> {
    let message = btree_map(
        proptest::sample::select(vec!["role", "content"]).prop_map(str::to_owned),
        json_value(2),
        0..3,
    )
    .prop_map(|entries| Value::Object(entries.into_iter().collect()));
    (
        vec(message, 0..3),
        json_value(2),
        btree_map(key(), json_value(2), 0..8),
    )
        .prop_map(|(messages, prompt, fields)| {
            let mut object: Map<String, Value> = fields.into_iter().collect();
            object.insert("messages".into(), Value::Array(messages));
            object.insert("prompt".into(), prompt);
            Value::Object(object)
        })
}

/// Every decoder on `body`: none may panic, and every refusal is a 400 with a parseable envelope.
fn decode_all(body: &[u8]) -> Result<(), TestCaseError> {
    let errors = [
        decode_chat(body).err(),
        decode_completion(body).err(),
        decode_tokenize(body).err(),
        decode_detokenize(body).err(),
    ];
    for error in errors.into_iter().flatten() {
        prop_assert_eq!(error.status, 400, "a refusal was not a 400: {:?}", error);
        prop_assert!(
            serde_json::from_str::<Value>(&error.to_json()).is_ok(),
            "the envelope is not JSON: {}",
            error.to_json()
        );
        if let Some(param) = &error.param {
            prop_assert!(!param.is_empty(), "an error named an empty field");
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2048))]

    #[test]
    fn streamed_stop_matching_equals_cutting_the_whole_text(
        (text, stops) in text_and_stops(),
        cuts in vec(any::<usize>(), 0..12),
    ) {
        let cut = reference_cut(&text, &stops);
        let expected = &text[..cut.unwrap_or(text.len())];
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        let mut matcher = StopMatcher::new(&stops);
        let mut released = String::new();
        let mut pushed = String::new();
        let mut stopped = false;
        for piece in pieces(&text, &cuts) {
            pushed.push_str(&piece);
            let release = matcher.push(&piece);
            prop_assert!(
                !stopped || (release.text.is_empty() && release.stopped),
                "text {:?} came after the stop", release.text
            );
            stopped = release.stopped;
            released.push_str(&release.text);
            prop_assert!(
                expected.starts_with(&released),
                "released {:?}, which runs past the cut text {:?}", released, expected
            );
            if !stopped {
                let held = matcher.held_back();
                prop_assert_eq!(
                    format!("{released}{held}"), pushed.clone(),
                    "released and held text do not add up to what was pushed"
                );
                prop_assert!(
                    held.is_empty() || held.len() < longest,
                    "held {:?}, not shorter than the longest stop ({} bytes)", held, longest
                );
                prop_assert!(
                    held.is_empty() || stops.iter().any(|stop| stop.starts_with(held)),
                    "held {:?}, which starts no stop string", held
                );
            }
        }
        if !stopped {
            released.push_str(&matcher.finish());
        } else {
            prop_assert_eq!(matcher.finish(), "", "finish returned text after a stop");
        }
        prop_assert_eq!(stopped, cut.is_some(), "stopped disagrees with whether a stop occurs");
        prop_assert_eq!(released.as_str(), expected);
    }

}

proptest! {
    // Random JSON costs more to build than to decode; 512 bodies each keep the file near a second in debug.
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn decoders_never_panic_on_random_json(value in json_value(4)) {
        decode_all(value.to_string().as_bytes())?;
    }

    #[test]
    fn decoders_never_panic_on_near_valid_bodies(value in near_valid_body()) {
        decode_all(value.to_string().as_bytes())?;
    }

    #[test]
    fn decoders_never_panic_on_random_bytes(bytes in vec(any::<u8>(), 0..64)) {
        decode_all(&bytes)?;
    }
}
