//! Text ↔ token ids: a Hugging Face `tokenizer.json` when the model directory has one,
//! otherwise bytes (token id = byte value), which every preset's vocabulary covers.

use std::path::Path;

use crate::EngineError;

/// How the engine turns text into tokens and back.
#[derive(Debug)]
pub enum TextCodec {
    /// UTF-8 bytes as token ids; ids of 256 and above decode as `<|id|>`.
    Bytes,
    /// A `tokenizers` tokenizer.
    Hf(Box<tokenizers::Tokenizer>),
}

impl TextCodec {
    /// `dir/tokenizer.json` if present, else [`TextCodec::Bytes`].
    ///
    /// # Errors
    /// [`EngineError::Config`] for a `tokenizer.json` that does not load.
    pub fn for_model_dir(dir: Option<&Path>) -> Result<Self, EngineError> {
        let Some(path) = dir.map(|d| d.join("tokenizer.json")).filter(|p| p.exists()) else {
            return Ok(Self::Bytes);
        };
        tokenizers::Tokenizer::from_file(&path)
            .map(|t| Self::Hf(Box::new(t)))
            .map_err(|e| EngineError::Config(format!("{}: {e}", path.display())))
    }

    /// A name for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Bytes => "bytes",
            Self::Hf(_) => "tokenizer.json",
        }
    }

    /// Token ids of `text`.
    ///
    /// # Errors
    /// [`EngineError::BadRequest`] if the tokenizer fails.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        match self {
            Self::Bytes => Ok(text.bytes().map(u32::from).collect()),
            Self::Hf(t) => t
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| EngineError::BadRequest(format!("cannot tokenize the prompt: {e}"))),
        }
    }

    /// Text of `ids` (lossy: invalid UTF-8 becomes U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> String {
        match self {
            Self::Bytes => {
                let mut out = String::new();
                let mut bytes = Vec::new();
                for &id in ids {
                    if id < 256 {
                        bytes.push(id as u8);
                    } else {
                        out.push_str(&String::from_utf8_lossy(&std::mem::take(&mut bytes)));
                        out.push_str(&format!("<|{id}|>"));
                    }
                }
                out.push_str(&String::from_utf8_lossy(&bytes));
                out
            }
            Self::Hf(t) => t.decode(ids, false).unwrap_or_default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_mark_other_ids() {
        let c = TextCodec::for_model_dir(None).unwrap();
        let ids = c.encode("héllo").unwrap();
        assert_eq!(ids.len(), 6);
        assert_eq!(c.decode(&ids), "héllo");
        assert_eq!(c.decode(&[104, 105, 300, 33]), "hi<|300|>!");
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            TextCodec::for_model_dir(Some(dir.path())).unwrap(),
            TextCodec::Bytes
        ));
        std::fs::write(dir.path().join("tokenizer.json"), "{}").unwrap();
        assert!(TextCodec::for_model_dir(Some(dir.path())).is_err());
    }

    #[test]
    fn a_tokenizer_json_is_used_when_present() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("tokenizer.json"),
            r#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
                "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
                "decoder": null,
                "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "hello": 1, "world": 2}, "unk_token": "[UNK]"}}"#,
        )
        .unwrap();
        let c = TextCodec::for_model_dir(Some(dir.path())).unwrap();
        assert_eq!(c.name(), "tokenizer.json");
        assert_eq!(c.encode("hello world hello").unwrap(), vec![1, 2, 1]);
        assert_eq!(c.encode("bonjour").unwrap(), vec![0]);
        assert_eq!(c.decode(&[1, 2]), "hello world");
    }
}
