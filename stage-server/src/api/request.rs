//! Request bodies of the generation, tokenize and detokenize routes, decoded and checked field by field.
//!
//! Bodies are parsed to a `serde_json::Value` and read by hand rather than derived, so every wrong type or
//! range is a 400 naming the exact field (`messages[1].content[0].type`), as OpenAI's own errors do. Unknown
//! fields are ignored and `null` counts as absent, so SDKs that send extra or empty parameters still work; but
//! a known parameter that would change the answer and that this server does not implement (`echo`, `suffix`,
//! `best_of` above 1, `tools`, a `response_format` other than text) is refused, not ignored, so no client gets
//! an answer to a question other than the one it asked.

use serde_json::{Map, Value};

use super::error::ApiError;
use super::fields::{Fields, describe, integer_in, wrong_type};
use crate::model::SamplingParams;
use crate::tokenizer::chat::ChatMessage;
use crate::wire::WireLimits;

/// The temperature when a request gives none: llama-server's default (OpenAI's is 1).
pub const DEFAULT_TEMPERATURE: f32 = 0.8;
/// Most stop strings a request may give (empty ones are dropped before counting).
pub const MAX_STOP_STRINGS: usize = 16;
/// Most alternatives per token in `top_logprobs` (OpenAI's limit, and the stage protocol's).
pub const MAX_TOP_LOGPROBS: u8 = 20;

/// A completion's prompt: text to tokenize, or token ids given by the client.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Prompt {
    /// Text, tokenized by the server.
    Text(String),
    /// Token ids, used as given (the server checks them against its vocabulary).
    Tokens(Vec<u32>),
}

/// Which generation route a request came to, with its input.
#[derive(Clone, Debug, PartialEq)]
pub enum Endpoint {
    /// `/v1/chat/completions`: a conversation for the chat template.
    Chat(Vec<ChatMessage>),
    /// `/v1/completions`: a raw prompt.
    Completion(Prompt),
}

/// A checked chat or completion request: what to generate and how.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerationRequest {
    /// The route and its input.
    pub endpoint: Endpoint,
    /// The model the client asked for, if it named one.
    pub model: Option<String>,
    /// The most tokens to generate; `max_completion_tokens` wins over `max_tokens` when both are given.
    /// `None`: until the context is full or the model stops. A limit past `usize::MAX` (`1e300`) is `usize::MAX`.
    pub max_tokens: Option<usize>,
    /// The sampler's settings: temperature defaults to [`DEFAULT_TEMPERATURE`], the rest to
    /// [`SamplingParams::default`]. Its `seed` is `seed.unwrap_or(0)`; the server replaces it when `seed` is `None`.
    pub sampling: SamplingParams,
    /// The seed the client gave; `None` means the server picks one.
    pub seed: Option<u64>,
    /// Added to the logits of token ids, each in `-100..=100`, in ascending order of the ids' JSON keys.
    pub logit_bias: Vec<(u32, f32)>,
    /// Strings that end generation; the text is cut before the first one. Never empty strings.
    pub stop: Vec<String>,
    /// Whether to return the chosen tokens' log probabilities.
    pub logprobs: bool,
    /// How many alternatives to return per token, `0..=20` (only meaningful with `logprobs`).
    pub top_logprobs: u8,
    /// Whether to answer with server-sent events.
    pub stream: bool,
    /// Whether a stream ends with a usage chunk (`stream_options.include_usage`); always false without `stream`.
    pub include_usage: bool,
}

/// A checked `/tokenize` request (llama-server's shape).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizeRequest {
    /// The text to tokenize.
    pub content: String,
    /// Whether to add the model's BOS/EOS as a prompt would (llama-server's default: false).
    pub add_special: bool,
    /// Whether to answer each token with its text piece.
    pub with_pieces: bool,
}

