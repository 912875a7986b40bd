//! Block reads and writes straight on the socket of the master that owns the key.
//!
//! - A read's value header is checked as it arrives and its payload is hashed and copied into
//!   the host page piece by piece out of the connection's read buffer. The cluster client would
//!   hand the value over as a fresh `Vec` (a copy out of its read buffer into new memory, page
//!   faults included) to be copied once more into the page.
//! - A write sends the value's header, then the payload straight from the pinned host page to
//!   the socket. The cluster client's `SET` would first copy the value into its command buffer
//!   (another fresh allocation of the block's size).
//!
//! Everything the cluster client is there for stays with it: the slot map comes from it
//! (`CLUSTER SLOTS`), and whatever this path cannot do plainly is handed back to it, under the
//! same deadline ([`Direct::Fallback`] from [`DirectIo::run`]): no route known,
//! a master that does not answer in time (a read: within half the deadline; a write: by the
//! deadline itself) or whose connection breaks (it is
//! then left to the cluster client for `retry_ms`), a redirection (`MOVED` also drops the slot
//! map until it is loaded again), any other error reply. With TLS everything goes through the
//! cluster client.

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use kvtier_core::{BlockKey, NamespaceFingerprint, Secret, Xxh3Stream};
use redis::cluster_async::ClusterConnection;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::lock;
use crate::remote_value::{REMOTE_HEADER_BYTES, verify_header_bytes};
use crate::{PageWriter, PinnedPage};

/// Hash slots of a Redis Cluster.
const SLOT_COUNT: u16 = 16384;

/// Each connection's read buffer: a payload is hashed and copied into its page out of it, a
/// piece at a time, while the piece is in cache.
const READ_BUFFER_BYTES: usize = 256 << 10;

/// Least time between two loads of the slot map (a map that does not load, or keeps turning
/// out wrong, costs one `CLUSTER SLOTS` per interval, not one per read).
const REFRESH_INTERVAL: Duration = Duration::from_millis(100);

/// The name of every direct connection (`CLIENT LIST` shows it).
pub(super) const CONNECTION_NAME: &str = "kvtier-direct";

/// Idle connections older than this are closed rather than used.
const MAX_IDLE_TIME: Duration = Duration::from_secs(30);

/// Longest reply line read (a bulk length or an error); a longer one breaks the connection.
const MAX_LINE_BYTES: usize = 4096;

/// What a direct read found, or how a direct write ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Direct {
    /// Read: the page holds the block, header and payload verified. Written: the master
    /// answered OK.
    Copied,
    /// No such key on the master that owns it.
    Absent,
    /// A value that does not verify (what did not).
    Corrupt(&'static str),
    /// A write the master refused for good (`OOM`, `NOPERM`, …): the cluster client would be
    /// refused the same.
    Refused,
    /// Not done here: ask the cluster client.
    Fallback,
}

/// One node's connection and its read buffer.
type NodeConn = BufReader<TcpStream>;

/// A slot range and the master that serves it, `host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SlotRange {
    first: u16,
    last: u16,
    addr: String,
}

/// Direct reads and writes: the slot map, idle connections per master, and the masters that
/// failed lately.
pub(super) struct DirectIo {
    username: Option<String>,
    password: Option<Secret>,
    connect_timeout: Duration,
    /// The tier's deadline for one read or write (`timeout_ms`). A direct read gets half of it
    /// (a master that does not answer within that is left to the cluster client, which gets
    /// the rest); a direct write, whose payload may still be moving, all of it.
    timeout: Duration,
    /// How long a master that failed is left to the cluster client.
    retry: Duration,
    /// Sorted by `first`; `None` until the first `CLUSTER SLOTS`, and again once a command
    /// found the map wrong (everything goes to the cluster client until it is refreshed).
    routes: RwLock<Option<Arc<Vec<SlotRange>>>>,
    /// Bumped each time the map is dropped, so a load that began before cannot put the old
    /// map back.
    generation: AtomicU64,
    refreshing: AtomicBool,
    /// When the slot map was last asked for.
    last_refresh: Mutex<Option<Instant>>,
    /// Idle connections per master and since when each is idle.
    idle: Mutex<HashMap<String, Vec<(NodeConn, Instant)>>>,
    /// Idle connections kept per master (the tier's read and write concurrency).
    max_idle: usize,
    down: Mutex<HashMap<String, Instant>>,
}

