//! Response bodies and stream chunks in OpenAI's shapes, plus llama-server's tokenize and detokenize answers.
//!
//! Every function returns compact JSON (no raw newline, so one SSE `data:` line per chunk is safe). Fields come
//! in OpenAI's order: the structs below are serialised with serde's derive, which keeps declaration order.

use std::hash::{BuildHasher, RandomState};

use serde::Serialize;
use serde::ser::{SerializeMap, Serializer};

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// The model ended its turn, or a stop string matched.
    Stop,
    /// `max_tokens` or the context ran out.
    Length,
}

/// Token counts of one request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Tokens in the prompt, cached ones included.
    pub prompt_tokens: usize,
    /// Tokens generated.
    pub completion_tokens: usize,
    /// Prompt tokens whose cache entries were reused rather than computed.
    pub cached_tokens: usize,
}

/// One alternative at a token position.
#[derive(Clone, Debug, PartialEq)]
pub struct TopLogprob {
    /// The token's text (lossy when it is part of a multi-byte character).
    pub token: String,
    /// The token's exact bytes.
    pub bytes: Vec<u8>,
    /// Its natural-log probability.
    pub logprob: f32,
}

/// A generated token with its log probability and the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprob {
    /// The token's text (lossy when it is part of a multi-byte character).
    pub token: String,
    /// The token's exact bytes.
    pub bytes: Vec<u8>,
    /// Its natural-log probability.
    pub logprob: f32,
    /// The alternatives, most likely first.
    pub top: Vec<TopLogprob>,
    /// Where the token's text starts in the completion, in characters. The tokens of a character split over
    /// several start where it does; bytes that make no character (one U+FFFD in the text) belong to the token
    /// that brought the first of them, and the token after starts after it.
    pub text_offset: usize,
}

/// What every response and chunk of one request repeats.
#[derive(Clone, Copy, Debug)]
pub struct Reply<'a> {
    /// `chatcmpl-...` or `cmpl-...`, from [`new_id`]; the same in every chunk of a stream.
    pub id: &'a str,
    /// Unix seconds when the request was accepted.
    pub created: u64,
    /// The model name the server reports.
    pub model: &'a str,
    /// `system_fingerprint`: names the model build, so clients can tell when answers may change.
    pub fingerprint: &'a str,
}

