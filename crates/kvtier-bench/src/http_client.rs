//! A minimal HTTP/1.1 client for the serving benchmark (hyper, one connection per request, as
//! `bench_serving` clients do): JSON calls, and streamed calls whose server-sent events are
//! handed over as they arrive, each with its arrival time.

use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

use crate::BenchError;

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError::InvalidConfig(format!("http: {e}"))
}

/// `host:port` and the path prefix of a base URL (`http://host:port[/prefix]`).
///
/// # Errors
/// [`BenchError::InvalidConfig`] for anything but an `http://` URL.
pub(crate) fn split_base(url: &str) -> Result<(String, String), BenchError> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| err(format!("--base-url {url:?}: give http://host:port")))?;
    let (host, path) = rest.split_once('/').unwrap_or((rest, ""));
    if host.is_empty() {
        return Err(err(format!("--base-url {url:?}: no host")));
    }
    let path = path.trim_end_matches('/');
    Ok((
        host.to_owned(),
        if path.is_empty() {
            String::new()
        } else {
            format!("/{path}")
        },
    ))
}

/// One request; `on_chunk(bytes, arrival)` gets the body as it arrives. Returns the status.
async fn request(
    host: &str,
    method: &str,
    path: &str,
    body: Option<String>,
    on_chunk: &mut (dyn FnMut(&[u8], Instant) + Send),
) -> Result<u16, BenchError> {
    let stream = tokio::net::TcpStream::connect(host)
        .await
        .map_err(|e| err(format!("{host}: {e}")))?;
    let _ = stream.set_nodelay(true);
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(err)?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    let req = hyper::Request::builder()
        .method(method)
        .uri(path)
        .header("host", host)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(err)?;
    let resp = sender.send_request(req).await.map_err(err)?;
    let status = resp.status().as_u16();
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(err)?;
        if let Some(data) = frame.data_ref() {
            on_chunk(data, Instant::now());
        }
    }
    Ok(status)
}

/// A JSON call: the parsed answer of a 2xx response.
///
/// # Errors
/// Connection errors, a non-2xx status (with the body), a body that is not JSON.
pub(crate) async fn call_json(
    host: &str,
    method: &str,
    path: &str,
    body: Option<String>,
) -> Result<serde_json::Value, BenchError> {
    let mut out = Vec::new();
    let status = request(host, method, path, body, &mut |b, _| out.extend_from_slice(b)).await?;
    let text = String::from_utf8_lossy(&out);
    if !(200..300).contains(&status) {
        return Err(err(format!("{method} {path}: HTTP {status}: {text}")));
    }
    serde_json::from_str(&text).map_err(|e| err(format!("{method} {path}: {e}: {text}")))
}

/// A streamed POST: `on_event(data, arrival)` for each `data:` line of the event stream.
/// Returns the status (the body of an error status is passed as one event).
///
/// # Errors
/// Connection errors.
pub(crate) async fn post_events(
    host: &str,
    path: &str,
    body: String,
    on_event: &mut (dyn FnMut(&str, Instant) + Send),
) -> Result<u16, BenchError> {
    let mut pending = String::new();
    let mut raw = Vec::new();
    let status = request(host, "POST", path, Some(body), &mut |bytes, at| {
        raw.extend_from_slice(bytes);
        // Whole lines only: a chunk may end inside a multi-byte character or a line.
        let Some(cut) = raw.iter().rposition(|b| *b == b'\n') else {
            return;
        };
        pending.push_str(&String::from_utf8_lossy(&raw[..=cut]));
        raw.drain(..=cut);
        for line in pending.lines() {
            if let Some(data) = line.strip_prefix("data:") {
                on_event(data.trim_start(), at);
            }
        }
        pending.clear();
    })
    .await?;
    if !(200..300).contains(&status) {
        on_event(&String::from_utf8_lossy(&raw), Instant::now());
    }
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_urls() {
        assert_eq!(
            split_base("http://127.0.0.1:8000").unwrap(),
            ("127.0.0.1:8000".into(), String::new())
        );
        assert_eq!(
            split_base("http://h:1/api/").unwrap(),
            ("h:1".into(), "/api".into())
        );
        assert!(split_base("https://h:1").is_err());
        assert!(split_base("http:///x").is_err());
    }
}