impl std::fmt::Debug for DirectIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectIo").finish_non_exhaustive()
    }
}

/// How the tier reaches the masters directly.
pub(super) struct DirectConfig {
    pub username: Option<String>,
    pub password: Option<Secret>,
    pub connect_timeout: Duration,
    /// The tier's deadline for one read or write.
    pub timeout: Duration,
    /// How long a master that failed is left to the cluster client.
    pub retry: Duration,
    /// Idle connections kept per master.
    pub max_idle: usize,
}

impl DirectIo {
    pub(super) fn new(c: DirectConfig) -> Self {
        Self {
            username: c.username,
            password: c.password,
            connect_timeout: c.connect_timeout,
            timeout: c.timeout,
            retry: c.retry,
            routes: RwLock::new(None),
            generation: AtomicU64::new(0),
            refreshing: AtomicBool::new(false),
            last_refresh: Mutex::new(None),
            idle: Mutex::new(HashMap::new()),
            max_idle: c.max_idle,
            down: Mutex::new(HashMap::new()),
        }
    }

    /// Loads the slot map from the cluster, unless a load is under way or the last one began
    /// less than [`REFRESH_INTERVAL`] ago.
    pub(super) async fn refresh(self: Arc<Self>, mut cluster: ClusterConnection) {
        if self.refreshing.swap(true, Ordering::AcqRel) {
            return;
        }
        {
            let mut last = lock(&self.last_refresh);
            if last.is_some_and(|t| t.elapsed() < REFRESH_INTERVAL) {
                self.refreshing.store(false, Ordering::Release);
                return;
            }
            *last = Some(Instant::now());
        }
        let generation = self.generation.load(Ordering::Acquire);
        let got = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async::<redis::Value>(&mut cluster)
            .await;
        match got {
            Ok(v) => match parse_slots(&v) {
                Some(map) => {
                    let mut routes = self.routes.write().unwrap_or_else(|e| e.into_inner());
                    if self.generation.load(Ordering::Acquire) == generation {
                        *routes = Some(Arc::new(map));
                    }
                }
                None => tracing::debug!(
                    "remote tier: CLUSTER SLOTS is not a slot map; reads use the cluster client"
                ),
            },
            Err(e) => {
                tracing::debug!(error = %e, "remote tier: CLUSTER SLOTS failed; reads use the cluster client")
            }
        }
        self.refreshing.store(false, Ordering::Release);
    }

    /// Whether the slot map is missing (never loaded, or dropped by a command that found it
    /// wrong).
    /// Cheap enough for every command: a load under way or one begun within
    /// [`REFRESH_INTERVAL`] says no, so no task is spawned just to return at once.
    pub(super) fn needs_refresh(&self) -> bool {
        self.routes.read().unwrap_or_else(|e| e.into_inner()).is_none()
            && !self.refreshing.load(Ordering::Acquire)
            && lock(&self.last_refresh).is_none_or(|t| t.elapsed() >= REFRESH_INTERVAL)
    }