impl FinishReason {
    /// OpenAI's `finish_reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// Characters an id's random part is drawn from.
const ID_ALPHABET: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
/// Length of an id's random part, as OpenAI's.
const ID_LENGTH: usize = 24;

/// A fresh response id: `prefix` (`chatcmpl-`, `cmpl-`) and 24 random letters and digits (about 143 bits).
///
/// The randomness is the kernel's (`/dev/urandom`, one read of 16 bytes per pass); if that cannot be read,
/// std's randomly keyed hasher stands in, since an id needs to be unique, not secret.
pub fn new_id(prefix: &str) -> String {
    let mut id = String::with_capacity(prefix.len() + ID_LENGTH);
    id.push_str(prefix);
    let mut drawn = 0;
    while drawn < ID_LENGTH {
        for byte in random_bytes() {
            // 248 = 4 x 62: dropping the bytes above it makes every character equally likely.
            if byte >= 248 || drawn == ID_LENGTH {
                continue;
            }
            id.push(char::from(ID_ALPHABET[usize::from(byte % 62)]));
            drawn += 1;
        }
    }
    id
}

/// A non-streamed `chat.completion` body.
pub fn chat_completion(
    reply: &Reply,
    text: &str,
    finish: FinishReason,
    usage: &Usage,
    logprobs: Option<&[TokenLogprob]>,
) -> String {
    let choice = ChatChoice {
        index: 0,
        message: Message {
            role: "assistant",
            content: text,
        },
        logprobs: logprobs.map(|tokens| ChatLogprobs { content: tokens }),
        finish_reason: finish.as_str(),
    };
    to_json(&Body::new(reply, "chat.completion", &[choice], Some(usage)))
}

/// A non-streamed `text_completion` body, with logprobs in the legacy shape: parallel `tokens`,
/// `token_logprobs`, `top_logprobs` (a `{token: logprob}` object per position) and `text_offset` (the
/// character offset where each token starts in `text`, from [`TokenLogprob::text_offset`]).
pub fn completion(
    reply: &Reply,
    text: &str,
    finish: FinishReason,
    usage: &Usage,
    logprobs: Option<&[TokenLogprob]>,
) -> String {
    let choice = TextChoice {
        text,
        index: 0,
        logprobs: logprobs.map(LegacyLogprobs::new),
        finish_reason: Some(finish.as_str()),
    };
    to_json(&Body::new(reply, "text_completion", &[choice], Some(usage)))
}

/// A stream's first chat chunk: the assistant role with empty content, as OpenAI sends it.
pub fn chat_chunk_role(reply: &Reply) -> String {
    chat_chunk(
        reply,
        Delta {
            role: Some("assistant"),
            content: Some(""),
        },
        None,
        None,
    )
}

/// A chat chunk carrying generated text, and the logprobs of the tokens that made it when asked for.
pub fn chat_chunk_content(reply: &Reply, text: &str, logprobs: Option<&[TokenLogprob]>) -> String {
    chat_chunk(
        reply,
        Delta {
            role: None,
            content: Some(text),
        },
        logprobs,
        None,
    )
}

/// A stream's last chat chunk before any usage chunk: an empty delta and the finish reason.
pub fn chat_chunk_finish(reply: &Reply, finish: FinishReason) -> String {
    chat_chunk(
        reply,
        Delta {
            role: None,
            content: None,
        },
        None,
        Some(finish),
    )
}

/// A streamed `text_completion` chunk. Its logprobs' `text_offset`s count characters from the start of the
/// whole completion ([`TokenLogprob::text_offset`]), as a non-streamed answer's do.
pub fn completion_chunk(
    reply: &Reply,
    text: &str,
    logprobs: Option<&[TokenLogprob]>,
    finish: Option<FinishReason>,
) -> String {
    let choice = TextChoice {
        text,
        index: 0,
        logprobs: logprobs.map(LegacyLogprobs::new),
        finish_reason: finish.map(FinishReason::as_str),
    };
    to_json(&Body::new(reply, "text_completion", &[choice], None))
}

/// A stream's usage chunk (`stream_options.include_usage`): no choices, the token counts. `chat` picks the
/// object name of a chat stream or a completion stream.
pub fn usage_chunk(reply: &Reply, chat: bool, usage: &Usage) -> String {
    let object = if chat {
        "chat.completion.chunk"
    } else {
        "text_completion"
    };
    let none: &[TextChoice] = &[];
    to_json(&Body::new(reply, object, none, Some(usage)))
}

/// The `/v1/models` body: a list of the one model this server runs.
pub fn models_list(id: &str, created: u64) -> String {
    to_json(&ModelList {
        object: "list",
        data: [ModelEntry {
            id,
            object: "model",
            created,
            owned_by: "stage-server",
        }],
    })
}

/// llama-server's `/tokenize` answer: `{"tokens": [ids]}`, or with `pieces` `{"tokens": [{"id", "piece"}]}`.
/// `pieces` pairs with `tokens` by position; a token past the end of `pieces` gets an empty piece.
pub fn tokenize_response(tokens: &[u32], pieces: Option<&[String]>) -> String {
    match pieces {
        None => to_json(&Tokens { tokens }),
        Some(pieces) => {
            let tokens: Vec<Piece> = tokens
                .iter()
                .enumerate()
                .map(|(index, &id)| Piece {
                    id,
                    piece: pieces.get(index).map_or("", String::as_str),
                })
                .collect();
            to_json(&Tokens { tokens })
        }
    }
}

/// llama-server's `/detokenize` answer: `{"content": text}`.
pub fn detokenize_response(content: &str) -> String {
    to_json(&Content { content })
}

/// The frame shared by completions, chunks and usage chunks.
#[derive(Serialize)]
struct Body<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    system_fingerprint: &'a str,
    choices: &'a [C],
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<UsageJson>,
}

/// OpenAI's usage object.
#[derive(Serialize)]
struct UsageJson {
    prompt_tokens: usize,
    completion_tokens: usize,
    total_tokens: usize,
    prompt_tokens_details: PromptDetails,
}

#[derive(Serialize)]
struct PromptDetails {
    cached_tokens: usize,
}

/// A non-streamed chat choice.
#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: Message<'a>,
    logprobs: Option<ChatLogprobs<'a>>,
    finish_reason: &'static str,
}

#[derive(Serialize)]
struct Message<'a> {
    role: &'static str,
    content: &'a str,
}

/// A streamed chat choice.
#[derive(Serialize)]
struct ChunkChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<ChatLogprobs<'a>>,
    finish_reason: Option<&'static str>,
}

/// What a chat chunk adds; the finish chunk's is `{}`.
#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

/// Chat logprobs: `{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`.
#[derive(Serialize)]
struct ChatLogprobs<'a> {
    #[serde(serialize_with = "chat_tokens")]
    content: &'a [TokenLogprob],
}

