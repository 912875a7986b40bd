//! Unix-socket clients with their default `:authority`: grpcio, grpc-java and grpc-swift send
//! the percent-encoded socket path (`%2Frun%2Fkvtier.sock`), which is not an RFC 3986
//! authority, and h2 resets every such stream (PROTOCOL_ERROR). Over the Unix socket the
//! authority names nothing, so each accepted connection is read through [`AuthorityFix`]: it
//! parses the client's HTTP/2 frames, decodes every header block (HPACK) and re-encodes it with
//! an invalid `:authority` replaced by `localhost` (what grpc-go, grpcurl and kubelet send).
//! Everything else passes byte for byte; the server's writes are not touched.

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// The client connection preface (RFC 9113 §3.4).
const PREFACE_LEN: usize = 24;
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// Frames we emit stay within the smallest SETTINGS_MAX_FRAME_SIZE a peer may have.
const MAX_FRAME: usize = 16_384;
/// A header block larger than this is refused (h2's own limit is 16 KiB by default).
const MAX_BLOCK: usize = 1 << 20;

/// A header block being collected: its stream, its first frame's flags and priority fields.
#[derive(Debug)]
struct Block {
    stream: [u8; 4],
    flags: u8,
    priority: Option<[u8; 5]>,
    bytes: Vec<u8>,
}

/// A server-side connection whose incoming header blocks get a valid `:authority`.
pub struct AuthorityFix<S> {
    inner: S,
    /// Bytes read from the client, not yet parsed into whole frames.
    raw: Vec<u8>,
    /// Bytes ready for the server to read, from `out_pos`.
    out: Vec<u8>,
    out_pos: usize,
    preface_left: usize,
    decoder: hpack::Decoder<'static>,
    block: Option<Block>,
    /// The stream could not be parsed: pass everything through as it is.
    passthrough: bool,
}

impl<S> std::fmt::Debug for AuthorityFix<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AuthorityFix")
            .field("buffered", &self.raw.len())
            .finish()
    }
}

impl<S> AuthorityFix<S> {
    /// Wraps an accepted connection.
    pub fn new(inner: S) -> Self {
        Self {
            inner,
            raw: Vec::new(),
            out: Vec::new(),
            out_pos: 0,
            preface_left: PREFACE_LEN,
            decoder: hpack::Decoder::new(),
            block: None,
            passthrough: false,
        }
    }

    /// Moves whole frames from `raw` to `out`, rewriting header blocks.
    fn process(&mut self) -> io::Result<()> {
        if self.passthrough {
            self.out.append(&mut self.raw);
            return Ok(());
        }
        if self.preface_left > 0 {
            let n = self.preface_left.min(self.raw.len());
            self.out.extend(self.raw.drain(..n));
            self.preface_left -= n;
            if self.preface_left > 0 {
                return Ok(());
            }
        }
        loop {
            if self.raw.len() < FRAME_HEADER {
                return Ok(());
            }
            let len =
                usize::from(self.raw[0]) << 16 | usize::from(self.raw[1]) << 8 | usize::from(self.raw[2]);
            if self.raw.len() < FRAME_HEADER + len {
                return Ok(());
            }
            let frame: Vec<u8> = self.raw.drain(..FRAME_HEADER + len).collect();
            let (kind, flags) = (frame[3], frame[4]);
            let stream: [u8; 4] = frame[5..9].try_into().expect("4 bytes");
            let mut payload = &frame[FRAME_HEADER..];
            match kind {
                HEADERS => {
                    if flags & PADDED != 0 {
                        let pad = usize::from(*payload.first().ok_or_else(malformed)?);
                        payload = payload
                            .get(1..payload.len().checked_sub(pad).ok_or_else(malformed)?)
                            .ok_or_else(malformed)?;
                    }
                    let priority = if flags & PRIORITY != 0 {
                        let p: [u8; 5] = payload
                            .get(..5)
                            .ok_or_else(malformed)?
                            .try_into()
                            .expect("5 bytes");
                        payload = &payload[5..];
                        Some(p)
                    } else {
                        None
                    };
                    self.block = Some(Block {
                        stream,
                        flags,
                        priority,
                        bytes: payload.to_vec(),
                    });
                }
                CONTINUATION => {
                    let b = self.block.as_mut().ok_or_else(malformed)?;
                    b.bytes.extend_from_slice(payload);
                    if b.bytes.len() > MAX_BLOCK {
                        return Err(malformed());
                    }
                }
                _ => {
                    self.out.extend_from_slice(&frame);
                    continue;
                }
            }
            if flags & END_HEADERS != 0 {
                let b = self.block.take().ok_or_else(malformed)?;
                self.emit(b)?;
            }
        }
    }

    /// Decodes a whole header block and writes it back as HEADERS (+ CONTINUATION) frames.
    fn emit(&mut self, b: Block) -> io::Result<()> {
        let headers = self.decoder.decode(&b.bytes).map_err(|_| malformed())?;
        let mut block = Vec::with_capacity(b.bytes.len() + 16);
        for (name, value) in &headers {
            let value: &[u8] = if name == b":authority" && !valid_authority(value) {
                b"localhost"
            } else {
                value
            };
            // Literal header field without indexing, new name, no Huffman (RFC 7541 §6.2.2):
            // the server's decoder table stays empty, so no state is shared with the client's.
            // Representation byte 0x00; then each string: its H bit (0) and 7-bit length.
            block.push(0);
            block.push(0);
            encode_int(&mut block, name.len(), 7);
            block.extend_from_slice(name);
            block.push(0);
            encode_int(&mut block, value.len(), 7);
            block.extend_from_slice(value);
        }
        let prio_len = if b.priority.is_some() { 5 } else { 0 };
        let first = block.len().min(MAX_FRAME - prio_len);
        let (head, mut rest) = block.split_at(first);
        let mut flags = b.flags & (END_STREAM | PRIORITY);
        if rest.is_empty() {
            flags |= END_HEADERS;
        }
        self.frame(
            HEADERS,
            flags,
            b.stream,
            b.priority.as_ref().map(|p| &p[..]),
            head,
        );
        while !rest.is_empty() {
            let n = rest.len().min(MAX_FRAME);
            let (part, tail) = rest.split_at(n);
            let flags = if tail.is_empty() { END_HEADERS } else { 0 };
            self.frame(CONTINUATION, flags, b.stream, None, part);
            rest = tail;
        }
        Ok(())
    }