    /// Runs `command` (and reads its whole reply) on a connection to the master that owns its
    /// key: an idle one if there is one (and once more on a new one if that fails: the master
    /// may have closed it), else a new one; a read within half the tier's deadline (and by
    /// `deadline`), a write by `deadline`, the caller's own: a write that has not ended then has
    /// its master marked failed here, rather than being dropped by the caller's timer unseen. What a read found, [`Direct::Copied`] for a write the master took,
    /// [`Direct::Refused`] for one it refused, or [`Direct::Fallback`] when the command was not
    /// done (the caller goes through the cluster client): no master known for the key, or one
    /// that cannot be used now (it is then left to the cluster client for `retry`).
    pub(super) async fn run(&self, command: Command<'_>, deadline: tokio::time::Instant) -> Direct {
        let Some(addr) = self.master_of(command.name().as_bytes()) else {
            return Direct::Fallback;
        };
        if self.is_down(&addr) {
            return Direct::Fallback;
        }
        let attempt = async {
            let mut pooled = self.take_idle(&addr);
            loop {
                let was_pooled = pooled.is_some();
                let mut conn = match pooled.take() {
                    Some(c) => c,
                    None => self.connect(&addr).await?,
                };
                match command.send(&mut conn).await {
                    Ok(Reply::Done(d)) => {
                        self.put_back(&addr, conn);
                        return Ok(d);
                    }
                    // The key lives elsewhere now: the map is wrong.
                    Ok(Reply::Moved) => {
                        self.put_back(&addr, conn);
                        self.drop_routes();
                        return Ok(Direct::Fallback);
                    }
                    // ASK (a slot being migrated), LOADING, CLUSTERDOWN, …: the cluster client
                    // knows what to do with it.
                    Ok(Reply::Error) => {
                        self.put_back(&addr, conn);
                        return Ok(Direct::Fallback);
                    }
                    // The rest of the reply is left unread: the connection goes.
                    Ok(Reply::Unread(d)) => return Ok(d),
                    Err(_) if was_pooled => continue,
                    Err(e) => return Err(e),
                }
            }
        };
        let by = match command {
            Command::Get { .. } => deadline.min(tokio::time::Instant::now() + self.timeout / 2),
            Command::Set { .. } => deadline,
        };
        let budget = by.saturating_duration_since(tokio::time::Instant::now());
        match tokio::time::timeout_at(by, attempt).await {
            Ok(Ok(d)) => d,
            Ok(Err(e)) => {
                self.failed(&addr, &e);
                Direct::Fallback
            }
            // The connection went with the dropped future.
            Err(_) => {
                let e = io::Error::new(io::ErrorKind::TimedOut, format!("no answer within {budget:?}"));
                self.failed(&addr, &e);
                Direct::Fallback
            }
        }
    }

    fn master_of(&self, name: &[u8]) -> Option<String> {
        let routes = self.routes.read().unwrap_or_else(|e| e.into_inner()).clone()?;
        let slot = key_slot(name);
        let i = routes.partition_point(|r| r.first <= slot).checked_sub(1)?;
        let r = &routes[i];
        (slot <= r.last).then(|| r.addr.clone())
    }

    fn is_down(&self, addr: &str) -> bool {
        let mut down = lock(&self.down);
        match down.get(addr) {
            Some(until) if *until > Instant::now() => true,
            Some(_) => {
                down.remove(addr);
                false
            }
            None => false,
        }
    }

    /// A command on `addr` failed: its idle connections and the slot map are dropped, and the
    /// master is left to the cluster client for `retry`.
    fn failed(&self, addr: &str, e: &io::Error) {
        tracing::debug!(addr, error = %e, "remote tier: direct command failed; using the cluster client");
        lock(&self.down).insert(addr.to_string(), Instant::now() + self.retry);
        lock(&self.idle).remove(addr);
        self.drop_routes();
    }

    fn drop_routes(&self) {
        let mut routes = self.routes.write().unwrap_or_else(|e| e.into_inner());
        self.generation.fetch_add(1, Ordering::AcqRel);
        *routes = None;
    }

    /// The most recently used idle connection to `addr`; those idle longer than
    /// [`MAX_IDLE_TIME`] are closed (something on the way may have dropped them).
    fn take_idle(&self, addr: &str) -> Option<NodeConn> {
        let mut idle = lock(&self.idle);
        let list = idle.get_mut(addr)?;
        list.retain(|(_, since)| since.elapsed() < MAX_IDLE_TIME);
        list.pop().map(|(c, _)| c)
    }

    fn put_back(&self, addr: &str, conn: NodeConn) {
        let mut idle = lock(&self.idle);
        let list = idle.entry(addr.to_string()).or_default();
        if list.len() < self.max_idle {
            list.push((conn, Instant::now()));
        }
    }

