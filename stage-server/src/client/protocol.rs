//! The chat client's side of the OpenAI API: the conversation, the request body, and what a stream event says.
//!
//! Everything here is pure (JSON in, values out) so it is tested without a server. Parsing goes through
//! `serde_json::Value` rather than typed structs on purpose: the client must keep working when a server
//! adds fields or leaves optional ones out, and only a handful of fields matter to it.

use std::fmt;

use serde_json::{Value, json};

use crate::tokenizer::chat::ChatMessage;

/// The messages so far and the system prompt that starts every request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Conversation {
    system: Option<String>,
    messages: Vec<ChatMessage>,
}

/// The sampling settings sent with every request; `None` leaves the server's default.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Sampling {
    /// The most tokens a reply may have.
    pub max_tokens: Option<usize>,
    /// The sampling temperature.
    pub temperature: Option<f32>,
}

/// Token counts from a stream's usage chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// Tokens in the prompt the server built from the conversation.
    pub prompt_tokens: u64,
    /// Tokens the server generated for the reply.
    pub completion_tokens: u64,
}

/// What one `data:` payload of a chat completion stream says.
#[derive(Debug, Clone, PartialEq)]
pub enum StreamEvent {
    /// A `chat.completion.chunk`: some reply text, the reason it ended, usage, or a mix.
    Chunk(Chunk),
    /// `[DONE]`: the stream is over.
    Done,
    /// An error envelope sent in place of a chunk (the server failed after the reply began).
    Error(ApiError),
}

/// The parts of a `chat.completion.chunk` the client uses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chunk {
    /// The first choice's `delta.content`, when it has one.
    pub content: Option<String>,
    /// The first choice's `finish_reason`, once the reply has ended.
    pub finish_reason: Option<String>,
    /// The usage object, on the final chunk when `stream_options.include_usage` was asked.
    pub usage: Option<Usage>,
}

/// An error the server answered with, from the OpenAI envelope `{"error": {...}}` when it sent one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status, absent for an error that came inside a stream.
    pub status: Option<u16>,
    /// What went wrong, in the server's words.
    pub message: String,
    /// The envelope's `type` (such as `invalid_request_error`).
    pub kind: Option<String>,
    /// The request field the error is about.
    pub param: Option<String>,
    /// The envelope's `code` (such as `model_not_found`).
    pub code: Option<String>,
    /// The `Retry-After` header's seconds, on a 429 or 503.
    pub retry_after: Option<u64>,
}

/// A stream payload that is neither `[DONE]` nor a JSON object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MalformedEvent {
    /// The start of the payload, for the message.
    pub excerpt: String,
}

impl Conversation {
    /// An empty conversation that starts every request with `system`, when given.
    pub fn new(system: Option<String>) -> Self {
        Self {
            system,
            messages: Vec::new(),
        }
    }

    /// The messages so far, without the system prompt.
    pub fn messages(&self) -> &[ChatMessage] {
        &self.messages
    }

    /// Adds what the user said.
    pub fn push_user(&mut self, content: impl Into<String>) {
        self.messages.push(ChatMessage::new("user", content));
    }

    /// Adds the assistant's reply (whole, or as much as arrived before it was stopped).
    pub fn push_assistant(&mut self, content: impl Into<String>) {
        self.messages.push(ChatMessage::new("assistant", content));
    }

    /// Takes back the last user message, for a request the server refused: leaving it in would send an
    /// unanswered turn (and, for a too-long prompt, the same refusal) with every later request.
    pub fn withdraw_user(&mut self) {
        if self
            .messages
            .last()
            .is_some_and(|message| message.role == "user")
        {
            self.messages.pop();
        }
    }

    /// Forgets every message; the system prompt stays.
    pub fn reset(&mut self) {
        self.messages.clear();
    }

