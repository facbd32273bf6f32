//! Pinned shapes of the OpenAI-compatible API: every error envelope, the refusal of each request rule, bodies and chunks.

use std::fmt::Write;

use serde_json::{Value, json};
use stage_server::api::{
    ApiError, FinishReason, Reply, TokenLogprob, TopLogprob, Usage, chat_chunk_content,
    chat_chunk_finish, chat_chunk_role, chat_completion, completion, completion_chunk, decode_chat,
    decode_completion, decode_detokenize, decode_tokenize, detokenize_response, models_list,
    tokenize_response, usage_chunk,
};

/// A chat reply with fixed id and time, so snapshots do not change between runs.
const CHAT: Reply<'static> = Reply {
    id: "chatcmpl-0123456789abcdefghijABCD",
    created: 1_700_000_000,
    model: "SmolLM2-135M-Instruct",
    fingerprint: "fp_1a2b3c4d",
};

/// The completion reply matching [`CHAT`].
const TEXT: Reply<'static> = Reply {
    id: "cmpl-0123456789abcdefghijABCD",
    ..CHAT
};

const USAGE: Usage = Usage {
    prompt_tokens: 12,
    completion_tokens: 3,
    cached_tokens: 8,
};

/// The envelope text with its status on the line before.
fn envelope(error: &ApiError) -> String {
    format!("{}\n{}", error.status, error.to_json())
}

fn alternative(token: &str, logprob: f32) -> TopLogprob {
    TopLogprob {
        token: token.to_owned(),
        bytes: token.as_bytes().to_vec(),
        logprob,
    }
}

/// Three generated tokens, "Hi", " there" and "!", with two alternatives each; the last one's bytes are a
/// lone UTF-8 lead byte, as a byte-fallback token's are.
fn logprobs() -> Vec<TokenLogprob> {
    vec![
        TokenLogprob {
            token: "Hi".into(),
            bytes: b"Hi".to_vec(),
            logprob: -0.25,
            top: vec![alternative("Hi", -0.25), alternative("Hello", -1.5)],
            text_offset: 0,
        },
        TokenLogprob {
            token: " there".into(),
            bytes: b" there".to_vec(),
            logprob: -0.5,
            top: vec![alternative(" there", -0.5), alternative("!", -2.0)],
            text_offset: 2,
        },
        TokenLogprob {
            token: "\u{fffd}".into(),
            bytes: vec![0xe2],
            logprob: -0.125,
            top: vec![
                TopLogprob {
                    token: "\u{fffd}".into(),
                    bytes: vec![0xe2],
                    logprob: -0.125,
                },
                alternative(".", -3.0),
            ],
            text_offset: 8,
        },
    ]
}

#[test]
fn an_invalid_field_envelope() {
    insta::assert_snapshot!(envelope(&ApiError::invalid(
        "top_p",
        "`top_p` must be between 0 and 1; got 1.5"
    )));
}

#[test]
fn a_bad_body_envelope() {
    insta::assert_snapshot!(envelope(&ApiError::bad_body(
        "the request body is not valid JSON"
    )));
}

#[test]
fn a_model_not_found_envelope() {
    insta::assert_snapshot!(envelope(&ApiError::model_not_found("gpt-4o")));
}

#[test]
fn an_unauthorized_envelope() {
    insta::assert_snapshot!(envelope(&ApiError::unauthorized()));
}

#[test]
fn a_context_exceeded_envelope() {
    insta::assert_snapshot!(envelope(&ApiError::context_exceeded(
        "messages", 9000, 8192
    )));
}

#[test]
fn an_overloaded_envelope() {
    insta::assert_snapshot!(envelope(&ApiError::overloaded(
        "all 4 slots are busy and 16 requests are queued; retry shortly"
    )));
}

#[test]
fn a_route_not_found_envelope() {
    insta::assert_snapshot!(envelope(&ApiError::route_not_found(
        "POST",
        "/v1/embeddings"
    )));
}

#[test]
fn a_method_not_allowed_envelope() {
    insta::assert_snapshot!(envelope(&ApiError::method_not_allowed(
        "GET",
        "/v1/chat/completions"
    )));
}

#[test]
fn an_unavailable_envelope() {
    insta::assert_snapshot!(envelope(&ApiError::unavailable("Loading model")));
}

