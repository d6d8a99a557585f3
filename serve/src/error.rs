//! Errors: OpenAI error objects for clients, [`ServeError`] for the
//! process that runs the server.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// An error answered to a client as OpenAI does:
/// `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param: param.map(str::to_string),
        }
    }

    /// 400: a malformed request or a bad value.
    pub fn bad(message: impl Into<String>, param: Option<&str>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message, param)
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The error object's JSON.
    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        (self.status, axum::Json(self.body())).into_response()
    }
}

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {cause}")]
    Bind { addr: String, cause: std::io::Error },
    #[error("the server stopped: {0}")]
    Io(#[from] std::io::Error),
    /// The batcher died; the process should end non-zero so that a
    /// supervisor restarts it.
    #[error("the server stopped because its batcher failed: {0}")]
    BatcherFailed(String),
}