    /// The body of a streaming `POST /v1/chat/completions` for the conversation so far.
    ///
    /// `model` is left out so the server uses the one it serves, whatever its id; usage is asked for so
    /// the client can print tokens per second.
    pub fn request_body(&self, sampling: Sampling) -> Value {
        let system = self
            .system
            .iter()
            .map(|content| ChatMessage::new("system", content.as_str()));
        let messages: Vec<ChatMessage> = system.chain(self.messages.iter().cloned()).collect();
        let mut body = json!({
            "messages": messages,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if let Some(max_tokens) = sampling.max_tokens {
            body["max_tokens"] = json!(max_tokens);
        }
        if let Some(temperature) = sampling.temperature {
            body["temperature"] = json!(temperature);
        }
        body
    }
}

impl StreamEvent {
    /// Reads one `data:` payload of a chat completion stream.
    pub fn parse(data: &str) -> Result<Self, MalformedEvent> {
        if data.trim() == "[DONE]" {
            return Ok(Self::Done);
        }
        let malformed = || MalformedEvent {
            excerpt: data.chars().take(80).collect(),
        };
        let value: Value = serde_json::from_str(data).map_err(|_| malformed())?;
        if !value.is_object() {
            return Err(malformed());
        }
        if let Some(error) = value.get("error") {
            return Ok(Self::Error(ApiError::from_error_object(None, error)));
        }
        let choice = value.get("choices").and_then(|choices| choices.get(0));
        let content = choice
            .and_then(|choice| choice.pointer("/delta/content"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        let finish_reason = choice
            .and_then(|choice| choice.get("finish_reason"))
            .and_then(Value::as_str)
            .map(str::to_owned);
        let usage = value.get("usage").and_then(Usage::from_value);
        Ok(Self::Chunk(Chunk {
            content,
            finish_reason,
            usage,
        }))
    }
}

impl Usage {
    fn from_value(value: &Value) -> Option<Self> {
        Some(Self {
            prompt_tokens: value.get("prompt_tokens")?.as_u64()?,
            completion_tokens: value.get("completion_tokens")?.as_u64()?,
        })
    }
}

impl ApiError {
    /// The error a non-2xx response's body describes; a body that is not an envelope becomes the message.
    pub fn from_response(status: u16, retry_after: Option<u64>, body: &[u8]) -> Self {
        let parsed: Option<Value> = serde_json::from_slice(body).ok();
        let mut error = match parsed.as_ref().and_then(|value| value.get("error")) {
            Some(object) => Self::from_error_object(Some(status), object),
            None => Self {
                status: Some(status),
                message: String::from_utf8_lossy(body).trim().to_owned(),
                ..Self::default()
            },
        };
        error.retry_after = retry_after;
        error
    }

    /// Reads the inside of an envelope; a bare string (some servers send `{"error": "text"}`) is the message.
    fn from_error_object(status: Option<u16>, object: &Value) -> Self {
        let text = |key: &str| object.get(key).and_then(Value::as_str).map(str::to_owned);
        let message = match object.as_str() {
            Some(message) => message.to_owned(),
            None => text("message").unwrap_or_default(),
        };
        Self {
            status,
            message,
            kind: text("type"),
            param: text("param"),
            code: text("code"),
            retry_after: None,
        }
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.status {
            Some(status) => write!(formatter, "the server answered {status}")?,
            None => write!(formatter, "the server stopped the reply")?,
        }
        let labels: Vec<&str> = [&self.kind, &self.code]
            .into_iter()
            .flatten()
            .map(String::as_str)
            .collect();
        if !labels.is_empty() {
            write!(formatter, " ({})", labels.join(", "))?;
        }
        if self.message.is_empty() {
            write!(formatter, " with no message")?;
        } else {
            write!(formatter, ": {}", self.message)?;
        }
        if let Some(param) = &self.param {
            write!(formatter, " [param: {param}]")?;
        }
        if let Some(seconds) = self.retry_after {
            write!(formatter, "; try again in {seconds} s")?;
        }
        Ok(())
    }
}

impl std::error::Error for ApiError {}

impl fmt::Display for MalformedEvent {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            formatter,
            "the server sent a stream event that is not a JSON object: {:?}",
            self.excerpt
        )
    }
}

impl std::error::Error for MalformedEvent {}

#[cfg(test)]
mod tests {
    use super::{ApiError, Chunk, Conversation, Sampling, StreamEvent, Usage};
    use serde_json::json;

    #[test]
    fn the_request_body_starts_with_the_system_prompt_and_asks_for_usage() {
        let mut conversation = Conversation::new(Some("Be brief.".to_owned()));
        conversation.push_user("Hi");
        conversation.push_assistant("Hello!");
        conversation.push_user("Bye");
        let body = conversation.request_body(Sampling {
            max_tokens: Some(32),
            temperature: Some(0.5),
        });
        assert_eq!(
            body,
            json!({
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "Hello!"},
                    {"role": "user", "content": "Bye"},
                ],
                "stream": true,
                "stream_options": {"include_usage": true},
                "max_tokens": 32,
                "temperature": 0.5,
            })
        );
        let defaults = Conversation::new(None).request_body(Sampling::default());
        assert!(
            defaults.get("max_tokens").is_none() && defaults.get("temperature").is_none(),
            "unset settings are left to the server"
        );
    }

