//! The connection to the sidecar: dialling a Unix socket or TCP target, and the stub with the
//! bearer-token interceptor.

use std::path::PathBuf;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use kvtier_proto::proto::kv_tier_client::KvTierClient;
use tonic::metadata::MetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Uri};
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

/// How to reach a sidecar: the target and, for TCP, TLS and the bearer token. Every client
/// (the engine, the benchmarks, `kvtier health`) connects through one of these.
#[derive(Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ConnectOptions {
    /// `unix:///path`, `unix:/path`, a bare path, `http://host:port`, `https://host:port`,
    /// `dns:host:port`, `ipv4:addr:port` or `ipv6:[addr]:port`.
    pub target: String,
    /// PEM file of the CA that signed an `https://` sidecar's certificate; `None` trusts the
    /// system's roots.
    pub tls_ca: Option<PathBuf>,
    /// The name an `https://` sidecar's certificate is checked against (default: the URL's
    /// host).
    pub tls_server_name: Option<String>,
    /// Bearer token sent with every call (TCP listeners off loopback require one). Never
    /// shown by `Debug`, never serialized.
    #[serde(skip_serializing)]
    pub token: Option<String>,
}

impl std::fmt::Debug for ConnectOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConnectOptions")
            .field("target", &self.target)
            .field("tls_ca", &self.tls_ca)
            .field("tls_server_name", &self.tls_server_name)
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .finish()
    }
}

impl From<&str> for ConnectOptions {
    fn from(target: &str) -> Self {
        Self::new(target)
    }
}

impl ConnectOptions {
    /// Plain options for `target` (no TLS settings, no token).
    pub fn new(target: impl Into<String>) -> Self {
        Self {
            target: target.into(),
            ..Self::default()
        }
    }

    /// These options with another target (the TLS settings and token kept).
    pub fn with_target(&self, target: impl Into<String>) -> Self {
        Self {
            target: target.into(),
            ..self.clone()
        }
    }

    /// The interceptor that sends the token.
    ///
    /// # Errors
    /// [`ClientError::Protocol`] for a token that is not ASCII.
    pub fn auth(&self) -> Result<Auth, ClientError> {
        Auth::bearer(self.token.as_deref())
    }

    /// Opens a channel (see [`ConnectOptions::target`] for the forms): TLS for `https://`,
    /// with [`ConnectOptions::tls_ca`] or the system's roots.
    ///
    /// # Errors
    /// [`ClientError::Connect`]; [`ClientError::Protocol`] for TLS settings on a target that
    /// is not `https://`, or a CA file that cannot be read.
    ///
    /// # Cancel safety
    /// Cancel safe: dropping the future drops the connection attempt.
    pub async fn channel(&self) -> Result<Channel, ClientError> {
        let target = self.target.as_str();
        let err = |source| ClientError::Connect {
            target: target.to_owned(),
            source,
        };
        let tls_asked = self.tls_ca.is_some() || self.tls_server_name.is_some();
        let path = match address(target) {
            Address::Url(url) => {
                let mut endpoint = Endpoint::from_shared(url.clone())
                    .map_err(err)?
                    .connect_timeout(Duration::from_secs(5));
                if url.starts_with("https://") {
                    endpoint = endpoint.tls_config(self.tls()?).map_err(err)?;
                } else if tls_asked {
                    return Err(self.not_tls());
                }
                return endpoint.connect().await.map_err(err);
            }
            Address::Unix(path) => path,
        };
        if tls_asked {
            return Err(self.not_tls());
        }
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

    fn not_tls(&self) -> ClientError {
        ClientError::Protocol(format!(
            "TLS settings (a CA or a server name) are for https:// sidecars, not {}",
            self.target
        ))
    }

    fn tls(&self) -> Result<ClientTlsConfig, ClientError> {
        let mut tls = ClientTlsConfig::new();
        tls = match &self.tls_ca {
            Some(path) => {
                let pem = std::fs::read(path).map_err(|e| {
                    ClientError::Protocol(format!("cannot read the CA file {}: {e}", path.display()))
                })?;
                tls.ca_certificate(Certificate::from_pem(pem))
            }
            None => tls.with_native_roots(),
        };
        if let Some(name) = &self.tls_server_name {
            tls = tls.domain_name(name.clone());
        }
        Ok(tls)
    }
}

/// Opens a plain channel to `target` ([`ConnectOptions::channel`] without TLS settings or a
/// token; `https://` trusts the system's roots).
///
/// # Errors
/// [`ClientError::Connect`].
///
/// # Cancel safety
/// Cancel safe: dropping the future drops the connection attempt.
pub async fn channel(target: &str) -> Result<Channel, ClientError> {
    ConnectOptions::new(target).channel().await
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