#[test]
fn a_server_error_envelope() {
    insta::assert_snapshot!(envelope(&ApiError::server_error(
        "stage 1 at 10.0.0.2:7000 closed the link mid-request"
    )));
}

#[test]
fn the_http_layers_envelopes() {
    let mut text = String::new();
    for (status, message) in [
        (400, "malformed request head"),
        (413, "the body is over the limit of 1048576 bytes"),
        (431, "the request head is over the limit of 16384 bytes"),
        (501, "Transfer-Encoding gzip is not supported"),
        (505, "only HTTP/1.1 and HTTP/1.0 are served"),
    ] {
        writeln!(
            text,
            "{}",
            envelope(&ApiError::from_status(status, message))
        )
        .unwrap();
    }
    insta::assert_snapshot!(text);
}

/// One refused body per request rule, with the error it gets: `route body => status param: message`.
#[test]
fn each_request_rule_refuses_with_its_own_message() {
    let message = json!([{"role": "user", "content": "hi"}]);
    let chat = |extra: Value| {
        let mut body = json!({"messages": message});
        for (key, value) in extra.as_object().unwrap() {
            body[key] = value.clone();
        }
        body.to_string()
    };
    let cases: Vec<(&str, String)> = vec![
        ("chat", "{\"messages\": [".to_owned()),
        ("chat", "[]".to_owned()),
        ("chat", "{}".to_owned()),
        ("chat", json!({"messages": []}).to_string()),
        ("chat", json!({"messages": [7]}).to_string()),
        ("chat", json!({"messages": [{"content": "hi"}]}).to_string()),
        (
            "chat",
            json!({"messages": [{"role": "user", "content": null}]}).to_string(),
        ),
        (
            "chat",
            json!({"messages": [{"role": "user", "content": {"text": "hi"}}]}).to_string(),
        ),
        (
            "chat",
            json!({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}
            ]}]})
            .to_string(),
        ),
        ("chat", chat(json!({"model": 4}))),
        ("chat", chat(json!({"max_tokens": 0}))),
        ("chat", chat(json!({"max_completion_tokens": 1.5}))),
        ("chat", chat(json!({"temperature": 2.5}))),
        ("chat", chat(json!({"top_p": -0.1}))),
        ("chat", chat(json!({"top_k": -1}))),
        ("chat", chat(json!({"min_p": 1.01}))),
        ("chat", chat(json!({"presence_penalty": 3}))),
        ("chat", chat(json!({"frequency_penalty": "high"}))),
        ("chat", chat(json!({"repeat_penalty": 0}))),
        ("chat", chat(json!({"seed": 1e300}))),
        ("chat", chat(json!({"stop": {"a": 1}}))),
        ("chat", chat(json!({"stop": ["ok", false]}))),
        ("chat", chat(json!({"logprobs": "yes"}))),
        ("chat", chat(json!({"top_logprobs": 2}))),
        ("chat", chat(json!({"logprobs": true, "top_logprobs": 21}))),
        ("chat", chat(json!({"n": 2}))),
        ("chat", chat(json!({"stream": 1}))),
        (
            "chat",
            chat(json!({"stream_options": {"include_usage": "yes"}})),
        ),
        ("chat", chat(json!({"logit_bias": {"dog": 5}}))),
        ("chat", chat(json!({"logit_bias": {"42": -101}}))),
        ("completion", json!({}).to_string()),
        ("completion", json!({"prompt": ["a", "b"]}).to_string()),
        ("completion", json!({"prompt": [1, 2, -3]}).to_string()),
        (
            "completion",
            json!({"prompt": "a", "logprobs": 25}).to_string(),
        ),
        ("tokenize", json!({}).to_string()),
        (
            "tokenize",
            json!({"content": "a", "with_pieces": 1}).to_string(),
        ),
        (
            "detokenize",
            json!({"tokens": [1, 4294967296u64]}).to_string(),
        ),
    ];
    let mut text = String::new();
    for (route, body) in cases {
        let result = match route {
            "chat" => decode_chat(body.as_bytes()).map(drop),
            "completion" => decode_completion(body.as_bytes()).map(drop),
            "tokenize" => decode_tokenize(body.as_bytes()).map(drop),
            _ => decode_detokenize(body.as_bytes()).map(drop),
        };
        let error = result.expect_err(&format!("{route} accepted {body}"));
        writeln!(
            text,
            "{route} {body}\n  => {} {}: {}",
            error.status,
            error.param.as_deref().unwrap_or("-"),
            error.message
        )
        .unwrap();
    }
    insta::assert_snapshot!(text);
}

