//! The permission bits of the sidecar's Unix socket.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Permission bits of the Unix socket (default `0600`: only the sidecar's user may connect).
/// `0660` lets the socket's group in too, for an engine that runs as another user in a shared
/// group (docs/api.md, "Who may connect"). Written as an octal string (`"0660"`) or a TOML
/// octal integer (`0o660`); the owner always keeps read and write, and nothing outside
/// `0666` is accepted.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SocketMode(u32);

/// What a socket mode may be written as, for error messages.
const FORM: &str = "an octal mode within 0666 that keeps the owner's read and write, such as \"0600\" or \"0660\" (or 0o660)";

impl SocketMode {
    /// Only the owner.
    pub const OWNER: SocketMode = SocketMode(0o600);

    /// Checks `bits`.
    ///
    /// # Errors
    /// A message naming the accepted form.
    pub fn new(bits: u32) -> Result<Self, String> {
        if bits & !0o666 != 0 || bits & 0o600 != 0o600 {
            return Err(format!("{bits:#o} is not {FORM}"));
        }
        Ok(Self(bits))
    }

    /// The bits, for chmod.
    pub fn bits(self) -> u32 {
        self.0
    }
}

impl Default for SocketMode {
    fn default() -> Self {
        Self::OWNER
    }
}

impl fmt::Debug for SocketMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04o}", self.0)
    }
}

impl Serialize for SocketMode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format!("{:04o}", self.0))
    }
}

impl<'de> Deserialize<'de> for SocketMode {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Bits(u32),
            Octal(String),
        }
        let bits =
            match Raw::deserialize(d).map_err(|_| serde::de::Error::custom(format!("expected {FORM}")))? {
                Raw::Bits(b) => b,
                Raw::Octal(s) => {
                    let digits = s.trim().trim_start_matches("0o");
                    u32::from_str_radix(digits, 8)
                        .map_err(|_| serde::de::Error::custom(format!("{s:?} is not {FORM}")))?
                }
            };
        SocketMode::new(bits).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_read_as_octal_and_bad_ones_are_named() {
        for (text, bits) in [
            ("\"0600\"", 0o600),
            ("\"0660\"", 0o660),
            ("\"660\"", 0o660),
            ("432", 0o660),
        ] {
            assert_eq!(
                serde_json::from_str::<SocketMode>(text).unwrap().bits(),
                bits,
                "{text}"
            );
        }
        for bad in ["\"0777\"", "\"0400\"", "\"rw\"", "660", "-1"] {
            let e = serde_json::from_str::<SocketMode>(bad).unwrap_err().to_string();
            assert!(e.contains("0660"), "{bad}: {e}");
        }
        assert_eq!(
            serde_json::to_string(&SocketMode::new(0o660).unwrap()).unwrap(),
            "\"0660\""
        );
    }
}
