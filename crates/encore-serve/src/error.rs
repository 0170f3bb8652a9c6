//! Errors in OpenAI's JSON shape: `{"error": {"message", "type", "param",
//! "code"}}` with the matching HTTP status.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

/// An error answer to a request.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

impl ApiError {
    /// A 400 for a request Encore cannot honour as written.
    pub fn bad_request(message: String, param: Option<&str>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message,
            kind: "invalid_request_error",
            param: param.map(str::to_string),
            code: None,
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
            status: StatusCode::NOT_FOUND,
            message: format!(
                "the model `{name}` does not exist here; this server serves `{served}`"
            ),
            kind: "invalid_request_error",
            param: Some("model".into()),
            code: Some("model_not_found"),
        }
    }

    /// A 503 while the model loads, or once the server is stopping.
    pub fn unavailable(message: &str) -> ApiError {
        ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// A 500: the engine failed (a device error).
    pub fn internal(message: String) -> ApiError {
        ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message,
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    pub fn not_found(path: &str) -> ApiError {
        ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("no route {path}"),
            kind: "invalid_request_error",
            param: None,
            code: None,
        }
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
            LlmError::Request(m) if m.contains("shutting down") => ApiError::unavailable(&m),
            e @ (LlmError::Request(_)
            | LlmError::Sampler(_)
            | LlmError::Chat(_)
            | LlmError::Tokenizer(_)) => ApiError::bad_request(e.to_string(), None),
            e => ApiError::internal(e.to_string()),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, Json(self.body())).into_response()
    }
}
