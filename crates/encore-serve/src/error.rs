//! Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param",
//! "code"}}` with the matching HTTP status. Every answer the server gives
//! that is not a success has this shape, whatever refused it: a handler,
//! the router (404, 405), a limit (401, 408, 413, 431, 503) or the engine;
//! under `/v1/messages` it has Anthropic's instead
//! ([`ApiError::anthropic_body`]).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

/// An error answer to a request.
#[derive(Debug, Clone)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// What went wrong, for a person.
    pub message: String,
    /// OpenAI's error type (`invalid_request_error`, `server_error`, ...).
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code, if there is one.
    pub code: Option<&'static str>,
    /// Seconds after which a retry may succeed (`Retry-After`).
    pub retry_after: Option<u32>,
}

/// Why a request ended without its answer, as the server's metrics count
/// it: refused before it ran, or cut while it ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Refused before it ran; the label names the reason.
    Rejected(&'static str),
    /// Cut while it ran (or waited to run); the label names the cause.
    Cut(&'static str),
    /// Any other failure.
    Failed,
}

impl ApiError {
    /// An error of `status` and OpenAI's `kind`, naming no field or code.
    pub(crate) fn new(status: StatusCode, kind: &'static str, message: String) -> ApiError {
        ApiError {
            status,
            message,
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// A 400 for a request Encore cannot honour as written.
    pub fn bad_request(message: String, param: Option<&str>) -> ApiError {
        ApiError {
            param: param.map(str::to_string),
            ..ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// A 400 for a prompt that does not fit the context.
    pub fn context_length(message: String) -> ApiError {
        ApiError {
            code: Some("context_length_exceeded"),
            ..ApiError::bad_request(message, Some("messages"))
        }
    }

    /// A 404 for a model this server does not serve.
    pub fn unknown_model(name: &str, served: &str) -> ApiError {
        ApiError {
            param: Some("model".into()),
            code: Some("model_not_found"),
            ..ApiError::new(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                format!("the model `{name}` does not exist here; this server serves `{served}`"),
            )
        }
    }

    /// A 503 while the model loads, or once the server is stopping.
    pub fn unavailable(message: &str) -> ApiError {
        ApiError {
            retry_after: Some(1),
            ..ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_error",
                message.into(),
            )
        }
    }

    /// A 503 for a request that finds the queue full.
    pub fn queue_full(queue: usize) -> ApiError {
        ApiError {
            code: Some("queue_full"),
            ..ApiError::unavailable(&format!(
                "the server is busy: {queue} requests already wait; retry later"
            ))
        }
    }

    /// A 503 for a request cut by the server's shutdown.
    pub fn shut_down(started: bool) -> ApiError {
        let message = if started {
            "the server shut down before the answer was complete"
        } else {
            "the server shut down before the request started; retry it elsewhere"
        };
        ApiError {
            code: Some("shutting_down"),
            ..ApiError::unavailable(message)
        }
    }

    /// A 500: the engine failed (a device error).
    pub fn internal(message: String) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// A 500 for a request failed by a device error.
    pub fn device(message: &str) -> ApiError {
        ApiError {
            code: Some("device_error"),
            ..ApiError::internal(format!(
                "{message}; the server is unhealthy and stops after the running requests"
            ))
        }
    }

    /// A 504 for a request that ran past its deadline.
    pub fn deadline(seconds: f64) -> ApiError {
        ApiError {
            code: Some("deadline_exceeded"),
            ..ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                "timeout_error",
                format!("the request ran past its deadline of {seconds} s and was cancelled"),
            )
        }
    }

    /// A 404 for a path no route serves.
    pub fn not_found(path: &str) -> ApiError {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("no route {path}"),
        )
    }

    /// A 405 for a route that exists under other methods.
    pub fn method_not_allowed(method: &str, path: &str) -> ApiError {
        ApiError::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            format!("{method} is not allowed on {path}"),
        )
    }

    /// A 413 for a body over the limit.
    pub fn body_too_large(limit: usize) -> ApiError {
        ApiError {
            code: Some("body_too_large"),
            ..ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "invalid_request_error",
                format!("the request body is over the limit of {limit} bytes"),
            )
        }
    }

    /// A 408 for a body that did not arrive in time.
    pub fn body_timeout(seconds: f64) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!("the request body did not arrive within {seconds} s"),
        )
    }

    /// A 431 for headers over the limit.
    pub fn headers_too_large(message: String) -> ApiError {
        ApiError::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "invalid_request_error",
            message,
        )
    }

    /// A 401 for a request without the server's key.
    pub fn unauthorized(message: &str) -> ApiError {
        ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "invalid_request_error",
                message.into(),
            )
        }
    }

    /// How the server's metrics count this error.
    pub fn outcome(&self) -> Outcome {
        match (self.status.as_u16(), self.code) {
            (_, Some("shutting_down")) => Outcome::Cut("shutdown"),
            (_, Some("deadline_exceeded")) => Outcome::Cut("deadline"),
            (_, Some("device_error")) => Outcome::Cut("device_error"),
            (_, Some("queue_full")) => Outcome::Rejected("queue_full"),
            (_, Some("context_length_exceeded")) => Outcome::Rejected("context_length"),
            (400 | 404, _) => Outcome::Rejected("invalid_request"),
            (401, _) => Outcome::Rejected("unauthorized"),
            (405, _) => Outcome::Rejected("method_not_allowed"),
            (408, _) => Outcome::Rejected("body_timeout"),
            (413, _) => Outcome::Rejected("body_too_large"),
            (431, _) => Outcome::Rejected("headers_too_large"),
            (503, _) => Outcome::Rejected("unavailable"),
            _ => Outcome::Failed,
        }
    }

    /// The JSON body in Anthropic's shape: `{"type": "error", "error":
    /// {"type", "message"}}`, the type named by the status as Anthropic
    /// names it (a 503 is `overloaded_error`, Anthropic's 529).
    pub fn anthropic_body(&self) -> serde_json::Value {
        let kind = match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            400..=499 => "invalid_request_error",
            _ => "api_error",
        };
        serde_json::json!({
            "type": "error",
            "error": {"type": kind, "message": self.message},
        })
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        })
    }
}

impl From<encore_llm::LlmError> for ApiError {
    fn from(e: encore_llm::LlmError) -> ApiError {
        use encore_llm::LlmError;
        match e {
            LlmError::Request(m) if m.contains("context holds") => ApiError::context_length(m),
            LlmError::Request(m) if m.contains("shutting down") => ApiError::shut_down(false),
            e @ (LlmError::Request(_)
            | LlmError::ControlText { .. }
            | LlmError::Sampler(_)
            | LlmError::Chat(_)
            | LlmError::Tokenizer(_)) => ApiError::bad_request(e.to_string(), None),
            e => ApiError::internal(e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let outcome = self.outcome();
        let retry_after = self.retry_after;
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(seconds) = retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response.extensions_mut().insert(outcome);
        // Kept for a layer that answers in another API's shape.
        response.extensions_mut().insert(self);
        response
    }
}