    fn frame(&mut self, kind: u8, flags: u8, stream: [u8; 4], prefix: Option<&[u8]>, payload: &[u8]) {
        let len = payload.len() + prefix.map_or(0, <[u8]>::len);
        self.out
            .extend_from_slice(&[(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags]);
        self.out.extend_from_slice(&stream);
        if let Some(p) = prefix {
            self.out.extend_from_slice(p);
        }
        self.out.extend_from_slice(payload);
    }
}

fn malformed() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "malformed HTTP/2 header block")
}

/// Whether `v` is a `host[:port]` h2 accepts: no percent signs, slashes or spaces.
fn valid_authority(v: &[u8]) -> bool {
    !v.is_empty()
        && v.iter()
            .all(|&c| c.is_ascii_graphic() && !matches!(c, b'%' | b'/' | b'\\'))
}

/// HPACK integer with an `n`-bit prefix (RFC 7541 §5.1), OR-ed into the last byte of `out` (the
/// byte holding the prefix's flag bits, pushed by the caller).
fn encode_int(out: &mut Vec<u8>, mut v: usize, n: u32) {
    let max = (1usize << n) - 1;
    let first = out.pop().unwrap_or(0);
    if v < max {
        out.push(first | v as u8);
        return;
    }
    out.push(first | max as u8);
    v -= max;
    while v >= 128 {
        out.push((v % 128) as u8 | 0x80);
        v /= 128;
    }
    out.push(v as u8);
}

impl<S: AsyncRead + Unpin> AsyncRead for AuthorityFix<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = &mut *self;
        loop {
            if this.out_pos < this.out.len() {
                let n = (this.out.len() - this.out_pos).min(buf.remaining());
                buf.put_slice(&this.out[this.out_pos..this.out_pos + n]);
                this.out_pos += n;
                if this.out_pos == this.out.len() {
                    this.out.clear();
                    this.out_pos = 0;
                }
                return Poll::Ready(Ok(()));
            }
            let mut tmp = [0u8; 16 * 1024];
            let mut rb = ReadBuf::new(&mut tmp);
            match Pin::new(&mut this.inner).poll_read(cx, &mut rb) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                Poll::Ready(Ok(())) if rb.filled().is_empty() => {
                    // End of stream: whatever is left unparsed goes through as it came.
                    this.out.append(&mut this.raw);
                    if this.out.is_empty() {
                        return Poll::Ready(Ok(()));
                    }
                }
                Poll::Ready(Ok(())) => {
                    this.raw.extend_from_slice(rb.filled());
                    if let Err(e) = this.process() {
                        tracing::debug!(error = %e, "unparsable HTTP/2 from a Unix-socket client: passed through");
                        this.passthrough = true;
                        this.process()?;
                    }
                }
            }
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for AuthorityFix<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

impl<S: Connected> Connected for AuthorityFix<S> {
    type ConnectInfo = S::ConnectInfo;
    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hpack_integers_and_authorities() {
        let mut v = vec![0];
        encode_int(&mut v, 10, 7);
        assert_eq!(v, [10]);
        let mut v = vec![0];
        encode_int(&mut v, 1337, 5);
        assert_eq!(v, [31, 154, 10], "RFC 7541 C.1.2");
        assert!(valid_authority(b"localhost") && valid_authority(b"127.0.0.1:50051"));
        assert!(!valid_authority(b"%2Frun%2Fkvtier.sock") && !valid_authority(b"/run/k.sock"));
    }

    #[test]
    fn a_header_block_is_rewritten_and_the_rest_passes_through() {
        let mut enc = hpack::Encoder::new();
        let block = enc.encode(vec![
            (&b":method"[..], &b"POST"[..]),
            (b":authority", b"%2Ftmp%2Fk.sock"),
            (b":path", b"/grpc.health.v1.Health/Check"),
        ]);
        let mut wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        let settings = [0u8, 0, 0, 4, 0, 0, 0, 0, 0];
        wire.extend_from_slice(&settings);
        let len = block.len();
        wire.extend_from_slice(&[
            (len >> 16) as u8,
            (len >> 8) as u8,
            len as u8,
            HEADERS,
            END_HEADERS,
            0,
            0,
            0,
            1,
        ]);
        wire.extend_from_slice(&block);
        let mut fix = AuthorityFix::new(());
        fix.raw = wire.clone();
        fix.process().unwrap();
        assert_eq!(&fix.out[..PREFACE_LEN + 9], &wire[..PREFACE_LEN + 9]);
        let frame = &fix.out[PREFACE_LEN + 9..];
        assert_eq!((frame[3], frame[4]), (HEADERS, END_HEADERS));
        let headers = hpack::Decoder::new().decode(&frame[9..]).unwrap();
        assert_eq!(headers[1], (b":authority".to_vec(), b"localhost".to_vec()));
        assert_eq!(headers[2].1, b"/grpc.health.v1.Health/Check".to_vec());
    }
}
