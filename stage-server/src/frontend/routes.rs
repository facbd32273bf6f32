//! The API's routes: which answer a request gets at once, and how a generation request becomes a job spec.

use crate::api::{
    self, ApiError, Endpoint, GenerationRequest, Prompt, decode_chat, decode_completion,
    decode_detokenize, decode_tokenize,
};
use crate::driver::SamplerExtras;
use crate::http::Request;
use crate::tokenizer::SpecialTokens;
use crate::wire::fresh_nonce;

use super::engine::JobSpec;
use super::prompt::PromptSource;
use super::state::{ApiState, Ready};

/// What a request gets.
#[derive(Debug)]
pub(crate) enum Routed {
    /// An answer now.
    Respond {
        route: &'static str,
        status: u16,
        content_type: &'static str,
        body: Vec<u8>,
        /// Whether to add `Retry-After` (429, 503).
        retry_after: bool,
    },
    /// A generation to queue.
    Generate {
        route: &'static str,
        spec: Box<JobSpec>,
        chat: bool,
        stream: bool,
        include_usage: bool,
        logprobs: bool,
    },
}

const CHAT: &str = "/v1/chat/completions";
const COMPLETIONS: &str = "/v1/completions";
const MODELS: &str = "/v1/models";
const HEALTH: &str = "/health";
const METRICS: &str = "/metrics";
const TOKENIZE: &str = "/tokenize";
const DETOKENIZE: &str = "/detokenize";

/// The route `path` names (llama-server's unprefixed aliases included), and the method it takes.
fn known(path: &str) -> Option<(&'static str, &'static str)> {
    Some(match path {
        "/v1/chat/completions" | "/chat/completions" => (CHAT, "POST"),
        "/v1/completions" | "/completions" => (COMPLETIONS, "POST"),
        "/v1/models" | "/models" => (MODELS, "GET"),
        "/health" | "/v1/health" => (HEALTH, "GET"),
        "/metrics" => (METRICS, "GET"),
        "/tokenize" => (TOKENIZE, "POST"),
        "/detokenize" => (DETOKENIZE, "POST"),
        _ => return None,
    })
}

/// Whether `given` is `key`, in a time that depends on their lengths only, so that how long a refusal takes
/// tells nothing about how much of a guess was right.
fn same_key(given: &str, key: &str) -> bool {
    given.len() == key.len()
        && given
            .bytes()
            .zip(key.bytes())
            .fold(0u8, |difference, (a, b)| difference | (a ^ b))
            == 0
}

fn json(route: &'static str, status: u16, body: String) -> Routed {
    Routed::Respond {
        route,
        status,
        content_type: "application/json",
        body: body.into_bytes(),
        retry_after: status == 429 || status == 503,
    }
}

fn error(route: &'static str, error: &ApiError) -> Routed {
    json(route, error.status, error.to_json())
}