/// Decodes and checks a `/v1/chat/completions` body.
pub fn decode_chat(body: &[u8]) -> Result<GenerationRequest, ApiError> {
    let object = parse_object(body)?;
    let fields = Fields::top(&object);
    let messages = decode_messages(&fields)?;
    let logprobs = fields.boolean("logprobs")?.unwrap_or(false);
    let top_logprobs = top_logprobs(&fields, "top_logprobs")?.unwrap_or(0);
    if top_logprobs > 0 && !logprobs {
        return Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` needs `logprobs` set to true",
        ));
    }
    decode_common(&fields, Endpoint::Chat(messages), logprobs, top_logprobs)
}

/// Decodes and checks a `/v1/completions` body. Its `logprobs` is OpenAI's legacy form: an integer `N` asks
/// for the chosen tokens' log probabilities with `N` alternatives each; `true` and `false` are also taken.
pub fn decode_completion(body: &[u8]) -> Result<GenerationRequest, ApiError> {
    let object = parse_object(body)?;
    let fields = Fields::top(&object);
    let prompt = decode_prompt(&fields)?;
    let (logprobs, top_logprobs) = match fields.get("logprobs") {
        None | Some(Value::Bool(false)) => (false, 0),
        Some(Value::Bool(true)) => (true, 0),
        Some(_) => (true, top_logprobs(&fields, "logprobs")?.unwrap_or(0)),
    };
    decode_common(
        &fields,
        Endpoint::Completion(prompt),
        logprobs,
        top_logprobs,
    )
}

/// Decodes and checks a `/tokenize` body: `content` (required), `add_special` and `with_pieces` (default false).
pub fn decode_tokenize(body: &[u8]) -> Result<TokenizeRequest, ApiError> {
    let object = parse_object(body)?;
    let fields = Fields::top(&object);
    let Some(content) = fields.string("content")? else {
        return Err(ApiError::invalid("content", "`content` is required"));
    };
    Ok(TokenizeRequest {
        content: content.to_owned(),
        add_special: fields.boolean("add_special")?.unwrap_or(false),
        with_pieces: fields.boolean("with_pieces")?.unwrap_or(false),
    })
}

/// Decodes and checks a `/detokenize` body, `{"tokens": [ids]}`. Absent `tokens` is an empty list, as in
/// llama-server.
pub fn decode_detokenize(body: &[u8]) -> Result<Vec<u32>, ApiError> {
    let object = parse_object(body)?;
    let fields = Fields::top(&object);
    let Some(value) = fields.get("tokens") else {
        return Ok(Vec::new());
    };
    let Value::Array(items) = value else {
        return Err(wrong_type("tokens", "an array of token ids", value));
    };
    token_ids(items, "tokens")
}

/// The fields chat and completions share.
fn decode_common(
    fields: &Fields,
    endpoint: Endpoint,
    logprobs: bool,
    top_logprobs: u8,
) -> Result<GenerationRequest, ApiError> {
    refuse_unsupported(fields)?;
    let model = fields.string("model")?.map(str::to_owned);
    let max_tokens = match fields.integer("max_completion_tokens", 1, i128::MAX)? {
        Some(limit) => Some(limit),
        None => fields.integer("max_tokens", 1, i128::MAX)?,
    }
    .map(to_usize);
    if fields
        .get("n")
        .is_some_and(|value| integer_in(value, "n", 1, 1).is_err())
    {
        return Err(ApiError::invalid(
            "n",
            "only `n` = 1 is supported; send separate requests for more choices",
        ));
    }
    let stream = fields.boolean("stream")?.unwrap_or(false);
    let include_usage = match fields.object("stream_options")? {
        Some(options) => Fields::nested(options, "stream_options")
            .boolean("include_usage")?
            .unwrap_or(false),
        None => false,
    };
    let seed = fields
        .integer("seed", i128::from(i64::MIN), i128::from(u64::MAX))?
        // A negative seed keeps its two's-complement bits, so every i64 and u64 is a distinct seed.
        .map(|seed| seed as u64);
    Ok(GenerationRequest {
        endpoint,
        model,
        max_tokens,
        sampling: decode_sampling(fields, seed)?,
        seed,
        logit_bias: decode_logit_bias(fields)?,
        stop: decode_stop(fields)?,
        logprobs,
        top_logprobs,
        stream,
        // Outside a stream the usage is always in the body; the option only shapes a stream.
        include_usage: stream && include_usage,
    })
}

/// Refuses the parameters that would change the answer and that this server does not implement, each in
/// words naming it (their neutral values, such as `echo: false` or `best_of: 1`, are taken).
fn refuse_unsupported(fields: &Fields) -> Result<(), ApiError> {
    if fields.boolean("echo")? == Some(true) {
        return Err(ApiError::invalid(
            "echo",
            "`echo` is not supported: the completion does not repeat its prompt; prepend the prompt yourself",
        ));
    }
    if fields
        .string("suffix")?
        .is_some_and(|suffix| !suffix.is_empty())
    {
        return Err(ApiError::invalid(
            "suffix",
            "`suffix` (text to insert before) is not supported; send the prompt alone",
        ));
    }
    if fields
        .get("best_of")
        .is_some_and(|value| integer_in(value, "best_of", 1, 1).is_err())
    {
        return Err(ApiError::invalid(
            "best_of",
            "`best_of` above 1 is not supported; send separate requests and pick the best yourself",
        ));
    }
    for name in ["tools", "functions"] {
        let given = match fields.get(name) {
            None => false,
            Some(Value::Array(items)) => !items.is_empty(),
            Some(_) => true,
        };
        if given {
            return Err(ApiError::invalid(
                name,
                format!(
                    "`{name}` is not supported: this server does not call tools or functions; send the request without it"
                ),
            ));
        }
    }
    if let Some(format) = fields.object("response_format")? {
        let format = Fields::nested(format, "response_format");
        match format.string("type")? {
            None | Some("text") => {}
            Some(other) => {
                return Err(ApiError::invalid(
                    "response_format.type",
                    format!(
                        "`response_format` of type `{other}` is not supported: this server does not constrain its output; only `text` is taken"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// The sampler's settings from `temperature`, `top_p`, `top_k`, `min_p`, the penalties and `seed`.
fn decode_sampling(fields: &Fields, seed: Option<u64>) -> Result<SamplingParams, ApiError> {
    let defaults = SamplingParams::default();
    let float = |name: &str, low: f64, high: f64, default: f32| -> Result<f32, ApiError> {
        Ok(fields
            .number(name, low, high)?
            .map_or(default, |value| value as f32))
    };
    let repeat_penalty = float("repeat_penalty", 0.0, 10.0, defaults.repeat_penalty)?;
    if repeat_penalty <= 0.0 {
        return Err(ApiError::invalid(
            "repeat_penalty",
            format!("`repeat_penalty` must be above 0 and at most 10; got {repeat_penalty}"),
        ));
    }
    Ok(SamplingParams {
        temperature: float("temperature", 0.0, 2.0, DEFAULT_TEMPERATURE)?,
        top_k: fields
            .integer("top_k", 0, i128::MAX)?
            .map_or(defaults.top_k, to_usize),
        top_p: float("top_p", 0.0, 1.0, defaults.top_p)?,
        min_p: float("min_p", 0.0, 1.0, defaults.min_p)?,
        seed: seed.unwrap_or(defaults.seed),
        repeat_penalty,
        presence_penalty: float("presence_penalty", -2.0, 2.0, defaults.presence_penalty)?,
        frequency_penalty: float("frequency_penalty", -2.0, 2.0, defaults.frequency_penalty)?,
        penalty_last_n: defaults.penalty_last_n,
    })
}

/// `messages`: a non-empty array of `{"role", "content"}` objects.
fn decode_messages(fields: &Fields) -> Result<Vec<ChatMessage>, ApiError> {
    let Some(value) = fields.get("messages") else {
        return Err(ApiError::invalid("messages", "`messages` is required"));
    };
    let Value::Array(items) = value else {
        return Err(wrong_type("messages", "an array of messages", value));
    };
    if items.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must hold at least one message",
        ));
    }
    let mut messages = Vec::with_capacity(items.len());
    for (index, item) in items.iter().enumerate() {
        let path = format!("messages[{index}]");
        let Value::Object(object) = item else {
            return Err(wrong_type(&path, "a message object", item));
        };
        messages.push(decode_message(&Fields::nested(object, &path))?);
    }
    Ok(messages)
}

/// One message. `content` may be a string, an array of text parts (joined with newlines, as llama-server
/// joins them), or `null`/absent for an assistant turn (one that only called tools, say).
fn decode_message(fields: &Fields) -> Result<ChatMessage, ApiError> {
    let Some(role) = fields.string("role")? else {
        return Err(required(&fields.param("role")));
    };
    let role = match role {
        "system" | "user" | "assistant" => role,
        // OpenAI's newer name for the system turn.
        "developer" => "system",
        "tool" | "function" => {
            return Err(ApiError::invalid(
                &fields.param("role"),
                format!(
                    "a `{role}` message needs tool calling, which this server does not support"
                ),
            ));
        }
        other => {
            return Err(ApiError::invalid(
                &fields.param("role"),
                format!("`{other}` is not a role; use system, user, assistant or developer"),
            ));
        }
    };
    let content = match fields.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => text_parts(parts, &fields.param("content"))?,
        Some(other) => {
            return Err(fields.wrong_type("content", "a string or an array of text parts", other));
        }
        None if role == "assistant" => String::new(),
        None => {
            return Err(ApiError::invalid(
                &fields.param("content"),
                format!(
                    "`{}` is required for a `{role}` message",
                    fields.param("content")
                ),
            ));
        }
    };
    Ok(ChatMessage::new(role, content))
}

/// The text of `[{"type": "text", "text": ...}, ...]`, joined with newlines. Images and audio are refused:
/// this server has no encoder for them, and dropping them silently would answer a different question.
fn text_parts(parts: &[Value], path: &str) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (index, part) in parts.iter().enumerate() {
        let part_path = format!("{path}[{index}]");
        let Value::Object(object) = part else {
            return Err(wrong_type(&part_path, "a content part object", part));
        };
        let part_fields = Fields::nested(object, &part_path);
        let Some(kind) = part_fields.string("type")? else {
            return Err(required(&part_fields.param("type")));
        };
        if kind != "text" {
            return Err(ApiError::invalid(
                &part_fields.param("type"),
                format!(
                    "content parts of type `{kind}` are not supported; only `text` is, this server has no \
                     encoder for other media"
                ),
            ));
        }
        let Some(text) = part_fields.string("text")? else {
            return Err(required(&part_fields.param("text")));
        };
        texts.push(text);
    }
    Ok(texts.join("\n"))
}

/// `prompt`: a string, an array holding one string, or an array of token ids.
fn decode_prompt(fields: &Fields) -> Result<Prompt, ApiError> {
    let Some(value) = fields.get("prompt") else {
        return Err(ApiError::invalid("prompt", "`prompt` is required"));
    };
    match value {
        Value::String(text) => Ok(Prompt::Text(text.clone())),
        Value::Array(items) => match items.as_slice() {
            [] => Err(ApiError::invalid(
                "prompt",
                "`prompt` must not be an empty array",
            )),
            [Value::String(text)] => Ok(Prompt::Text(text.clone())),
            [Value::String(_), ..] => Err(ApiError::invalid(
                "prompt",
                format!(
                    "`prompt` holds {} strings, but one request takes one prompt; send them separately",
                    items.len()
                ),
            )),
            _ => token_ids(items, "prompt").map(Prompt::Tokens),
        },
        other => Err(wrong_type(
            "prompt",
            "a string or an array of token ids",
            other,
        )),
    }
}

/// Each item of `items` as a token id; an error names the item (`prompt[3]`).
fn token_ids(items: &[Value], param: &str) -> Result<Vec<u32>, ApiError> {
    items
        .iter()
        .enumerate()
        .map(|(index, item)| {
            let path = format!("{param}[{index}]");
            if !item.is_number() {
                return Err(wrong_type(&path, "a token id (an integer)", item));
            }
            integer_in(item, &path, 0, i128::from(u32::MAX)).map(|id| id as u32)
        })
        .collect()
}

/// `stop`: one string or an array of up to [`MAX_STOP_STRINGS`] strings; empty strings are dropped.
fn decode_stop(fields: &Fields) -> Result<Vec<String>, ApiError> {
    let stops = match fields.get("stop") {
        None => Vec::new(),
        Some(Value::String(text)) => vec![text.clone()],
        Some(Value::Array(items)) => {
            let mut stops = Vec::with_capacity(items.len());
            for (index, item) in items.iter().enumerate() {
                let Value::String(text) = item else {
                    return Err(wrong_type(&format!("stop[{index}]"), "a string", item));
                };
                stops.push(text.clone());
            }
            stops
        }
        Some(other) => {
            return Err(wrong_type("stop", "a string or an array of strings", other));
        }
    };
    let stops: Vec<String> = stops.into_iter().filter(|stop| !stop.is_empty()).collect();
    if stops.len() > MAX_STOP_STRINGS {
        return Err(ApiError::invalid(
            "stop",
            format!(
                "`stop` holds {} strings; at most {MAX_STOP_STRINGS} are allowed",
                stops.len()
            ),
        ));
    }
    Ok(stops)
}

/// `logit_bias`: an object from token-id strings to biases in `-100..=100`, at most as many entries as a stage
/// `Configure` frame carries.
fn decode_logit_bias(fields: &Fields) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(object) = fields.object("logit_bias")? else {
        return Ok(Vec::new());
    };
    let limit = WireLimits::default().max_logit_bias as usize;
    if object.len() > limit {
        return Err(ApiError::invalid(
            "logit_bias",
            format!(
                "`logit_bias` has {} entries; at most {limit} are allowed",
                object.len()
            ),
        ));
    }
    let mut biases = Vec::with_capacity(object.len());
    for (key, value) in object {
        let param = format!("logit_bias.{key}");
        // `parse` alone would take "+5"; a token id key is plain decimal digits.
        let id = key
            .bytes()
            .all(|byte| byte.is_ascii_digit())
            .then(|| key.parse::<u32>().ok())
            .flatten()
            .ok_or_else(|| {
                ApiError::invalid(
                    "logit_bias",
                    format!(
                        "`logit_bias` keys must be token ids (decimal integers); got {}",
                        describe(&Value::String(key.clone()))
                    ),
                )
            })?;
        let Some(bias) = value.as_f64() else {
            return Err(wrong_type(&param, "a number", value));
        };
        if !(-100.0..=100.0).contains(&bias) {
            return Err(ApiError::invalid(
                &param,
                format!("`{param}` must be between -100 and 100; got {bias}"),
            ));
        }
        biases.push((id, bias as f32));
    }
    Ok(biases)
}

/// A `top_logprobs`-style count at field `name`: an integer in `0..=20`.
fn top_logprobs(fields: &Fields, name: &str) -> Result<Option<u8>, ApiError> {
    Ok(fields
        .integer(name, 0, i128::from(MAX_TOP_LOGPROBS))?
        .map(|count| count as u8))
}

/// The body as a JSON object: a 400 with the parser's message when it is not JSON, another when it is not an
/// object.
fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(object)) => Ok(object),
        Ok(other) => Err(ApiError::bad_body(format!(
            "the request body must be a JSON object; got {}",
            describe(&other)
        ))),
        Err(error) => Err(ApiError::bad_body(format!(
            "the request body is not valid JSON: {error}"
        ))),
    }
}

/// The 400 for a required field that is missing.
fn required(param: &str) -> ApiError {
    ApiError::invalid(param, format!("`{param}` is required"))
}

/// A count already checked to be at least 0; one past `usize::MAX` means "as many as there can be".
fn to_usize(value: i128) -> usize {
    usize::try_from(value).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn chat(body: Value) -> Result<GenerationRequest, ApiError> {
        decode_chat(body.to_string().as_bytes())
    }

    fn completion(body: Value) -> Result<GenerationRequest, ApiError> {
        decode_completion(body.to_string().as_bytes())
    }

    /// A valid chat body with `extra` merged in.
    fn chat_with(extra: Value) -> Result<GenerationRequest, ApiError> {
        let mut body = json!({"messages": [{"role": "user", "content": "hi"}]});
        for (key, value) in extra.as_object().expect("extra is an object") {
            body[key] = value.clone();
        }
        chat(body)
    }

    /// The field a refused chat body blames.
    fn refused_param(extra: Value) -> String {
        let error = chat_with(extra.clone()).expect_err(&format!("{extra} was accepted"));
        assert_eq!(error.status, 400, "{extra} was not a 400");
        error.param.unwrap_or_default()
    }

    #[test]
    fn a_minimal_chat_gets_the_defaults() {
        let request = chat_with(json!({})).expect("a minimal chat was refused");
        assert_eq!(
            request.endpoint,
            Endpoint::Chat(vec![ChatMessage::new("user", "hi")])
        );
        assert_eq!(
            request.sampling,
            SamplingParams {
                temperature: DEFAULT_TEMPERATURE,
                ..SamplingParams::default()
            },
            "the defaults changed"
        );
        assert_eq!(request.max_tokens, None);
        assert_eq!(request.seed, None);
        assert!(request.stop.is_empty() && request.logit_bias.is_empty());
        assert!(!request.logprobs && !request.stream && !request.include_usage);
    }

    #[test]
    fn every_sampling_field_is_read() {
        let request = chat_with(json!({
            "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 42,
            "presence_penalty": -1.5, "frequency_penalty": 2, "repeat_penalty": 1.1
        }))
        .expect("valid sampling fields were refused");
        let sampling = request.sampling;
        assert_eq!(
            (
                sampling.temperature,
                sampling.top_p,
                sampling.top_k,
                sampling.min_p
            ),
            (0.5, 0.9, 7, 0.1)
        );
        assert_eq!(
            (
                sampling.presence_penalty,
                sampling.frequency_penalty,
                sampling.repeat_penalty
            ),
            (-1.5, 2.0, 1.1)
        );
        assert_eq!((sampling.seed, request.seed), (42, Some(42)));
    }

    #[test]
    fn the_body_must_be_a_json_object() {
        let not_json = decode_chat(b"{\"messages\": [").unwrap_err();
        assert_eq!((not_json.status, not_json.param.as_deref()), (400, None));
        assert!(
            not_json.message.contains("EOF while parsing"),
            "the parser's message is missing: {}",
            not_json.message
        );
        let array = decode_chat(b"[1, 2]").unwrap_err();
        assert!(array.message.contains("JSON object"), "{}", array.message);
        assert_eq!(decode_completion(b"").unwrap_err().status, 400);
    }

    #[test]
    fn messages_must_be_a_non_empty_array_of_objects() {
        assert_eq!(
            chat(json!({})).unwrap_err().param.as_deref(),
            Some("messages")
        );
        assert_eq!(refused_param(json!({"messages": []})), "messages");
        assert_eq!(refused_param(json!({"messages": "hi"})), "messages");
        assert_eq!(refused_param(json!({"messages": ["hi"]})), "messages[0]");
    }

    #[test]
    fn a_message_needs_a_string_role_and_content() {
        let param = |message: Value| {
            refused_param(json!({"messages": [{"role": "user", "content": "a"}, message]}))
        };
        assert_eq!(param(json!({"content": "x"})), "messages[1].role");
        assert_eq!(
            param(json!({"role": 1, "content": "x"})),
            "messages[1].role"
        );
        assert_eq!(param(json!({"role": "user"})), "messages[1].content");
        assert_eq!(
            param(json!({"role": "user", "content": null})),
            "messages[1].content"
        );
        assert_eq!(
            param(json!({"role": "user", "content": 5})),
            "messages[1].content"
        );
    }

    #[test]
    fn an_assistant_message_may_have_null_content() {
        let request = chat(json!({"messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": null},
            {"role": "assistant"}
        ]}))
        .expect("null assistant content was refused");
        let Endpoint::Chat(messages) = request.endpoint else {
            panic!("a chat decoded as a completion");
        };
        assert_eq!(messages[1].content, "");
        assert_eq!(messages[2].content, "");
    }

    #[test]
    fn text_parts_are_joined_and_other_parts_refused() {
        let request = chat(json!({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "one"}, {"type": "text", "text": "two"}
        ]}]}))
        .expect("text parts were refused");
        assert_eq!(
            request.endpoint,
            Endpoint::Chat(vec![ChatMessage::new("user", "one\ntwo")])
        );
        let param = |parts: Value| {
            refused_param(
                json!({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": parts}]}),
            )
        };
        assert_eq!(
            param(json!([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}])),
            "messages[1].content[1].type"
        );
        assert_eq!(param(json!([{"text": "a"}])), "messages[1].content[0].type");
        assert_eq!(
            param(json!([{"type": "text"}])),
            "messages[1].content[0].text"
        );
        assert_eq!(
            param(json!([{"type": "text", "text": 3}])),
            "messages[1].content[0].text"
        );
        assert_eq!(param(json!(["a"])), "messages[1].content[0]");
    }

    #[test]
    fn model_must_be_a_string() {
        assert_eq!(
            chat_with(json!({"model": "m"})).unwrap().model.as_deref(),
            Some("m")
        );
        assert_eq!(refused_param(json!({"model": 3})), "model");
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens() {
        let both = chat_with(json!({"max_tokens": 10, "max_completion_tokens": 20})).unwrap();
        assert_eq!(
            both.max_tokens,
            Some(20),
            "max_completion_tokens did not win"
        );
        let old = chat_with(json!({"max_tokens": 10})).unwrap();
        assert_eq!(old.max_tokens, Some(10));
    }

    #[test]
    fn token_limits_are_integers_of_at_least_one() {
        assert_eq!(refused_param(json!({"max_tokens": 0})), "max_tokens");
        assert_eq!(refused_param(json!({"max_tokens": -3})), "max_tokens");
        assert_eq!(refused_param(json!({"max_tokens": 2.5})), "max_tokens");
        assert_eq!(refused_param(json!({"max_tokens": "9"})), "max_tokens");
        assert_eq!(refused_param(json!({"max_tokens": -1e300})), "max_tokens");
        let huge = chat_with(json!({"max_tokens": 1e300})).expect("a huge limit was refused");
        assert_eq!(
            huge.max_tokens,
            Some(usize::MAX),
            "a huge limit did not mean no limit"
        );
        assert_eq!(
            refused_param(json!({"max_completion_tokens": 0})),
            "max_completion_tokens"
        );
    }

    #[test]
    fn sampling_ranges_are_enforced_at_their_edges() {
        let accepted = [
            json!({"temperature": 0}),
            json!({"temperature": 2}),
            json!({"top_p": 0}),
            json!({"top_p": 1}),
            json!({"top_k": 0}),
            json!({"min_p": 1}),
            json!({"presence_penalty": -2}),
            json!({"frequency_penalty": 2}),
            json!({"repeat_penalty": 10}),
            json!({"repeat_penalty": 0.01}),
        ];
        for extra in accepted {
            assert!(chat_with(extra.clone()).is_ok(), "{extra} was refused");
        }
        let refused = [
            (json!({"temperature": -0.1}), "temperature"),
            (json!({"temperature": 2.01}), "temperature"),
            (json!({"temperature": "hot"}), "temperature"),
            (json!({"top_p": 1.5}), "top_p"),
            (json!({"top_k": -1}), "top_k"),
            (json!({"top_k": 1.5}), "top_k"),
            (json!({"min_p": -0.5}), "min_p"),
            (json!({"presence_penalty": 2.5}), "presence_penalty"),
            (json!({"frequency_penalty": -3}), "frequency_penalty"),
            (json!({"repeat_penalty": 0}), "repeat_penalty"),
            (json!({"repeat_penalty": 10.5}), "repeat_penalty"),
            (json!({"temperature": 1e308}), "temperature"),
        ];
        for (extra, param) in refused {
            assert_eq!(
                refused_param(extra.clone()),
                param,
                "{extra} blamed the wrong field"
            );
        }
    }

    #[test]
    fn a_negative_seed_keeps_its_bits() {
        let request = chat_with(json!({"seed": -1})).unwrap();
        assert_eq!(request.seed, Some(u64::MAX), "-1 did not become all ones");
        let largest = chat_with(json!({"seed": u64::MAX})).unwrap();
        assert_eq!(largest.seed, Some(u64::MAX));
        assert_eq!(refused_param(json!({"seed": 1.5})), "seed");
        assert_eq!(refused_param(json!({"seed": "7"})), "seed");
    }

    #[test]
    fn stop_is_a_string_or_an_array_and_empty_strings_drop() {
        assert_eq!(chat_with(json!({"stop": "\n"})).unwrap().stop, vec!["\n"]);
        assert_eq!(
            chat_with(json!({"stop": ""})).unwrap().stop,
            Vec::<String>::new()
        );
        assert_eq!(
            chat_with(json!({"stop": ["a", "", "b"]})).unwrap().stop,
            vec!["a", "b"]
        );
        assert_eq!(refused_param(json!({"stop": 3})), "stop");
        assert_eq!(refused_param(json!({"stop": ["a", 3]})), "stop[1]");
        let sixteen: Vec<String> = (0..16).map(|index| index.to_string()).collect();
        assert_eq!(chat_with(json!({"stop": sixteen})).unwrap().stop.len(), 16);
        let seventeen: Vec<String> = (0..17).map(|index| index.to_string()).collect();
        assert_eq!(refused_param(json!({"stop": seventeen})), "stop");
    }

    #[test]
    fn chat_logprobs_is_a_boolean_and_top_logprobs_needs_it() {
        let request = chat_with(json!({"logprobs": true, "top_logprobs": 20})).unwrap();
        assert_eq!((request.logprobs, request.top_logprobs), (true, 20));
        assert_eq!(refused_param(json!({"logprobs": 1})), "logprobs");
        assert_eq!(refused_param(json!({"top_logprobs": 3})), "top_logprobs");
        assert_eq!(
            refused_param(json!({"logprobs": true, "top_logprobs": 21})),
            "top_logprobs"
        );
        assert_eq!(
            refused_param(json!({"logprobs": true, "top_logprobs": -1})),
            "top_logprobs"
        );
        assert!(
            chat_with(json!({"top_logprobs": 0})).is_ok(),
            "zero alternatives without logprobs was refused"
        );
    }

    #[test]
    fn n_must_be_one() {
        assert!(chat_with(json!({"n": 1})).is_ok(), "n = 1 was refused");
        for n in [json!(2), json!(0), json!("1"), json!(1.5)] {
            assert_eq!(
                refused_param(json!({"n": n})),
                "n",
                "n = {n} was not refused"
            );
        }
    }

    #[test]
    fn stream_options_only_count_with_stream() {
        let streamed =
            chat_with(json!({"stream": true, "stream_options": {"include_usage": true}})).unwrap();
        assert!(streamed.stream && streamed.include_usage);
        let plain = chat_with(json!({"stream_options": {"include_usage": true}})).unwrap();
        assert!(
            !plain.include_usage,
            "include_usage was set without a stream"
        );
        assert_eq!(refused_param(json!({"stream": "yes"})), "stream");
        assert_eq!(
            refused_param(json!({"stream_options": true})),
            "stream_options"
        );
        assert_eq!(
            refused_param(json!({"stream_options": {"include_usage": 1}})),
            "stream_options.include_usage"
        );
    }

    #[test]
    fn logit_bias_maps_token_ids_to_bounded_numbers() {
        let request = chat_with(json!({"logit_bias": {"50256": -100, "7": 2.5}})).unwrap();
        assert_eq!(request.logit_bias, vec![(50256, -100.0), (7, 2.5)]);
        assert_eq!(
            refused_param(json!({"logit_bias": {"cat": 1}})),
            "logit_bias"
        );
        assert_eq!(
            refused_param(json!({"logit_bias": {"+5": 1}})),
            "logit_bias"
        );
        assert_eq!(
            refused_param(json!({"logit_bias": {"4294967296": 1}})),
            "logit_bias"
        );
        assert_eq!(
            refused_param(json!({"logit_bias": {"5": 101}})),
            "logit_bias.5"
        );
        assert_eq!(
            refused_param(json!({"logit_bias": {"5": "1"}})),
            "logit_bias.5"
        );
        assert_eq!(refused_param(json!({"logit_bias": [1]})), "logit_bias");
    }

    #[test]
    fn unknown_fields_and_user_are_ignored() {
        assert!(
            chat_with(json!({"user": "u-1", "metadata": {"a": 1}, "cache_prompt": true})).is_ok(),
            "an unknown field was refused"
        );
    }

    #[test]
    fn parameters_that_would_change_the_answer_and_are_not_implemented_are_refused_by_name() {
        for (extra, param) in [
            (json!({"echo": true}), "echo"),
            (json!({"suffix": "}"}), "suffix"),
            (json!({"best_of": 3}), "best_of"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "f"}}]}),
                "tools",
            ),
            (json!({"functions": [{"name": "f"}]}), "functions"),
            (
                json!({"response_format": {"type": "json_object"}}),
                "response_format.type",
            ),
        ] {
            assert_eq!(refused_param(extra), param);
        }
        let error = chat_with(json!({"echo": true})).unwrap_err();
        assert!(error.message.contains("not supported"), "{}", error.message);
        // Their neutral values change nothing and are taken.
        for neutral in [
            json!({"echo": false}),
            json!({"suffix": ""}),
            json!({"best_of": 1}),
            json!({"tools": []}),
            json!({"response_format": {"type": "text"}}),
            json!({"echo": null, "suffix": null, "tools": null}),
        ] {
            assert!(chat_with(neutral.clone()).is_ok(), "{neutral} was refused");
        }
    }

    #[test]
    fn a_message_role_is_system_user_assistant_or_developer() {
        let request = chat(json!({"messages": [
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": "hi"}
        ]}))
        .expect("a developer message was refused");
        let Endpoint::Chat(messages) = request.endpoint else {
            panic!("not a chat");
        };
        assert_eq!(
            messages[0],
            ChatMessage::new("system", "be brief".to_owned())
        );
        for role in ["wizard", "tool", "function", "User"] {
            let error = chat(json!({"messages": [
                {"role": "user", "content": "hi"},
                {"role": role, "content": "x"}
            ]}))
            .expect_err(&format!("role {role} was taken"));
            assert_eq!(error.param.as_deref(), Some("messages[1].role"), "{role}");
        }
    }

    #[test]
    fn a_prompt_is_a_string_one_string_or_token_ids() {
        let text = completion(json!({"prompt": "hi"})).unwrap();
        assert_eq!(
            text.endpoint,
            Endpoint::Completion(Prompt::Text("hi".into()))
        );
        let single = completion(json!({"prompt": ["hi"]})).unwrap();
        assert_eq!(
            single.endpoint,
            Endpoint::Completion(Prompt::Text("hi".into()))
        );
        let tokens = completion(json!({"prompt": [1, 2, 4294967295u32]})).unwrap();
        assert_eq!(
            tokens.endpoint,
            Endpoint::Completion(Prompt::Tokens(vec![1, 2, u32::MAX]))
        );
        let param = |body: Value| completion(body).unwrap_err().param.unwrap_or_default();
        assert_eq!(param(json!({})), "prompt");
        assert_eq!(param(json!({"prompt": 3})), "prompt");
        assert_eq!(param(json!({"prompt": []})), "prompt");
        assert_eq!(param(json!({"prompt": ["a", "b"]})), "prompt");
        assert_eq!(param(json!({"prompt": [1, -2]})), "prompt[1]");
        assert_eq!(param(json!({"prompt": [1, "a"]})), "prompt[1]");
        assert_eq!(param(json!({"prompt": [1, 4294967296u64]})), "prompt[1]");
        assert_eq!(param(json!({"prompt": [[1, 2]]})), "prompt[0]");
    }

    #[test]
    fn completion_logprobs_is_a_count_or_a_boolean() {
        let counted = completion(json!({"prompt": "a", "logprobs": 5})).unwrap();
        assert_eq!((counted.logprobs, counted.top_logprobs), (true, 5));
        let zero = completion(json!({"prompt": "a", "logprobs": 0})).unwrap();
        assert_eq!((zero.logprobs, zero.top_logprobs), (true, 0));
        let flag = completion(json!({"prompt": "a", "logprobs": true})).unwrap();
        assert_eq!((flag.logprobs, flag.top_logprobs), (true, 0));
        let off = completion(json!({"prompt": "a", "logprobs": false})).unwrap();
        assert!(!off.logprobs);
        for bad in [json!(21), json!(-1), json!("5")] {
            let error = completion(json!({"prompt": "a", "logprobs": bad})).unwrap_err();
            assert_eq!(error.param.as_deref(), Some("logprobs"), "logprobs = {bad}");
        }
    }

    #[test]
    fn completions_share_the_sampling_rules() {
        let error = completion(json!({"prompt": "a", "top_p": 2})).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("top_p"));
        let error = completion(json!({"prompt": "a", "n": 3})).unwrap_err();
        assert_eq!(error.param.as_deref(), Some("n"));
    }

    #[test]
    fn tokenize_needs_content_and_takes_two_flags() {
        let request = decode_tokenize(br#"{"content": "hi", "with_pieces": true}"#).unwrap();
        assert_eq!(
            request,
            TokenizeRequest {
                content: "hi".into(),
                add_special: false,
                with_pieces: true
            }
        );
        let param = |body: &[u8]| decode_tokenize(body).unwrap_err().param.unwrap_or_default();
        assert_eq!(param(b"{}"), "content");
        assert_eq!(param(br#"{"content": 1}"#), "content");
        assert_eq!(
            param(br#"{"content": "a", "add_special": "no"}"#),
            "add_special"
        );
    }

    #[test]
    fn detokenize_takes_token_ids() {
        assert_eq!(decode_detokenize(br#"{"tokens": [3, 1]}"#), Ok(vec![3, 1]));
        assert_eq!(
            decode_detokenize(b"{}"),
            Ok(Vec::new()),
            "absent tokens is not empty"
        );
        let param = |body: &[u8]| {
            decode_detokenize(body)
                .unwrap_err()
                .param
                .unwrap_or_default()
        };
        assert_eq!(param(br#"{"tokens": "3"}"#), "tokens");
        assert_eq!(param(br#"{"tokens": [1, 2.5]}"#), "tokens[1]");
        assert_eq!(param(br#"{"tokens": [-1]}"#), "tokens[0]");
    }
}
