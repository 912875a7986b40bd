//! The connection to the sidecar: dialling a Unix socket or TCP target, and the stub with the
//! bearer-token interceptor.

use std::path::PathBuf;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use kvtier_proto::proto::kv_tier_client::KvTierClient;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint, Uri};
use tonic::{Request, Status};

use crate::ClientError;

/// Adds the bearer token (TCP listeners off loopback require one).
#[derive(Debug, Clone, Default)]
pub struct Auth(Option<MetadataValue<tonic::metadata::Ascii>>);

impl Auth {
    /// Sends `Bearer <token>` with every call, or nothing without a token.
    ///
    /// # Errors
    /// [`ClientError::Protocol`] for a token that is not ASCII.
    pub fn bearer(token: Option<&str>) -> Result<Self, ClientError> {
        let Some(t) = token else {
            return Ok(Self(None));
        };
        let value = format!("Bearer {t}")
            .parse()
            .map_err(|_| ClientError::Protocol("the token is not ASCII".into()))?;
        Ok(Self(Some(value)))
    }
}

impl Interceptor for Auth {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// The generated gRPC stub with the bearer-token interceptor.
pub type Stub = KvTierClient<InterceptedService<Channel, Auth>>;

/// Opens a channel to `target`: `unix:///path` (or a bare path) for the Unix socket,
/// `http://host:port` or `https://host:port` for TCP.
///
/// # Errors
/// [`ClientError::Connect`].
///
/// # Cancel safety
/// Cancel safe: dropping the future drops the connection attempt.
pub async fn channel(target: &str) -> Result<Channel, ClientError> {
    let err = |source| ClientError::Connect {
        target: target.to_owned(),
        source,
    };
    if target.starts_with("http://") || target.starts_with("https://") {
        return Endpoint::from_shared(target.to_owned())
            .map_err(err)?
            .connect()
            .await
            .map_err(err);
    }
    let path = PathBuf::from(target.strip_prefix("unix://").unwrap_or(target));
    // The URI is required by the API and ignored by the connector.
    Endpoint::from_static("http://kvtier.sock")
        .connect_timeout(Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move { Ok::<_, std::io::Error>(TokioIo::new(tokio::net::UnixStream::connect(path).await?)) }
        }))
        .await
        .map_err(err)
}
