//! Flags several commands share, defined once: the KV geometry of the benchmarks and key
//! tools, the block size of the engine commands, and how every client command reaches a
//! sidecar (TLS and the bearer token). Their defaults are kvtier-core's.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use kvtier_client::ConnectOptions;
use kvtier_core::{Dtype, KvGeometry};

/// Tokens per KV block.
#[derive(Debug, Clone, Copy, Args)]
pub struct BlockTokensFlag {
    /// Tokens per KV block.
    #[arg(long, default_value_t = KvGeometry::DEFAULT_BLOCK_TOKENS)]
    pub block_tokens: u32,
}

/// The KV geometry: Qwen3-30B-A3B's shape. Each flag left out comes from the command's base
/// geometry ([`GeometryArgs::over`]): a running sidecar's own when the command talks to one,
/// else the command's default.
#[derive(Debug, Clone, Copy, Args)]
pub struct GeometryArgs {
    /// Layers whose KV is stored [default: a running sidecar's own with --sidecar URL; else 1
    /// for benchmarks (the seed experiment kept 1 of Qwen3-30B-A3B's 48) and 48 for `keys`,
    /// as `serve`]
    #[arg(long)]
    pub layers: Option<u32>,
    /// KV heads per tensor-parallel rank [default: the sidecar's, else 4]
    #[arg(long)]
    pub kv_heads: Option<u32>,
    /// Head dimension [default: the sidecar's, else 128]
    #[arg(long)]
    pub head_dim: Option<u32>,
    /// KV element type: f32, f16, bf16, fp8_e4m3, fp8_e5m2 [default: the sidecar's, else bf16]
    #[arg(long)]
    pub dtype: Option<Dtype>,
    /// Tokens per KV block [default: the sidecar's, else 64]
    #[arg(long)]
    pub block_tokens: Option<u32>,
}

impl GeometryArgs {
    /// The benchmarks' own default: Qwen3-30B-A3B's shape with one layer, as the seed.
    pub fn bench_default() -> Result<KvGeometry> {
        Ok(KvGeometry::new(
            1,
            KvGeometry::QWEN3_30B_A3B_KV_HEADS,
            KvGeometry::QWEN3_30B_A3B_HEAD_DIM,
            Dtype::Bf16,
            KvGeometry::DEFAULT_BLOCK_TOKENS,
        )?)
    }

    /// The flags given, the rest from `base`; validated.
    pub fn over(&self, base: KvGeometry) -> Result<KvGeometry> {
        Ok(KvGeometry::new(
            self.layers.unwrap_or(base.layers()),
            self.kv_heads.unwrap_or(base.kv_heads()),
            self.head_dim.unwrap_or(base.head_dim()),
            self.dtype.unwrap_or(base.dtype()),
            self.block_tokens.unwrap_or(base.block_tokens()),
        )?)
    }

    /// The flags over the benchmarks' default ([`GeometryArgs::bench_default`]).
    pub fn geometry(&self) -> Result<KvGeometry> {
        self.over(Self::bench_default()?)
    }
}

/// How a client command reaches a sidecar over TCP with TLS and a bearer token (the Unix
/// socket needs neither). One definition for every command that connects.
#[derive(Debug, Clone, Default, Args)]
pub struct ConnectFlags {
    /// PEM file of the CA that signed the sidecar's certificate, for an https:// sidecar
    /// [default: the system's trusted roots]
    #[arg(long, value_name = "PEM")]
    pub tls_ca: Option<PathBuf>,
    /// Name to check the sidecar's certificate against [default: the host in the URL]
    #[arg(long, value_name = "NAME")]
    pub tls_server_name: Option<String>,
    /// File holding the bearer token a TCP sidecar requires (a trailing newline is dropped).
    /// The token may also come from the KVTIER_AUTH_TOKEN variable; it is never a flag value,
    /// which other users see in `ps`.
    #[arg(long, value_name = "FILE")]
    pub auth_token_file: Option<PathBuf>,
}

impl ConnectFlags {
    /// The connection options for `target`.
    ///
    /// # Errors
    /// An unreadable or empty token file, or both a file and KVTIER_AUTH_TOKEN.
    pub fn options(&self, target: &str) -> Result<ConnectOptions> {
        let env = std::env::var("KVTIER_AUTH_TOKEN").ok().filter(|t| !t.is_empty());
        let token = match (&self.auth_token_file, env) {
            (Some(_), Some(_)) => {
                anyhow::bail!("--auth-token-file and KVTIER_AUTH_TOKEN are both set: give one")
            }
            (Some(path), None) => {
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("--auth-token-file {}: cannot read it", path.display()))?;
                let token = text.trim_end_matches(['\n', '\r']).to_owned();
                anyhow::ensure!(
                    !token.is_empty(),
                    "--auth-token-file {}: the file is empty",
                    path.display()
                );
                Some(token)
            }
            (None, env) => env,
        };
        Ok(ConnectOptions {
            target: target.to_owned(),
            tls_ca: self.tls_ca.clone(),
            tls_server_name: self.tls_server_name.clone(),
            token,
        })
    }
}