    #[test]
    fn reset_keeps_the_system_prompt_and_a_refused_turn_is_withdrawn() {
        let mut conversation = Conversation::new(Some("S".to_owned()));
        conversation.push_user("one");
        conversation.push_assistant("two");
        conversation.push_user("three");
        conversation.withdraw_user();
        assert_eq!(
            conversation.messages().len(),
            2,
            "only the refused user turn goes"
        );
        conversation.withdraw_user();
        assert_eq!(
            conversation.messages().len(),
            2,
            "an assistant turn is never withdrawn"
        );
        conversation.reset();
        assert!(conversation.messages().is_empty());
        assert_eq!(
            conversation.request_body(Sampling::default())["messages"],
            json!([{"role": "system", "content": "S"}])
        );
    }

    #[test]
    fn stream_payloads_read_as_deltas_usage_done_and_errors() {
        let delta = r#"{"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hel"},"finish_reason":null}]}"#;
        assert_eq!(
            StreamEvent::parse(delta),
            Ok(StreamEvent::Chunk(Chunk {
                content: Some("Hel".to_owned()),
                ..Chunk::default()
            }))
        );
        let last = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"length"}]}"#;
        assert_eq!(
            StreamEvent::parse(last),
            Ok(StreamEvent::Chunk(Chunk {
                finish_reason: Some("length".to_owned()),
                ..Chunk::default()
            }))
        );
        let usage = r#"{"choices":[],"usage":{"prompt_tokens":12,"completion_tokens":5,"total_tokens":17}}"#;
        assert_eq!(
            StreamEvent::parse(usage),
            Ok(StreamEvent::Chunk(Chunk {
                usage: Some(Usage {
                    prompt_tokens: 12,
                    completion_tokens: 5
                }),
                ..Chunk::default()
            }))
        );
        assert_eq!(StreamEvent::parse("[DONE]"), Ok(StreamEvent::Done));
        let error = r#"{"error":{"message":"stage 2 went away","type":"server_error","param":null,"code":null}}"#;
        let Ok(StreamEvent::Error(error)) = StreamEvent::parse(error) else {
            panic!("an envelope inside a stream is an error event");
        };
        assert_eq!(error.message, "stage 2 went away");
        assert!(StreamEvent::parse("not json").is_err());
        assert!(StreamEvent::parse("[1,2]").is_err(), "an array is no chunk");
    }

    #[test]
    fn an_error_response_reads_its_envelope_or_keeps_the_raw_body() {
        let body = br#"{"error":{"message":"'temperature' must be a number","type":"invalid_request_error","param":"temperature","code":null}}"#;
        let error = ApiError::from_response(400, None, body);
        assert_eq!(error.param.as_deref(), Some("temperature"));
        assert_eq!(
            error.to_string(),
            "the server answered 400 (invalid_request_error): 'temperature' must be a number [param: temperature]"
        );
        let busy = ApiError::from_response(429, Some(2), b"{\"error\":{\"message\":\"queue full\",\"type\":\"rate_limit_error\",\"code\":\"queue_full\"}}");
        assert_eq!(
            busy.to_string(),
            "the server answered 429 (rate_limit_error, queue_full): queue full; try again in 2 s"
        );
        let plain = ApiError::from_response(502, None, b"Bad Gateway\n");
        assert_eq!(plain.to_string(), "the server answered 502: Bad Gateway");
        let bare = ApiError::from_response(500, None, br#"{"error":"boom"}"#);
        assert_eq!(
            bare.message, "boom",
            "a bare string envelope is the message"
        );
    }
}