#[test]
fn a_chat_completion() {
    insta::assert_snapshot!(chat_completion(
        &CHAT,
        "Hi there!",
        FinishReason::Stop,
        &USAGE,
        None
    ));
}

#[test]
fn a_chat_completion_with_logprobs() {
    insta::assert_snapshot!(chat_completion(
        &CHAT,
        "Hi there\u{fffd}",
        FinishReason::Length,
        &USAGE,
        Some(&logprobs())
    ));
}

#[test]
fn a_completion() {
    insta::assert_snapshot!(completion(
        &TEXT,
        " jumps over",
        FinishReason::Length,
        &USAGE,
        None
    ));
}

#[test]
fn a_completion_with_legacy_logprobs() {
    insta::assert_snapshot!(completion(
        &TEXT,
        "Hi there\u{fffd}",
        FinishReason::Stop,
        &USAGE,
        Some(&logprobs())
    ));
}

#[test]
fn a_chat_role_chunk() {
    insta::assert_snapshot!(chat_chunk_role(&CHAT));
}

#[test]
fn a_chat_content_chunk() {
    insta::assert_snapshot!(chat_chunk_content(&CHAT, "Hi", None));
}

#[test]
fn a_chat_content_chunk_with_logprobs() {
    insta::assert_snapshot!(chat_chunk_content(&CHAT, "Hi", Some(&logprobs()[..1])));
}

#[test]
fn a_chat_finish_chunk() {
    insta::assert_snapshot!(chat_chunk_finish(&CHAT, FinishReason::Stop));
}

#[test]
fn a_completion_chunk() {
    insta::assert_snapshot!(completion_chunk(&TEXT, " jumps", None, None));
}

#[test]
fn a_completion_chunk_with_logprobs_later_in_the_text() {
    insta::assert_snapshot!(completion_chunk(
        &TEXT,
        " there\u{fffd}",
        Some(&logprobs()[1..]),
        None
    ));
}

#[test]
fn a_final_completion_chunk() {
    insta::assert_snapshot!(completion_chunk(
        &TEXT,
        "",
        None,
        Some(FinishReason::Length)
    ));
}

#[test]
fn a_chat_usage_chunk() {
    insta::assert_snapshot!(usage_chunk(&CHAT, true, &USAGE));
}

#[test]
fn a_completion_usage_chunk() {
    insta::assert_snapshot!(usage_chunk(&TEXT, false, &USAGE));
}

#[test]
fn the_models_list() {
    insta::assert_snapshot!(models_list("SmolLM2-135M-Instruct", 1_700_000_000));
}

#[test]
fn tokenize_and_detokenize_answers() {
    let pieces = ["Hi".to_owned(), " there".to_owned()];
    let text = format!(
        "{}\n{}\n{}",
        tokenize_response(&[9906, 1070], None),
        tokenize_response(&[9906, 1070], Some(&pieces)),
        detokenize_response("Hi there\n\"quoted\"")
    );
    insta::assert_snapshot!(text);
}

#[test]
fn every_response_is_one_line_of_json() {
    let logprobs = logprobs();
    let bodies = [
        chat_completion(&CHAT, "a\nb", FinishReason::Stop, &USAGE, Some(&logprobs)),
        completion(&TEXT, "a\nb", FinishReason::Stop, &USAGE, Some(&logprobs)),
        chat_chunk_role(&CHAT),
        chat_chunk_content(&CHAT, "line\nbreak", Some(&logprobs)),
        chat_chunk_finish(&CHAT, FinishReason::Length),
        completion_chunk(
            &TEXT,
            "line\nbreak",
            Some(&logprobs),
            Some(FinishReason::Stop),
        ),
        usage_chunk(&CHAT, true, &USAGE),
        ApiError::server_error("two\nlines").to_json(),
    ];
    for body in bodies {
        assert!(
            !body.contains('\n'),
            "a raw newline would split an SSE data line: {body}"
        );
        serde_json::from_str::<Value>(&body)
            .unwrap_or_else(|error| panic!("not JSON ({error}): {body}"));
    }
}