#[derive(Serialize)]
struct ChatToken<'a> {
    token: &'a str,
    logprob: f32,
    bytes: &'a [u8],
    top_logprobs: Vec<ChatAlternative<'a>>,
}

#[derive(Serialize)]
struct ChatAlternative<'a> {
    token: &'a str,
    logprob: f32,
    bytes: &'a [u8],
}

/// A completion choice, streamed or not.
#[derive(Serialize)]
struct TextChoice<'a> {
    text: &'a str,
    index: u32,
    logprobs: Option<LegacyLogprobs<'a>>,
    finish_reason: Option<&'static str>,
}

/// The completions API's parallel-array logprobs.
#[derive(Serialize)]
struct LegacyLogprobs<'a> {
    tokens: Vec<&'a str>,
    token_logprobs: Vec<f32>,
    top_logprobs: Vec<Alternatives<'a>>,
    text_offset: Vec<usize>,
}

/// One position's alternatives as a `{token: logprob}` object.
struct Alternatives<'a>(&'a [TopLogprob]);

#[derive(Serialize)]
struct ModelList<'a> {
    object: &'static str,
    data: [ModelEntry<'a>; 1],
}

#[derive(Serialize)]
struct ModelEntry<'a> {
    id: &'a str,
    object: &'static str,
    created: u64,
    owned_by: &'static str,
}

#[derive(Serialize)]
struct Tokens<T> {
    tokens: T,
}

#[derive(Serialize)]
struct Piece<'a> {
    id: u32,
    piece: &'a str,
}

#[derive(Serialize)]
struct Content<'a> {
    content: &'a str,
}

impl<'a, C> Body<'a, C> {
    fn new(
        reply: &Reply<'a>,
        object: &'static str,
        choices: &'a [C],
        usage: Option<&Usage>,
    ) -> Self {
        Self {
            id: reply.id,
            object,
            created: reply.created,
            model: reply.model,
            system_fingerprint: reply.fingerprint,
            choices,
            usage: usage.map(UsageJson::from),
        }
    }
}

impl<'a> LegacyLogprobs<'a> {
    /// The parallel arrays of `tokens`.
    fn new(tokens: &'a [TokenLogprob]) -> Self {
        Self {
            tokens: tokens.iter().map(|token| token.token.as_str()).collect(),
            token_logprobs: tokens.iter().map(|token| token.logprob).collect(),
            top_logprobs: tokens
                .iter()
                .map(|token| Alternatives(&token.top))
                .collect(),
            text_offset: tokens.iter().map(|token| token.text_offset).collect(),
        }
    }
}

impl From<&Usage> for UsageJson {
    fn from(usage: &Usage) -> Self {
        Self {
            prompt_tokens: usage.prompt_tokens,
            completion_tokens: usage.completion_tokens,
            total_tokens: usage.prompt_tokens + usage.completion_tokens,
            prompt_tokens_details: PromptDetails {
                cached_tokens: usage.cached_tokens,
            },
        }
    }
}

impl Serialize for Alternatives<'_> {
    /// Two alternatives can share a text (different byte tokens that decode to the same replacement
    /// character); an object cannot hold a key twice, so the first, more likely one is kept.
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(None)?;
        for (index, alternative) in self.0.iter().enumerate() {
            let earlier = &self.0[..index];
            if earlier.iter().any(|seen| seen.token == alternative.token) {
                continue;
            }
            map.serialize_entry(&alternative.token, &alternative.logprob)?;
        }
        map.end()
    }
}

/// Serialises chat logprob tokens with their alternatives in OpenAI's field names.
fn chat_tokens<S: Serializer>(tokens: &&[TokenLogprob], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_seq(tokens.iter().map(|token| {
        ChatToken {
            token: &token.token,
            logprob: token.logprob,
            bytes: &token.bytes,
            top_logprobs: token
                .top
                .iter()
                .map(|alternative| ChatAlternative {
                    token: &alternative.token,
                    logprob: alternative.logprob,
                    bytes: &alternative.bytes,
                })
                .collect(),
        }
    }))
}

/// One `chat.completion.chunk`.
fn chat_chunk(
    reply: &Reply,
    delta: Delta,
    logprobs: Option<&[TokenLogprob]>,
    finish: Option<FinishReason>,
) -> String {
    let choice = ChunkChoice {
        index: 0,
        delta,
        logprobs: logprobs.map(|tokens| ChatLogprobs { content: tokens }),
        finish_reason: finish.map(FinishReason::as_str),
    };
    to_json(&Body::new(reply, "chat.completion.chunk", &[choice], None))
}