    async fn connect(&self, addr: &str) -> io::Result<NodeConn> {
        let stream = tokio::time::timeout(self.connect_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        stream.set_nodelay(true)?;
        let mut conn = BufReader::with_capacity(READ_BUFFER_BYTES, stream);
        let mut line = Vec::new();
        if let Some(password) = &self.password {
            let mut args = vec!["AUTH"];
            args.extend(self.username.as_deref());
            args.push(password.expose());
            conn.get_mut().write_all(&command(&args)).await?;
            read_line(&mut conn, &mut line).await?;
            if !line.starts_with(b"+OK") {
                return Err(io::Error::new(io::ErrorKind::PermissionDenied, "AUTH refused"));
            }
        }
        // Named, so `CLIENT LIST` on a master tells kvtier's direct connections apart.
        conn.get_mut()
            .write_all(&command(&["CLIENT", "SETNAME", CONNECTION_NAME]))
            .await?;
        read_line(&mut conn, &mut line).await?;
        if !line.starts_with(b"+OK") {
            return Err(bad_reply("a CLIENT SETNAME refused"));
        }
        Ok(conn)
    }
}

/// A command sent on a direct connection.
pub(super) enum Command<'a> {
    /// `GET name`, the value read into `writer`'s page (block `key` of `ns`, `len` bytes).
    Get {
        name: &'a str,
        ns: NamespaceFingerprint,
        key: BlockKey,
        len: usize,
        writer: &'a PageWriter,
    },
    /// `SET name header+payload`, the payload the `len` bytes at `offset` of `page`.
    Set {
        name: &'a str,
        header: &'a [u8; REMOTE_HEADER_BYTES],
        page: &'a PinnedPage,
        offset: usize,
        len: usize,
    },
}

impl Command<'_> {
    fn name(&self) -> &str {
        match self {
            Command::Get { name, .. } | Command::Set { name, .. } => name,
        }
    }

    /// Sends the command on `conn` and reads its reply.
    async fn send(&self, conn: &mut NodeConn) -> io::Result<Reply> {
        match *self {
            Command::Get {
                name,
                ns,
                key,
                len,
                writer,
            } => read_value(conn, name, ns, key, len, writer).await,
            Command::Set {
                name,
                header,
                page,
                offset,
                len,
            } => set_value(conn, name, header, page, offset, len).await,
        }
    }
}

/// How a command's reply ended.
enum Reply {
    /// Read to its end; the connection can be used again.
    Done(Direct),
    /// A `MOVED` redirection, read to its end.
    Moved,
    /// Another error reply, read to its end.
    Error,
    /// Given up before its end (a value that does not verify, or a host page that could not
    /// be written).
    Unread(Direct),
}

/// Sends `GET name` and reads the reply, a value straight into `writer`'s page.
async fn read_value(
    conn: &mut NodeConn,
    name: &str,
    ns: NamespaceFingerprint,
    key: BlockKey,
    len: usize,
    writer: &PageWriter,
) -> io::Result<Reply> {
    conn.get_mut().write_all(&command(&["GET", name])).await?;
    let mut line = Vec::with_capacity(32);
    read_line(conn, &mut line).await?;
    match line.split_first() {
        Some((b'-', e)) if e.starts_with(b"MOVED ") => return Ok(Reply::Moved),
        Some((b'-', _)) => return Ok(Reply::Error),
        Some((b'$', n)) if n == b"-1" => return Ok(Reply::Done(Direct::Absent)),
        Some((b'$', _)) => {}
        _ => return Err(bad_reply("a GET reply that is neither a value nor an error")),
    }
    let n: usize = std::str::from_utf8(&line[1..])
        .ok()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad_reply("a bad bulk length"))?;
    let Some(payload_len) = n.checked_sub(REMOTE_HEADER_BYTES) else {
        return Ok(Reply::Unread(Direct::Corrupt("shorter than a header")));
    };
    let mut header = [0u8; REMOTE_HEADER_BYTES];
    conn.read_exact(&mut header).await?;
    let digest = match verify_header_bytes(&header, payload_len, ns, key, len) {
        Ok(d) => d,
        Err(reason) => return Ok(Reply::Unread(Direct::Corrupt(reason))),
    };
    // A page that cannot be written is not the master's fault: the cluster client's read
    // will find the same and report it.
    let Ok((offset, _)) = writer.layer_range(0) else {
        return Ok(Reply::Unread(Direct::Fallback));
    };
    let mut hash = Xxh3Stream::new();
    let mut done = 0;
    while done < len {
        let piece = conn.fill_buf().await?;
        if piece.is_empty() {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let take = piece.len().min(len - done);
        hash.update(&piece[..take]);
        if writer.region().write(offset + done, &piece[..take]).is_err() {
            return Ok(Reply::Unread(Direct::Fallback));
        }
        conn.consume(take);
        done += take;
    }
    let mut end = [0u8; 2];
    conn.read_exact(&mut end).await?;
    if &end != b"\r\n" {
        return Err(bad_reply("a value not followed by CRLF"));
    }
    Ok(Reply::Done(if hash.digest() == digest {
        Direct::Copied
    } else {
        Direct::Corrupt("payload checksum")
    }))
}

