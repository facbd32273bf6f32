//! The API's error: an HTTP status and OpenAI's `{"error": {...}}` envelope, one constructor per cause.

use serde::Serialize;

/// An error answer: the HTTP status and the fields of OpenAI's error object.
///
/// The `kind` strings are OpenAI's `type` values, so SDKs map them to their own exception classes
/// (`BadRequestError`, `NotFoundError`, `RateLimitError` ...); the message says what was wrong and what to do.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{status} {kind}: {message}")]
pub struct ApiError {
    /// The HTTP status code.
    pub status: u16,
    /// OpenAI's error `type`, such as `invalid_request_error`.
    pub kind: &'static str,
    /// What went wrong, for a person to read.
    pub message: String,
    /// The request field at fault (`messages[1].content`), when one is.
    pub param: Option<String>,
    /// A machine-readable cause (`model_not_found`, `context_length_exceeded` ...), when there is one.
    pub code: Option<String>,
}

impl ApiError {
    /// 400: the request field `param` is wrong; `message` says how.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: 400,
            kind: INVALID_REQUEST,
            message: message.into(),
            param: Some(param.to_owned()),
            code: None,
        }
    }

    /// 400 with no field to blame: the body is not JSON, or not a JSON object.
    pub fn bad_body(message: impl Into<String>) -> Self {
        Self::from_status(400, message)
    }

    /// 404: the request names a model this server does not serve.
    pub fn model_not_found(model: &str) -> Self {
        Self {
            status: 404,
            kind: INVALID_REQUEST,
            message: format!(
                "the model `{model}` does not exist on this server; GET /v1/models lists the one it serves"
            ),
            param: Some("model".to_owned()),
            code: Some("model_not_found".to_owned()),
        }
    }

    /// 401: the bearer token is missing or wrong. OpenAI itself answers a bad key with `invalid_request_error`
    /// and code `invalid_api_key`, so that is what SDKs expect.
    pub fn unauthorized() -> Self {
        Self {
            status: 401,
            kind: INVALID_REQUEST,
            message: "missing or incorrect API key; send it as `Authorization: Bearer <key>`"
                .to_owned(),
            param: None,
            code: Some("invalid_api_key".to_owned()),
        }
    }

    /// 400: the prompt (`param`, such as `messages` or `prompt`) has `prompt_tokens` tokens, which leave no room
    /// in a context of `context` tokens.
    pub fn context_exceeded(param: &str, prompt_tokens: usize, context: usize) -> Self {
        Self {
            status: 400,
            kind: INVALID_REQUEST,
            message: format!(
                "this model's context is {context} tokens, but the prompt has {prompt_tokens}; shorten the prompt"
            ),
            param: Some(param.to_owned()),
            code: Some("context_length_exceeded".to_owned()),
        }
    }

    /// 429: the server is full (every slot busy and the queue at its bound); the client should retry later.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self {
            code: Some("rate_limit_exceeded".to_owned()),
            ..Self::from_status(429, message)
        }
    }

    /// 404: no route at `path`. The text is OpenAI's ("Invalid URL (POST /v1/foo)").
    pub fn route_not_found(method: &str, path: &str) -> Self {
        Self::from_status(404, format!("Invalid URL ({method} {path})"))
    }

    /// 405: the route exists but not for `method`. The text is OpenAI's.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::from_status(405, format!("Invalid method for URL ({method} {path})"))
    }

    /// 503: the server cannot answer now (loading, or the pipeline's later stages are unreachable).
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::from_status(503, message)
    }

    /// 500: something failed inside the server; the request itself may have been fine.
    pub fn server_error(message: impl Into<String>) -> Self {
        Self::from_status(500, message)
    }

    /// Any status with no field or code, its `type` picked from the status class: for the HTTP layer's own
    /// refusals (400 malformed request, 413 body too large, 431 head too large, 501, 505).
    pub fn from_status(status: u16, message: impl Into<String>) -> Self {
        let kind = match status {
            429 => RATE_LIMIT,
            503 => "unavailable_error",
            500..=599 => "server_error",
            _ => INVALID_REQUEST,
        };
        Self {
            status,
            kind,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// The response body: `{"error":{"message":..,"type":..,"param":..,"code":..}}`, absent fields as `null`.
    pub fn to_json(&self) -> String {
        let envelope = Envelope {
            error: Body {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code.as_deref(),
            },
        };
        serde_json::to_string(&envelope).expect("an error envelope always serialises")
    }
}

const INVALID_REQUEST: &str = "invalid_request_error";
const RATE_LIMIT: &str = "rate_limit_error";

/// The outer object of the error body.
#[derive(Serialize)]
struct Envelope<'a> {
    error: Body<'a>,
}

/// OpenAI's error object, fields in OpenAI's order.
#[derive(Serialize)]
struct Body<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_invalid_field_is_a_400_naming_the_field() {
        let error = ApiError::invalid("top_p", "must be between 0 and 1");
        assert_eq!(error.status, 400, "the status was not 400");
        assert_eq!(
            error.to_json(),
            r#"{"error":{"message":"must be between 0 and 1","type":"invalid_request_error","param":"top_p","code":null}}"#,
            "the envelope changed"
        );
    }

    #[test]
    fn a_message_with_quotes_and_newlines_is_escaped() {
        let json = ApiError::server_error("a \"quoted\"\nline").to_json();
        let value: serde_json::Value =
            serde_json::from_str(&json).expect("the envelope is not JSON");
        assert_eq!(
            value["error"]["message"], "a \"quoted\"\nline",
            "the message did not survive escaping"
        );
        assert!(
            !json.contains('\n'),
            "a raw newline would break an SSE data line"
        );
    }

    #[test]
    fn statuses_pick_their_openai_type() {
        let cases = [
            (400, "invalid_request_error"),
            (413, "invalid_request_error"),
            (431, "invalid_request_error"),
            (429, "rate_limit_error"),
            (500, "server_error"),
            (501, "server_error"),
            (503, "unavailable_error"),
            (505, "server_error"),
        ];
        for (status, kind) in cases {
            assert_eq!(
                ApiError::from_status(status, "x").kind,
                kind,
                "status {status} got the wrong type"
            );
        }
    }

    #[test]
    fn the_context_error_names_both_numbers() {
        let error = ApiError::context_exceeded("messages", 5000, 4096);
        assert!(
            error.message.contains("5000") && error.message.contains("4096"),
            "the message does not name both numbers: {}",
            error.message
        );
        assert_eq!(error.code.as_deref(), Some("context_length_exceeded"));
        assert_eq!(error.param.as_deref(), Some("messages"));
    }

    #[test]
    fn overload_is_a_429_with_openais_code() {
        let error = ApiError::overloaded("busy");
        assert_eq!((error.status, error.kind), (429, "rate_limit_error"));
        assert_eq!(error.code.as_deref(), Some("rate_limit_exceeded"));
    }
}