/// Compact JSON of a value that always serialises: string keys only, and serde_json writes a non-finite
/// float as `null` rather than failing.
fn to_json<T: Serialize>(value: &T) -> String {
    serde_json::to_string(value).expect("response shapes always serialise")
}

/// 16 random bytes: the kernel's, or a randomly keyed hash of the time and a counter when it cannot be read.
fn random_bytes() -> [u8; 16] {
    if let Ok(bytes) = crate::wire::try_fresh_nonce() {
        return bytes;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    let state = RandomState::new();
    let low = state.hash_one((nanos, 0u8));
    let high = state.hash_one((nanos, 1u8));
    let mut bytes = [0; 16];
    bytes[..8].copy_from_slice(&low.to_le_bytes());
    bytes[8..].copy_from_slice(&high.to_le_bytes());
    bytes
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    const REPLY: Reply<'static> = Reply {
        id: "chatcmpl-test",
        created: 1_700_000_000,
        model: "tiny",
        fingerprint: "fp_0123",
    };

    fn parse(text: &str) -> Value {
        serde_json::from_str(text).expect("a response is not JSON")
    }

    fn token(text: &str, logprob: f32, top: &[(&str, f32)]) -> TokenLogprob {
        TokenLogprob {
            token: text.to_owned(),
            bytes: text.as_bytes().to_vec(),
            logprob,
            top: top
                .iter()
                .map(|&(token, logprob)| TopLogprob {
                    token: token.to_owned(),
                    bytes: token.as_bytes().to_vec(),
                    logprob,
                })
                .collect(),
            text_offset: 0,
        }
    }

    #[test]
    fn ids_have_the_prefix_and_24_alphanumerics_and_differ() {
        let id = new_id("chatcmpl-");
        let random = id.strip_prefix("chatcmpl-").expect("the prefix is missing");
        assert_eq!(
            random.len(),
            24,
            "the random part has the wrong length: {id}"
        );
        assert!(
            random.bytes().all(|byte| byte.is_ascii_alphanumeric()),
            "the id has a character outside [0-9A-Za-z]: {id}"
        );
        assert_ne!(new_id("cmpl-"), new_id("cmpl-"), "two ids were equal");
    }

    #[test]
    fn usage_totals_and_reports_cached_tokens() {
        let usage = Usage {
            prompt_tokens: 10,
            completion_tokens: 5,
            cached_tokens: 4,
        };
        let body = parse(&chat_completion(
            &REPLY,
            "hi",
            FinishReason::Stop,
            &usage,
            None,
        ));
        assert_eq!(
            body["usage"],
            json!({"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                   "prompt_tokens_details": {"cached_tokens": 4}})
        );
    }

    #[test]
    fn the_finish_chunk_has_an_empty_delta() {
        let chunk = parse(&chat_chunk_finish(&REPLY, FinishReason::Length));
        assert_eq!(
            chunk["choices"][0]["delta"],
            json!({}),
            "the delta is not empty"
        );
        assert_eq!(chunk["choices"][0]["finish_reason"], "length");
        assert!(
            chunk.get("usage").is_none(),
            "a content chunk carries usage"
        );
    }

    #[test]
    fn legacy_text_offsets_are_the_tokens_own() {
        let at = |text: &str, text_offset: usize| TokenLogprob {
            text_offset,
            ..token(text, -0.1, &[])
        };
        let tokens = [at("é", 7), at("ab", 8), at("c", 10)];
        let body = parse(&completion_chunk(&REPLY, "éabc", Some(&tokens), None));
        assert_eq!(
            body["choices"][0]["logprobs"]["text_offset"],
            json!([7, 8, 10])
        );
    }

    #[test]
    fn legacy_alternatives_keep_the_first_of_a_repeated_text() {
        let tokens = [token(
            "a",
            -0.5,
            &[("a", -0.5), ("\u{fffd}", -1.0), ("\u{fffd}", -2.0)],
        )];
        let body = completion(
            &REPLY,
            "a",
            FinishReason::Stop,
            &Usage::default(),
            Some(&tokens),
        );
        assert!(
            body.contains(r#"{"a":-0.5,"�":-1.0}"#),
            "the alternatives object is wrong: {body}"
        );
    }

    #[test]
    fn tokenize_pieces_pair_by_position() {
        assert_eq!(tokenize_response(&[1, 2], None), r#"{"tokens":[1,2]}"#);
        let pieces = ["a".to_owned()];
        assert_eq!(
            tokenize_response(&[1, 2], Some(&pieces)),
            r#"{"tokens":[{"id":1,"piece":"a"},{"id":2,"piece":""}]}"#
        );
    }
}