/// Sends `SET name header+payload`, the payload straight from the pinned page to the socket,
/// and reads the reply: [`Reply::Done`] for `+OK`.
async fn set_value(
    conn: &mut NodeConn,
    name: &str,
    header: &[u8; REMOTE_HEADER_BYTES],
    page: &PinnedPage,
    offset: usize,
    len: usize,
) -> io::Result<Reply> {
    let mut head = format!(
        "*3\r\n$3\r\nSET\r\n${}\r\n{name}\r\n${}\r\n",
        name.len(),
        REMOTE_HEADER_BYTES + len
    )
    .into_bytes();
    head.extend_from_slice(header);
    conn.get_mut().write_all(&head).await?;
    let stream = conn.get_ref();
    let mut done = 0;
    while done < len {
        stream.writable().await?;
        // SAFETY: `page` is a pin on a published block. Host pages are written only through the
        // `PageWriter` of a reserved page, never once published, and a pinned page is neither
        // evicted nor reused; the host arena is kvtier's own memory. So nothing writes these
        // bytes while the view lives (within this call, no await inside).
        let sent = unsafe {
            page.region()
                .with_bytes(offset + done, len - done, |p| stream.try_write(p))
        };
        match sent {
            // A page that cannot be read: the connection is mid-command, so it goes.
            Err(_) => return Ok(Reply::Unread(Direct::Fallback)),
            Ok(Ok(n)) => done += n,
            Ok(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => {}
            // The kernel could not read the page (its memory went away): not the master's
            // fault; the connection is mid-command, so it goes.
            Ok(Err(e)) if e.raw_os_error() == Some(libc::EFAULT) => {
                return Ok(Reply::Unread(Direct::Fallback));
            }
            Ok(Err(e)) => return Err(e),
        }
    }
    conn.get_mut().write_all(b"\r\n").await?;
    let mut line = Vec::with_capacity(32);
    read_line(conn, &mut line).await?;
    match line.split_first() {
        Some((b'+', _)) => Ok(Reply::Done(Direct::Copied)),
        Some((b'-', e)) if e.starts_with(b"MOVED ") => Ok(Reply::Moved),
        // Where the key is or whether the cluster serves now: the cluster client's to handle.
        Some((b'-', e)) if CLUSTER_STATE_ERRORS.iter().any(|p| e.starts_with(p)) => Ok(Reply::Error),
        // Anything else (OOM, NOPERM, …) it would be refused too.
        Some((b'-', _)) => Ok(Reply::Done(Direct::Refused)),
        _ => Err(bad_reply("a SET reply that is neither OK nor an error")),
    }
}

/// Error replies about the cluster's state rather than the command: a write that gets one is
/// handed to the cluster client (which follows redirections and waits out failovers).
const CLUSTER_STATE_ERRORS: [&[u8]; 6] = [
    b"ASK ",
    b"TRYAGAIN",
    b"CLUSTERDOWN",
    b"LOADING",
    b"MASTERDOWN",
    b"READONLY",
];

fn bad_reply(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{what} from the node"))
}

/// One reply line without its CRLF into `line`.
async fn read_line(conn: &mut NodeConn, line: &mut Vec<u8>) -> io::Result<()> {
    line.clear();
    loop {
        let buf = conn.fill_buf().await?;
        if buf.is_empty() {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        match buf.iter().position(|&b| b == b'\n') {
            Some(i) => {
                line.extend_from_slice(&buf[..i]);
                conn.consume(i + 1);
                if line.pop() != Some(b'\r') {
                    return Err(bad_reply("a line not ended by CRLF"));
                }
                return Ok(());
            }
            None => {
                line.extend_from_slice(buf);
                let n = buf.len();
                conn.consume(n);
            }
        }
        if line.len() > MAX_LINE_BYTES {
            return Err(bad_reply("a reply line too long"));
        }
    }
}

/// A command as RESP: an array of bulk strings.
fn command(args: &[&str]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// The hash slot of a key: CRC16 (XMODEM) of the key, or of its hash tag (the bytes between
/// the first `{` and the next `}`, when not empty), modulo 16384.
fn key_slot(key: &[u8]) -> u16 {
    let tagged = key.iter().position(|&b| b == b'{').and_then(|open| {
        let rest = &key[open + 1..];
        let close = rest.iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &rest[..close])
    });
    crc16_xmodem(tagged.unwrap_or(key)) % SLOT_COUNT
}

fn crc16_xmodem(data: &[u8]) -> u16 {
    let mut crc = 0u16;
    for &b in data {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The masters of a `CLUSTER SLOTS` reply, sorted by slot; `None` if it is not one. A range
/// whose master has no address this client can dial (none, `?`, a wildcard) is left out: its
/// keys are read through the cluster client.
fn parse_slots(v: &redis::Value) -> Option<Vec<SlotRange>> {
    use redis::Value;
    let int = |v: &Value| match v {
        Value::Int(i) => u16::try_from(*i).ok(),
        _ => None,
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    let Value::Array(entries) = v else { return None };
    let mut out = Vec::with_capacity(entries.len());
    for e in entries {
        let Value::Array(e) = e else { return None };
        let (first, last) = (int(e.first()?)?, int(e.get(1)?)?);
        let Value::Array(master) = e.get(2)? else {
            return None;
        };
        if first > last || last >= SLOT_COUNT {
            return None;
        }
        let (Some(host), port) = (master.first().and_then(text), int(master.get(1)?)?) else {
            continue;
        };
        if host.is_empty()
            || host == "?"
            || host
                .parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_unspecified())
        {
            continue;
        }
        let addr = if host.contains(':') {
            format!("[{host}]:{port}")
        } else {
            format!("{host}:{port}")
        };
        out.push(SlotRange { first, last, addr });
    }
    out.sort_by_key(|r| r.first);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis_for_known_keys_and_hash_tags() {
        // Values from `CLUSTER KEYSLOT` of a real server.
        assert_eq!(key_slot(b"foo"), 12182);
        assert_eq!(key_slot(b"bar"), 5061);
        assert_eq!(key_slot(b"123456789"), 12739);
        assert_eq!(key_slot(b"{user1000}.following"), key_slot(b"user1000"));
        assert_eq!(key_slot(b"foo{}{bar}"), crc16_xmodem(b"foo{}{bar}") % SLOT_COUNT);
        assert_eq!(key_slot(b"foo{{bar}}zap"), key_slot(b"{bar"));
    }

    #[test]
    fn a_slots_reply_becomes_sorted_ranges_and_a_bad_one_none() {
        use redis::Value;
        let node = |h: &str, p: i64| Value::Array(vec![Value::BulkString(h.into()), Value::Int(p)]);
        let range = |a: i64, b: i64, n: Value| Value::Array(vec![Value::Int(a), Value::Int(b), n]);
        let v = Value::Array(vec![
            range(5461, 16383, node("127.0.0.1", 7001)),
            range(0, 5460, node("::1", 7000)),
        ]);
        let map = parse_slots(&v).unwrap();
        assert_eq!(
            map[0],
            SlotRange {
                first: 0,
                last: 5460,
                addr: "[::1]:7000".into()
            }
        );
        assert_eq!(map[1].addr, "127.0.0.1:7001");
        assert_eq!(
            parse_slots(&Value::Array(vec![range(0, 16384, node("h", 1))])),
            None
        );
        // Masters without a usable address are left out, the rest kept.
        let v = Value::Array(vec![
            range(0, 10, node("", 1)),
            range(11, 20, node("0.0.0.0", 2)),
            range(21, 30, Value::Array(vec![Value::Nil, Value::Int(3)])),
            range(31, 16383, node("10.0.0.1", 4)),
        ]);
        let kept = SlotRange {
            first: 31,
            last: 16383,
            addr: "10.0.0.1:4".into(),
        };
        assert_eq!(parse_slots(&v).unwrap(), vec![kept]);
        assert_eq!(parse_slots(&Value::Int(1)), None);
    }

    #[test]
    fn commands_are_resp_arrays() {
        assert_eq!(command(&["GET", "k"]), b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n");
    }
}
