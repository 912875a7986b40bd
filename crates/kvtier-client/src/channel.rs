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

/// Where a target string points, in the forms gRPC's naming document defines.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Address {
    /// A Unix socket path.
    Unix(PathBuf),
    /// An `http://` or `https://` URL.
    Url(String),
}

/// Reads `target`: `unix:path` or `unix:/abs/path` (one slash), `unix:///abs/path`, a bare
/// path, `http(s)://host:port`, and `dns:[//authority/]host:port`, `ipv4:addr:port`,
/// `ipv6:[addr]:port` (plaintext TCP).
fn address(target: &str) -> Address {
    if target.starts_with("http://") || target.starts_with("https://") {
        return Address::Url(target.to_owned());
    }
    if let Some(rest) = target.strip_prefix("dns:") {
        // `dns://authority/host:port` names a DNS server first; the host follows its slash.
        let host = rest
            .strip_prefix("//")
            .map_or(rest, |r| r.split_once('/').map_or(r, |(_, h)| h));
        return Address::Url(format!("http://{host}"));
    }
    if let Some(addr) = target
        .strip_prefix("ipv4:")
        .or_else(|| target.strip_prefix("ipv6:"))
    {
        return Address::Url(format!("http://{addr}"));
    }
    if let Some(abs) = target.strip_prefix("unix://") {
        return Address::Unix(PathBuf::from(abs));
    }
    Address::Unix(PathBuf::from(target.strip_prefix("unix:").unwrap_or(target)))
}

/// Opens a channel to `target`: a Unix socket (`unix:///path`, `unix:/path`, `unix:path` or a
/// bare path) or TCP (`http://host:port`, `https://host:port`, `dns:host:port`,
/// `ipv4:addr:port`, `ipv6:[addr]:port`).
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
    let path = match address(target) {
        Address::Url(url) => {
            return Endpoint::from_shared(url)
                .map_err(err)?
                .connect()
                .await
                .map_err(err);
        }
        Address::Unix(path) => path,
    };
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_grpc_naming_form_is_read() {
        let unix = |p: &str| Address::Unix(PathBuf::from(p));
        let url = |u: &str| Address::Url(u.to_owned());
        for (target, want) in [
            ("unix:///run/kvtier.sock", unix("/run/kvtier.sock")),
            ("unix:/run/kvtier.sock", unix("/run/kvtier.sock")),
            ("unix:kvtier.sock", unix("kvtier.sock")),
            ("/run/kvtier.sock", unix("/run/kvtier.sock")),
            ("http://127.0.0.1:50051", url("http://127.0.0.1:50051")),
            ("https://kv.example:443", url("https://kv.example:443")),
            ("dns:localhost:50051", url("http://localhost:50051")),
            ("dns://8.8.8.8/localhost:50051", url("http://localhost:50051")),
            ("ipv4:127.0.0.1:50051", url("http://127.0.0.1:50051")),
            ("ipv6:[::1]:50051", url("http://[::1]:50051")),
        ] {
            assert_eq!(address(target), want, "{target}");
        }
    }
}