/// Routes `request`.
pub(crate) fn route(state: &ApiState, request: &Request) -> Routed {
    let Some((route, method)) = known(&request.path) else {
        return error(
            "(unknown)",
            &ApiError::route_not_found(&request.method, &request.path),
        );
    };
    if request.method != method {
        return error(
            route,
            &ApiError::method_not_allowed(&request.method, &request.path),
        );
    }
    // Every route but health needs the key, by the route it names, not by its path: the unprefixed aliases
    // reach the same handlers, and a check by prefix let `POST /chat/completions` through without one.
    if let Some(key) = &state.config.api_key
        && route != HEALTH
    {
        // The scheme's name is case-insensitive (RFC 9110, section 11.1).
        let given = request
            .header("authorization")
            .and_then(|value| value.trim().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        if !given.is_some_and(|given| same_key(given, key)) {
            return error(route, &ApiError::unauthorized());
        }
    }
    if route == HEALTH {
        let down = state.chain.down_reason();
        return match (state.ready.get(), down) {
            (Some(_), None) => json(route, 200, r#"{"status":"ok"}"#.to_owned()),
            (Some(_), Some(reason)) => json(
                route,
                503,
                serde_json::json!({"error": {
                    "code": 503,
                    "message": format!("the chain is down: {reason}"),
                    "type": "unavailable_error",
                }})
                .to_string(),
            ),
            (None, _) => json(
                route,
                503,
                serde_json::json!({"error": {
                    "code": 503,
                    "message": state.not_ready_reason(),
                    "type": "unavailable_error",
                }})
                .to_string(),
            ),
        };
    }
    if route == MODELS {
        return json(route, 200, api::models_list(&state.model_id, state.created));
    }
    if route == METRICS {
        let mut text = state.metrics.render();
        if let Some(ready) = state.ready.get() {
            text.push_str(&format!(
                "# HELP stage_server_lanes Lanes (generations at a time).\n# TYPE stage_server_lanes gauge\nstage_server_lanes {}\n",
                ready.engine.capacity()
            ));
        }
        return Routed::Respond {
            route,
            status: 200,
            content_type: "text/plain; version=0.0.4",
            body: text.into_bytes(),
            retry_after: false,
        };
    }
    let Some(ready) = state.ready.get() else {
        return error(route, &ApiError::unavailable(state.not_ready_reason()));
    };
    let result = match route {
        TOKENIZE => tokenize(ready, &request.body).map(|body| json(route, 200, body)),
        DETOKENIZE => detokenize(ready, &request.body).map(|body| json(route, 200, body)),
        CHAT => {
            decode_chat(&request.body).and_then(|decoded| generation(state, ready, route, decoded))
        }
        _ => decode_completion(&request.body)
            .and_then(|decoded| generation(state, ready, route, decoded)),
    };
    result.unwrap_or_else(|failure| error(route, &failure))
}

fn tokenize(ready: &Ready, body: &[u8]) -> Result<String, ApiError> {
    let request = decode_tokenize(body)?;
    let tokenizer = &ready.text.tokenizer;
    let tokens = tokenizer
        .encode(&request.content, request.add_special, true)
        .map_err(|failure| ApiError::invalid("content", failure.to_string()))?;
    let pieces: Option<Vec<String>> = request.with_pieces.then(|| {
        tokens
            .iter()
            .map(|&token| String::from_utf8_lossy(tokenizer.token_bytes(token)).into_owned())
            .collect()
    });
    Ok(api::tokenize_response(&tokens, pieces.as_deref()))
}

fn detokenize(ready: &Ready, body: &[u8]) -> Result<String, ApiError> {
    let tokens = decode_detokenize(body)?;
    ready.text.check_ids(&tokens, "tokens")?;
    let text = ready
        .text
        .tokenizer
        .decode_with(&tokens, SpecialTokens::Render);
    Ok(api::detokenize_response(&text))
}

/// Checks a decoded generation request against the model and turns it into a job spec.
fn generation(
    state: &ApiState,
    ready: &Ready,
    route: &'static str,
    request: GenerationRequest,
) -> Result<Routed, ApiError> {
    if let Some(model) = &request.model
        && model != &state.model_id
    {
        return Err(ApiError::model_not_found(model));
    }
    let (prompt, chat) = match request.endpoint {
        Endpoint::Chat(messages) => (PromptSource::Chat(messages), true),
        Endpoint::Completion(Prompt::Text(text)) => (PromptSource::Text(text), false),
        Endpoint::Completion(Prompt::Tokens(tokens)) => (PromptSource::Tokens(tokens), false),
    };
    if chat && ready.text.template.is_none() {
        return Err(ApiError::invalid(
            "messages",
            "the model has no chat template; use /v1/completions",
        ));
    }
    // A bias on an id the model cannot produce would be dropped without a word.
    if let Some(&(token, _)) = request
        .logit_bias
        .iter()
        .find(|(token, _)| *token as usize >= ready.text.vocab_size)
    {
        return Err(ApiError::invalid(
            &format!("logit_bias.{token}"),
            format!(
                "token id {token} is not in the model's vocabulary of {} tokens",
                ready.text.vocab_size
            ),
        ));
    }
    let mut sampling = request.sampling.clone();
    sampling.seed = request.seed.unwrap_or_else(random_seed);
    let spec = JobSpec {
        prompt,
        sampling,
        extras: SamplerExtras {
            logit_bias: request.logit_bias.clone(),
            top_logprobs: if request.logprobs {
                request.top_logprobs
            } else {
                0
            },
            logprobs: request.logprobs,
        },
        max_tokens: request.max_tokens,
        stop: request.stop.clone(),
        logprobs: request.logprobs,
    };
    Ok(Routed::Generate {
        route,
        spec: Box::new(spec),
        chat,
        stream: request.stream,
        include_usage: request.include_usage,
        logprobs: request.logprobs,
    })
}

fn random_seed() -> u64 {
    let nonce = fresh_nonce();
    let mut bytes = [0u8; 8];
    bytes.copy_from_slice(&nonce[..8]);
    u64::from_le_bytes(bytes)
}
