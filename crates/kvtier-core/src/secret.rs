//! A secret setting (the sidecar's bearer token, the remote tier's password): never printed,
//! never logged.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What `--print-config` and logs show instead of a secret.
pub const REDACTED: &str = "<redacted>";

/// A secret string. `Debug`, `Display` and serialization show [`REDACTED`]; only
/// [`Secret::expose`] gives the value. Reading the placeholder back is an error, so a printed
/// configuration cannot silently become a token of `<redacted>`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    /// Wraps `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value itself (for the one comparison that needs it).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl fmt::Display for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s == REDACTED {
            return Err(serde::de::Error::custom(
                "this is the placeholder --print-config prints, not a secret: give the value itself \
                 (or, for the bearer token, server.auth_token_file or KVTIER_SERVER__AUTH_TOKEN)",
            ));
        }
        Ok(Self(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_never_shown_and_the_placeholder_is_refused() {
        let s = Secret::new("hunter2");
        assert_eq!(format!("{s:?} {s}"), "<redacted> <redacted>");
        assert_eq!(serde_json::to_string(&s).unwrap(), "\"<redacted>\"");
        assert_eq!(s.expose(), "hunter2");
        let e = serde_json::from_str::<Secret>("\"<redacted>\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("placeholder"), "{e}");
    }
}
